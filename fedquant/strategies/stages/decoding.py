"""Decoding stage: the screened replies decoded in the plan's order, in vote groups, each handed to admission."""

from __future__ import annotations

import time

from flwr.app import Message

from fedquant.codecs.buffers import BufferPool
from fedquant.strategies.admission import REASON_PAYLOAD, REASON_PLAN
from fedquant.strategies.decode_plan import ClientAssignment, DecodePlan
from fedquant.strategies.reply_decoder import DecodedReply, RejectedReply, decode_reply, decode_threads
from fedquant.strategies.side_info import needs_side_info
from fedquant.strategies.stages.admitting import Admitting
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.stages.state import TrainRound


class Decoding(RoundStage):
    """Decodes every screened reply with the record codec its plan names and passes it to ``admitting``.

    Decoding follows the plan's order; the replies decodable without side information vote
    first (their norms are judged together once all are decoded, before any becomes side
    information, :func:`_vote_groups`), the others are judged against the replies admitted
    before them, so an outlier never reaches the side information.
    """

    def __init__(self, decode_plan: DecodePlan, min_numel: int, admitting: Admitting) -> None:
        self.decode_plan = decode_plan
        self.min_numel = min_numel
        self.admitting = admitting
        self.buffers = BufferPool()  # the decoded updates' memory, lent again round after round

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Decode and admit ``state.screened``; the accepted replies end in ``state.accepted``."""
        start = time.perf_counter()
        self.admitting.start(state)
        order = self.decode_plan.decode_order(list(state.screened), state.assignments)
        # one kernel thread per reply when a round has many
        with decode_threads(len(state.sent)), self.buffers.lending():
            self._decode_groups(state, order)
        self.admitting.finish(state)
        state.traffic.decode_seconds = time.perf_counter() - start
        state.admitted = [r for r in replies if id(r) in state.accepted]

    def _decode_groups(self, state: TrainRound, order: list[int]) -> None:
        """Decode and admit the replies in ``order``, vote group by vote group."""
        for group in _vote_groups(order, state.assignments, self.min_numel):
            admitted_before = bool(state.traffic.update_norms)
            reference = self.admitting.reference(state)
            pending: list[tuple[int, DecodedReply]] = []
            for node_id in group:
                decoded = self._decode_one(state, node_id, in_vote=not admitted_before)
                if decoded is None:
                    continue
                if not admitted_before:
                    pending.append((node_id, decoded))
                else:
                    self.admitting.admit_one(state, node_id, decoded, reference)
            if pending:
                self.admitting.admit_vote(state, pending)

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """The decode plan's metrics of the round (NDQSG's groups, for instance)."""
        return self.decode_plan.round_metrics(state.server_round)

    def _decode_one(self, state: TrainRound, node_id: int, in_vote: bool = False) -> DecodedReply | None:
        """Decode one admitted reply, or reject it (plan refusal, bad payload) and return None.

        A reply of the first vote is added to the vote's running sums in the pass that checks it
        (:meth:`Admitting.vote_hook`)."""
        server_round, reply = state.server_round, state.screened[node_id]
        assignment = state.assignments[node_id]
        reason = self.decode_plan.admit(server_round, node_id, assignment)
        if reason is not None:
            state.reject(node_id, (REASON_PLAN, reason))
            return None
        hook = self.admitting.vote_hook(state, node_id) if in_vote else None
        try:
            codec = self.decode_plan.reply_codec(server_round, assignment, self.min_numel)
            decoded = decode_reply(reply.content, state.received(node_id), codec, state.seeds[node_id], hook)
        except RejectedReply as err:
            self.admitting.vote_failed(state)
            state.reject(node_id, (REASON_PAYLOAD, str(err)))
            return None
        self.admitting.vote_joined(state, decoded)
        return decoded


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
