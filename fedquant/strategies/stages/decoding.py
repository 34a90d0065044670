"""Decoding stage: the screened replies decoded in the plan's order, in vote groups, each judged by the rules.

The replies decodable without side information vote first: they are added to the vote's running
sums while decoding, judged together once all are decoded (their norms set the reference, their
sum is the consensus), before any becomes side information (:func:`_vote_groups`). The others are
judged against the replies admitted before them, so an outlier never reaches the side information.
An accepted reply teaches the decode plan; its update, as admitted, goes to ``state.decoded``.
"""

from __future__ import annotations

import time
from logging import WARNING

from flwr.app import Message
from flwr.supercore import log

from fedquant.codecs.buffers import BufferPool
from fedquant.metrics.bandwidth import record_numel
from fedquant.strategies.admission import REASON_PAYLOAD, REASON_PLAN, Admission
from fedquant.strategies.admission.rules.metrics import conform, single_metric_record
from fedquant.strategies.admission.vote import Ballot
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, DecodePlan
from fedquant.strategies.reply_decoder import DecodedReply, RejectedReply, decode_reply, decode_threads
from fedquant.strategies.round import LOG_PREFIX, TrainRound
from fedquant.strategies.side_info import needs_side_info
from fedquant.strategies.stages.base import RoundStage


class Decoding(RoundStage):
    """Decodes every screened reply with the record codec its plan names; the rules judge each update.

    ``weighted_sum``: the aggregation stage takes the vote's weighted sum (a FedAvg-like inner strategy).
    """

    def __init__(self, decode_plan: DecodePlan, min_numel: int, admission: Admission, weighted_sum: bool) -> None:
        self.decode_plan = decode_plan
        self.min_numel = min_numel
        self.admission = admission
        self.weighted_sum = weighted_sum
        self.buffers = BufferPool()  # the decoded updates' memory, lent again round after round

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Decode and admit ``state.screened``; the accepted replies end in ``state.accepted``."""
        start = time.perf_counter()
        state.vote.sums = self.admission.sums(self.weighted_sum)
        order = self.decode_plan.decode_order(list(state.screened), state.assignments)
        # one kernel thread per reply when a round has many
        with decode_threads(len(state.sent)), self.buffers.lending():
            for group in _vote_groups(order, state.assignments, self.min_numel):
                self._decode_group(state, group)
        self.admission.end_round(state.traffic.update_norms)
        state.traffic.decode_seconds = time.perf_counter() - start
        state.admitted = [r for r in replies if id(r) in state.accepted]

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """The decode plan's metrics of the round (NDQSG's groups, for instance)."""
        return self.decode_plan.round_metrics(state.server_round)

    def _decode_group(self, state: TrainRound, group: list[int]) -> None:
        """Decode and admit one vote group: the first vote together, a later group one by one."""
        first = not state.traffic.update_norms
        reference = self.admission.reference(state.traffic.update_norms)
        pending: list[tuple[int, DecodedReply]] = []
        for node_id in group:
            decoded = self._decode_one(state, node_id, in_vote=first)
            if decoded is None:
                continue
            if first:
                pending.append((node_id, decoded))
            elif (judged := self._judge(state, node_id, decoded, reference)) is not None:
                self._accept(state, node_id, judged, in_vote=False)
        if pending:
            self._admit_vote(state, pending)

    def _decode_one(self, state: TrainRound, node_id: int, in_vote: bool) -> DecodedReply | None:
        """Decode one screened reply, or reject it (plan refusal, bad payload) and return None.

        A reply of the first vote is added to the vote's running sums in the pass that checks it."""
        server_round, reply, sums = state.server_round, state.screened[node_id], state.vote.sums
        assignment = state.assignments[node_id]
        reason = self.decode_plan.admit(server_round, node_id, assignment)
        if reason is not None:
            state.reject(node_id, (REASON_PLAN, reason))
            return None
        hook = None
        if in_vote and sums.active:
            weight = single_metric_record(reply.content).get(self.admission.weight_key)
            usable = isinstance(weight, int | float) and not isinstance(weight, bool)
            hook = sums.squares(float(weight) if usable else float("nan"))  # NaN: never matches, slow mean
        try:
            codec = self.decode_plan.reply_codec(server_round, assignment, self.min_numel)
            decoded = decode_reply(reply.content, state.received(node_id), codec, state.seeds[node_id], hook)
        except RejectedReply as err:
            sums.failed()
            state.reject(node_id, (REASON_PAYLOAD, str(err)))
            return None
        sums.joined(decoded)
        return decoded

    def _admit_vote(self, state: TrainRound, pending: list[tuple[int, DecodedReply]]) -> None:
        """Judge a vote's updates against the reference they set together, then accept the survivors."""
        norms = [d.update_norm for _, d in pending]
        self._warn_norm_split(state, norms)
        reference = self.admission.reference(norms)
        judged = [(n, d) for n, d in ((n, self._judge(state, n, d, reference)) for n, d in pending) if d is not None]
        decoded, received = [d for _, d in judged], [state.received(n) for n, _ in judged]
        self.admission.set_consensus(state.vote, decoded, received)
        terms = self.admission.vote_terms(state.vote, decoded, received)  # one pass over the consensus
        for i, (node_id, update) in enumerate(judged):
            self._accept(state, node_id, update, in_vote=True, terms=None if terms is None else terms[i])

    def _judge(self, state: TrainRound, node_id: int, decoded: DecodedReply, reference: object) -> DecodedReply | None:
        record = single_metric_record(state.screened[node_id].content)
        problem, decoded, clipped = self.admission.judge(
            state.vote, decoded, state.received(node_id), reference, record
        )
        if problem is not None:
            state.reject(node_id, problem)
            return None
        state.traffic.clipped_reasons += clipped
        return decoded

    def _accept(
        self, state: TrainRound, node_id: int, decoded: DecodedReply, in_vote: bool, terms: dict | None = None
    ) -> None:
        problem = self.admission.oppose(Ballot(state.vote, node_id, decoded, state.received(node_id), in_vote, terms))
        if problem is not None:
            state.reject(node_id, problem)
            return
        reply = state.screened[node_id]
        state.traffic.update_norms.append(decoded.update_norm)
        client = DecodedClient(
            node_id,
            state.assignments[node_id],
            decoded.updates,
            state.bytes_of[node_id],
            record_numel(state.sent[node_id]),
        )
        self.decode_plan.accepted(state.server_round, client)
        state.decoded[id(reply)] = decoded
        conform(single_metric_record(reply.content), state.vote.schema)
        state.accepted[id(reply)] = reply

    def _warn_norm_split(self, state: TrainRound, norms: list[float]) -> None:
        """A warning when a vote's update norms fall into two groups too far apart for the norm rule."""
        split = self.admission.norm_split(norms)
        if split is None:
            return
        state.traffic.admission_warnings += 1
        log(
            WARNING,
            "%s: round %s: the update norms split into two groups %.3g x apart; the norm rule cannot tell "
            "which is honest (more than half of the vote may be attacking)",
            LOG_PREFIX, state.server_round, split,
        )  # fmt: skip


def _vote_groups(order: list[int], assignments: dict[int, ClientAssignment], min_numel: int) -> list[list[int]]:
    """Split a decode order into the first vote and the rest, each in decode order.

    The first vote holds every reply decodable without side information (NDQSG's P1, and its P2
    replies whose tensors all fall back to DQSG): the more replies vote on the norm reference
    before anything becomes side information, the larger the minority it withstands. The rest
    (decoded against side information) is judged against the replies admitted before it.
    """
    against = {n for n in order if needs_side_info(assignments[n].record_codec(min_numel))}
    first = [n for n in order if n not in against]
    rest = [n for n in order if n in against]
    return [group for group in (first, rest) if group]
