"""Secure stage: a whole SecAgg+ round over summable updates, in place of screening, decoding,
admission and per-reply aggregation (the server sees only the sum).

The protocol needs four round trips; Flower's loop makes one per round. So the stage runs the
first two (*advertise*, *share-keys*) in ``configure_train`` over the ``grid`` Flower hands it,
returns the *collect* requests (protocol record, model, inner config, the round's grid) as the
round's train messages, so that Flower sends them with its own timeout, and in
``aggregate_train`` runs *unmask* over the same grid, decodes the sum
(:func:`~fedquant.codecs.summable.decode_sum`) and hands the inner strategy one synthetic reply:
``received + mean`` weighing the weight total. FedAvg's weighted mean of one reply is that
reply, so the model becomes ``received + mean`` exactly; a server optimizer (FedAdam, ...) gets
``mean`` as its pseudo-gradient.

Every check the threat model promises runs before the inner strategy: a round fails (model kept,
reason logged, ``secagg-failed`` = 1) when the protocol fails (too few survivors or shares),
when the weight total is zero or above ``survivors * WEIGHT_SCALE`` (honest clients cannot
exceed it), or when the decoded mean's L2 norm exceeds ``clip`` plus a bound on the rounding
error and noise (honest clients, who clip, cannot exceed it either).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import ERROR, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedquant.codecs.summable import WEIGHT_BITS, WEIGHT_SCALE, SumGrid, decode_sum
from fedquant.metrics.bandwidth import content_bytes, dense_float32_bytes
from fedquant.rng import derive_seed
from fedquant.secagg.config import SecAggConfig
from fedquant.secagg.driver import sort_replies, stage_messages
from fedquant.secagg.messages import STAGES
from fedquant.secagg.server import SecAggServer, Segment
from fedquant.secagg.wiring import GRID_PREFIX, GRID_RECORD, add_flat, float_layout, grid_record, wire_bytes
from fedquant.strategies.inner_guard import guarded_train
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.stages.state import LOG_PREFIX, TrainRound
from fedquant.strategies.update_bounds import restore_dtypes

#: How many standard deviations of the decoded mean's error the aggregate-norm check allows.
ERROR_BOUND_SIGMAS = 4.0
#: Per-coordinate variance of one client's rounding, in grid units.
ROUNDING_VARIANCE = {"dither": 1.0 / 12.0, "stochastic": 1.0 / 4.0}


@dataclass
class SecureRound:
    """What one secure round keeps from ``configure_train`` to ``aggregate_train``."""

    server: SecAggServer | None = None
    grid: SumGrid | None = None
    transport: object = None  # the Flower Grid of configure_train
    layout: list[tuple[str, int]] = field(default_factory=list)
    record_name: str = "arrays"
    sent: dict[int, Message] = field(default_factory=dict)  # node -> collect request
    dither_seeds: dict[int, int] = field(default_factory=dict)
    sampled: int = 0
    up: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # stage -> uplink bytes
    down: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # stage -> protocol downlink bytes
    model_bytes: int = 0  # the model in the collect requests
    up_of: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # node -> uplink bytes
    failure: str | None = None
    survivors: int = 0
    dropped_after_sharing: int = 0
    aggregate_norm: float = math.nan
    weight_total: float = 0.0
    dp_round_epsilon: float | None = None


class SecureAggregation(RoundStage):
    """The secure round (see the module doc).

    Parameters
    ----------
    strategy : Strategy
        The inner strategy (aggregates the one synthetic reply).
    config : SecAggConfig
    seed : int
        The run's base seed: the rotation seed of round ``r`` is ``derive_seed(seed, r, "secagg-rotation")``.
    client_seed : callable
        ``(round, node) -> dither seed`` (the wrapper's ``client_seed``).
    weight_key : str
        The inner strategy's weight key (``num-examples``).
    stage_timeout : float or None
        Seconds each extra round trip (advertise, share-keys, unmask) waits for replies.
    """

    def __init__(
        self,
        strategy: Strategy,
        config: SecAggConfig,
        seed: int,
        client_seed: Callable[[int, int], int],
        weight_key: str,
        stage_timeout: float | None = 600.0,
    ) -> None:
        self.strategy = strategy
        self.config = config
        self.seed = seed
        self.client_seed = client_seed
        self.weight_key = weight_key
        self.stage_timeout = stage_timeout
        self.previous_mean: np.ndarray | None = None
        self.cumulative_uplink_bytes = 0
        self.failures: dict[int, str] = {}
        self.ledger = None
        if config.noise_multiplier > 0:
            from fedquant.secagg.accounting import PrivacyLedger

            self.ledger = PrivacyLedger(config.delta)

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
            sec.grid = self.config.scale_rule().grid(
                numel, len(nodes), derive_seed(self.seed, state.server_round, "secagg-rotation"), self.previous_mean
            )
            segments = [Segment("update", sec.grid.padded_numel, sec.grid.bits), Segment("weight", 1, WEIGHT_BITS)]
            sec.server = SecAggServer(self.config, nodes, segments, state.server_round)
        except ValueError as err:
            return self._fail(state, f"cannot set up the secure round for {len(nodes)} nodes: {err}")
        while sec.server.stage in ("advertise", "share-keys"):
            self._round_trip(state, sec)
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
        messages.extend(sec.sent.values())

    def _round_trip(self, state: TrainRound, sec: SecureRound) -> None:
        """One protocol stage over the Grid kept from ``configure_train``."""
        server = sec.server
        sent = stage_messages(server)
        for message in sent.values():
            sec.down[server.stage] += wire_bytes(message.content)
        try:
            replies = list(sec.transport.send_and_receive(list(sent.values()), timeout=self.stage_timeout))
        except Exception as err:  # noqa: BLE001 -- a transport failure is a failed round, not a crashed run
            log(ERROR, "%s: round %s: secagg %s: the grid raised %r", LOG_PREFIX, state.server_round, server.stage, err)
            replies = []
        self._count_up(sec, server.stage, replies)
        server.receive(sort_replies(sent, replies, state.server_round))

    @staticmethod
    def _count_up(sec: SecureRound, stage: str, replies: list[Message]) -> None:
        for reply in replies:  # every reply that arrived counts, accepted or not
            if reply.has_error():
                continue
            size = wire_bytes(reply.content)
            sec.up[stage] += size
            sec.up_of[reply.metadata.src_node_id] += size

    # ------------------------------------------------------------------ receive
    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Take the collect replies, run unmask, check and decode the sum, aggregate it."""
        sec: SecureRound | None = state.secure
        if sec is None or sec.server is None or sec.failure is not None:
            return
        server = sec.server
        self._count_up(sec, "collect", replies)
        server.receive(sort_replies(sec.sent, replies, state.server_round))
        while not server.done:
            self._round_trip(state, sec)
        state.reply_bytes = dict(sec.up_of)
        result = server.result
        if result is None:
            return self._fail(state, server.failure or "the protocol failed")
        sec.survivors, sec.dropped_after_sharing = len(result.survivors), len(result.dropped)
        units = int(result.sums["weight"][0])
        if units <= 0 or units > len(result.survivors) * WEIGHT_SCALE:
            return self._fail(
                state, f"weight total {units} is outside 1..{len(result.survivors) * WEIGHT_SCALE} "
                f"({len(result.survivors)} survivors); a client misreported its weight",
            )  # fmt: skip
        grid = sec.grid
        seeds = [sec.dither_seeds[n] for n in result.survivors]
        mean = decode_sum(result.sums["update"], grid, seeds, units).numpy()
        sec.weight_total = units / WEIGHT_SCALE
        sec.aggregate_norm = float(np.linalg.norm(mean.astype(np.float64)))
        limit = grid.clip + ERROR_BOUND_SIGMAS * error_scale(grid, len(result.survivors), sec.weight_total)
        if not math.isfinite(sec.aggregate_norm) or sec.aggregate_norm > limit:
            return self._fail(
                state, f"the aggregate's norm {sec.aggregate_norm:.4g} exceeds clip + error bound {limit:.4g}; "
                "a client ignored the clip",
            )  # fmt: skip
        received = {name: array.numpy() for name, array in state.model.items()}
        arrays = ArrayRecord({name: Array(a) for name, a in add_flat(received, mean, sec.layout).items()})
        content = RecordDict({sec.record_name: arrays, "metrics": MetricRecord({self.weight_key: sec.weight_total})})
        reply = Message(content, reply_to=sec.sent[result.survivors[0]])
        aggregated, metrics, state.failed = guarded_train(self.strategy, state.server_round, [reply])
        if aggregated is None:
            return self._fail(state, "the inner strategy did not aggregate the secure sum")
        state.arrays = restore_dtypes(aggregated, state.dtypes)
        state.inner_metrics = metrics
        self.previous_mean = mean
        if self.ledger is not None:
            rho = self.ledger.record(grid, len(result.survivors))
            sec.dp_round_epsilon = self.ledger.round_epsilon(rho)

    def _fail(self, state: TrainRound, reason: str) -> None:
        sec = state.secure
        sec.failure = reason
        self.failures[state.server_round] = reason
        state.arrays = None
        log(ERROR, "%s: round %s: secure aggregation failed, keeping the current model: %s",
            LOG_PREFIX, state.server_round, reason)  # fmt: skip

    # ------------------------------------------------------------------ report
    def report(self, state: TrainRound) -> dict[str, int | float]:
        """Bytes per protocol stage, bits per parameter with every stage counted, survivors, failure, DP."""
        sec: SecureRound | None = state.secure
        if sec is None:
            return {}
        numel = sum(n for _, n in sec.layout)
        uplink = sum(sec.up.values())
        self.cumulative_uplink_bytes += uplink
        dense = sec.sampled * (dense_float32_bytes(state.model) if state.model is not None else 0)
        out: dict[str, int | float] = {f"secagg-uplink-bytes-{stage}": sec.up.get(stage, 0) for stage in STAGES}
        out.update({f"secagg-downlink-bytes-{stage}": sec.down.get(stage, 0) for stage in STAGES})
        out.update(
            {
                "uplink-bytes": uplink,
                "uplink-bytes-dense": dense,
                "compression-ratio": dense / uplink if uplink else 0.0,
                "bits-per-param": 8.0 * uplink / (sec.sampled * numel) if sec.sampled and numel else 0.0,
                "cumulative-uplink-bytes": self.cumulative_uplink_bytes,
                "downlink-bytes": sec.model_bytes,
                "secagg-downlink-bytes": sum(sec.down.values()),
                "secagg-sampled": sec.sampled,
                "secagg-survivors": sec.survivors,
                "secagg-dropped": sec.sampled - sec.survivors,
                "secagg-dropped-after-sharing": sec.dropped_after_sharing,
                "secagg-failed": int(sec.failure is not None),
                "secagg-bits": sec.grid.bits if sec.grid is not None else 0,
                "secagg-wrap-bound": sec.grid.wrap_bound if sec.grid is not None else 0.0,
                "secagg-aggregate-norm": sec.aggregate_norm if math.isfinite(sec.aggregate_norm) else -1.0,
                "secagg-weight-total": sec.weight_total,
            }
        )
        if self.ledger is not None:
            out["dp-epsilon"] = self.ledger.epsilon()
            out["dp-delta"] = self.config.delta
            if sec.dp_round_epsilon is not None:
                out["dp-round-epsilon"] = sec.dp_round_epsilon
        if sec.failure is not None:
            log(WARNING, "%s: round %s: secagg-failed: %s", LOG_PREFIX, state.server_round, sec.failure)
        return out


def error_scale(grid: SumGrid, survivors: int, weight_total: float) -> float:
    """Standard deviation scale of the decoded mean's error norm: ``sqrt(E ||mean_hat - mean||^2)``.

    Each survivor's rounding adds ``ROUNDING_VARIANCE`` grid units per rotated coordinate (plus the
    noise's variance); see :func:`~fedquant.codecs.summable.expected_mean_error`.
    """
    per_unit = (ROUNDING_VARIANCE[grid.rounding] + grid.noise_variance) * survivors / weight_total**2
    steps = np.asarray(grid.steps, dtype=np.float64)
    return math.sqrt(float(np.sum(grid.real_elements_per_block() * steps**2)) * per_unit)
