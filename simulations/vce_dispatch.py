"""Message dispatch of Flower 1.42's simulation engine in time independent of the registered nodes.

flwr 1.42's ``vce_api.add_messages_to_queue`` polls every 0.1 s by calling
``state.get_message_ins(node_id, limit=1)`` once for *every registered node*, and each of those
calls scans every stored message (checking its expiry and federation) under the state's lock.
One pass therefore costs O(registered nodes x messages in flight): with 10,000 nodes and 100
sampled per round that is 1,000,000 message checks per pass, seconds of one core each, while
holding the lock the ServerApp needs to push and pull. :func:`dispatch_once` does the same job in
one scan of the stored messages: it hands every node with an undelivered message its first one
(as ``limit=1`` does), after the same expiry/federation check, and marks them delivered.

:func:`install` swaps it in for Flower's loop when the state is Flower's ``InMemoryLinkState``
(the one the simulation engine uses) and leaves any other state to Flower's own loop. It is
idempotent and only touches a process that has already imported the simulation engine, so
importing it from a ClientApp module is harmless in a deployment.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from queue import Queue
from typing import Any

_VCE_API = "flwr.server.superlink.fleet.vce.vce_api"


def dispatch_once(state: Any, queue: Queue, nodes: Mapping[int, int]) -> int:
    """Queue the first undelivered message of every node in ``nodes``; returns how many.

    ``state`` is an ``InMemoryLinkState``. Costs one pass over the messages it stores, whatever
    the number of nodes.
    """
    from flwr.supercore.date import now

    with state.lock:
        first: dict[int, str] = {}
        for msg_id, msg in state.message_ins_store.items():
            dst = msg.metadata.dst_node_id
            if msg.metadata.delivered_at == "" and dst in nodes and dst not in first:
                first[dst] = msg_id
        if not first:
            return 0
        state._check_stored_messages(set(first.values()))  # drops expired messages, as get_message_ins does
        messages = [m for m in map(state.message_ins_store.get, first.values()) if m is not None]
        delivered_at = now().isoformat()
        for msg in messages:
            msg.metadata.delivered_at = delivered_at
    for msg in messages:
        queue.put(msg)
    return len(messages)


def _make_loop(flower_loop: Callable[..., None]) -> Callable[..., None]:
    from flwr.server.superlink.linkstate import InMemoryLinkState

    def add_messages_to_queue(state: Any, queue: Queue, nodes_mapping: Mapping[int, int], f_stop: threading.Event):
        if not isinstance(state, InMemoryLinkState):
            return flower_loop(state, queue, nodes_mapping, f_stop)
        while not f_stop.is_set():
            dispatch_once(state, queue, nodes_mapping)
            f_stop.wait(0.1)
        return None

    add_messages_to_queue.fedquant_dispatch = True  # type: ignore[attr-defined]
    add_messages_to_queue.flower_loop = flower_loop  # type: ignore[attr-defined]
    return add_messages_to_queue


def install(force_import: bool = False) -> bool:
    """Use :func:`dispatch_once` in the simulation engine of this process; returns whether it is in use.

    Parameters
    ----------
    force_import : bool
        Import Flower's simulation engine if this process has not (a script about to call
        ``run_simulation``). Without it, a process that does not run the engine (a SuperNode's
        ClientApp, a Ray worker) is left untouched.
    """
    module = sys.modules.get(_VCE_API)
    if module is None and force_import:
        import importlib

        module = importlib.import_module(_VCE_API)
    if module is None:
        return False
    if not getattr(module.add_messages_to_queue, "fedquant_dispatch", False):
        module.add_messages_to_queue = _make_loop(module.add_messages_to_queue)
    return True


def uninstall() -> None:
    """Put Flower's own dispatch loop back (for comparisons); a no-op when :func:`install` did nothing."""
    module = sys.modules.get(_VCE_API)
    if module is not None and getattr(module.add_messages_to_queue, "fedquant_dispatch", False):
        module.add_messages_to_queue = module.add_messages_to_queue.flower_loop
