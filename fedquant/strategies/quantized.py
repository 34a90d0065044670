"""``QuantizedStrategy``: wraps any Flower Message-API strategy with uplink compression."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from fedquant.codecs import Codec
from fedquant.metrics.history import EVALUATE_PREFIX, TRAIN_PREFIX, HistoryRecorder
from fedquant.protocol import DEFAULT_MIN_NUMEL
from fedquant.rng import derive_seed
from fedquant.secagg.config import SecAggConfig
from fedquant.strategies.admission import AdmissionRules, weight_key_of
from fedquant.strategies.decode_plan import DecodePlan
from fedquant.strategies.downlink import DEFAULT_FULL_CODEC, DEFAULT_REFERENCES
from fedquant.strategies.inner_guard import guarded_train
from fedquant.strategies.round import LOG_PREFIX
from fedquant.strategies.stages import RoundLedger, RoundStage, Settings, TrainRound, build_stages, write_messages
from fedquant.strategies.stages.decoding import Decoding
from fedquant.strategies.stages.secure import SecureAggregation
from fedquant.strategies.tensor_policy import TensorPolicy


class QuantizedStrategy(Strategy):
    """Strategy wrapper that compresses the clients' updates with a fedquant codec.

    Use ``quantize_mod`` on the clients. ``configure_train`` adds to each client's ConfigRecord
    its codec spec, seed and encoding threshold (keys in :mod:`fedquant.protocol`);
    ``aggregate_train`` checks and decodes every reply, hands the survivors to the wrapped
    strategy (as ``received + decoded update``, or, for an inner strategy that aggregates as
    FedAvg does, without their arrays and with the weighted mean of the updates as its result:
    :mod:`~fedquant.strategies.fedavg_mean`) and adds the round's bandwidth metrics. Each
    step is a round stage (:mod:`fedquant.strategies.stages`). Evaluate messages pass unchanged;
    their replies go through the same admission rules.

    Every reply is untrusted: one that cannot be decoded or fails the admission rules is dropped
    alone, logged and counted (``rejected-<reason>``); outlying weights and norms are clipped
    (``clipped-<reason>``). If no reply survives, the current model is kept.

    Parameters
    ----------
    strategy : Strategy
        Any Message-API strategy; its train messages must carry exactly one ArrayRecord.
    codec : str or Codec
        Codec spec (``"qsgd:levels=16"``, ``"ef+signsgd"``) or a codec instance.
    seed : int
        Base seed: client ``n`` in round ``r`` gets ``derive_seed(seed, r, n)``.
    min_numel : int
        Float tensors with fewer elements travel uncompressed (default 1024).
    uplink_bandwidth : callable, optional
        ``node_id -> bytes per second``; adds ``simulated-upload-seconds`` (the slowest reply).
    decode_plan : DecodePlan, optional
        Per-client codec assignment and decode order (default: the plan registered for the
        codec's quantizer, e.g. NDQSG's :class:`~fedquant.strategies.nested.NestedDecodePlan`).
    recorder : HistoryRecorder, optional
        Receives every round's train (``train/``) and evaluate (``evaluate/``) metrics.
    client_mse : bool
        Whether clients measure ``quantization-mse`` (default True; one more decode per tensor).
    admission : AdmissionRules, optional
        Which replies reach the wrapped strategy, with what weight and update (default: every
        rule on; ``AdmissionRules.off()`` keeps only the payload checks).
    downlink_codec, downlink_full_codec, downlink_references
        Compress the model sent to clients too: differences to one of the last
        ``downlink_references`` models a client holds, else the full model with
        ``downlink_full_codec`` (:mod:`fedquant.strategies.downlink`). Default: dense.
    upload_deadline_seconds, uplink_bytes_budget : optional
        Choose each client's setting of ``codec``'s family so its reply fits
        ``uplink_bandwidth(node) x T`` and/or the round's byte total (:mod:`fedquant.strategies.budget`).
    extra_stages : sequence of RoundStage
        Stages run after the built-in ones (their metrics join the round's), e.g. simulated
        link times (``simulations.link_times.LinkTimes``).
    secure_aggregation : SecAggConfig, optional
        Aggregate the train updates with SecAgg+ over the summable integer codec: the server
        learns only their weighted mean (:mod:`fedquant.strategies.stages.secure`,
        ``docs/secure-aggregation.md``). The secure round replaces screening, decoding, admission
        and per-reply aggregation, and ``codec`` is not used for the train uplink; it cannot be
        combined with ``downlink_codec`` or an upload budget.
    secure_stage_timeout : float or None
        Seconds each of the secure round's extra round trips (advertise, share-keys, unmask)
        waits for replies (default 600; the collect stage runs under Flower's own timeout).
    tensor_policy : TensorPolicy, optional
        Per-tensor codecs and bounds of the served values by tensor-name pattern
        (:mod:`~fedquant.strategies.tensor_policy`). Default: BatchNorm running statistics at
        ``fp16``, running variances clamped to >= 0 (``docs/models.md``); the round's metrics
        count the values the bounds moved (``policy-clamped-values``).

    Examples
    --------
    >>> strategy = QuantizedStrategy(FedAvg(), codec="qsgd:levels=16", seed=0)  # doctest: +SKIP
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
        upload_deadline_seconds: float | None = None,
        uplink_bytes_budget: int | None = None,
        extra_stages: Sequence[RoundStage] = (),
        secure_aggregation: SecAggConfig | None = None,
        secure_stage_timeout: float | None = 600.0,
        tensor_policy: TensorPolicy | None = None,
    ) -> None:
        super().__init__()
        settings = Settings.check(
            strategy, codec, seed, min_numel, uplink_bandwidth, decode_plan, client_mse, admission, downlink_codec,
            downlink_full_codec, downlink_references, upload_deadline_seconds, uplink_bytes_budget, extra_stages,
            secure_aggregation, tensor_policy,
        )  # fmt: skip
        self.strategy, self.codec, self.seed, self.min_numel = strategy, settings.codec, seed, min_numel
        self.uplink_bandwidth, self.recorder, self.client_mse = uplink_bandwidth, recorder, settings.client_mse
        self.decode_plan, self.admission = settings.decode_plan, settings.admission
        self.downlink, self.budget = settings.downlink, settings.budget
        self.stages, self.evaluation, self.admitting, self.recording = build_stages(settings, self.client_seed)
        self.secure = settings.secure_aggregation
        self.tensor_policy = settings.tensor_policy
        self.secure_stage = None
        if self.secure is not None:
            self.secure_stage = SecureAggregation(
                strategy, self.secure, seed, self.client_seed, weight_key_of(strategy), secure_stage_timeout
            )
            # sending the model, arrival, screening, decoding, admission and aggregation all read
            # single replies; under secure aggregation there are none to read
            self.stages = [self.secure_stage, *settings.extra_stages]
        self._rounds = RoundLedger()

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
        log(INFO, "\t│\t├── Secure aggregation: %s", repr(self.secure) if self.secure else "no")
        log(INFO, "\t│\t├── Tensor policy: %r", self.tensor_policy)
        log(INFO, "\t│\t└── Simulated uplink bandwidth: %s", "yes" if self.uplink_bandwidth else "no")
        self.strategy.summary()

    @property
    def cumulative_uplink_bytes(self) -> int:
        """Uplink bytes of every train round so far."""
        if self.secure_stage is not None:
            return self.secure_stage.cumulative_uplink_bytes
        return self.recording.cumulative_uplink_bytes

    @property
    def secure_failures(self) -> dict[int, str]:
        """Round -> why its secure aggregation failed (empty without secure aggregation)."""
        return dict(self.secure_stage.failures) if self.secure_stage is not None else {}

    def client_seed(self, server_round: int, node_id: int) -> int:
        """The codec seed of ``node_id`` in ``server_round``; override to key clients by something stabler."""
        return derive_seed(self.seed, server_round, node_id)

    def start(self, *args, **kwargs) -> Result:
        """Flower's :meth:`Strategy.start` (every round), then :meth:`release_buffers`: a finished run
        keeps no decoded update's memory."""
        try:
            return super().start(*args, **kwargs)
        finally:
            self.release_buffers()

    def release_buffers(self) -> None:
        """Let go of the memory the decoding stage keeps from one round to the next (the arrays of
        the last round's decoded updates, lent again to the next round's decoders,
        :class:`~fedquant.codecs.buffers.BufferPool`); the next round allocates afresh."""
        for stage in self.stages:
            if isinstance(stage, Decoding):
                stage.buffers.release()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of training: the inner strategy's messages, each with its codec and seed."""
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        state = TrainRound(server_round, model=arrays, grid=grid)
        for stage in self.stages:
            stage.configure(state, messages)
        if self.secure is None:  # the secure stage writes its own collect requests
            write_messages(state, messages)
        self._rounds.open("train", server_round, state)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check the replies, aggregate the survivors with the inner strategy, add metrics."""
        replies = list(replies)
        state = self._rounds.close("train", server_round)
        if state is None:
            for stage in self.stages:
                stage.unconfigured(server_round, replies)
            log(WARNING, "%s: round %s was not configured here; replies pass through", LOG_PREFIX, server_round)
            arrays, metrics, _ = guarded_train(self.strategy, server_round, replies)
            return arrays, metrics
        for stage in self.stages:
            stage.receive(state, replies)
        metrics = MetricRecord() if state.inner_metrics is None else state.inner_metrics
        for stage in self.stages:
            for key, value in stage.report(state).items():
                metrics[key] = value
        if self.recorder is not None:
            self.recorder.record(server_round, metrics, prefix=TRAIN_PREFIX)
        return state.arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of evaluation (the inner strategy's messages, unchanged)."""
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        self._rounds.open("evaluate", server_round, {m.metadata.dst_node_id for m in messages})
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Aggregate the evaluation metrics of the replies that pass the admission rules (as in training)."""
        asked = self._rounds.close("evaluate", server_round)
        metrics = self.evaluation.aggregate(server_round, list(replies), asked)  # type: ignore[arg-type]
        if self.recorder is not None and metrics is not None:
            self.recorder.record(server_round, metrics, prefix=EVALUATE_PREFIX)
        return metrics
