"""``QuantizedStrategy``: wraps any Flower Message-API strategy with uplink compression."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedquant.codecs import Codec, get_codec
from fedquant.metrics.bandwidth import RoundTraffic, content_bytes, dense_float32_bytes, record_numel
from fedquant.metrics.history import EVALUATE_PREFIX, TRAIN_PREFIX, HistoryRecorder
from fedquant.rng import derive_seed
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, DecodePlan
from fedquant.strategies.nested import NestedDecodePlan
from fedquant.strategies.protocol import (
    CLIENT_METRICRECORD_NAME,
    DEFAULT_MIN_NUMEL,
    KEY_CLIENT_MSE,
    KEY_CODEC,
    KEY_MIN_NUMEL,
    KEY_SEED,
    METRIC_CLIENT_ENCODE_SECONDS,
    METRIC_CLIENT_MSE,
)
from fedquant.strategies.reply_decoder import RejectedReply, decode_reply

LOG_PREFIX = "QuantizedStrategy"


@dataclass
class _RoundPlan:
    """What ``configure_train`` decided, kept until ``aggregate_train`` of the same round."""

    assignments: dict[int, ClientAssignment]
    seeds: dict[int, int]
    sent: dict[int, ArrayRecord]
    traffic: RoundTraffic
    received_numpy: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)

    def received(self, node_id: int) -> dict[str, np.ndarray]:
        """The arrays sent to ``node_id`` as NumPy, deserialized once per distinct ArrayRecord."""
        record = self.sent[node_id]
        key = id(record)
        if key not in self.received_numpy:
            self.received_numpy[key] = {name: array.numpy() for name, array in record.items()}
        return self.received_numpy[key]


class QuantizedStrategy(Strategy):
    """Strategy wrapper that compresses the clients' updates with a fedquant codec.

    Use ``quantize_mod`` on the clients. In ``configure_train`` the wrapper adds to each
    client's ConfigRecord the codec spec, the client's seed for the round and the encoding
    threshold (keys in :mod:`fedquant.strategies.protocol`). In ``aggregate_train`` it checks and
    decodes every reply, rebuilds dense arrays ``received + decoded update``, hands those to the
    wrapped strategy and adds the round's bandwidth metrics to its MetricRecord. Evaluation
    passes through unchanged.

    Replies that cannot be decoded (malformed, another codec or shape, NaN/Inf, wrong keys) are
    dropped with a logged reason naming the node and counted in ``rejected-replies``; replies
    that carry an error go to the wrapped strategy as they are (Flower's handling). If no reply
    survives, the round returns no arrays and the current model is kept.

    Parameters
    ----------
    strategy : Strategy
        Any Message-API strategy (FedAvg, FedProx, FedAdam, Krum, ...). Its train messages must
        carry exactly one ArrayRecord.
    codec : str or Codec
        Codec spec (``"qsgd:levels=16"``, ``"ef+signsgd"``) or a codec instance.
    seed : int
        Base seed. Client ``n`` in round ``r`` gets ``derive_seed(seed, r, n)``; each tensor
        ``derive_seed(client_seed, tensor_name)``.
    min_numel : int
        Float tensors with fewer elements travel uncompressed (default 1024; QSGD's authors
        used 10 000 on ImageNet models, which would leave every layer of a small model dense).
    uplink_bandwidth : callable, optional
        ``node_id -> bytes per second``. When given, each round reports
        ``simulated-upload-seconds``: the largest reply bytes / bandwidth among the replies
        that arrived (the slowest sampled client).
    decode_plan : DecodePlan, optional
        Per-client codec assignment, decode order and side information (see
        :mod:`fedquant.strategies.decode_plan`); the default gives every client ``codec``,
        except for an ``ndqsg`` codec, which gets NDQSG's two-group scheme
        :class:`~fedquant.strategies.nested.NestedDecodePlan` (``rho`` adapted each round unless
        the spec string names it; a Codec instance fixes its own ``rho``; ``alpha`` from the spec).
    recorder : HistoryRecorder, optional
        Receives every round's train (``train/``) and evaluate (``evaluate/``) metrics.
    client_mse : bool
        Whether clients measure ``quantization-mse`` (default True). Measuring decodes every
        payload once more on the client, which costs about one decode per tensor per round.

    Examples
    --------
    Server::

        strategy = QuantizedStrategy(FedAvg(), codec="qsgd:levels=16", seed=0)

    Client::

        app = ClientApp(mods=[quantize_mod])
    """

    def __init__(
        self,
        strategy: Strategy,
        codec: str | Codec,
        seed: int = 0,
        min_numel: int = DEFAULT_MIN_NUMEL,
        uplink_bandwidth: Callable[[int], float] | None = None,
        decode_plan: DecodePlan | None = None,
        recorder: HistoryRecorder | None = None,
        client_mse: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a flwr.serverapp.strategy.Strategy, got {type(strategy).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
            raise ValueError(f"min_numel must be a positive int, got {min_numel!r}")
        if uplink_bandwidth is not None and not callable(uplink_bandwidth):
            raise ValueError("uplink_bandwidth must be a callable node_id -> bytes per second")
        self.strategy = strategy
        self.codec = get_codec(codec)
        self.seed = seed
        self.min_numel = min_numel
        self.uplink_bandwidth = uplink_bandwidth
        if decode_plan is None:
            decode_plan = _default_plan(codec, self.codec, seed)
        self.decode_plan = decode_plan
        self.recorder = recorder
        self.client_mse = bool(client_mse)
        self.cumulative_uplink_bytes = 0
        self._rounds: dict[int, _RoundPlan] = {}

    def __repr__(self) -> str:
        """Compute a string representation of the strategy."""
        return f"Quantized Uplink Strategy Wrapper ({self.codec.spec})"

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        log(INFO, "\t├──> fedquant settings:")
        log(INFO, "\t│\t├── Codec: %s", self.codec.spec)
        log(INFO, "\t│\t├── Base seed: %s", self.seed)
        log(INFO, "\t│\t├── Min. elements to encode: %s", self.min_numel)
        log(INFO, "\t│\t├── Client-side MSE: %s", "yes" if self.client_mse else "no")
        log(INFO, "\t│\t├── Decode plan: %r", self.decode_plan)
        log(INFO, "\t│\t└── Simulated uplink bandwidth: %s", "yes" if self.uplink_bandwidth else "no")
        self.strategy.summary()

    # ------------------------------------------------------------------ train
    def client_seed(self, server_round: int, node_id: int) -> int:
        """The codec seed of ``node_id`` in ``server_round``; override to key clients by something stabler."""
        return derive_seed(self.seed, server_round, node_id)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of training: the inner strategy's messages, each with its codec and seed."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        node_ids = [m.metadata.dst_node_id for m in messages]
        assignments = self.decode_plan.assign(server_round, node_ids, self.codec)
        plan = _RoundPlan(assignments=assignments, seeds={}, sent={}, traffic=RoundTraffic())
        for message in messages:
            node_id = message.metadata.dst_node_id
            records = message.content.array_records
            if len(records) != 1:
                raise ValueError(
                    f"{LOG_PREFIX} needs train messages with exactly one ArrayRecord; "
                    f"the message to node {node_id} has {len(records)}"
                )
            assignment = assignments[node_id]
            plan.seeds[node_id] = self.client_seed(server_round, node_id)
            plan.sent[node_id] = next(iter(records.values()))
            entries = {
                KEY_CODEC: assignment.codec.spec,
                KEY_SEED: plan.seeds[node_id],
                KEY_MIN_NUMEL: self.min_numel,
                KEY_CLIENT_MSE: self.client_mse,
                **assignment.config,
            }
            # Inner strategies share one RecordDict among all messages: give each its own.
            message.content = _with_config_entries(message.content, entries)
            plan.traffic.downlink_bytes += content_bytes(message.content)
        self._rounds[server_round] = plan
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check the replies, aggregate the survivors with the inner strategy, add metrics."""
        replies = list(replies)
        plan = self._rounds.pop(server_round, None)
        if plan is None:
            log(WARNING, "%s: round %s was not configured here; replies pass through", LOG_PREFIX, server_round)
            return self.strategy.aggregate_train(server_round, replies)
        accepted = self._decode_replies(server_round, replies, plan)
        survivors = [r for r in replies if r.has_error() or id(r) in accepted]
        if any(not r.has_error() for r in survivors):
            arrays, metrics = self.strategy.aggregate_train(server_round, survivors)
        else:
            log(WARNING, "%s: round %s: no reply survived; keeping the current model", LOG_PREFIX, server_round)
            arrays, metrics = None, None
        self.cumulative_uplink_bytes += plan.traffic.uplink_bytes
        own = plan.traffic.metrics(self.cumulative_uplink_bytes, self.uplink_bandwidth is not None)
        metrics = MetricRecord() if metrics is None else metrics
        for key, value in {**own, **self.decode_plan.round_metrics(server_round)}.items():
            metrics[key] = value
        if self.recorder is not None:
            self.recorder.record(server_round, metrics, prefix=TRAIN_PREFIX)
        return arrays, metrics

    def _decode_replies(self, server_round: int, replies: list[Message], plan: _RoundPlan) -> set[int]:
        """Decode every content reply in the plan's order; return the ids of accepted replies."""
        traffic = plan.traffic
        by_node: dict[int, Message] = {}
        bytes_of: dict[int, int] = {}
        arrival: list[int] = []
        for reply in replies:
            if reply.has_error():
                continue
            node_id = reply.metadata.src_node_id
            reply_bytes = content_bytes(reply.content)
            sent = plan.sent.get(node_id)
            traffic.add_reply(
                reply_bytes,
                dense_float32_bytes(sent) if sent is not None else reply_bytes,
                record_numel(sent) if sent is not None else 0,
            )
            if self.uplink_bandwidth is not None and sent is not None:
                traffic.upload_seconds.append(reply_bytes / float(self.uplink_bandwidth(node_id)))
            if sent is None:
                self._reject(server_round, node_id, "the node was not sent a train message this round", traffic)
            elif node_id in by_node:
                self._reject(server_round, node_id, "a second reply from the same node", traffic)
            else:
                by_node[node_id] = reply
                bytes_of[node_id] = reply_bytes
                arrival.append(node_id)

        accepted: set[int] = set()
        side = self.decode_plan.side_information()
        needs_side = any(a.codec.needs_side_info for a in plan.assignments.values())
        start = time.perf_counter()
        for node_id in self.decode_plan.decode_order(arrival, plan.assignments):
            reply = by_node[node_id]
            assignment = plan.assignments[node_id]
            reason = self.decode_plan.admit(server_round, node_id, assignment, side)
            if reason is not None:
                self._reject(server_round, node_id, reason, traffic)
                continue
            try:
                decoded = decode_reply(
                    reply.content,
                    plan.received(node_id),
                    assignment.codec,
                    plan.seeds[node_id],
                    self.min_numel,
                    side,
                )
            except RejectedReply as err:
                self._reject(server_round, node_id, str(err), traffic)
                continue
            if needs_side:
                side.add(decoded.updates)
            sent_numel = record_numel(plan.sent[node_id])
            self.decode_plan.accepted(
                server_round, DecodedClient(node_id, assignment, decoded.updates, bytes_of[node_id], sent_numel)
            )
            reply.content[decoded.record_name] = decoded.arrays
            _take_client_metrics(reply.content, traffic)
            accepted.add(id(reply))
        traffic.decode_seconds = time.perf_counter() - start
        return accepted

    @staticmethod
    def _reject(server_round: int, node_id: int, reason: str, traffic: RoundTraffic) -> None:
        traffic.rejected += 1
        log(WARNING, "%s: round %s: dropped the reply of node %s: %s", LOG_PREFIX, server_round, node_id, reason)

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of evaluation (passed through)."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Aggregate evaluation metrics (passed through; recorded when a recorder is set)."""
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        if self.recorder is not None and metrics is not None:
            self.recorder.record(server_round, metrics, prefix=EVALUATE_PREFIX)
        return metrics


def _default_plan(requested: str | Codec, codec: Codec, seed: int) -> DecodePlan:
    """The plan used without ``decode_plan``: NDQSG's two groups for ``ndqsg``, else the default."""
    if codec.name != "ndqsg":
        return DecodePlan()
    return NestedDecodePlan.from_spec(requested if isinstance(requested, str) else codec.spec, seed=seed)


def _with_config_entries(content: RecordDict, entries: dict) -> RecordDict:
    """A new RecordDict sharing ``content``'s records, with ``entries`` added to a copy of its ConfigRecord.

    The first ConfigRecord gets the entries (Flower's strategies send exactly one); a message
    without one gets a ConfigRecord named ``"config"``.
    """
    records = dict(content.items())
    config_names = list(content.config_records.keys())
    name = config_names[0] if config_names else "config"
    config = ConfigRecord(dict(content.config_records[name])) if config_names else ConfigRecord()
    for key, value in entries.items():
        config[key] = value
    records[name] = config
    return RecordDict(records)


def _take_client_metrics(content: RecordDict, traffic: RoundTraffic) -> None:
    """Move the mod's own entries out of the reply's MetricRecords into ``traffic``."""
    for name in list(content.metric_records.keys()):
        record = content.metric_records[name]
        mse = record.pop(METRIC_CLIENT_MSE, None)
        seconds = record.pop(METRIC_CLIENT_ENCODE_SECONDS, None)
        if isinstance(mse, (int, float)) and not isinstance(mse, bool) and np.isfinite(mse):
            traffic.client_mse.append(float(mse))
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and np.isfinite(seconds):
            traffic.client_encode_seconds.append(float(seconds))
        if name == CLIENT_METRICRECORD_NAME and len(record) == 0:
            del content[name]
