"""What an admission rule is: the steps of a round it may judge at, each a function of the vote and the references.

A rule overrides the steps it judges at; the others pass everything.
:class:`~fedquant.strategies.admission.judge.Admission` asks every registered rule at each step,
in registration order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Message, MetricRecord

from fedquant.strategies.admission.references import References
from fedquant.strategies.admission.settings import AdmissionRules
from fedquant.strategies.admission.vote import Ballot, Vote
from fedquant.strategies.reply_decoder import DecodedReply

Problem = tuple[str, str]
Reject = Callable[[int, Problem], None]

__all__ = ["Admitted", "Ballot", "Problem", "Reject", "Rule", "Setup"]


@dataclass(frozen=True)
class Setup:
    """What a rule is built from: the run's switches and factors, the inner strategy's weight key, the seed."""

    rules: AdmissionRules
    weight_key: str
    seed: int = 0


@dataclass
class Admitted:
    """The replies a round admitted, as the weight rules see them: records, node ids, updates when asked."""

    kind: str
    records: list[MetricRecord]
    nodes: list[int]
    updates: Callable[[], list[Mapping[str, np.ndarray]]]  # the float updates, computed on demand


class Rule:
    """One admission rule: ``reason`` names what it rejects or clips for; :meth:`build` is None when it is off."""

    reason: str = ""
    rejects: bool = True  # reported as rejected-<reason>
    clips: bool = False  # reported as clipped-<reason>

    def __init__(self, setup: Setup) -> None:
        self.rules, self.weight_key, self.seed = setup.rules, setup.weight_key, setup.seed

    @classmethod
    def build(cls, setup: Setup) -> Rule | None:
        """The rule for a run, or None when ``setup.rules`` switches it off (by default always on)."""
        return cls(setup)

    def check(self, vote: Vote, record: MetricRecord | None) -> Problem | None:
        """A reply's MetricRecord, alone, against the round's schema (screening)."""
        return None

    def screen(self, vote: Vote, references: References, records: Mapping[int, MetricRecord]) -> dict[int, str]:
        """Per key of ``records``, a sentence for the replies to reject, judged together (screening)."""
        return {}

    def screen_entries(
        self,
        references: References,
        replies: Mapping[int, Message],
        received: Callable[[int], Mapping[str, np.ndarray]],
        reject: Reject,
    ) -> tuple[dict[int, Message], int]:
        """The train replies whose arrays pass before decoding, and how many were clipped."""
        return dict(replies), 0

    def reference(self, references: References, norms: Sequence[float]) -> object:
        """The reference a vote of these update norms sets for :meth:`judge` (None: the rule keeps none)."""
        return None

    def judge(
        self, vote: Vote, references: References, decoded: DecodedReply, reference: object, record: MetricRecord | None
    ) -> tuple[str | None, float]:
        """``(sentence, scale)`` of a decoded update: a sentence rejects it, a scale below 1 clips it."""
        return None, 1.0

    def wants_terms(self, voters: int) -> bool:
        """Whether :meth:`oppose` reads the inner products of a vote of ``voters`` updates."""
        return False

    def oppose(self, references: References, ballot: Ballot) -> str | None:
        """A sentence when the update points against the round's consensus (rejected)."""
        return None

    def weigh(self, vote: Vote, references: References, admitted: Admitted, weights: Sequence[float]) -> list[float]:
        """The admitted replies' weights, lowered where the rule bounds them."""
        return list(weights)

    def end_round(self, references: References, admitted_norms: Sequence[float]) -> None:
        """Remember what the round admitted for the next one."""

    @property
    def opposes(self) -> bool:
        """Whether the rule judges directions (the vote then keeps a consensus)."""
        return type(self).oppose is not Rule.oppose
