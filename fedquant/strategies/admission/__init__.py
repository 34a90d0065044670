"""Admission: which untrusted replies reach the aggregate, and with what influence (docs/admission.md).

``vote.py`` is a round's vote (running sums, consensus, the round's references), ``references.py``
what admission remembers across rounds, ``rules/`` one module per rule, registered in
``rules/__init__.py``; ``judge.py`` asks the registered rules at each step of a round.
"""

from fedquant.strategies.admission.judge import Admission
from fedquant.strategies.admission.reasons import (
    CLIP_REASONS,
    DEFAULT_WEIGHT_KEY,
    REASON_DIRECTION,
    REASON_DRIFT,
    REASON_DUPLICATE,
    REASON_METRICS,
    REASON_NON_FLOAT,
    REASON_NORM,
    REASON_PAYLOAD,
    REASON_PLAN,
    REASON_UNEXPECTED,
    REASON_WEIGHT,
    REASONS,
    REJECTED_RULE_MAX_SHARE,
    warn_rejections,
    warn_rule_shares,
)
from fedquant.strategies.admission.references import MedianReference, Reference, References, weighted_median
from fedquant.strategies.admission.rules.metrics import single_metric_record
from fedquant.strategies.admission.rules.weights import cap_shares, weight_key_of
from fedquant.strategies.admission.settings import AdmissionRules, PersistenceRule
from fedquant.strategies.admission.vote import Vote

__all__ = [
    "CLIP_REASONS",
    "DEFAULT_WEIGHT_KEY",
    "REASONS",
    "REASON_DIRECTION",
    "REASON_DRIFT",
    "REASON_DUPLICATE",
    "REASON_METRICS",
    "REASON_NON_FLOAT",
    "REASON_NORM",
    "REASON_PAYLOAD",
    "REASON_PLAN",
    "REASON_UNEXPECTED",
    "REASON_WEIGHT",
    "REJECTED_RULE_MAX_SHARE",
    "Admission",
    "AdmissionRules",
    "MedianReference",
    "PersistenceRule",
    "Reference",
    "References",
    "Vote",
    "cap_shares",
    "single_metric_record",
    "warn_rejections",
    "warn_rule_shares",
    "weight_key_of",
    "weighted_median",
]
