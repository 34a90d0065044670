"""Secure sums by groups: the round's clients split into disjoint SecAgg+ instances run in lockstep.

The server learns each group's sum instead of one sum over everyone. What it buys: a client that
ignores the clip (or sends any vector at all) can only spoil its own group's sum, which the
strategy then leaves out (its members are named in the log: the offender is one of them), so
one client can neither refuse the whole round (denial of service) nor move the mean by more
than its group could; its cost is privacy (each sum covers ``~n / groups`` clients, not ``n``).
With one group this is exactly one :class:`~fedquant.secagg.server.SecAggServer`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flwr.app import RecordDict

from fedquant.secagg.server import SecAggServer, SecureSum

#: The smallest group: its threshold (a majority of at least 2) must leave room for one dropout.
MIN_GROUP_SIZE = 3


def split_groups(nodes: Sequence[int], groups: int, rng: random.Random) -> list[list[int]]:
    """``nodes`` in ``min(groups, len(nodes) // MIN_GROUP_SIZE)`` (at least 1) random groups of near-equal size."""
    order = sorted(set(nodes))
    count = max(1, min(groups, len(order) // MIN_GROUP_SIZE))
    rng.shuffle(order)
    return [sorted(order[g::count]) for g in range(count)]


@dataclass
class GroupedServer:
    """Several :class:`SecAggServer` driven as one (``requests``, ``receive``, ``stage``, ``done``)."""

    servers: list[SecAggServer]

    @property
    def server_round(self) -> int:
        return self.servers[0].server_round

    @property
    def done(self) -> bool:
        return all(s.done for s in self.servers)

    @property
    def stage(self) -> str:
        """The stage of the groups still running (they move together); ``done`` or ``failed`` after."""
        running = [s.stage for s in self.servers if not s.done]
        if running:
            return running[0]
        return "done" if self.completed() else "failed"

    @property
    def failure(self) -> str | None:
        """Why every group failed (``None`` while one runs or completed)."""
        if not self.done or self.completed():
            return None
        return "; ".join(f"group of {len(s.nodes)}: {s.failure}" for s in self.servers)

    def completed(self) -> list[SecureSum]:
        """The sums of the groups that completed."""
        return [s.result for s in self.servers if s.result is not None]

    def requests(self) -> dict[int, RecordDict]:
        out: dict[int, RecordDict] = {}
        for server in self.servers:
            out.update(server.requests())
        return out

    def receive(self, replies: Mapping[int, RecordDict | None]) -> None:
        for server in self.servers:
            if not server.done:
                server.receive({n: c for n, c in replies.items() if n in server.active})
