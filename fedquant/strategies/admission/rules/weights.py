"""The weight rule: a reply's weight is a single finite number > 0, not an outlier, and bounded.

Rejects (reason ``num-examples``) a missing or bad weight (:func:`problem`, part of the metrics
check), one above ``weight_reject_factor`` x the round's reference (widened by the spread); clips
the admitted weights to ``weight_factor`` x the reference and to a ``max_weight_share`` of the
round's total (:func:`bounded`). The references are medians a minority cannot move
(:class:`~fedquant.strategies.admission.references.MedianReference`, train and evaluate apart).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flwr.app import MetricRecord

from fedquant.metrics.robust import describe, finite, is_number
from fedquant.strategies.admission.reasons import DEFAULT_WEIGHT_KEY, REASON_WEIGHT
from fedquant.strategies.admission.references import Reference, References, widened
from fedquant.strategies.admission.rules.base import Admitted, Rule
from fedquant.strategies.admission.settings import AdmissionRules
from fedquant.strategies.admission.vote import Vote


class Weights(Rule):
    """Rejects outlying weights when screening; clips the admitted weights before aggregation."""

    reason = REASON_WEIGHT
    clips = True

    # always on: its reference is the norm rule's weight ratio too

    def screen(self, vote: Vote, references: References, records: Mapping[int, MetricRecord]) -> dict[int, str]:
        """Per key, a sentence for the weights above the reject bound; sets ``vote.weight_reference``."""
        vote.weight_reference = None
        if weights_of(list(records.values()), self.weight_key) is None:
            return {}
        weights = {n: r[self.weight_key] for n, r in records.items()}
        reference = references.weights[vote.kind].reference(list(weights.values()))
        vote.weight_reference = reference.value if reference is not None and reference.value > 0 else None
        if self.rules.weight_reject_factor is None:
            return {}
        problems = {n: outlier(self.rules, w, reference, self.weight_key) for n, w in weights.items()}
        return {n: p for n, p in problems.items() if p is not None}

    def weigh(self, vote: Vote, references: References, admitted: Admitted, weights: Sequence[float]) -> list[float]:
        reference = references.weights[vote.kind].value(weights)
        out = bounded(self.rules, weights, reference)
        references.weights[vote.kind].end_round(out)
        return out


def problem(rules: AdmissionRules, value: object, weight_key: str) -> str | None:
    """A sentence when a reply's weight is to be rejected, else None."""
    if not rules.check_weight:
        return None
    if value is None:
        return f"the MetricRecord has no '{weight_key}'"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"'{weight_key}' must be a single number, got {type(value).__name__}"
    if not finite(value) or value <= 0:
        return f"'{weight_key}' must be a finite number > 0, got {describe(value)}"
    if rules.max_weight is not None and value > rules.max_weight:
        return f"'{weight_key}' = {describe(value)} exceeds the cap of {rules.max_weight:g}"
    return None


def outlier(rules: AdmissionRules, value: float, reference: float | Reference | None, weight_key: str) -> str | None:
    """A sentence when a weight exceeds ``weight_reject_factor`` (widened by ``weight_spread``) x the
    reference, else None."""
    reference, factor = widened(reference, rules.weight_reject_factor, rules.weight_spread)
    if factor is None or reference is None or not reference > 0 or not value > factor * reference:
        return None
    return f"'{weight_key}' = {describe(value)} exceeds {factor:.3g} x the reference weight {reference:.4g}"


def bounded(rules: AdmissionRules, weights: Sequence[float], reference: float | None) -> list[float]:
    """The weights after ``weight_factor`` (against ``reference``) and ``max_weight_share``.

    Weights only go down; a weight that was within both bounds is returned unchanged.
    """
    out = [float(w) for w in weights]
    if rules.weight_factor is not None and reference is not None and reference > 0:
        cap = rules.weight_factor * reference
        out = [min(w, cap) for w in out]
    if rules.max_weight_share is not None and out:
        out = cap_shares(out, rules.max_weight_share)
    return [w if w < float(orig) else orig for w, orig in zip(out, weights, strict=True)]


def ratio(vote: Vote, record: MetricRecord | None, weight_key: str) -> float:
    """A reply's weight over the round's reference weight (1.0 when either is unknown)."""
    weights = weights_of([record], weight_key) if record is not None else None
    reference = vote.weight_reference
    return float(weights[0]) / reference if weights and reference else 1.0


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


def write_weights(records: Sequence[MetricRecord], weight_key: str, values: Sequence[float]) -> int:
    """Write bounded weights into the records; return how many changed (were clipped)."""
    clipped = 0
    for record, weight in zip(records, values, strict=True):
        if weight != record[weight_key]:
            record[weight_key] = float(weight)
            clipped += 1
    return clipped


def weights_of(records: Sequence[MetricRecord], weight_key: str) -> list[float] | None:
    """The records' weights, or None when one is not a positive finite number (the weight rule is off)."""
    if any(r is None for r in records):
        return None
    weights = [r.get(weight_key) for r in records]
    if all(is_number(w) and finite(w) and w > 0 for w in weights):
        return weights  # type: ignore[return-value]
    return None


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
