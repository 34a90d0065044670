"""Divergence detection: tell the user when a run's global model has blown up or collapsed.

Two signs, checked on the server's own evaluation after every round (never on what clients
report, which is untrusted):

* a non-finite test loss or accuracy;
* an accuracy collapse: the model had learned (best accuracy at least ``min_gain`` above chance)
  and then lost most of it (accuracy back within ``1 - collapse_share`` of that gain above
  chance). A model whose ReLUs all died, the usual end of a too-large learning rate, predicts one
  class: chance accuracy and a loss of ``ln(classes)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DIVERGED_COLUMN = "diverged"  # 1 in a history row when the model is diverged at that round, else 0


@dataclass
class DivergenceMonitor:
    """Follows a run's per-round evaluation and says when it diverges.

    Parameters
    ----------
    num_classes : int
        Classes of the task; chance accuracy is ``1 / num_classes``.
    min_gain : float
        Accuracy above chance the model must have reached before a fall counts as a collapse.
    collapse_share : float
        Share of the best gain above chance that must be lost for a collapse (0.75: a model at
        0.95 on 10 classes has collapsed below 0.3125).
    """

    num_classes: int
    min_gain: float = 0.2
    collapse_share: float = 0.75
    best_accuracy: float = 0.0
    first_round: int | None = None
    reason: str = ""
    last_round_diverged: bool = False

    @property
    def chance(self) -> float:
        return 1.0 / max(self.num_classes, 1)

    def check(self, server_round: int, accuracy: float, loss: float) -> str | None:
        """Record one round's evaluation; return why the model is diverged, or None when it is not.

        The first diverged round and its reason are kept in ``first_round`` and ``reason``.
        """
        why = None
        if not math.isfinite(loss):
            why = f"the test loss is not finite ({loss})"
        elif not math.isfinite(accuracy):
            why = f"accuracy is not finite ({accuracy})"
        else:
            gain = self.best_accuracy - self.chance
            floor = self.chance + (1.0 - self.collapse_share) * gain
            if gain >= self.min_gain and accuracy <= floor:
                why = (
                    f"accuracy collapsed to {accuracy:.4f} from a best of {self.best_accuracy:.4f} "
                    f"(chance {self.chance:.4f})"
                )
            self.best_accuracy = max(self.best_accuracy, accuracy)
        if why is not None and self.first_round is None:
            self.first_round, self.reason = server_round, why
        self.last_round_diverged = why is not None
        return why

    @property
    def diverged(self) -> bool:
        return self.first_round is not None

    @property
    def recovered(self) -> bool:
        """The model diverged at some round but its latest evaluation is healthy again."""
        return self.diverged and not self.last_round_diverged
