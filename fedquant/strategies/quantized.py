"""``QuantizedStrategy``: wraps any Flower Message-API strategy with uplink compression."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedquant.codecs import Codec, get_codec
from fedquant.metrics.bandwidth import (
    ADMISSION_WARNINGS,
    AGGREGATION_FAILED,
    REJECTED_REPLIES,
    REJECTED_SHARE,
    ZERO_NORM_DROPPED,
    RoundTraffic,
    clipped_reason_key,
    content_bytes,
    dense_float32_bytes,
    record_numel,
)
from fedquant.metrics.history import EVALUATE_PREFIX, TRAIN_PREFIX, HistoryRecorder
from fedquant.metrics.links import link_metrics, transfer_seconds
from fedquant.metrics.robust import finite, is_number
from fedquant.protocol import (
    CLIENT_METRICRECORD_NAME,
    DEFAULT_MIN_NUMEL,
    METRIC_CLIENT_ENCODE_SECONDS,
    METRIC_CLIENT_MSE,
    METRIC_CLIENT_STATE_RESETS,
)
from fedquant.rng import derive_seed
from fedquant.strategies.admission import (
    CLIP_REASONS,
    REASON_DIRECTION,
    REASON_DUPLICATE,
    REASON_NON_FLOAT,
    REASON_NORM,
    REASON_PAYLOAD,
    REASON_PLAN,
    REASON_UNEXPECTED,
    REASON_WEIGHT,
    REASONS,
    REJECTED_RULE_MAX_SHARE,
    AdmissionRules,
    single_metric_record,
    warn_rule_shares,
    weight_key_of,
)
from fedquant.strategies.budget import UploadBudget
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, DecodePlan, default_plan
from fedquant.strategies.downlink import DEFAULT_FULL_CODEC, DEFAULT_REFERENCES, DownlinkCompressor
from fedquant.strategies.influence import InfluenceBounds
from fedquant.strategies.inner_guard import guarded_evaluate, guarded_train, without_zero_norm_updates
from fedquant.strategies.metric_screen import (
    MetricSchema,
    check_record,
    clamp_metrics,
    conform,
    vote_schema,
)
from fedquant.strategies.reply_decoder import DecodedReply, RejectedReply, decode_reply, decode_threads
from fedquant.strategies.side_info import needs_side_info
from fedquant.strategies.update_bounds import (
    restore_dtypes,
)

LOG_PREFIX = "QuantizedStrategy"


@dataclass
class _RoundPlan:
    """What ``configure_train`` decided, kept until ``aggregate_train`` of the same round."""

    assignments: dict[int, ClientAssignment]
    seeds: dict[int, int]
    sent: dict[int, ArrayRecord]
    traffic: RoundTraffic
    model: ArrayRecord | None = None  # the global model the inner strategy configured the round with
    dtypes: dict[str, np.dtype] = field(default_factory=dict)  # its dtypes
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
    threshold (keys in :mod:`fedquant.protocol`). In ``aggregate_train`` it checks and
    decodes every reply, rebuilds dense arrays ``received + decoded update``, hands those to the
    wrapped strategy and adds the round's bandwidth metrics to its MetricRecord. Evaluate messages
    pass through unchanged; their replies go through the same admission rules.

    Every reply is untrusted. Replies that cannot be decoded (malformed, another codec or shape,
    NaN/Inf, wrong keys) or that fail the admission rules (bad ``num-examples`` or one far above
    the round's, metrics of another key set or type than the round's, an update norm far above
    the round's reference, odd integer or bool entries, a node that replied twice; see
    :class:`~fedquant.strategies.admission.AdmissionRules`) are dropped alone, with a logged
    reason naming the node, and counted in ``rejected-replies`` and ``rejected-<reason>``; weights
    and update norms above the relative bounds are clipped (``clipped-<reason>``), and aggregated
    client metrics are kept within the honest range (:mod:`fedquant.strategies.metric_screen`);
    replies that carry an error go to the wrapped strategy as they are (Flower's handling). If
    no reply survives, the round returns no arrays and the current model is kept.

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
        Per-client codec assignment, decode order and the record codec of each reply (see
        :mod:`fedquant.strategies.decode_plan`). Default: the plan registered for the codec's
        quantizer (built from the spec as given), e.g. NDQSG's two-group scheme
        :class:`~fedquant.strategies.nested.NestedDecodePlan` for ``ndqsg`` (``rho`` adapted each
        round unless the spec string names it; a Codec instance fixes its own ``rho``); else
        :class:`~fedquant.strategies.decode_plan.DecodePlan` (every client gets ``codec``).
    recorder : HistoryRecorder, optional
        Receives every round's train (``train/``) and evaluate (``evaluate/``) metrics.
    client_mse : bool
        Whether clients measure ``quantization-mse`` (default True). Measuring decodes every
        payload once more on the client, which costs about one decode per tensor per round.
    admission : AdmissionRules, optional
        Which replies (train and evaluate) reach the wrapped strategy, and with what weight and
        update: weights and update norms bounded relative to the round, typed and finite
        metrics, no duplicate nodes (see :mod:`fedquant.strategies.admission`). Default
        ``AdmissionRules()``: every rule on; ``AdmissionRules.off()`` keeps only the payload checks.
    downlink_codec : str or Codec, optional
        Compress the model sent to clients too (default None: dense float arrays). A client that
        holds one of the last ``downlink_references`` models the server sent gets the difference
        to it encoded with this codec; others get the model encoded with ``downlink_full_codec``
        (default ``fp16``). See :mod:`fedquant.strategies.downlink`. Replies are decoded against
        the model the client rebuilt, so both sides see the same model.
    downlink_full_codec : str or Codec
        Codec of full-model sends (``fp32`` for lossless ones).
    downlink_references : int
        Reference models the server keeps for clients that skip rounds (default 8; each is one model copy).
    downlink_bandwidth : callable, optional
        ``node_id -> bytes per second`` of the download links. Adds ``simulated-download-seconds``
        (slowest sampled client) and ``simulated-round-seconds`` (max over replies of download +
        upload time; upload counts only with ``uplink_bandwidth``).
    upload_deadline_seconds : float, optional
        Before each round, choose each sampled client's setting of ``codec``'s family (levels,
        or fp32/fp16) so its predicted reply fits ``uplink_bandwidth(node) x T`` (needs
        ``uplink_bandwidth``); reports ``deadline-met-fraction`` and the chosen settings. See
        :mod:`fedquant.strategies.budget`.
    uplink_bytes_budget : int, optional
        Largest predicted total of a round's replies in bytes (alone or with the deadline).

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
        admission: AdmissionRules | None = None,
        downlink_codec: str | Codec | None = None,
        downlink_full_codec: str | Codec = DEFAULT_FULL_CODEC,
        downlink_references: int = DEFAULT_REFERENCES,
        downlink_bandwidth: Callable[[int], float] | None = None,
        upload_deadline_seconds: float | None = None,
        uplink_bytes_budget: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a flwr.serverapp.strategy.Strategy, got {type(strategy).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
            raise ValueError(f"min_numel must be a positive int, got {min_numel!r}")
        if admission is not None and not isinstance(admission, AdmissionRules):
            raise ValueError(f"admission must be an AdmissionRules, got {type(admission).__name__}")
        if uplink_bandwidth is not None and not callable(uplink_bandwidth):
            raise ValueError("uplink_bandwidth must be a callable node_id -> bytes per second")
        if downlink_bandwidth is not None and not callable(downlink_bandwidth):
            raise ValueError("downlink_bandwidth must be a callable node_id -> bytes per second")
        self.strategy = strategy
        self.codec = get_codec(codec)
        self.seed = seed
        self.min_numel = min_numel
        self.uplink_bandwidth = uplink_bandwidth
        if decode_plan is None:
            decode_plan = default_plan(codec if isinstance(codec, str) else self.codec.spec, self.codec, seed)
        self.decode_plan = decode_plan
        self.recorder = recorder
        self.client_mse = bool(client_mse)
        self.admission = AdmissionRules() if admission is None else admission
        self._weight_key = weight_key_of(strategy)
        self.bounds = InfluenceBounds(self.admission, self._weight_key)
        self.cumulative_uplink_bytes = 0
        self._rounds: dict[int, _RoundPlan] = {}
        self._evaluated: dict[int, set[int]] = {}
        # Both-direction options (issue 12): downlink compression and the upload budget.
        self.downlink = (
            None
            if downlink_codec is None
            else DownlinkCompressor(downlink_codec, downlink_full_codec, seed, min_numel, downlink_references)
        )
        self.downlink_bandwidth = downlink_bandwidth
        self.budget = (
            None
            if upload_deadline_seconds is None and uplink_bytes_budget is None
            else UploadBudget(
                deadline_seconds=upload_deadline_seconds,
                bandwidth=uplink_bandwidth,
                bytes_budget=uplink_bytes_budget,
                min_numel=min_numel,
            )
        )

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
        log(INFO, "\t│\t├── Admission: %r", self.admission)
        log(INFO, "\t│\t├── Downlink: %s", repr(self.downlink) if self.downlink else "dense")
        log(INFO, "\t│\t├── Upload budget: %s", repr(self.budget) if self.budget else "no")
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
        if self.budget is not None:
            assignments = self.budget.choose(server_round, assignments, arrays)
        plan = _RoundPlan(assignments=assignments, seeds={}, sent={}, traffic=RoundTraffic())
        plan.model = arrays
        plan.dtypes = {name: np.dtype(array.dtype) for name, array in arrays.items()}
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
            record_name, record = next(iter(records.items()))
            plan.sent[node_id], wire, downlink_entries = self._send_model(server_round, node_id, record, plan.traffic)
            entries = {
                **assignment.record_codec(self.min_numel).config_entries(plan.seeds[node_id], self.client_mse),
                **assignment.config,
                **downlink_entries,
            }
            # Inner strategies share one RecordDict among all messages: give each its own.
            message.content = _with_config_entries(message.content, entries, {record_name: wire})
            plan.traffic.downlink_bytes_of[node_id] = content_bytes(message.content)
            plan.traffic.downlink_bytes += plan.traffic.downlink_bytes_of[node_id]
        self._rounds[server_round] = plan
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check the replies, aggregate the survivors with the inner strategy, add metrics."""
        replies = list(replies)
        if self.downlink is not None:  # reads (and removes) the replies' reference claims
            self.downlink.confirm(server_round, replies)
        plan = self._rounds.pop(server_round, None)
        if plan is None:
            log(WARNING, "%s: round %s was not configured here; replies pass through", LOG_PREFIX, server_round)
            arrays, metrics, _ = guarded_train(self.strategy, server_round, replies)
            return arrays, metrics
        reply_bytes = {  # as they arrived: decoding replaces the payloads by dense arrays
            r.metadata.src_node_id: content_bytes(r.content)
            for r in replies
            if not r.has_error() and r.metadata.src_node_id in plan.sent
        }
        accepted, schema = self._decode_replies(server_round, replies, plan)
        admitted = [r for r in replies if id(r) in accepted]
        both_ways = self._link_metrics(server_round, reply_bytes, plan, {r.metadata.src_node_id for r in admitted})
        records = [single_metric_record(r.content) for r in admitted]
        clipped = self.bounds.bound_weights(records, "train")
        plan.traffic.clipped_reasons += [REASON_WEIGHT] * clipped
        survivors = [r for r in replies if r.has_error()] + admitted
        survivors, zero_dropped = without_zero_norm_updates(self.strategy, survivors, plan.model)
        failed = False
        if admitted:
            arrays, metrics, failed = guarded_train(self.strategy, server_round, survivors)
            arrays = restore_dtypes(arrays, plan.dtypes)
            metrics = clamp_metrics(metrics, records, schema, self.admission.metric_trim, self._weight_key)
        else:
            log(WARNING, "%s: round %s: no reply survived; keeping the current model", LOG_PREFIX, server_round)
            arrays, metrics = None, None
        self.cumulative_uplink_bytes += plan.traffic.uplink_bytes
        reasons, limit = plan.traffic.rejected_reasons, self.admission.warn_rule_share
        rule_share, rule_warnings = warn_rule_shares(server_round, "train", reasons, plan.traffic.replies, limit)
        plan.traffic.admission_warnings += rule_warnings
        own = plan.traffic.metrics(
            self.cumulative_uplink_bytes,
            self.uplink_bandwidth is not None,
            REASONS,
            CLIP_REASONS,
            self.admission.metric_trim,
        )
        plan.traffic.admission_warnings += self._warn_rejections(
            server_round, "train", len(plan.traffic.rejected_reasons), plan.traffic.replies
        )
        metrics = MetricRecord() if metrics is None else metrics
        own[AGGREGATION_FAILED] = int(failed)
        own[REJECTED_RULE_MAX_SHARE] = rule_share
        own[ZERO_NORM_DROPPED] = zero_dropped
        for key, value in {**own, **both_ways, **self.decode_plan.round_metrics(server_round)}.items():
            metrics[key] = value
        if self.recorder is not None:
            self.recorder.record(server_round, metrics, prefix=TRAIN_PREFIX)
        return arrays, metrics

    def _decode_replies(
        self, server_round: int, replies: list[Message], plan: _RoundPlan
    ) -> tuple[set[int], MetricSchema | None]:
        """Admit, decode and check every content reply; the ids of the accepted replies and the round's schema.

        Replies go through :class:`~fedquant.strategies.admission.AdmissionRules` in steps,
        cheapest first: who sent it (unexpected and duplicate nodes), its metrics, its integer
        and bool entries, then, after decoding, its update norm (rejected or clipped against the
        minority-proof reference of :class:`~fedquant.strategies.influence.InfluenceBounds`).
        Decoding follows the plan's order; the replies decodable without side information vote
        first (their norms are judged together once all are decoded, before any becomes side
        information, :func:`_vote_groups`), the others are judged against the replies admitted
        before them, so an outlier never reaches the side information.
        """
        traffic = plan.traffic
        content_replies = [r for r in replies if not r.has_error()]
        client_metrics = {id(r): _pop_client_metrics(r.content) for r in content_replies}
        bytes_of: dict[int, int] = {}
        for reply in content_replies:  # every reply that arrived counts as uplink, admitted or not
            node_id = reply.metadata.src_node_id
            reply_bytes = content_bytes(reply.content)
            sent = plan.sent.get(node_id)
            traffic.add_reply(
                reply_bytes,
                dense_float32_bytes(sent) if sent is not None else reply_bytes,
                record_numel(sent) if sent is not None else 0,
            )
            if self.uplink_bandwidth is not None and sent is not None:
                traffic.upload_seconds.append(transfer_seconds(reply_bytes, self.uplink_bandwidth(node_id)))
            bytes_of.setdefault(node_id, reply_bytes)
        screened, schema = self._screen(server_round, content_replies, plan.sent, "train", traffic)
        by_node, clipped = self.bounds.screen_non_float(
            {r.metadata.src_node_id: r for r in screened},
            plan.received,
            lambda node_id, problem: self._reject(server_round, node_id, problem, traffic),
        )
        traffic.clipped_reasons += [REASON_NON_FLOAT] * clipped
        arrival = list(by_node)

        accepted: set[int] = set()

        def judge(node_id: int, decoded: DecodedReply, reference: float | None) -> DecodedReply | None:
            record = single_metric_record(by_node[node_id].content)
            problem, decoded, clipped = self.bounds.judge_update(decoded, plan.received(node_id), reference, record)
            if problem is not None:
                self._reject(server_round, node_id, (REASON_NORM, problem), traffic)
                return None
            traffic.clipped_reasons += clipped
            return decoded

        def accept(node_id: int, decoded: DecodedReply, in_vote: bool) -> None:
            problem = self.bounds.opposition(node_id, decoded, plan.received(node_id), in_vote)
            if problem is not None:
                self._reject(server_round, node_id, (REASON_DIRECTION, problem), traffic)
                return
            reply = by_node[node_id]
            traffic.update_norms.append(decoded.update_norm)
            client = DecodedClient(
                node_id, plan.assignments[node_id], decoded.updates, bytes_of[node_id], record_numel(plan.sent[node_id])
            )
            self.decode_plan.accepted(server_round, client)
            reply.content[decoded.record_name] = decoded.arrays
            conform(single_metric_record(reply.content), schema)
            _add_client_metrics(client_metrics[id(reply)], traffic)
            accepted.add(id(reply))

        start = time.perf_counter()
        self.bounds.start_round()
        order = self.decode_plan.decode_order(arrival, plan.assignments)
        for group in _vote_groups(order, plan.assignments, self.min_numel):
            admitted_before = bool(traffic.update_norms)
            reference = self.bounds.norm_reference(traffic.update_norms)
            pending: list[tuple[int, DecodedReply]] = []
            for node_id in group:
                decoded = self._decode_one(server_round, node_id, by_node[node_id], plan)
                if decoded is None:
                    continue
                if not admitted_before:
                    pending.append((node_id, decoded))
                elif (judged := judge(node_id, decoded, reference)) is not None:
                    accept(node_id, judged, in_vote=False)
            if not pending:
                continue
            norms = [d.update_norm for _, d in pending]
            self._warn_norm_split(server_round, norms, traffic)
            group_reference = self.bounds.norm_reference(norms)
            judged = [(n, d) for n, d in ((n, judge(n, d, group_reference)) for n, d in pending) if d is not None]
            self.bounds.set_consensus([d for _, d in judged], [plan.received(n) for n, _ in judged])
            for node_id, decoded in judged:
                accept(node_id, decoded, in_vote=True)
        self.bounds.end_round(traffic.update_norms)
        traffic.decode_seconds = time.perf_counter() - start
        return accepted, schema

    def _screen(
        self,
        server_round: int,
        content_replies: list[Message],
        expected: Container[int] | None,
        kind: str,
        traffic: RoundTraffic | None,
    ) -> tuple[list[Message], MetricSchema | None]:
        """The replies whose sender and metrics pass the admission rules, and the round's metric schema.

        A reply from a node not in ``expected`` (None: any node) or from a node that replied more
        than once is dropped, as is one whose MetricRecord fails
        :func:`~fedquant.strategies.metric_screen.check_record` against the schema the expected
        nodes' replies vote (:func:`~fedquant.strategies.metric_screen.vote_schema`).
        """
        rules, weight_key = self.admission, self._weight_key
        copies = Counter(r.metadata.src_node_id for r in content_replies)
        peers = [
            single_metric_record(r.content)
            for r in content_replies
            if (expected is None or r.metadata.src_node_id in expected) and copies[r.metadata.src_node_id] == 1
        ]
        schema = vote_schema(peers, weight_key, rules)
        seen: set[int] = set()
        passed = []
        for reply in content_replies:
            node_id = reply.metadata.src_node_id
            if expected is not None and node_id not in expected:
                problem = (REASON_UNEXPECTED, f"the node was not sent a {kind} message this round")
            elif node_id in seen or (rules.reject_duplicates and copies[node_id] > 1):
                problem = (REASON_DUPLICATE, f"the node sent {copies[node_id]} {kind} replies this round")
            else:
                problem = check_record(single_metric_record(reply.content), schema, weight_key, rules)
            seen.add(node_id)
            if problem is None:
                passed.append(reply)
            else:
                self._reject(server_round, node_id, problem, traffic)
        outliers = self.bounds.screen_weights({id(r): single_metric_record(r.content) for r in passed}, kind)
        for reply in [r for r in passed if id(r) in outliers]:
            self._reject(server_round, reply.metadata.src_node_id, (REASON_WEIGHT, outliers[id(reply)]), traffic)
        return [r for r in passed if id(r) not in outliers], schema

    def _decode_one(self, server_round: int, node_id: int, reply: Message, plan: _RoundPlan) -> DecodedReply | None:
        """Decode one admitted reply, or reject it (plan refusal, bad payload) and return None."""
        assignment = plan.assignments[node_id]
        reason = self.decode_plan.admit(server_round, node_id, assignment)
        if reason is not None:
            self._reject(server_round, node_id, (REASON_PLAN, reason), plan.traffic)
            return None
        try:
            codec = self.decode_plan.reply_codec(server_round, assignment, self.min_numel)
            with decode_threads(len(plan.sent)):  # one kernel thread per reply when a round has many
                return decode_reply(reply.content, plan.received(node_id), codec, plan.seeds[node_id])
        except RejectedReply as err:
            self._reject(server_round, node_id, (REASON_PAYLOAD, str(err)), plan.traffic)
            return None

    def _warn_norm_split(self, server_round: int, norms: list[float], traffic: RoundTraffic) -> None:
        """A warning when a vote's update norms fall into two groups too far apart for the norm rule."""
        split = self.bounds.norm_split(norms)
        if split is None:
            return
        traffic.admission_warnings += 1
        log(
            WARNING,
            "%s: round %s: the update norms split into two groups %.3g x apart; the norm rule cannot tell "
            "which is honest (more than half of the vote may be attacking)",
            LOG_PREFIX, server_round, split,
        )  # fmt: skip

    def _warn_rejections(self, server_round: int, kind: str, rejected: int, replies: int) -> int:
        """A warning when admission rejected a large share of a round (``warn_rejected_share``); 1 if logged."""
        if not replies or rejected < self.admission.warn_rejected_share * replies:
            return 0
        majority = " (a majority: more than half of the round may be attacking, or the rules do not fit it)"
        log(
            WARNING,
            "%s: round %s: admission rejected %d of %d %s replies%s",
            LOG_PREFIX,
            server_round,
            rejected,
            replies,
            kind,
            majority if 2 * rejected > replies else "",
        )
        return 1

    def _send_model(
        self, server_round: int, node_id: int, record: ArrayRecord, traffic: RoundTraffic
    ) -> tuple[ArrayRecord, ArrayRecord, dict]:
        """What node ``node_id`` rebuilds, what its message carries, and the downlink config entries."""
        traffic.downlink_dense_bytes += dense_float32_bytes(record)
        if self.downlink is None:
            traffic.downlink_mse.append(0.0)
            return record, record, {}
        sent = self.downlink.send(server_round, node_id, record)
        traffic.downlink_mse.append(sent.mse)
        return sent.model, sent.wire, sent.config

    def _link_metrics(
        self, server_round: int, reply_bytes: dict[int, int], plan: _RoundPlan, admitted: Container[int]
    ) -> dict[str, float]:
        """The upload budget's metrics (learning from the admitted replies' sizes) and the simulated link times."""
        metrics = self.budget.observe(server_round, reply_bytes, admitted) if self.budget is not None else {}
        if self.downlink_bandwidth is not None:
            down = plan.traffic.downlink_bytes_of
            metrics.update(link_metrics(down, reply_bytes, self.downlink_bandwidth, self.uplink_bandwidth))
        return metrics

    @staticmethod
    def _reject(server_round: int, node_id: int, problem: tuple[str, str], traffic: RoundTraffic | None) -> None:
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

    # ------------------------------------------------------------------ evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of evaluation (the inner strategy's messages, unchanged)."""
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        self._evaluated[server_round] = {m.metadata.dst_node_id for m in messages}
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Aggregate evaluation metrics of the replies that pass the admission rules (recorded with a recorder).

        Evaluate replies are as untrusted as train replies: one without ``num-examples``, with
        other metric keys or value types than the round's, NaN/Inf metrics, or from an unexpected
        or duplicated node is dropped alone (logged) instead of aborting the round in the inner
        strategy; weights are bounded and the aggregated metrics kept within the replies' window
        as in training (:mod:`fedquant.strategies.metric_screen`).
        """
        replies = list(replies)
        content_replies = [r for r in replies if not r.has_error()]
        asked = self._evaluated.pop(server_round, None)
        admitted, schema = self._screen(server_round, content_replies, asked, "evaluate", None)
        records = [single_metric_record(r.content) for r in admitted]
        for record in records:
            conform(record, schema)
        clipped = self.bounds.bound_weights(records, "evaluate")
        survivors = [r for r in replies if r.has_error()] + admitted
        dropped = len(content_replies) - len(admitted)
        metrics, failed = None, False
        if admitted:
            metrics, failed = guarded_evaluate(self.strategy, server_round, survivors)
            metrics = clamp_metrics(metrics, records, schema, self.admission.metric_trim, self._weight_key)
        warned = self._warn_rejections(server_round, "evaluate", dropped, len(content_replies))
        if dropped or clipped:
            metrics = MetricRecord() if metrics is None else metrics
            metrics[REJECTED_REPLIES] = dropped
            metrics[REJECTED_SHARE] = dropped / len(content_replies)
            metrics[clipped_reason_key(REASON_WEIGHT)] = clipped
            metrics[ADMISSION_WARNINGS] = warned
        if failed:
            metrics = MetricRecord() if metrics is None else metrics
            metrics[AGGREGATION_FAILED] = 1
        if self.recorder is not None and metrics is not None:
            self.recorder.record(server_round, metrics, prefix=EVALUATE_PREFIX)
        return metrics


def _with_config_entries(
    content: RecordDict, entries: dict, arrays: dict[str, ArrayRecord] | None = None
) -> RecordDict:
    """A new RecordDict sharing ``content``'s records, with ``entries`` added to a copy of its ConfigRecord.

    ``arrays`` replaces ArrayRecords by name (the encoded model of a downlink codec).

    The first ConfigRecord gets the entries (Flower's strategies send exactly one); a message
    without one gets a ConfigRecord named ``"config"``.
    """
    records = {**dict(content.items()), **(arrays or {})}
    config_names = list(content.config_records.keys())
    name = config_names[0] if config_names else "config"
    config = ConfigRecord(dict(content.config_records[name])) if config_names else ConfigRecord()
    for key, value in entries.items():
        config[key] = value
    records[name] = config
    return RecordDict(records)


def _vote_groups(order: list[int], assignments: dict[int, ClientAssignment], min_numel: int) -> list[list[int]]:
    """Split a decode order into the first vote and the rest, each in decode order.

    The first vote holds every reply decodable without side information (NDQSG's P1, and its P2
    replies whose tensors all fall back to DQSG): the more replies vote on the norm reference
    before anything becomes side information, the larger the minority it withstands. The rest
    (decoded against side information) is judged against the replies admitted before it.
    """
    against = {n for n in order if needs_side_info(assignments[n].record_codec(min_numel))}
    first = [n for n in order if n not in against]
    rest = [n for n in order if n in against]
    return [group for group in (first, rest) if group]


def _pop_client_metrics(content: RecordDict) -> tuple[float | None, float | None, bool]:
    """Take the mod's own entries out of the reply's MetricRecords: ``(mse, encode seconds, state reset)``.

    Done before the admission rules look at the metrics, so the inner strategy's metric keys are
    compared, not fedquant's. The values count only if the reply is accepted; a negative or
    non-finite MSE or time is ignored (no client measures one), and the round reports means
    clamped into the window of the accepted values.
    """
    mse = seconds = None
    reset = False
    for name in list(content.metric_records.keys()):
        record = content.metric_records[name]
        if METRIC_CLIENT_MSE in record:
            mse = _non_negative(record.pop(METRIC_CLIENT_MSE))
        if METRIC_CLIENT_ENCODE_SECONDS in record:
            seconds = _non_negative(record.pop(METRIC_CLIENT_ENCODE_SECONDS))
        if METRIC_CLIENT_STATE_RESETS in record:
            reset = bool(_non_negative(record.pop(METRIC_CLIENT_STATE_RESETS)))
        if name == CLIENT_METRICRECORD_NAME and len(record) == 0:
            del content[name]
    return mse, seconds, reset


def _add_client_metrics(values: tuple[float | None, float | None, bool], traffic: RoundTraffic) -> None:
    mse, seconds, reset = values
    if mse is not None:
        traffic.client_mse.append(mse)
    if seconds is not None:
        traffic.client_encode_seconds.append(seconds)
    traffic.client_state_resets += int(reset)


def _non_negative(value: object) -> float | None:
    if is_number(value) and finite(value) and value >= 0:  # type: ignore[operator]
        return float(value)  # type: ignore[arg-type]
    return None
