"""The wrapper's options, checked once, and the built-in train stages in their order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flwr.serverapp.strategy import Strategy

from fedquant.codecs import Codec, get_codec
from fedquant.secagg.config import SecAggConfig
from fedquant.strategies.admission import Admission, AdmissionRules, weight_key_of
from fedquant.strategies.budget import UploadBudget
from fedquant.strategies.decode_plan import DecodePlan, default_plan
from fedquant.strategies.downlink import DownlinkCompressor
from fedquant.strategies.fedavg_mean import aggregates_like_fedavg
from fedquant.strategies.stages.aggregation import Aggregation
from fedquant.strategies.stages.arrival import Arrival
from fedquant.strategies.stages.assignment import Assignment
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.stages.budgeting import Budgeting
from fedquant.strategies.stages.decoding import Decoding
from fedquant.strategies.stages.evaluation import Evaluation
from fedquant.strategies.stages.recording import Recording
from fedquant.strategies.stages.screening import Screening
from fedquant.strategies.stages.sending import Downlink
from fedquant.strategies.stages.value_bounds import ValueBounds
from fedquant.strategies.tensor_policy import TensorPolicy


@dataclass(frozen=True)
class Settings:
    """``QuantizedStrategy``'s options after their checks (see its docstring for each)."""

    strategy: Strategy
    codec: Codec
    seed: int
    min_numel: int
    uplink_bandwidth: Callable[[int], float] | None
    decode_plan: DecodePlan
    client_mse: bool
    admission: AdmissionRules
    downlink: DownlinkCompressor | None
    budget: UploadBudget | None
    extra_stages: tuple[RoundStage, ...]
    secure_aggregation: SecAggConfig | None = None
    tensor_policy: TensorPolicy = TensorPolicy()

    @classmethod
    def check(cls, strategy, codec, seed, min_numel, uplink_bandwidth, decode_plan, client_mse, admission,
              downlink_codec, downlink_full_codec, downlink_references, upload_deadline_seconds,
              uplink_bytes_budget, extra_stages, secure_aggregation=None, tensor_policy=None) -> Settings:  # fmt: skip
        """Check the wrapper's arguments (ValueError naming the bad one) and build its parts."""
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
        if not all(isinstance(stage, RoundStage) for stage in extra_stages):
            raise ValueError("extra_stages must hold RoundStage instances")
        if secure_aggregation is not None:
            if not isinstance(secure_aggregation, SecAggConfig):
                raise ValueError(f"secure_aggregation must be a SecAggConfig, got {type(secure_aggregation).__name__}")
            if downlink_codec is not None:
                raise ValueError("secure_aggregation cannot be combined with downlink_codec (the update is summed "
                                 "against the dense model every client receives)")  # fmt: skip
            if upload_deadline_seconds is not None or uplink_bytes_budget is not None:
                raise ValueError("secure_aggregation cannot be combined with an upload budget (every client "
                                 "encodes on the round's one grid)")  # fmt: skip
        parsed = get_codec(codec)
        if decode_plan is None:
            decode_plan = default_plan(codec if isinstance(codec, str) else parsed.spec, parsed, seed)
        downlink = (
            None
            if downlink_codec is None
            else DownlinkCompressor(downlink_codec, downlink_full_codec, seed, min_numel, downlink_references)
        )
        budget = (
            None
            if upload_deadline_seconds is None and uplink_bytes_budget is None
            else UploadBudget(
                deadline_seconds=upload_deadline_seconds,
                bandwidth=uplink_bandwidth,
                bytes_budget=uplink_bytes_budget,
                min_numel=min_numel,
            )
        )
        admission = AdmissionRules() if admission is None else admission
        if tensor_policy is not None and not isinstance(tensor_policy, TensorPolicy):
            raise ValueError(f"tensor_policy must be a TensorPolicy, got {type(tensor_policy).__name__}")
        tensor_policy = TensorPolicy() if tensor_policy is None else tensor_policy
        return cls(strategy, parsed, seed, min_numel, uplink_bandwidth, decode_plan, bool(client_mse), admission,
                   downlink, budget, tuple(extra_stages), secure_aggregation, tensor_policy)  # fmt: skip


def build_stages(
    settings: Settings, client_seed: Callable[[int, int], int]
) -> tuple[list[RoundStage], Evaluation, Admission, Recording]:
    """The train stages in the order a round walks them, the evaluate walk, and the parts both share.

    A reply's path from ``aggregate_train`` to the inner strategy is this list: each stage reads
    and writes the round's state, and the admission rules judge it through ``admission``.
    """
    s = settings
    admission = Admission(s.admission, weight_key_of(s.strategy), s.seed)
    recording = Recording(s.admission, s.uplink_bandwidth is not None, *admission.reported_reasons())
    stages: list[RoundStage] = [
        Assignment(s.codec, s.decode_plan, s.budget, client_seed, s.min_numel, s.client_mse, s.tensor_policy),
        Downlink(s.downlink),
        Arrival(s.uplink_bandwidth),
        Screening(admission),
        Decoding(s.decode_plan, s.min_numel, admission, aggregates_like_fedavg(s.strategy)),
        *([Budgeting(s.budget)] if s.budget is not None else []),
        Aggregation(s.strategy, admission),
        ValueBounds(s.tensor_policy),
        recording,
        *s.extra_stages,
    ]
    return stages, Evaluation(s.strategy, admission), admission, recording
