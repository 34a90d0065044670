"""Aggregates that a few clients cannot move beyond the honest range: the trimmed window and clamped means.

A window of ``n`` values leaves out the ``t = max(1, floor(trim n))`` lowest and highest (none for
``n < 3``, at most ``(n - 1) // 2``). With at most ``t`` values from liars, both ends of the window
are honest values, so anything clamped into it lies within the range honest clients reported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def is_number(value: object) -> bool:
    """An int or a float (a bool is not a metric value)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite(value: object) -> bool:
    """Whether a number, or every element of a list of numbers, is finite (ints beyond float range are not)."""
    try:
        if isinstance(value, list):
            return bool(np.isfinite(np.asarray(value, dtype=np.float64)).all())
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except (OverflowError, TypeError, ValueError):
        return False


def describe(value: object) -> str:
    """A short, safe rendering of an untrusted number for log messages (huge ints are not printed in full)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (int, float)):
        return repr(value)
    return type(value).__name__


def trim_count(n: int, trim: float) -> int:
    """How many of ``n`` values the window leaves out at each end."""
    if n < 3 or trim <= 0:
        return 0
    return min((n - 1) // 2, max(1, math.floor(trim * n)))


def window(values: Sequence[float], trim: float) -> tuple[float, float]:
    """``(lo, hi)``: the range of ``values`` without the :func:`trim_count` lowest and highest."""
    ordered = sorted(values)
    t = trim_count(len(ordered), trim)
    return ordered[t], ordered[len(ordered) - 1 - t]


def clamp_to_window(value: object, values: Sequence[float], trim: float) -> float:
    """``value`` clamped into the window of ``values``; their median when ``value`` is not a finite number."""
    lo, hi = window(values, trim)
    if not (is_number(value) and finite(value)):
        return float(np.median(values))
    return min(max(value, lo), hi)  # type: ignore[type-var, return-value]


def bounded_mean(values: Sequence[float], trim: float) -> float | None:
    """The mean of ``values`` clamped into their window (None without values)."""
    if not values:
        return None
    return float(clamp_to_window(float(np.mean(values)), values, trim))
