"""Secure stage: a whole SecAgg+ round in place of screening, decoding, admission and aggregation.

Advertise and share-keys run in ``configure_train`` over the grid Flower hands it; the collect
requests become the round's train messages (Flower sends them with its timeout); consistency
(signed rounds) and unmask run in ``aggregate_train`` over the same grid. The clients are split
into ``SecAggConfig.groups`` SecAgg+ groups run in lockstep; the mean of the groups that pass
:func:`.secure_round.checked_mean` reaches the inner strategy as one synthetic reply
``received + mean`` weighing the number of inputs: FedAvg's mean of one reply is that reply. A
failed round keeps the model.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from logging import ERROR

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedquant.metrics.bandwidth import content_bytes
from fedquant.metrics.message_bytes import messages_bytes
from fedquant.rng import derive_seed
from fedquant.secagg.accounting import PrivacyLedger
from fedquant.secagg.config import SecAggConfig
from fedquant.secagg.driver import sort_replies, stage_messages
from fedquant.secagg.groups import GroupedServer, split_groups
from fedquant.secagg.server import SecAggServer, Segment
from fedquant.secagg.wiring import (
    GRID_PREFIX,
    GRID_RECORD,
    UPDATE_SEGMENT,
    add_flat,
    float_layout,
    grid_record,
    wire_bytes,
)
from fedquant.strategies.dtypes import restore_dtypes
from fedquant.strategies.inner_guard import guarded_train
from fedquant.strategies.round import LOG_PREFIX, TrainRound
from fedquant.strategies.secure_round import SecureRound, checked_mean, count_up, round_metrics, round_trip
from fedquant.strategies.stages.base import RoundStage


class SecureAggregation(RoundStage):
    """The secure round (module doc). ``client_seed(round, node)`` gives dither seeds, ``weight_key``
    names the synthetic reply's weight, ``stage_timeout`` bounds each extra round trip (seconds)."""

    def __init__(self, strategy: Strategy, config: SecAggConfig, seed: int, client_seed: Callable[[int, int], int],
                 weight_key: str, stage_timeout: float | None = 600.0) -> None:  # fmt: skip
        self.strategy, self.config, self.seed, self.client_seed = strategy, config, seed, client_seed
        self.weight_key, self.stage_timeout = weight_key, stage_timeout
        self.previous_mean: np.ndarray | None = None  # the ScaleRule's input: last round's decoded mean
        self.cumulative_uplink_bytes, self.failures = 0, {}
        self.ledger = PrivacyLedger(config.delta) if config.noise_multiplier > 0 else None

    # ------------------------------------------------------------------ configure
    def configure(self, state: TrainRound, messages: list[Message]) -> None:
        """Run advertise and share-keys over ``state.grid``; replace ``messages`` by the collect requests."""
        sec = state.secure = SecureRound(transport=state.grid, sampled=len(messages))
        templates = {m.metadata.dst_node_id: m for m in messages}
        messages.clear()
        if state.model is None or state.grid is None or not templates:
            return self._fail(state, "no model, grid or sampled node to run a secure round with")
        sec.record_name = next(iter(next(iter(templates.values())).content.array_records), "arrays")
        sec.layout = float_layout(state.model)
        numel = sum(n for _, n in sec.layout)
        if numel == 0:
            return self._fail(state, "the model has no float tensor to aggregate")
        nodes = sorted(templates)
        try:
            rng = random.Random(os.urandom(16))  # groups and rings: the server's choice, not predictable
            parts = split_groups(nodes, self.config.groups, rng)
            sec.groups = len(parts)
            sec.grid = self.config.scale_rule().grid(  # sized for the largest group's sum
                numel, max(map(len, parts)), derive_seed(self.seed, state.server_round, "secagg-rotation"),
                self.previous_mean,
            )
            segments = [Segment(UPDATE_SEGMENT, sec.grid.sent_numel, sec.grid.bits)]
            sec.server = GroupedServer([SecAggServer(self.config, p, segments, state.server_round, rng=rng)
                                        for p in parts])  # fmt: skip
        except ValueError as err:
            return self._fail(state, f"cannot set up the secure round for {len(nodes)} nodes: {err}")
        while sec.server.stage in ("advertise", "share-keys"):
            round_trip(state, sec, self.stage_timeout)
        if sec.server.done:
            return self._fail(state, sec.server.failure or "the protocol ended before collect")
        grid_config = sec.grid.to_config(GRID_PREFIX)

        def extra(stage: str, node: int) -> RecordDict:
            template = templates[node].content
            sec.dither_seeds[node] = self.client_seed(state.server_round, node)
            records = {sec.record_name: state.model}
            for name, record in template.config_records.items():
                records[name] = ConfigRecord(dict(record))
            records[GRID_RECORD] = grid_record(grid_config, sec.dither_seeds[node], self.config.max_examples)
            return RecordDict(records)

        sec.sent = stage_messages(sec.server, extra)
        model_bytes = wire_bytes(RecordDict({sec.record_name: state.model}))
        for node, message in sec.sent.items():
            sec.down["collect"] += wire_bytes(message.content) - model_bytes
            sec.model_bytes += content_bytes(RecordDict({sec.record_name: state.model}))
            state.traffic.downlink_bytes_of[node] = content_bytes(message.content)
        sec.message_down["collect"] += messages_bytes(sec.sent.values())
        messages.extend(sec.sent.values())

    # ------------------------------------------------------------------ receive
    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Take the collect replies, run unmask, check and decode the sum, aggregate it."""
        sec: SecureRound | None = state.secure
        if sec is None or sec.server is None or sec.failure is not None:
            return
        server = sec.server
        count_up(sec, "collect", replies)
        server.receive(sort_replies(sec.sent, replies, state.server_round))
        while not server.done:
            round_trip(state, sec, self.stage_timeout)
        state.reply_bytes = dict(sec.up_of)
        if not server.completed():
            return self._fail(state, server.failure or "the protocol failed")
        mean, problem = checked_mean(sec, server)
        if problem is not None:
            return self._fail(state, problem)
        grid = sec.grid
        received = {name: array.numpy() for name, array in state.model.items()}
        arrays = ArrayRecord({name: Array(a) for name, a in add_flat(received, mean, sec.layout).items()})
        content = RecordDict({sec.record_name: arrays, "metrics": MetricRecord({self.weight_key: sec.weight_total})})
        reply = Message(content, reply_to=sec.sent[server.completed()[0].survivors[0]])
        aggregated, metrics, state.failed = guarded_train(self.strategy, state.server_round, [reply])
        if aggregated is None:
            return self._fail(state, "the inner strategy did not aggregate the secure sum")
        state.arrays = restore_dtypes(aggregated, state.dtypes)
        state.inner_metrics = metrics
        self.previous_mean = mean
        if self.ledger is not None:
            rho = self.ledger.record(grid, min(sec.group_sizes))  # each client hides in its own group
            sec.dp_round_epsilon = self.ledger.round_epsilon(rho)

    def _fail(self, state: TrainRound, reason: str) -> None:
        sec = state.secure
        sec.failure = reason
        self.failures[state.server_round] = reason
        state.arrays = None
        log(ERROR, "%s: round %s: secure aggregation failed, keeping the current model: %s",
            LOG_PREFIX, state.server_round, reason)  # fmt: skip

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """Bytes per protocol stage, bits per parameter with every stage counted, survivors, failure, DP."""
        if state.secure is None:
            return {}
        self.cumulative_uplink_bytes += sum(state.secure.up.values())
        return round_metrics(state, self.cumulative_uplink_bytes, self.ledger, self.config.delta)
