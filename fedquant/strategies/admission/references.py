"""What admission remembers across rounds: the median references and each rule's per-node memory.

Everything a rule carries from one round to the next lives in one :class:`References` store, so
a run's cross-round state is one object with one eviction rule: a median reference keeps the last
round only, a per-node memory (:class:`~fedquant.strategies.node_memory.NodeMemory`, the drift
ledger's too) the ``max_clients`` nodes seen most recently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

V = TypeVar("V")


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
    (:class:`References` holds one per quantity).
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


class References:
    """Admission's cross-round store: the median references of the relative rules, and each rule's memory.

    ``norms``, ``integer_changes`` and ``weights[kind]`` are :class:`MedianReference` s; a rule
    with memory of its own (a per-node CUSUM, a drift ledger) keeps it under its name
    (:meth:`kept`), built on first use.
    """

    def __init__(self) -> None:
        self.norms = MedianReference()
        self.integer_changes = MedianReference()
        self.weights = {"train": MedianReference(), "evaluate": MedianReference()}
        self._kept: dict[str, object] = {}

    def __repr__(self) -> str:
        return f"References(norms={self.norms!r}, kept={sorted(self._kept)})"

    def kept(self, name: str, build: Callable[[], V]) -> V:
        """The memory rule ``name`` keeps across rounds (``build()`` the first time)."""
        if name not in self._kept:
            self._kept[name] = build()
        return self._kept[name]  # type: ignore[return-value]
