"""The norm rule: a decoded update's L2 norm against the round's reference norm.

Rejects (reason ``update-norm``) a norm that is not finite, above ``max_update_norm``, or above
``norm_factor`` x the reference (widened by the spread of the norms, and by the reply's weight
ratio with ``norm_per_weight``); clips one above ``clip_factor`` x the reference to that norm,
keeping its direction. The reference is the median of the vote's norms and the last round's
(:class:`~fedquant.strategies.admission.references.MedianReference`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import MetricRecord

from fedquant.records import numpy_array
from fedquant.strategies.admission.reasons import REASON_NORM
from fedquant.strategies.admission.references import Reference, References, widened
from fedquant.strategies.admission.rules.base import Rule
from fedquant.strategies.admission.rules.weights import ratio
from fedquant.strategies.admission.settings import AdmissionRules
from fedquant.strategies.admission.vote import Vote
from fedquant.strategies.reply_decoder import DecodedReply


class Norms(Rule):
    """Rejects or clips a decoded update by its norm; the admitted norms are the next round's history."""

    reason = REASON_NORM
    clips = True

    # always on: a norm that is not finite is never admitted

    def reference(self, references: References, norms: Sequence[float]) -> Reference | None:
        """The reference norm (and the spread) given the round's ``norms`` (None when no relative rule is on)."""
        return references.norms.reference(norms) if self.rules.relative_norms else None

    def judge(
        self, vote: Vote, references: References, decoded: DecodedReply, reference: object, record: MetricRecord | None
    ) -> tuple[str | None, float]:
        return verdict(self.rules, decoded.update_norm, reference, ratio(vote, record, self.weight_key))

    def end_round(self, references: References, admitted_norms: Sequence[float]) -> None:
        if self.rules.relative_norms:
            references.norms.end_round(admitted_norms)


def verdict(
    rules: AdmissionRules, norm: float, reference: float | Reference | None, weight_ratio: float = 1.0
) -> tuple[str | None, float]:
    """``(sentence, scale)``: a sentence when the update is to be rejected, else the factor to scale it by.

    ``scale`` is 1.0 unless ``clip_factor`` clips the update to ``clip_factor x reference``. A
    :class:`Reference` widens ``norm_factor`` by ``norm_spread``; a float is used as it is.
    ``weight_ratio`` (the reply's weight over the reference weight) widens it with ``norm_per_weight``.
    """
    reference, factor = widened(reference, rules.norm_factor, rules.norm_spread)
    if factor is not None and rules.norm_per_weight and math.isfinite(weight_ratio):
        factor *= max(1.0, weight_ratio)
    if not math.isfinite(norm):
        return "the update's L2 norm is not finite", 1.0
    if rules.max_update_norm is not None and norm > rules.max_update_norm:
        return f"update L2 norm {norm:.4g} exceeds max_update_norm {rules.max_update_norm:.4g}", 1.0
    if reference is None:
        return None, 1.0
    if factor is not None and norm > factor * reference:
        return f"update L2 norm {norm:.4g} exceeds {factor:.3g} x the reference norm {reference:.4g}", 1.0
    if rules.clip_factor is not None and norm > rules.clip_factor * reference:
        return None, rules.clip_factor * reference / norm
    return None, 1.0


def check_norm(rules: AdmissionRules, norm: float, reference: float | Reference | None) -> str | None:
    """A sentence when an update of L2 norm ``norm`` is to be dropped, else None (clipping aside)."""
    return verdict(rules, norm, reference)[0]


def norm_split(rules: AdmissionRules, norms: Sequence[float]) -> float | None:
    """How far apart the upper and lower halves of a vote's norms lie (median of each), when that is
    more than ``norm_factor``: then the reference may be an attacker's, and the round should say so."""
    factor = rules.norm_factor
    if factor is None or len(norms) < 4:
        return None
    ordered = sorted(norms)
    half = len(ordered) // 2
    low, high = float(np.median(ordered[:half])), float(np.median(ordered[-half:]))
    if high > factor * low:
        return high / low if low > 0 else float("inf")
    return None


def clip_update(decoded: DecodedReply, received: Mapping[str, np.ndarray], scale: float) -> DecodedReply:
    """The reply with every float entry's update scaled by ``scale`` (< 1): ``received + scale x update``."""
    plain = dict(decoded.plain)
    values = dict(decoded.plain_values)
    for name, value in decoded.plain_values.items():
        sent = received[name]
        if sent.dtype.kind != "f":
            continue
        base = sent.astype(np.float64)
        clipped = base + scale * (value.astype(np.float64) - base)
        values[name] = np.require(clipped.astype(sent.dtype), requirements="C")
        plain[name] = numpy_array(values[name])
    updates = {name: update * scale for name, update in decoded.updates.items()}
    return DecodedReply(decoded.record_name, plain, values, updates, decoded.update_norm * scale)
