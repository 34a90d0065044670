"""Admission rules: which untrusted replies reach the aggregate, and with what influence.

A rule either rejects a reply (dropped alone) or clips it (kept with a smaller weight or update).
The rules, their references and what one client can do per round: docs/admission.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
from flwr.app import MetricRecord, RecordDict
from flwr.supercore import log

from fedquant.metrics.robust import describe, finite
from fedquant.strategies.direction import PersistenceRule
from fedquant.strategies.drift import DriftRule

REASON_DUPLICATE = "duplicate-node"
REASON_UNEXPECTED = "unexpected-node"
REASON_METRICS = "metrics"
REASON_WEIGHT = "num-examples"
REASON_PAYLOAD = "payload"
REASON_NON_FLOAT = "non-float"
REASON_NORM = "update-norm"
REASON_PLAN = "decode-plan"
REASON_DIRECTION = "direction"
REASON_DRIFT = "drift"
REASONS = (
    REASON_DUPLICATE,
    REASON_UNEXPECTED,
    REASON_METRICS,
    REASON_WEIGHT,
    REASON_PAYLOAD,
    REASON_NON_FLOAT,
    REASON_NORM,
    REASON_PLAN,
    REASON_DIRECTION,
)
#: The reasons a reply can be clipped for (it stays in the aggregate).
CLIP_REASONS = (REASON_WEIGHT, REASON_NON_FLOAT, REASON_NORM, REASON_DRIFT)
DEFAULT_WEIGHT_KEY = "num-examples"


def _positive(name: str, value: object, minimum: float = 0.0, inclusive: bool = False) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise ValueError(f"{name} must be a finite number {bound} or None, got {value!r}")


@dataclass(frozen=True)
class AdmissionRules:
    """The checks every reply must pass before it reaches the wrapped strategy, and their bounds.

    Every rule is on by default and each can be switched off on its own (``None`` or ``False``);
    :meth:`off` switches all of them off. Each option is described in docs/admission.md.

    >>> AdmissionRules(norm_factor=5.0, max_weight=None)  # tighter norm bound, no weight cap
    """

    reject_duplicates: bool = True
    consistent_metrics: bool = True
    finite_metrics: bool = True
    check_weight: bool = True
    max_weight: float | None = 1e9
    weight_factor: float | None = 3.0
    weight_reject_factor: float | None = 10.0
    weight_spread: float | None = 8.0
    max_weight_share: float | None = 0.5
    norm_factor: float | None = 10.0
    norm_spread: float | None = 5.0
    norm_per_weight: bool = True
    clip_factor: float | None = 2.0
    max_update_norm: float | None = None
    reject_opposing: bool = False
    opposing_margin: float = 0.05
    check_non_float: bool = True
    metric_keys: frozenset[str] | None = None
    list_metrics: frozenset[str] = field(default_factory=frozenset)
    max_list_length: int = 1024
    metric_trim: float = 0.25
    warn_rejected_share: float = 0.3
    warn_rule_share: float = 0.05
    persistent_opposition: PersistenceRule | None = PersistenceRule()
    cross_round: DriftRule | None = None

    def __post_init__(self) -> None:
        names = ("max_weight", "norm_factor", "max_update_norm", "weight_factor", "weight_reject_factor", "clip_factor")
        for name in ("norm_spread", "weight_spread"):
            _positive(name, getattr(self, name), inclusive=True)
        for name in names:
            _positive(name, getattr(self, name))
        for name in ("norm_factor", "weight_factor", "weight_reject_factor", "clip_factor"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (a multiple of the reference), got {value!r}")
        if self.max_weight_share is not None:
            _positive("max_weight_share", self.max_weight_share)
            if self.max_weight_share > 1:
                raise ValueError(f"max_weight_share must be in (0, 1], got {self.max_weight_share!r}")
        _positive("metric_trim", self.metric_trim, inclusive=True)
        if not 0 <= self.opposing_margin < 1:
            raise ValueError(f"opposing_margin must be in [0, 1), got {self.opposing_margin!r}")
        if self.metric_trim >= 0.5:
            raise ValueError(f"metric_trim must be in [0, 0.5), got {self.metric_trim!r}")
        _positive("warn_rejected_share", self.warn_rejected_share)
        _positive("warn_rule_share", self.warn_rule_share)
        if self.persistent_opposition is not None and not isinstance(self.persistent_opposition, PersistenceRule):
            raise ValueError(f"persistent_opposition must be a PersistenceRule, got {self.persistent_opposition!r}")
        if self.cross_round is not None and not isinstance(self.cross_round, DriftRule):
            raise ValueError(f"cross_round must be a DriftRule, got {self.cross_round!r}")
        if (
            isinstance(self.max_list_length, bool)
            or not isinstance(self.max_list_length, int)
            or self.max_list_length < 0
        ):
            raise ValueError(f"max_list_length must be an int >= 0, got {self.max_list_length!r}")
        for name in ("metric_keys", "list_metrics"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"{name} must be a set of metric key strings, got {value!r}")
            object.__setattr__(self, name, frozenset(value))

    @classmethod
    def off(cls) -> AdmissionRules:
        """Rules that accept whatever decodes (payload checks still apply)."""
        return cls(
            reject_duplicates=False,
            consistent_metrics=False,
            finite_metrics=False,
            check_weight=False,
            max_weight=None,
            weight_factor=None,
            weight_reject_factor=None,
            max_weight_share=None,
            norm_factor=None,
            clip_factor=None,
            check_non_float=False,
            reject_opposing=False,
            metric_trim=0.0,
            persistent_opposition=None,
            cross_round=None,
        )

    @property
    def relative_norms(self) -> bool:
        """Whether any rule compares norms with a reference."""
        return self.norm_factor is not None or self.clip_factor is not None

    # ------------------------------------------------------------------ weights
    def weight_problem(self, value: object, weight_key: str) -> str | None:
        """A sentence when a reply's weight is to be rejected, else None."""
        if not self.check_weight:
            return None
        if value is None:
            return f"the MetricRecord has no '{weight_key}'"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"'{weight_key}' must be a single number, got {type(value).__name__}"
        if not finite(value) or value <= 0:
            return f"'{weight_key}' must be a finite number > 0, got {describe(value)}"
        if self.max_weight is not None and value > self.max_weight:
            return f"'{weight_key}' = {describe(value)} exceeds the cap of {self.max_weight:g}"
        return None

    def weight_outlier(self, value: float, reference: float | Reference | None, weight_key: str) -> str | None:
        """A sentence when a weight exceeds ``weight_reject_factor`` (widened by ``weight_spread``) x the
        reference, else None."""
        reference, factor = widened(reference, self.weight_reject_factor, self.weight_spread)
        if factor is None or reference is None or not reference > 0 or not value > factor * reference:
            return None
        return f"'{weight_key}' = {describe(value)} exceeds {factor:.3g} x the reference weight {reference:.4g}"

    def bound_weights(self, weights: Sequence[float], reference: float | None) -> list[float]:
        """The weights after ``weight_factor`` (against ``reference``) and ``max_weight_share``.

        Weights only go down; a weight that was within both bounds is returned unchanged.
        """
        out = [float(w) for w in weights]
        if self.weight_factor is not None and reference is not None and reference > 0:
            cap = self.weight_factor * reference
            out = [min(w, cap) for w in out]
        if self.max_weight_share is not None and out:
            out = cap_shares(out, self.max_weight_share)
        return [w if w < float(orig) else orig for w, orig in zip(out, weights, strict=True)]

    # ------------------------------------------------------------------ update norms
    def norm_verdict(
        self, norm: float, reference: float | Reference | None, weight_ratio: float = 1.0
    ) -> tuple[str | None, float]:
        """``(sentence, scale)``: a sentence when the update is to be rejected, else the factor to scale it by.

        ``scale`` is 1.0 unless ``clip_factor`` clips the update to ``clip_factor x reference``. A
        :class:`Reference` widens ``norm_factor`` by ``norm_spread``; a float is used as it is.
        ``weight_ratio`` (the reply's weight over the reference weight) widens it with
        ``norm_per_weight``.
        """
        reference, factor = widened(reference, self.norm_factor, self.norm_spread)
        if factor is not None and self.norm_per_weight and math.isfinite(weight_ratio):
            factor *= max(1.0, weight_ratio)
        if not math.isfinite(norm):
            return "the update's L2 norm is not finite", 1.0
        if self.max_update_norm is not None and norm > self.max_update_norm:
            return f"update L2 norm {norm:.4g} exceeds max_update_norm {self.max_update_norm:.4g}", 1.0
        if reference is None:
            return None, 1.0
        if factor is not None and norm > factor * reference:
            return f"update L2 norm {norm:.4g} exceeds {factor:.3g} x the reference norm {reference:.4g}", 1.0
        if self.clip_factor is not None and norm > self.clip_factor * reference:
            return None, self.clip_factor * reference / norm
        return None, 1.0

    def check_norm(self, norm: float, reference: float | Reference | None) -> str | None:
        """A sentence when an update of L2 norm ``norm`` is to be dropped, else None (clipping aside)."""
        return self.norm_verdict(norm, reference)[0]


@dataclass(frozen=True)
class Reference:
    """A round's reference for a relative rule: the value and the spread of the values around it.

    ``log_spread`` is the robust scale (1.4826 x the median absolute deviation) of the log values
    the reference was taken over: how far apart honest clients of this federation lie. The
    reject bounds widen with it (``norm_spread``, ``weight_spread``); 0.0 where it is unknown.
    """

    value: float
    log_spread: float = 0.0


class MedianReference:
    """A reference value (norm, weight) that a minority of the round cannot move, and that follows the round.

    :meth:`value` is the weighted median of the given current values (weight 1 each) and the
    history: the values admitted in the previous round (:meth:`end_round`) and the previous
    round's reference, which together weigh ``history_weight`` x the number of current values.

    Why the history weighs less than the round: it is there so that exactly half of a round
    cannot move the reference (the history breaks the tie), not to outvote a round that agrees
    with itself. When it weighed as much as the round (the previous admitted values and the
    previous reference, one vote each), one reply per round could never outvote two stale
    values: on Flower's default federation (2 clients, 1 per round) a client's update after the
    other client's rounds (60 x the other's converged norm, honestly) was rejected, and a rejected
    round admits nothing, so the reference never came back (7 of 20 honest replies lost).
    With ``history_weight`` h < 1 the current values move the median when more than ``(1 + h) / 2``
    of them agree (a single reply is its own reference), and ``a`` attackers of ``m`` replies
    move it only when ``a >= (1 + h) m / 2`` (3/4 of the round for h = 0.5) while the history is
    honest; in round 1 (no history), a strict majority.

    This is the one seam of the relative rules: a recalibrated rule replaces this class
    (``InfluenceBounds`` builds one per quantity).
    """

    def __init__(self, history_weight: float = 0.5) -> None:
        if not 0 < history_weight < 1:
            raise ValueError(f"history_weight must be in (0, 1), got {history_weight!r}")
        self.history_weight = history_weight
        self.previous: list[float] = []
        self.tie_breaker: float | None = None

    def __repr__(self) -> str:
        return f"MedianReference(previous={len(self.previous)} values, tie_breaker={self.tie_breaker})"

    def pool(self, current: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        """``(values, weights)`` the median is taken over: the current values, then the history."""
        now = [float(v) for v in current if math.isfinite(v)]
        past = self.previous + ([] if self.tie_breaker is None else [self.tie_breaker])
        each = self.history_weight * len(now) / len(past) if now and past else 1.0
        values = np.array(now + past, dtype=np.float64)
        weights = np.array([1.0] * len(now) + [each] * len(past), dtype=np.float64)
        return values, weights

    def value(self, current: Sequence[float]) -> float | None:
        """The reference for this round given its ``current`` values (None without any value)."""
        values, weights = self.pool(current)
        return weighted_median(values, weights) if values.size else None

    def reference(self, current: Sequence[float]) -> Reference | None:
        """:meth:`value` with the robust spread of the log values of the same pool (zeros left out)."""
        values, weights = self.pool(current)
        if not values.size:
            return None
        center = weighted_median(values, weights)
        positive = values > 0
        spread = 0.0
        if center > 0 and positive.any():
            deviations = np.abs(np.log(values[positive]) - math.log(center))
            spread = MAD_TO_SIGMA * weighted_median(deviations, weights[positive])
        return Reference(center, spread)

    def end_round(self, admitted: Sequence[float]) -> None:
        """Remember the values admitted this round (after clipping) for the next one."""
        admitted = [float(v) for v in admitted if math.isfinite(v)]
        if not admitted:
            return
        self.tie_breaker = self.value(admitted)
        self.previous = admitted


#: 1.4826 x the median absolute deviation estimates the standard deviation of normal data.
MAD_TO_SIGMA = 1.4826


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value where the cumulative weight (in value order) reaches half the total.

    Where it reaches half exactly at a value, the mean of that value and the next: with equal
    weights this is ``np.median``.
    """
    order = np.argsort(values, kind="stable")
    ordered, cumulative = values[order], np.cumsum(weights[order])
    half = cumulative[-1] / 2
    i = int(np.searchsorted(cumulative, half * (1 - 1e-12)))
    if i + 1 < ordered.size and abs(cumulative[i] - half) <= 1e-12 * cumulative[-1]:
        return float((ordered[i] + ordered[i + 1]) / 2)
    return float(ordered[i])


def widened(
    reference: float | Reference | None, factor: float | None, spread: float | None
) -> tuple[float | None, float | None]:
    """``(reference value, reject factor)``: ``factor`` widened to ``exp(spread x log_spread)`` where that is larger."""
    if not isinstance(reference, Reference):
        return reference, factor
    if factor is not None and spread is not None:
        factor = max(factor, math.exp(min(spread * reference.log_spread, 700.0)))
    return reference.value, factor


def cap_shares(weights: Sequence[float], share: float) -> list[float]:
    """Lower the largest weights so none exceeds ``share`` of the total (water-filling).

    The capped weights become equal to ``share x total`` of the new total; the others stay. With
    ``share x n <= 1`` every weight becomes the smallest (equal shares).
    """
    n = len(weights)
    if n == 0:
        return []
    if share * n <= 1:
        low = min(weights)
        return [low] * n
    order = sorted(range(n), key=lambda i: -weights[i])
    rest = float(sum(weights))
    out = [float(w) for w in weights]
    for capped in range(n):  # cap the `capped` largest weights at x = share * R / (1 - share * capped)
        if capped:
            rest -= weights[order[capped - 1]]
        if share * capped >= 1:  # unreachable for share * n > 1; equal shares are the safe answer
            break
        x = share * rest / (1 - share * capped) if capped else share * rest
        if weights[order[capped]] <= x * (1 + 1e-12):
            for i in order[:capped]:
                out[i] = x
            return out
    return [min(weights)] * n


#: The train metric: the largest share of the round's replies that one rule rejected.
REJECTED_RULE_MAX_SHARE = "rejected-rule-max-share"


def warn_rule_shares(
    server_round: int, kind: str, reasons: Sequence[str], replies: int, limit: float
) -> tuple[float, int]:
    """``(largest share, warnings)``: the largest share of ``replies`` one reason in ``reasons`` rejected,
    and how many reasons rejected more than ``limit`` of them (each logged as a warning)."""
    if not replies or not reasons:
        return 0.0, 0
    counts = Counter(reasons)
    warned = 0
    for reason, count in sorted(counts.items()):
        if count > limit * replies:
            warned += 1
            log(
                WARNING,
                "QuantizedStrategy: round %s: the %s rule rejected %d of %d %s replies (%.0f%%, above %.0f%%): honest "
                "clients may be dropped (see AdmissionRules) or a part of the federation is attacking",
                server_round, reason, count, replies, kind, 100 * count / replies, 100 * limit,
            )  # fmt: skip
    return max(counts.values()) / replies, warned


def single_metric_record(content: RecordDict) -> MetricRecord | None:
    """The reply's MetricRecord when it holds exactly one, else None.

    Read from the content's items: Flower's ``content.metric_records`` builds a view that writes
    every record back into the content, a cost paid several times per reply and round.
    """
    records = [record for record in content.values() if isinstance(record, MetricRecord)]
    return records[0] if len(records) == 1 else None


def weight_key_of(strategy: object) -> str:
    """The metric a strategy weights replies by (``weighted_by_key``, else ``num-examples``).

    Wrappers such as Flower's DP strategies hold the weighting strategy in ``.strategy``.
    """
    seen = 0
    while strategy is not None and seen < 8:
        key = getattr(strategy, "weighted_by_key", None)
        if isinstance(key, str):
            return key
        strategy, seen = getattr(strategy, "strategy", None), seen + 1
    return DEFAULT_WEIGHT_KEY
