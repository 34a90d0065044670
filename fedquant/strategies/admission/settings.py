"""The admission rules' switches and factors, checked once: one frozen object a run is configured with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fedquant.strategies.drift import DriftRule


def _positive(name: str, value: object, minimum: float = 0.0, inclusive: bool = False) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= minimum if inclusive else value > minimum)
    if not ok:
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise ValueError(f"{name} must be a finite number {bound} or None, got {value!r}")


@dataclass(frozen=True)
class PersistenceRule:
    """When a client's updates oppose the others' persistently enough to be rejected.

    Parameters
    ----------
    allowance : float
        How far below 0 a cosine must lie to add to the sum (by ``-cos - allowance``); a positive
        cosine subtracts itself.
    threshold : float
        The sum above which the client's updates are rejected (reason ``direction``).
    max_clients : int
        How many node ids are remembered (least recently seen are forgotten first).
    """

    allowance: float = 0.5
    threshold: float = 0.75
    max_clients: int = 100_000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.allowance) and 0 <= self.allowance < 1):
            raise ValueError(f"allowance must be in [0, 1), got {self.allowance!r}")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"threshold must be finite and > 0, got {self.threshold!r}")
        if isinstance(self.max_clients, bool) or not isinstance(self.max_clients, int) or self.max_clients < 1:
            raise ValueError(f"max_clients must be an int >= 1, got {self.max_clients!r}")


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
