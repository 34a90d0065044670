"""Budget stage: the upload budget learns from the admitted replies' sizes and reports its round."""

from __future__ import annotations

from fedquant.strategies.budget import UploadBudget
from fedquant.strategies.round import TrainRound
from fedquant.strategies.stages.base import RoundStage


class Budgeting(RoundStage):
    """Feeds the reply sizes back to ``budget`` (whose settings the assignment stage chose)."""

    def __init__(self, budget: UploadBudget) -> None:
        self.budget = budget

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """The budget's metrics; only the admitted replies teach its size model."""
        admitted = {r.metadata.src_node_id for r in state.admitted}
        return self.budget.observe(state.budget, state.reply_bytes, admitted)
