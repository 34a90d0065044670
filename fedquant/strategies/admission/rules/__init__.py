"""The admission rules, one module each, registered here in the order a round applies them.

A rule is a :class:`~fedquant.strategies.admission.rules.base.Rule` whose verdicts are functions
of the round's vote and the cross-round references; adding one is its module plus one line below.
"""

from __future__ import annotations

from fedquant.strategies.admission.rules.base import Rule
from fedquant.strategies.admission.rules.direction import Direction
from fedquant.strategies.admission.rules.drift import Drift
from fedquant.strategies.admission.rules.metrics import Metrics
from fedquant.strategies.admission.rules.non_float import NonFloat
from fedquant.strategies.admission.rules.norms import Norms
from fedquant.strategies.admission.rules.persistence import Persistence
from fedquant.strategies.admission.rules.weights import Weights

REGISTERED: tuple[type[Rule], ...] = (
    Metrics,  # a reply's MetricRecord against the round's schema
    Weights,  # outlying weights rejected, admitted ones clipped
    NonFloat,  # integer and bool entries, before decoding
    Norms,  # a decoded update's norm, rejected or clipped
    Persistence,  # a node opposing the others across rounds (before the one-round rule)
    Direction,  # an update opposing the round's consensus
    Drift,  # a node's summed pull across rounds (after the weight clip)
)

__all__ = ["REGISTERED", "Rule"]
