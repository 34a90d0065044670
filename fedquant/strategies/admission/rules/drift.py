"""The cross-round rule's verdict: the admitted weights lowered so that a node's summed pull stays bounded.

The rule itself (its sketch, ledger and bounds) is :mod:`fedquant.strategies.drift`; this module
registers it as a weight rule (reason ``drift``), on when ``AdmissionRules.cross_round`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedquant.strategies.admission.reasons import REASON_DRIFT
from fedquant.strategies.admission.references import References
from fedquant.strategies.admission.rules.base import Admitted, Rule, Setup
from fedquant.strategies.admission.vote import Vote
from fedquant.strategies.drift import DriftLedger


class Drift(Rule):
    """Lowers a train reply's weight where its pull, this round or summed over its rounds, breaks a bound."""

    reason = REASON_DRIFT
    clips = True
    rejects = False

    @classmethod
    def build(cls, setup: Setup) -> Drift | None:
        return None if setup.rules.cross_round is None else cls(setup)

    def ledger(self, references: References) -> DriftLedger:
        """Every node's sketched summed pull, kept across rounds."""
        return references.kept("drift", lambda: DriftLedger(self.rules.cross_round, self.seed))

    def weigh(self, vote: Vote, references: References, admitted: Admitted, weights: Sequence[float]) -> list[float]:
        if admitted.kind != "train" or len(weights) < 2:
            return list(weights)
        return self.ledger(references).bound(admitted.nodes, admitted.updates(), weights)
