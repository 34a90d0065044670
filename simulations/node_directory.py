"""Which partition each node holds: the stable key behind client sampling and per-client seeds.

Flower's simulation engine gives every virtual SuperNode a fresh random 64-bit node id in each
run (``LinkState.create_node``) but the same ``partition-id`` (``0..num-supernodes-1``, in its
node config); it registers the nodes one after the other in partition order
(``flwr/server/superlink/fleet/vce/vce_api.py: _register_nodes``), and the SuperLink stamps each
registration with its time (``NodeInfo.registered_at``, microseconds). So the server orders the
nodes by registration time, and a node's place in that order is its partition id, without a
message to any client: one ``grid.get_nodes()`` the first time new nodes appear, then per round
only the ``get_node_ids()`` that the sampling needs anyway and a sort (10,000 registered nodes
with 100 sampled per round cost no per-round query of every node).

Two safety nets: when two new nodes registered in the same microsecond (or the grid does not
list ``NodeInfo``), the new nodes are asked for their partition id once, with a small QUERY
message (about 0.1 s per node on a busy 2-core machine, so only as a fallback), and the
partition ids clients report in their train replies are checked against the inferred ones
(:meth:`PartitionDirectory.confirm`; a mismatch is logged: the run then is not reproducible).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

QUERY_KEY = "fedquant-sim.query"  # ConfigRecord key of the question (its value: what is asked)
QUERY_PARTITION = "partition-id"
PARTITION_ID_KEY = "partition-id"  # node-config key set by Flower's simulation engine
NUM_PARTITIONS_KEY = "num-partitions"


def partition_query() -> RecordDict:
    """The content of the QUERY message that asks a node for its partition id."""
    return RecordDict({"config": ConfigRecord({QUERY_KEY: QUERY_PARTITION})})


def is_partition_query(msg: Message) -> bool:
    """Whether a QUERY message asks for the node's partition id (the ClientApp's side)."""
    config = msg.content.config_records.get("config")
    return config is not None and config.get(QUERY_KEY) == QUERY_PARTITION


def partition_answer(node_config: dict) -> RecordDict:
    """The reply content: the node's ``partition-id`` and ``num-partitions`` from its node config."""
    answer = {k: int(node_config[k]) for k in (PARTITION_ID_KEY, NUM_PARTITIONS_KEY) if k in node_config}
    return RecordDict({"config": ConfigRecord(answer)})


class PartitionDirectory:
    """Node id -> partition id (inferred from registration order, or asked); a stable order of the nodes.

    Parameters
    ----------
    timeout : float
        Seconds to wait for the answers to a partition query. A node that does not answer in
        time, answers with an error or without a valid partition id keeps no partition: it sorts
        after every node with one, by node id (not reproducible, and logged).
    """

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self.partition_of: dict[int, int] = {}
        self._seen: set[int] = set()
        self._mismatch_logged = False

    def key(self, node_id: int) -> tuple[int, int]:
        """Sort key: ``(0, partition id)`` for a node with a partition, else ``(1, node id)``."""
        pid = self.partition_of.get(node_id)
        return (0, pid) if pid is not None else (1, node_id)

    def wait_for_registration(self, grid: Grid, settle_seconds: float = 1.0, limit_seconds: float = 120.0) -> int:
        """Wait until the grid's node count stops changing for ``settle_seconds``; returns the count.

        The simulation engine starts the ServerApp while it is still registering nodes (with
        10,000 of them, round 1 once saw 8,362): sampling from a partial federation would differ
        between runs. Gives up after ``limit_seconds`` (a deployment whose nodes keep joining).
        """
        deadline = time.monotonic() + limit_seconds
        count, since = len(list(grid.get_node_ids())), time.monotonic()
        while time.monotonic() - since < settle_seconds and time.monotonic() < deadline:
            time.sleep(0.1)
            now = len(list(grid.get_node_ids()))
            if now != count:
                count, since = now, time.monotonic()
        return count

    def ordered_nodes(self, grid: Grid) -> list[int]:
        """The grid's nodes sorted by partition id (learns the nodes not seen before)."""
        node_ids = list(grid.get_node_ids())
        new = [n for n in node_ids if n not in self._seen]
        if new:
            self._seen.update(new)
            unplaced = self._place_by_registration(grid, new)
            if unplaced:
                self.learn(grid, unplaced)
        return sorted(node_ids, key=self.key)

    def _place_by_registration(self, grid: Grid, new: list[int]) -> list[int]:
        """Give ``new`` nodes the next partition ids in registration order; return those it cannot place."""
        try:
            stamps = {int(info.node_id): _timestamp(info.registered_at) for info in grid.get_nodes()}
        except (AttributeError, NotImplementedError, TypeError, ValueError):
            return new  # a grid without NodeInfo: ask every node
        new_set = set(new)
        if any(stamps.get(n) is None for n in new):
            return new
        order = sorted(new, key=lambda n: stamps[n])
        ties = {n for a, b in zip(order, order[1:]) if stamps[a] == stamps[b] for n in (a, b)}
        if ties or set(self.partition_of) & new_set:
            return new  # registered in the same microsecond: the order among them is unknown
        start = len(self.partition_of)
        for offset, node_id in enumerate(order):
            self.partition_of[node_id] = start + offset
        log(INFO, "fedquant: placed %d new node(s) by registration order", len(order))
        return []

    def learn(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Ask ``node_ids`` for their partition id (one QUERY message each) and record the answers."""
        node_ids = sorted(set(node_ids))
        self._seen.update(node_ids)
        messages = [Message(partition_query(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
        replies = grid.send_and_receive(messages, timeout=self.timeout)
        asked, learned = set(node_ids), 0
        for reply in replies:
            node_id = reply.metadata.src_node_id
            pid = None if reply.has_error() else _valid_partition(reply)
            if pid is not None and node_id in asked:
                self.partition_of[node_id] = pid
                learned += 1
        log(INFO, "fedquant: asked %d node(s) for their partition, %d answered", len(node_ids), learned)
        if learned < len(node_ids):
            log(WARNING, "fedquant: %d node(s) gave no partition id; they are sampled by node id (not reproducible)",
                len(node_ids) - learned)  # fmt: skip

    def confirm(self, node_id: int, reported_partition: int) -> bool:
        """Check a partition id a client reported against the one assumed; log the first mismatch."""
        assumed = self.partition_of.get(node_id)
        if assumed is None or assumed == reported_partition:
            return True
        if not self._mismatch_logged:
            self._mismatch_logged = True
            log(WARNING, "fedquant: node %s reports partition %s, placed as %s: nodes did not register in "
                "partition order, so client sampling and seeds may differ between runs", node_id,
                reported_partition, assumed)  # fmt: skip
        return False


def _timestamp(text: str) -> datetime | None:
    """A ``registered_at`` ISO timestamp as a datetime (None when missing or unreadable)."""
    try:
        return datetime.fromisoformat(text) if text else None
    except (TypeError, ValueError):
        return None


def _valid_partition(reply: Message) -> int | None:
    """The reply's partition id if it is an int in ``0..num-partitions-1`` (the reply is untrusted)."""
    config = reply.content.config_records.get("config")
    if config is None:
        return None
    pid, num = config.get(PARTITION_ID_KEY), config.get(NUM_PARTITIONS_KEY)
    if isinstance(pid, bool) or not isinstance(pid, int) or isinstance(num, bool) or not isinstance(num, int):
        return None
    return pid if 0 <= pid < num else None
