"""Recording stage: the round's traffic and admission metrics, and the running uplink total."""

from __future__ import annotations

from fedquant.metrics.bandwidth import RoundTraffic
from fedquant.strategies.admission import (
    CLIP_REASONS,
    REASONS,
    REJECTED_RULE_MAX_SHARE,
    AdmissionRules,
    warn_rejections,
    warn_rule_shares,
)
from fedquant.strategies.round import TrainRound
from fedquant.strategies.stages.base import RoundStage


class Recording(RoundStage):
    """Reports ``state.traffic`` under the metric keys (``uplink-bytes``, ``rejected-<reason>``, ...)."""

    def __init__(
        self,
        admission: AdmissionRules,
        with_upload_seconds: bool,
        reasons: tuple[str, ...] = REASONS,
        clip_reasons: tuple[str, ...] = CLIP_REASONS,
    ) -> None:
        self.admission = admission
        self.with_upload_seconds = with_upload_seconds
        self.reasons, self.clip_reasons = reasons, clip_reasons
        self.cumulative_uplink_bytes = 0

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """The traffic metrics; warns when admission rejected a large share of the round."""
        traffic = state.traffic
        for reply_id in state.accepted:  # in the order they were accepted
            add_client_metrics(state.client_metrics[reply_id], traffic)
        self.cumulative_uplink_bytes += traffic.uplink_bytes
        # the warnings first, so that admission-warnings counts them
        traffic.admission_warnings += warn_rejections(
            self.admission, state.server_round, "train", len(traffic.rejected_reasons), traffic.replies
        )
        rule_share, rule_warnings = warn_rule_shares(
            state.server_round, "train", traffic.rejected_reasons, traffic.replies, self.admission.warn_rule_share
        )
        traffic.admission_warnings += rule_warnings
        own = traffic.metrics(
            self.cumulative_uplink_bytes,
            self.with_upload_seconds,
            self.reasons,
            self.clip_reasons,
            self.admission.metric_trim,
        )
        own[REJECTED_RULE_MAX_SHARE] = rule_share
        return own


def add_client_metrics(values: tuple[float | None, float | None, bool], traffic: RoundTraffic) -> None:
    """Count an accepted reply's own metrics (as the arrival stage took them out) in the round."""
    mse, seconds, reset = values
    if mse is not None:
        traffic.client_mse.append(mse)
    if seconds is not None:
        traffic.client_encode_seconds.append(seconds)
    traffic.client_state_resets += int(reset)
