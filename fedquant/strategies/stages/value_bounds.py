"""Value-bounds stage: the served model keeps the invariants the tensor policy names (variances >= 0)."""

from __future__ import annotations

from flwr.app import Message

from fedquant.strategies.round import TrainRound
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.tensor_policy import TensorPolicy

METRIC_CLAMPED = "policy-clamped-values"


class ValueBounds(RoundStage):
    """Clips the round's aggregated arrays to the policy's bounds, after whatever the inner strategy
    did (a mean, one client's model, an optimizer step), and counts the values it moved."""

    def __init__(self, policy: TensorPolicy) -> None:
        self.policy = policy

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Clip ``state.arrays`` (none when no reply survived: the model is kept as it is)."""
        if state.arrays is not None:
            state.arrays, state.clamped_values = self.policy.constrain(state.arrays)

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """``policy-clamped-values``: values of the served model the bounds moved this round."""
        return {METRIC_CLAMPED: state.clamped_values}
