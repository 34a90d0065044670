"""The one-round direction rule: an update pointing against the round's consensus (reason ``direction``).

The consensus is the sum of the first vote's updates after the norm rule, the update itself
included, so a sign-flipped honest update is dropped while an honest one of noise alone passes.
Off by default (``reject_opposing``): one round cannot tell a flip from a non-IID honest client;
the persistence rule (:mod:`.persistence`) catches a flip from its second round instead.
"""

from __future__ import annotations

from fedquant.strategies.admission.reasons import REASON_DIRECTION
from fedquant.strategies.admission.references import References
from fedquant.strategies.admission.rules.base import Ballot, Rule, Setup


class Direction(Rule):
    """Rejects an update whose cosine with the consensus is below ``-opposing_margin``."""

    reason = REASON_DIRECTION

    @classmethod
    def build(cls, setup: Setup) -> Direction | None:
        return cls(setup) if setup.rules.reject_opposing else None

    def wants_terms(self, voters: int) -> bool:
        return True

    def oppose(self, references: References, ballot: Ballot) -> str | None:
        cosine = ballot.cosine(0 if ballot.in_vote else 1)
        if cosine is None or cosine >= -self.rules.opposing_margin:
            return None
        return f"its update points against the round's consensus (cosine {cosine:.3g})"
