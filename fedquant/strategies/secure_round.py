"""The secure round's per-round record (:class:`SecureRound`) and its metrics (:func:`round_metrics`)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from logging import ERROR, WARNING

import numpy as np
from flwr.app import Message
from flwr.supercore import log

from fedquant.codecs.summable import WEIGHT_SCALE, SumGrid, decode_sum
from fedquant.metrics.bandwidth import dense_float32_bytes
from fedquant.metrics.message_bytes import messages_bytes
from fedquant.secagg.driver import sort_replies, stage_messages
from fedquant.secagg.groups import GroupedServer
from fedquant.secagg.messages import CONSISTENCY, ORDER, STAGES
from fedquant.secagg.wiring import UPDATE_SEGMENT, wire_bytes
from fedquant.strategies.round import LOG_PREFIX, TrainRound

#: How many standard deviations of the decoded mean's error the aggregate-norm check allows.
ERROR_BOUND_SIGMAS = 4.0
#: Whole-message bytes per stage (``fedquant.metrics.messages_bytes``): prefix + stage.
MESSAGE_UP_PREFIX = "secagg-message-bytes-up-"
MESSAGE_DOWN_PREFIX = "secagg-message-bytes-down-"
#: Per-coordinate variance of one client's rounding, in grid units.
ROUNDING_VARIANCE = {"dither": 1.0 / 12.0, "stochastic": 1.0 / 4.0}


@dataclass
class SecureRound:
    """What one secure round keeps from ``configure_train`` to ``aggregate_train``."""

    server: GroupedServer | None = None
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
    message_up: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # stage -> whole replies
    message_down: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # stage -> whole requests
    failure: str | None = None
    survivors: int = 0
    dropped_after_sharing: int = 0
    aggregate_norm: float = math.nan
    weight_total: float = 0.0  # the mean's denominator: the inputs summed (the server counts them)
    groups: int = 1
    group_sizes: list[int] = field(default_factory=list)  # inputs of every group the server decoded
    refused_groups: int = 0
    refused_inputs: int = 0
    dp_round_epsilon: float | None = None


def round_metrics(state: TrainRound, cumulative: int, ledger, delta: float) -> dict[str, int | float]:
    """Bytes per protocol stage (payload and whole messages), bits per parameter with every stage
    counted, survivors, failure, DP.

    The server sees only the sum, so how often one client's values wrapped cannot be measured here
    (``secagg-wrap-bound`` is the grid's bound on any wrap in the round).
    """
    sec: SecureRound | None = state.secure
    if sec is None:
        return {}
    numel = sum(n for _, n in sec.layout)
    uplink = sum(sec.up.values())
    dense = sec.sampled * (dense_float32_bytes(state.model) if state.model is not None else 0)
    stages = ORDER if CONSISTENCY in sec.down else STAGES  # the consistency stage of signed rounds
    out: dict[str, int | float] = {f"secagg-uplink-bytes-{stage}": sec.up.get(stage, 0) for stage in stages}
    out.update({f"secagg-downlink-bytes-{stage}": sec.down.get(stage, 0) for stage in stages})
    out.update({MESSAGE_UP_PREFIX + stage: sec.message_up.get(stage, 0) for stage in stages})
    out.update({MESSAGE_DOWN_PREFIX + stage: sec.message_down.get(stage, 0) for stage in stages})
    out.update(
        {
            "uplink-bytes": uplink,
            "uplink-bytes-dense": dense,
            "compression-ratio": dense / uplink if uplink else 0.0,
            "bits-per-param": 8.0 * uplink / (sec.sampled * numel) if sec.sampled and numel else 0.0,
            "cumulative-uplink-bytes": cumulative,
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
            "secagg-groups": sec.groups,
            "secagg-refused-groups": sec.refused_groups,
            "secagg-refused-inputs": sec.refused_inputs,
        }
    )
    if ledger is not None:
        out["dp-epsilon"] = ledger.epsilon()
        out["dp-delta"] = delta
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


def round_trip(state: TrainRound, sec: SecureRound, timeout: float | None) -> None:
    """One protocol stage over the Grid kept from ``configure_train``."""
    server = sec.server
    sent = stage_messages(server)
    for message in sent.values():
        sec.down[server.stage] += wire_bytes(message.content)
    sec.message_down[server.stage] += messages_bytes(sent.values())
    try:
        replies = list(sec.transport.send_and_receive(list(sent.values()), timeout=timeout))
    except Exception as err:  # noqa: BLE001 -- a transport failure is a failed round, not a crashed run
        log(ERROR, "%s: round %s: secagg %s: the grid raised %r", LOG_PREFIX, state.server_round, server.stage, err)
        replies = []
    count_up(sec, server.stage, replies)
    server.receive(sort_replies(sent, replies, state.server_round))


def count_up(sec: SecureRound, stage: str, replies: list[Message]) -> None:
    """Count the uplink bytes of the replies that arrived (accepted or not; whole messages: errors too)."""
    sec.message_up[stage] += messages_bytes(replies)
    for reply in replies:  # every reply that arrived counts, accepted or not
        if reply.has_error():
            continue
        size = wire_bytes(reply.content)
        sec.up[stage] += size
        sec.up_of[reply.metadata.src_node_id] += size


def checked_mean(sec: SecureRound, grouped: GroupedServer) -> tuple[np.ndarray | None, str | None]:
    """The mean of the groups whose sums honest clipped clients could send, or why the round fails.

    Each completed group's sum is decoded as a sum (no weight divides it: the denominator is the
    number of inputs, which the server counts itself). A group whose sum's norm exceeds ``clip``
    per input plus ``ERROR_BOUND_SIGMAS`` of its rounding error holds a client that ignored the
    clip: the group is left out and its members logged; the others make the mean.
    """
    grid = sec.grid
    kept, inputs = [], 0
    for result in grouped.completed():
        members = len(result.survivors)
        seeds = [sec.dither_seeds[n] for n in result.survivors]
        total = decode_sum(result.sums[UPDATE_SEGMENT], grid, seeds, WEIGHT_SCALE).numpy().astype(np.float64)
        # With a subset of keep of the coordinates the decoded sum is rescaled by 1 / keep; unscaled,
        # it is at most the sent coordinates' norm, which clipping bounds like the whole.
        keep = grid.sent_numel / grid.padded_numel
        norm = float(np.linalg.norm(total)) * keep
        limit = grid.clip * members + ERROR_BOUND_SIGMAS * math.sqrt(keep) * error_scale(grid, members, 1.0)
        sec.dropped_after_sharing += len(result.dropped)
        sec.group_sizes.append(members)  # kept or not, the server has seen this sum (DP counts it)
        if not math.isfinite(norm) or norm > limit:
            sec.refused_groups += 1
            sec.refused_inputs += members
            log(WARNING, "%s: round %s: the secure sum of nodes %s has norm %.4g, more than their %d clipped "
                "inputs can reach (%.4g): one of them ignored the clip; the group is left out",
                LOG_PREFIX, sec.server.server_round, list(result.survivors), norm, members, limit)  # fmt: skip
            continue
        kept.append(total)
        inputs += members
    sec.survivors = inputs
    if not kept:
        return None, f"no group's secure sum is within what clipped clients can send ({sec.refused_groups} refused)"
    mean = (np.sum(kept, axis=0) / inputs).astype(np.float32)
    sec.weight_total = float(inputs)
    sec.aggregate_norm = float(np.linalg.norm(mean.astype(np.float64)))
    return mean, None
