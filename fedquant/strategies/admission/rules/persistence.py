"""Persistent opposition: a per-client CUSUM of how far its updates point against the others' across rounds.

One round's direction says little late in training: honest updates are then nearly orthogonal, and
an honest update's cosine with the sum of the round's other updates falls well below zero now and
then (-0.13 on digits IID, -0.58 on Dirichlet 0.5), so no single-round margin separates a sign flip
from an honest client. What separates a flip is persistence: it points against the others *every*
round. :class:`DirectionHistory` keeps, per node id, a one-sided CUSUM with a dead zone

    S_t = max(0, S_{t-1} + max(0, -cos_t - allowance) - max(0, cos_t))

of the node's leave-one-out cosines ``cos_t`` (its update against the sum of the round's other
first-vote updates) and flags the node while ``S_t > threshold``. Opposition counts only beyond
``-allowance`` (non-IID honest clients sit persistently near -0.3 late in training on digits
Dirichlet 0.5, a flip early in training near -0.9), and only agreement (a positive cosine) pays it
back: a flip caught early stays caught while it keeps pointing away, even when its late cosines
are as small as honest ones. The ``max(0, .)`` means honest rounds bank no credit, so a client
that behaves for ten rounds and then flips is judged as one that flips from the start. Rounds a
client misses leave its sum unchanged (it cannot reset it by staying away); a rejected update
still counts. Memory is bounded: at most ``max_clients`` nodes are kept, the least recently seen
forgotten first (a forgotten node starts again at 0).

Verdict (reason ``direction``), registered in :mod:`~fedquant.strategies.admission.rules`:
:class:`Persistence`, in the vote after the norm rule, before the one-round direction rule.
"""

from __future__ import annotations

import math

from fedquant.strategies.admission.reasons import REASON_DIRECTION
from fedquant.strategies.admission.references import References
from fedquant.strategies.admission.rules.base import Ballot, Rule, Setup
from fedquant.strategies.admission.settings import PersistenceRule
from fedquant.strategies.node_memory import NodeMemory


class DirectionHistory:
    """The CUSUM of each node's leave-one-out cosines (see the module docstring).

    Parameters
    ----------
    rule : PersistenceRule
        Allowance, threshold and memory bound.
    """

    def __init__(self, rule: PersistenceRule) -> None:
        self.rule = rule
        self._sums: NodeMemory[float] = NodeMemory(rule.max_clients)

    def __len__(self) -> int:
        return len(self._sums)

    def __repr__(self) -> str:
        return f"DirectionHistory({len(self)} nodes, {self.rule!r})"

    def sum_of(self, node: int) -> float:
        """The node's current sum (0 for a node not seen, or forgotten)."""
        return self._sums.get(node, 0.0)

    def observe(self, node: int, cosine: float) -> float:
        """Add one round's leave-one-out cosine of ``node``; its new sum.

        A non-finite cosine counts as the most opposing one (-1): it can only come from an update
        the caller failed to screen, and it must not reset the sum.
        """
        if not math.isfinite(cosine):
            cosine = -1.0
        cosine = min(1.0, max(-1.0, cosine))
        step = max(0.0, -cosine - self.rule.allowance) - max(0.0, cosine)
        total = max(0.0, self._sums.get(node, 0.0) + step)
        self._sums.put(node, total)
        return total

    def persistent(self, node: int) -> bool:
        """Whether the node's sum is above the threshold."""
        return self.sum_of(node) > self.rule.threshold


class Persistence(Rule):
    """Rejects the updates of a node whose CUSUM of leave-one-out cosines is above the threshold."""

    reason = REASON_DIRECTION

    @classmethod
    def build(cls, setup: Setup) -> Persistence | None:
        return None if setup.rules.persistent_opposition is None else cls(setup)

    def history(self, references: References) -> DirectionHistory:
        """The CUSUM of every node, kept across rounds."""
        return references.kept("persistence", lambda: DirectionHistory(self.rules.persistent_opposition))

    def wants_terms(self, voters: int) -> bool:
        # with one other update, who opposes whom is undecidable: both would be flagged
        return voters - 1 >= 2

    def oppose(self, references: References, ballot: Ballot) -> str | None:
        history = self.history(references)
        if ballot.voters - ballot.in_vote >= 2:
            others = ballot.cosine(-1 if ballot.in_vote else 0)
            if others is not None:
                history.observe(ballot.node, others)
        if history.persistent(ballot.node):
            return f"its updates point against the others' persistently (CUSUM {history.sum_of(ballot.node):.3g})"
        return None
