"""A run's admission: the registered rules, built once, asked step by step against the vote and the references.

The round's stages call one method per step (screening: :meth:`Admission.screen_replies`,
:meth:`Admission.screen_entries`; decoding: :meth:`Admission.judge`,
:meth:`Admission.oppose`; aggregation: :meth:`Admission.weigh`, :meth:`Admission.end_round`);
each asks every rule that judges at that step, in the order of
:data:`~fedquant.strategies.admission.rules.REGISTERED`, and names the rule in its verdict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence

import numpy as np
from flwr.app import Message, MetricRecord

from fedquant.strategies.admission import rules as registered
from fedquant.strategies.admission.reasons import CLIP_REASONS, REASON_DUPLICATE, REASON_UNEXPECTED, REASONS
from fedquant.strategies.admission.references import References
from fedquant.strategies.admission.rules.base import Admitted, Problem, Reject, Rule, Setup
from fedquant.strategies.admission.rules.metrics import single_metric_record, vote_schema
from fedquant.strategies.admission.rules.norms import clip_update, norm_split
from fedquant.strategies.admission.rules.weights import weights_of, write_weights
from fedquant.strategies.admission.settings import AdmissionRules
from fedquant.strategies.admission.vote import Ballot, Vote, VoteSums
from fedquant.strategies.reply_decoder import DecodedReply


class Admission:
    """The rules of a run (those ``rules`` switch on) and the references they keep across rounds.

    Parameters
    ----------
    rules : AdmissionRules
        The switches and factors.
    weight_key : str
        The metric the inner strategy weights replies by.
    seed : int
        The server's seed (the cross-round rule's sketch).
    rule_types : sequence of Rule subclasses, optional
        The rules to build, in the order they judge (default: those registered in
        :mod:`fedquant.strategies.admission.rules`).
    """

    def __init__(
        self,
        rules: AdmissionRules,
        weight_key: str,
        seed: int = 0,
        rule_types: Sequence[type[Rule]] | None = None,
    ) -> None:
        self.settings = rules
        self.weight_key = weight_key
        self.references = References()
        setup = Setup(rules, weight_key, seed)
        kinds = registered.REGISTERED if rule_types is None else rule_types
        self.rules = [rule for kind in kinds if (rule := kind.build(setup)) is not None]
        self._opposing = [rule for rule in self.rules if rule.opposes]

    def __repr__(self) -> str:
        return f"Admission({[type(r).__name__ for r in self.rules]}, {self.references!r})"

    def reported_reasons(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The reasons a train round reports counts of, rejected and clipped: the fixed ones, then the
        run's rules' own (a registered rule's reason is reported without editing any list)."""
        rejected = tuple(dict.fromkeys([*REASONS, *(r.reason for r in self.rules if r.rejects)]))
        clipped = tuple(dict.fromkeys([*CLIP_REASONS, *(r.reason for r in self.rules if r.clips)]))
        return rejected, clipped

    def sums(self, weighted_sum: bool) -> VoteSums:
        """Running sums for a train round's first vote: the consensus when a direction rule reads it, the
        weighted sum when the aggregation takes it (``weighted_sum``)."""
        return VoteSums(consensus=bool(self._opposing), weighted=weighted_sum)

    # ------------------------------------------------------------------ screening
    def screen_replies(
        self, replies: Sequence[Message], expected: Container[int] | None, vote: Vote, reject: Reject
    ) -> list[Message]:
        """The replies whose sender and metrics pass; the round's metric schema goes to ``vote.schema``.

        A reply from a node not in ``expected`` (None: any node) or from a node that replied more
        than once is dropped (``reject(node, problem)``), as is one a rule rejects by its
        MetricRecord, against the schema the expected nodes' replies vote (:func:`vote_schema`).
        """
        rules, kind = self.settings, vote.kind
        copies = Counter(r.metadata.src_node_id for r in replies)
        peers = [
            single_metric_record(r.content)
            for r in replies
            if (expected is None or r.metadata.src_node_id in expected) and copies[r.metadata.src_node_id] == 1
        ]
        vote.schema = vote_schema(peers, self.weight_key, rules)
        seen: set[int] = set()
        passed = []
        for reply in replies:
            node_id = reply.metadata.src_node_id
            if expected is not None and node_id not in expected:
                problem = (REASON_UNEXPECTED, f"the node was not sent a {kind} message this round")
            elif node_id in seen or (rules.reject_duplicates and copies[node_id] > 1):
                problem = (REASON_DUPLICATE, f"the node sent {copies[node_id]} {kind} replies this round")
            else:
                problem = self.check(vote, single_metric_record(reply.content))
            seen.add(node_id)
            if problem is None:
                passed.append(reply)
            else:
                reject(node_id, problem)
        outliers = self.screen(vote, {id(r): single_metric_record(r.content) for r in passed})
        for reply in [r for r in passed if id(r) in outliers]:
            reject(reply.metadata.src_node_id, outliers[id(reply)])
        return [r for r in passed if id(r) not in outliers]

    def check(self, vote: Vote, record: MetricRecord | None) -> Problem | None:
        """A reply's MetricRecord, alone: the first rule's problem with it, else None."""
        for rule in self.rules:
            if (problem := rule.check(vote, record)) is not None:
                return problem
        return None

    def screen(self, vote: Vote, records: Mapping[int, MetricRecord]) -> dict[int, Problem]:
        """The round's MetricRecords together: per key, the first rule's problem."""
        problems: dict[int, Problem] = {}
        for rule in self.rules:
            for key, sentence in rule.screen(vote, self.references, records).items():
                problems.setdefault(key, (rule.reason, sentence))
        return problems

    def screen_entries(
        self,
        replies: Mapping[int, Message],
        received: Callable[[int], Mapping[str, np.ndarray]],
        reject: Reject,
    ) -> tuple[dict[int, Message], list[str]]:
        """The train replies whose arrays pass before decoding, and a reason per clip."""
        kept, clipped = dict(replies), []
        for rule in self.rules:
            kept, count = rule.screen_entries(self.references, kept, received, reject)
            clipped += [rule.reason] * count
        return kept, clipped

    # ------------------------------------------------------------------ decoded updates
    def reference(self, norms: Sequence[float]) -> object:
        """The reference a vote of these update norms sets for :meth:`judge` (None when no rule keeps one)."""
        for rule in self.rules:
            if (value := rule.reference(self.references, norms)) is not None:
                return value
        return None

    def norm_split(self, norms: Sequence[float]) -> float | None:
        """How far apart a vote's halves of norms lie, when more than the norm rule can tell apart."""
        return norm_split(self.settings, norms)

    def judge(
        self,
        vote: Vote,
        decoded: DecodedReply,
        received: Mapping[str, np.ndarray],
        reference: object,
        record: MetricRecord | None,
    ) -> tuple[Problem | None, DecodedReply, list[str]]:
        """``(problem, reply, clipped)``: a decoded update rejected, or as admitted (clipped where a rule
        scaled it down, ``clipped`` naming the rules)."""
        clipped: list[str] = []
        for rule in self.rules:
            sentence, scale = rule.judge(vote, self.references, decoded, reference, record)
            if sentence is not None:
                return (rule.reason, sentence), decoded, []
            if scale < 1:
                decoded = clip_update(decoded, received, scale)
                clipped.append(rule.reason)
        return None, decoded, clipped

    def vote_terms(
        self, vote: Vote, decoded: Sequence[DecodedReply], received: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, tuple[float, float]]] | None:
        """The first vote's inner products with the consensus, one pass for all (None when no rule reads them)."""
        if not vote.consensus or not decoded or not any(r.wants_terms(vote.voters) for r in self._opposing):
            return None
        return vote.terms_of(decoded, received)

    def set_consensus(
        self, vote: Vote, decoded: Sequence[DecodedReply], received: Sequence[Mapping[str, np.ndarray]]
    ) -> None:
        """The vote's consensus, when a direction rule is on."""
        if self._opposing:
            vote.set_consensus(decoded, received)

    def oppose(self, ballot: Ballot) -> Problem | None:
        """The first direction rule's problem with an update against its vote's consensus, else None."""
        if not ballot.vote.consensus:
            return None
        for rule in self._opposing:
            if (sentence := rule.oppose(self.references, ballot)) is not None:
                return rule.reason, sentence
        return None

    # ------------------------------------------------------------------ weights and the round's end
    def weigh(self, vote: Vote, admitted: Admitted) -> list[str]:
        """Lower the admitted replies' weights (written into their records); a reason per clip."""
        clipped: list[str] = []
        for rule in self.rules:
            weights = weights_of(admitted.records, self.weight_key)
            if weights is None:
                break
            bounded = rule.weigh(vote, self.references, admitted, weights)
            clipped += [rule.reason] * write_weights(admitted.records, self.weight_key, bounded)
        return clipped

    def end_round(self, admitted_norms: Sequence[float]) -> None:
        """Remember the round's admitted update norms (after clipping) for the next round."""
        for rule in self.rules:
            rule.end_round(self.references, admitted_norms)
