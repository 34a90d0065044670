"""Bytes sent and received, counted as FlowerTune counts them: ``ArrayRecord.count_bytes()`` per message.

FlowerTune's leaderboard budgets communication by summing ``count_bytes()`` (array data plus key
names) of every message's ArrayRecord in both directions. Counting where messages cross the
:class:`~flwr.serverapp.Grid` sees what really travels, whatever strategy (or strategy wrapper)
built or will read the messages.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


def array_bytes(message: Message) -> int:
    """``count_bytes()`` of the message's ArrayRecords (0 for an error reply)."""
    if message.has_error():
        return 0
    return sum(record.count_bytes() for record in message.content.array_records.values())


class CountingGrid(Grid):
    """A Grid that delegates to ``grid`` and keeps per exchange the bytes sent down and received up."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.exchanges: list[dict[str, int | str]] = []  # one per send_and_receive, in order

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.exchanges.append({
            "type": messages[0].metadata.message_type if messages else "",
            "downlink": sum(array_bytes(m) for m in messages),
            "uplink": sum(array_bytes(r) for r in replies),
        })  # fmt: skip
        return replies

    def train_bytes(self) -> list[tuple[int, int]]:
        """(downlink, uplink) of each train exchange, i.e. of each round."""
        return [(int(e["downlink"]), int(e["uplink"])) for e in self.exchanges if e["type"] == "train"]

    # the rest of the Grid interface, delegated unchanged
    @property
    def run(self):
        return self.grid.run

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)
