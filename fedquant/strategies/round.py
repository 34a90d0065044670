"""The per-round state of the server: one object per round, one store, one eviction rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.supercore import log

from fedquant.metrics.bandwidth import RoundTraffic
from fedquant.strategies.admission.vote import Vote
from fedquant.strategies.budget import BudgetChoice
from fedquant.strategies.decode_plan import ClientAssignment
from fedquant.strategies.reply_decoder import DecodedReply

LOG_PREFIX = "QuantizedStrategy"


@dataclass
class TrainRound:
    """Everything one train round's stages decide and learn, from ``configure_train`` to ``aggregate_train``.

    Stages talk to each other only through these fields: each field names the stage that writes it.
    """

    server_round: int
    model: ArrayRecord | None = None  # the global model the inner strategy configured the round with
    dtypes: dict[str, np.dtype] = field(default_factory=dict)  # its dtypes
    # assignment
    assignments: dict[int, ClientAssignment] = field(default_factory=dict)
    seeds: dict[int, int] = field(default_factory=dict)
    entries: dict[int, dict] = field(default_factory=dict)  # node id -> config entries, in stage order
    budget: BudgetChoice | None = None  # the upload budget's settings, learned from in budgeting
    # downlink
    sent: dict[int, ArrayRecord] = field(default_factory=dict)  # what each node rebuilds
    wire: dict[int, ArrayRecord] = field(default_factory=dict)  # what its message carries
    traffic: RoundTraffic = field(default_factory=RoundTraffic)
    received_numpy: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    # arrival
    reply_bytes: dict[int, int] = field(default_factory=dict)  # node id -> bytes as they arrived (last reply)
    bytes_of: dict[int, int] = field(default_factory=dict)  # node id -> bytes of its first reply
    client_metrics: dict[int, tuple] = field(default_factory=dict)  # id(reply) -> the mod's own entries
    # screening
    screened: dict[int, Message] = field(default_factory=dict)  # node id -> reply, arrival order
    vote: Vote | None = None  # the round's vote: its schema and references (screening), sums and consensus
    # decoding and admission
    accepted: dict[int, Message] = field(default_factory=dict)  # id(reply) -> reply, in the order accepted
    decoded: dict[int, DecodedReply] = field(default_factory=dict)  # id(reply) -> its update, as admitted
    admitted: list[Message] = field(default_factory=list)
    # aggregation
    arrays: ArrayRecord | None = None
    inner_metrics: MetricRecord | None = None
    failed: bool = False
    zero_dropped: int = 0
    clamped_values: int = 0  # values of the served model the tensor policy's bounds moved
    # secure aggregation (:mod:`.secure`): the Grid of configure_train, for the protocol's extra round trips
    grid: object = None
    secure: object = None

    def received(self, node_id: int) -> dict[str, np.ndarray]:
        """The arrays sent to ``node_id`` as NumPy, deserialized once per distinct ArrayRecord."""
        record = self.sent[node_id]
        key = id(record)
        if key not in self.received_numpy:
            self.received_numpy[key] = {name: array.numpy() for name, array in record.items()}
        return self.received_numpy[key]

    def reject(self, node_id: int, problem: tuple[str, str]) -> None:
        """Drop ``node_id``'s reply: count its reason in the round's traffic and log it."""
        reject(self.server_round, node_id, problem, self.traffic)


class RoundLedger:
    """The open rounds, train and evaluate, each from its configure to its aggregate.

    One eviction rule: configuring round ``r`` of a kind forgets every earlier round of that kind
    (a round not aggregated before the next one starts never will be), so state cannot pile up.
    """

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], object] = {}

    def open(self, kind: str, server_round: int, state: object) -> None:
        """Keep ``state`` until :meth:`close` of the same round."""
        self._open = {key: s for key, s in self._open.items() if key[0] != kind or key[1] >= server_round}
        self._open[kind, server_round] = state

    def close(self, kind: str, server_round: int) -> object | None:
        """Take the state of an open round (None when it was not configured here)."""
        return self._open.pop((kind, server_round), None)

    def peek(self, kind: str, server_round: int) -> object | None:
        """The state of an open round, left open."""
        return self._open.get((kind, server_round))

    def __len__(self) -> int:
        return len(self._open)


def reject(server_round: int, node_id: int, problem: tuple[str, str], traffic: RoundTraffic | None) -> None:
    """Log a dropped reply and, in a train round, count its reason."""
    reason, sentence = problem
    if traffic is not None:
        traffic.rejected_reasons.append(reason)
    log(
        WARNING,
        "%s: round %s: dropped the reply of node %s (%s): %s",
        LOG_PREFIX,
        server_round,
        node_id,
        reason,
        sentence,
    )
