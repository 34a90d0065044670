"""Admission stage: each decoded update's norm and direction judged against the round's honest majority."""

from __future__ import annotations

from logging import WARNING

from flwr.supercore import log

from fedquant.metrics.bandwidth import RoundTraffic, record_numel
from fedquant.strategies.admission import REASON_DIRECTION, REASON_NORM, single_metric_record
from fedquant.strategies.decode_plan import DecodedClient, DecodePlan
from fedquant.strategies.influence import InfluenceBounds
from fedquant.strategies.metric_screen import conform
from fedquant.strategies.reply_decoder import DecodedReply
from fedquant.strategies.stages.state import LOG_PREFIX, TrainRound
from fedquant.strategies.vote_sums import VoteSums


class Admitting:
    """Admits decoded replies, alone against the updates admitted before them or as one vote.

    The decoding stage calls it once per decoded reply (:meth:`admit_one`) or once per vote
    (:meth:`admit_vote`); an accepted reply teaches the decode plan and is added to
    ``state.accepted``, its update (as admitted: clipped if need be) to ``state.decoded``.
    """

    def __init__(self, bounds: InfluenceBounds, decode_plan: DecodePlan, weighted_sum: bool = False) -> None:
        self.bounds = bounds
        self.decode_plan = decode_plan
        self.weighted_sum = weighted_sum  # the aggregation stage takes the vote's weighted sum

    def start(self, state: TrainRound) -> None:
        """Begin the round's norm and direction bookkeeping and the vote's running sums."""
        self.bounds.start_round()
        state.vote_sums = VoteSums(consensus=self.bounds.directions_on(), weighted=self.weighted_sum)

    def vote_hook(self, state: TrainRound, node_id: int):
        """The check of a first-vote reply's decoded updates that also adds them to the vote's sums
        (None when no sum is kept); :meth:`vote_joined` or :meth:`vote_failed` follows."""
        sums = state.vote_sums
        if sums is None or not sums.active:
            return None
        weight = single_metric_record(state.screened[node_id].content).get(self.bounds.weight_key)
        usable = isinstance(weight, int | float) and not isinstance(weight, bool)
        return sums.squares(float(weight) if usable else float("nan"))  # NaN: never matches, slow mean

    def vote_joined(self, state: TrainRound, decoded: DecodedReply) -> None:
        """The reply the last :meth:`vote_hook` served decoded in full."""
        if state.vote_sums is not None:
            state.vote_sums.joined(decoded)

    def vote_failed(self, state: TrainRound) -> None:
        """The reply the last :meth:`vote_hook` served was refused while decoding."""
        if state.vote_sums is not None:
            state.vote_sums.failed()

    def finish(self, state: TrainRound) -> None:
        """End the round: the admitted norms become the next round's reference; the consensus
        buffers go to ``state.scratch``."""
        self.bounds.end_round(state.traffic.update_norms)
        state.scratch = self.bounds.take_consensus()

    def reference(self, state: TrainRound) -> float | None:
        """The norm reference of the updates admitted so far (None before any)."""
        return self.bounds.norm_reference(state.traffic.update_norms)

    def admit_one(self, state: TrainRound, node_id: int, decoded: DecodedReply, reference: float | None) -> None:
        """Judge one update against ``reference`` (the updates admitted before it) and accept it or not."""
        if (judged := self._judge(state, node_id, decoded, reference)) is not None:
            self._accept(state, node_id, judged, in_vote=False)

    def admit_vote(self, state: TrainRound, pending: list[tuple[int, DecodedReply]]) -> None:
        """Judge a vote's updates against the reference they set together, then accept the survivors."""
        norms = [d.update_norm for _, d in pending]
        self._warn_norm_split(state.server_round, norms, state.traffic)
        group_reference = self.bounds.norm_reference(norms)
        judged = [
            (n, d) for n, d in ((n, self._judge(state, n, d, group_reference)) for n, d in pending) if d is not None
        ]
        decoded, received = [d for _, d in judged], [state.received(n) for n, _ in judged]
        self.bounds.set_consensus(decoded, received, state.vote_sums)
        terms = self.bounds.vote_terms(decoded, received)  # one pass over the consensus for the vote
        for i, (node_id, update) in enumerate(judged):
            self._accept(state, node_id, update, in_vote=True, terms=None if terms is None else terms[i])

    def _judge(
        self, state: TrainRound, node_id: int, decoded: DecodedReply, reference: float | None
    ) -> DecodedReply | None:
        record = single_metric_record(state.screened[node_id].content)
        problem, decoded, clipped = self.bounds.judge_update(decoded, state.received(node_id), reference, record)
        if problem is not None:
            state.reject(node_id, (REASON_NORM, problem))
            return None
        state.traffic.clipped_reasons += clipped
        return decoded

    def _accept(
        self, state: TrainRound, node_id: int, decoded: DecodedReply, in_vote: bool, terms: dict | None = None
    ) -> None:
        server_round, traffic = state.server_round, state.traffic
        problem = self.bounds.opposition(node_id, decoded, state.received(node_id), in_vote, terms)
        if problem is not None:
            state.reject(node_id, (REASON_DIRECTION, problem))
            return
        reply = state.screened[node_id]
        traffic.update_norms.append(decoded.update_norm)
        client = DecodedClient(
            node_id,
            state.assignments[node_id],
            decoded.updates,
            state.bytes_of[node_id],
            record_numel(state.sent[node_id]),
        )
        self.decode_plan.accepted(server_round, client)
        state.decoded[id(reply)] = decoded
        conform(single_metric_record(reply.content), state.schema)
        state.accepted[id(reply)] = reply

    def _warn_norm_split(self, server_round: int, norms: list[float], traffic: RoundTraffic) -> None:
        """A warning when a vote's update norms fall into two groups too far apart for the norm rule."""
        split = self.bounds.norm_split(norms)
        if split is None:
            return
        traffic.admission_warnings += 1
        log(
            WARNING,
            "%s: round %s: the update norms split into two groups %.3g x apart; the norm rule cannot tell "
            "which is honest (more than half of the vote may be attacking)",
            LOG_PREFIX, server_round, split,
        )  # fmt: skip
