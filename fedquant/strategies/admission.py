"""Admission rules: which untrusted replies the server lets into the aggregate.

A reply that decodes is still untrusted: its metrics steer the weighted average and its update,
valid bytes and all, can be of any size. :class:`AdmissionRules` holds the checks
:class:`~fedquant.strategies.QuantizedStrategy` applies to every reply, train and evaluate, on
top of the payload checks of the codecs. Every rule is on by default and each can be switched
off on its own.

===================  ================================================================  =========
reason               rule                                                               switch
===================  ================================================================  =========
``duplicate-node``   two or more replies name the same source node: all of them are    ``reject_duplicates``
                     dropped (none can be told apart from a forged copy)
``unexpected-node``  a reply from a node that was not sent a train message this round   always on
``metrics``          the reply does not hold exactly one MetricRecord, its keys differ   ``consistent_metrics``,
                     from those most of its peers send, or a value is NaN/Inf           ``finite_metrics``
``num-examples``     the weight (``num-examples``, or the inner strategy's              ``check_weight``,
                     ``weighted_by_key``) is missing, a list, not finite, <= 0, or      ``max_weight``
                     above ``max_weight``
``payload``          the payload or the arrays do not decode (see the codecs)           always on
``update-norm``      the decoded update's L2 norm exceeds ``norm_factor`` times the     ``norm_factor``,
                     median norm of the round's decoded updates, or ``max_update_norm``  ``max_update_norm``
``decode-plan``      the decode plan refused the reply (e.g. NDQSG's second group       always on
                     with no first-group reply to decode against)
===================  ================================================================  =========

Rejected replies are dropped alone (the round goes on with the others), logged with the node id
and the reason, counted in ``rejected-replies`` and, per reason, in ``rejected-<reason>``.

Why the norm rule rejects rather than clips: an update ``norm_factor`` times larger than the
round's median is not what honest training of the same model from the same starting point
produces; clipping it would still let its sender push the model by ``norm_factor`` median norms
in a direction of its choice every round, while dropping it costs one reply. (To bound every
client's influence by clipping, wrap the inner strategy in Flower's
``DifferentialPrivacyServerSideFixedClipping``, which works under this wrapper.) The median
needs an honest majority of the round's decoded replies: with one or two replies it cannot tell
which one is off, so give ``max_update_norm`` an absolute bound where that matters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flwr.app import MetricRecord, RecordDict

REASON_DUPLICATE = "duplicate-node"
REASON_UNEXPECTED = "unexpected-node"
REASON_METRICS = "metrics"
REASON_WEIGHT = "num-examples"
REASON_PAYLOAD = "payload"
REASON_NORM = "update-norm"
REASON_PLAN = "decode-plan"
REASONS = (
    REASON_DUPLICATE,
    REASON_UNEXPECTED,
    REASON_METRICS,
    REASON_WEIGHT,
    REASON_PAYLOAD,
    REASON_NORM,
    REASON_PLAN,
)
DEFAULT_WEIGHT_KEY = "num-examples"


@dataclass(frozen=True)
class AdmissionRules:
    """The checks every reply must pass before it reaches the wrapped strategy.

    Parameters
    ----------
    reject_duplicates : bool
        Drop every reply of a node that replied more than once in a round (default True).
    consistent_metrics : bool
        A reply must carry exactly one MetricRecord with the key set most of the round's replies
        carry (ties go to the set that holds the weight key, then the larger set); others are
        dropped alone, where Flower's strategies would abort the whole round (default True).
    finite_metrics : bool
        Drop replies with a NaN or Inf metric value (default True).
    check_weight : bool
        The weight metric (``num-examples`` or the inner strategy's ``weighted_by_key``) must be
        present, a single finite number and > 0 (default True).
    max_weight : float or None
        Largest accepted weight (default 1e9 examples); None for no cap. A client can still claim
        any weight up to it: with a weighted mean that buys it up to all of the aggregate's
        weight (within the norm bound); strategies that ignore weights (FedMedian, Krum) don't.
    norm_factor : float or None
        Drop a decoded update whose L2 norm exceeds ``norm_factor`` times the median L2 norm of
        the round's decoded updates (default 10); None switches the rule off.
    max_update_norm : float or None
        Absolute bound on a decoded update's L2 norm (default None: none).

    Examples
    --------
    >>> AdmissionRules(norm_factor=5.0, max_weight=None)  # tighter norm bound, no weight cap
    """

    reject_duplicates: bool = True
    consistent_metrics: bool = True
    finite_metrics: bool = True
    check_weight: bool = True
    max_weight: float | None = 1e9
    norm_factor: float | None = 10.0
    max_update_norm: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_weight", "norm_factor", "max_update_norm"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
        if self.norm_factor is not None and self.norm_factor < 1:
            raise ValueError(f"norm_factor must be >= 1 (a multiple of the median norm), got {self.norm_factor!r}")

    @classmethod
    def off(cls) -> AdmissionRules:
        """Rules that accept whatever decodes (payload checks still apply)."""
        return cls(
            reject_duplicates=False,
            consistent_metrics=False,
            finite_metrics=False,
            check_weight=False,
            max_weight=None,
            norm_factor=None,
        )

    # ------------------------------------------------------------------ metrics
    def consensus_keys(self, contents: Sequence[RecordDict], weight_key: str) -> frozenset[str] | None:
        """The MetricRecord key set most replies carry (None when the rule is off or none has one)."""
        if not self.consistent_metrics:
            return None
        counts: dict[frozenset[str], int] = {}
        for content in contents:
            record = single_metric_record(content)
            if record is not None:
                keys = frozenset(record.keys())
                counts[keys] = counts.get(keys, 0) + 1
        if not counts:
            return None
        return max(counts, key=lambda keys: (counts[keys], weight_key in keys, len(keys), sorted(keys)))

    def check_metrics(
        self, content: RecordDict, weight_key: str, consensus: frozenset[str] | None
    ) -> tuple[str, str] | None:
        """``(reason, sentence)`` when the reply's metrics fail a rule, else None."""
        record = single_metric_record(content)
        if record is None:
            if self.consistent_metrics or self.check_weight:
                found = len(content.metric_records)
                return REASON_METRICS, f"expected exactly one MetricRecord, found {found}"
            return None
        if consensus is not None and frozenset(record.keys()) != consensus:
            missing, extra = sorted(consensus - set(record.keys())), sorted(set(record.keys()) - consensus)
            if weight_key in missing:
                return REASON_WEIGHT, f"the MetricRecord has no '{weight_key}'"
            return REASON_METRICS, f"MetricRecord keys differ from the round's: missing {missing}, extra {extra}"
        if self.check_weight:
            problem = self._weight_problem(record.get(weight_key), weight_key)
            if problem is not None:
                return REASON_WEIGHT, problem
        if self.finite_metrics:
            for key, value in record.items():
                if not _all_finite(value):
                    return REASON_METRICS, f"metric '{key}' is not finite"
        return None

    def _weight_problem(self, value: object, weight_key: str) -> str | None:
        if value is None:
            return f"the MetricRecord has no '{weight_key}'"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"'{weight_key}' must be a single number, got {type(value).__name__}"
        if not math.isfinite(value) or value <= 0:
            return f"'{weight_key}' must be a finite number > 0, got {value!r}"
        if self.max_weight is not None and value > self.max_weight:
            return f"'{weight_key}' = {value!r} exceeds the cap of {self.max_weight:g}"
        return None

    # ------------------------------------------------------------------ update norms
    def norm_reference(self, norms: Sequence[float]) -> float | None:
        """The median of the given norms, the reference of ``norm_factor`` (None: rule off or no norms)."""
        if self.norm_factor is None or not norms:
            return None
        ordered = sorted(norms)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])

    def check_norm(self, norm: float, reference: float | None) -> str | None:
        """A sentence when an update of L2 norm ``norm`` is to be dropped, else None."""
        if not math.isfinite(norm):
            return "the update's L2 norm is not finite"
        if self.max_update_norm is not None and norm > self.max_update_norm:
            return f"update L2 norm {norm:.4g} exceeds max_update_norm {self.max_update_norm:.4g}"
        if reference is not None and self.norm_factor is not None and norm > self.norm_factor * reference:
            return f"update L2 norm {norm:.4g} exceeds {self.norm_factor:g} x the round's median norm {reference:.4g}"
        return None


def single_metric_record(content: RecordDict) -> MetricRecord | None:
    """The reply's MetricRecord when it holds exactly one, else None."""
    records = content.metric_records
    return next(iter(records.values())) if len(records) == 1 else None


def weight_key_of(strategy: object) -> str:
    """The metric a strategy weights replies by (``weighted_by_key``, else ``num-examples``)."""
    key = getattr(strategy, "weighted_by_key", None)
    return key if isinstance(key, str) else DEFAULT_WEIGHT_KEY


def _all_finite(value: object) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_all_finite(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(value)
    return True
