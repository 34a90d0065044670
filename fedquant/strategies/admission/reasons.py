"""The reasons a reply is rejected or clipped for: the suffixes of ``rejected-<reason>``, ``clipped-<reason>``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from logging import WARNING

from flwr.supercore import log

from fedquant.strategies.admission.settings import AdmissionRules

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


def warn_rejections(admission: AdmissionRules, server_round: int, kind: str, rejected: int, replies: int) -> int:
    """A warning when admission rejected a large share of a round (``warn_rejected_share``); 1 if logged."""
    if not replies or rejected < admission.warn_rejected_share * replies:
        return 0
    majority = " (a majority: more than half of the round may be attacking, or the rules do not fit it)"
    log(
        WARNING,
        "QuantizedStrategy: round %s: admission rejected %d of %d %s replies%s",
        server_round,
        rejected,
        replies,
        kind,
        majority if 2 * rejected > replies else "",
    )
    return 1
