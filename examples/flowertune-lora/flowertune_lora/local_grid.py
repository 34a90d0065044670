"""Run the ServerApp and ClientApp in this process, without Ray: what the sweep uses to stay CPU-cheap.

:class:`InProcessGrid` is just enough of a :class:`~flwr.serverapp.Grid` for ``Strategy.start``:
each message goes to the ClientApp (its mods included) with that node's :class:`Context`, one
after the other. The messages are the objects a simulation would serialise, so the ArrayRecords
and their ``count_bytes()`` are the same; what this skips is Ray and the process boundary
(``flwr run .`` and the slow test go through Flower's simulation engine).
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

APP_DIR = Path(__file__).resolve().parents[1]


def default_run_config() -> dict:
    """The app's ``[tool.flwr.app.config]``."""
    return tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


class InProcessGrid(Grid):
    """Nodes ``101..100+n`` with partition ids ``0..n-1``; a ClientApp exception becomes an error reply."""

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict) -> None:
        for attr in ("run_id", "node_id", "task_id"):  # the identity a ServerApp process has, so Message() works
            try:
                getattr(TaskIdentity, attr)
            except RuntimeError:
                setattr(TaskIdentity, attr, 1)
        self.client_app = client_app
        self.contexts = {
            101 + p: Context(run_id=1, node_id=101 + p, node_config={"partition-id": p, "num-partitions": num_nodes},
                             state=RecordDict(), run_config=dict(run_config))  # fmt: skip
            for p in range(num_nodes)
        }

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            try:
                replies.append(self.client_app(message, self.contexts[message.metadata.dst_node_id]))
            except Exception as err:  # (Flower turns a ClientApp exception into an error reply)
                error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err))
                replies.append(Message(error, reply_to=message))
        return replies

    # not needed by Strategy.start
    @property
    def run(self):
        raise NotImplementedError

    def set_run(self, run) -> None:
        raise NotImplementedError

    def create_message(self, *args, **kwargs) -> Message:
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError


def run_in_process(run_config: dict, num_clients: int) -> None:
    """One run of the app (ServerApp ``main`` with an :class:`InProcessGrid`), history written as usual."""
    from flowertune_lora.client_app import app as client_app
    from flowertune_lora.server_app import main

    config = {**default_run_config(), **run_config}
    unknown = set(run_config) - set(default_run_config())
    if unknown:
        raise ValueError(f"unknown run-config keys: {sorted(unknown)}")
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    main(InProcessGrid(client_app, num_clients, config), context)
