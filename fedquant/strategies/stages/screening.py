"""Screening stage: who may reply, with which metrics and which integer entries, before any decoding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from flwr.app import Message

from fedquant.metrics.bandwidth import RoundTraffic
from fedquant.strategies.admission import REASON_DUPLICATE, REASON_UNEXPECTED, Admission, Vote
from fedquant.strategies.admission.rules.metrics import single_metric_record, vote_schema
from fedquant.strategies.round import TrainRound, reject
from fedquant.strategies.stages.base import RoundStage


class Screening(RoundStage):
    """Drops replies from unexpected or repeated nodes, then asks the rules that judge before decoding
    (metrics, weights, integer and bool entries: the cheap rules, cheapest first)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Open the round's vote (``state.vote``) and fill ``state.screened`` (node id -> reply, arrival order)."""
        server_round, traffic = state.server_round, state.traffic
        content_replies = [r for r in replies if not r.has_error()]
        state.vote = Vote("train")
        screened = self.screen(server_round, content_replies, state.sent, state.vote, traffic)
        state.screened, clipped = self.admission.screen_entries(
            {r.metadata.src_node_id: r for r in screened},
            state.received,
            lambda node_id, problem: reject(server_round, node_id, problem, traffic),
        )
        traffic.clipped_reasons += clipped

    def screen(
        self,
        server_round: int,
        content_replies: list[Message],
        expected: Container[int] | None,
        vote: Vote,
        traffic: RoundTraffic | None,
    ) -> list[Message]:
        """The replies whose sender and metrics pass; the round's metric schema goes to ``vote.schema``.

        A reply from a node not in ``expected`` (None: any node) or from a node that replied more
        than once is dropped, as is one a rule rejects by its MetricRecord, against the schema the
        expected nodes' replies vote (:func:`~fedquant.strategies.admission.rules.metrics.vote_schema`).
        """
        rules, kind = self.admission.settings, vote.kind
        copies = Counter(r.metadata.src_node_id for r in content_replies)
        peers = [
            single_metric_record(r.content)
            for r in content_replies
            if (expected is None or r.metadata.src_node_id in expected) and copies[r.metadata.src_node_id] == 1
        ]
        vote.schema = vote_schema(peers, self.admission.weight_key, rules)
        seen: set[int] = set()
        passed = []
        for reply in content_replies:
            node_id = reply.metadata.src_node_id
            if expected is not None and node_id not in expected:
                problem = (REASON_UNEXPECTED, f"the node was not sent a {kind} message this round")
            elif node_id in seen or (rules.reject_duplicates and copies[node_id] > 1):
                problem = (REASON_DUPLICATE, f"the node sent {copies[node_id]} {kind} replies this round")
            else:
                problem = self.admission.check(vote, single_metric_record(reply.content))
            seen.add(node_id)
            if problem is None:
                passed.append(reply)
            else:
                reject(server_round, node_id, problem, traffic)
        outliers = self.admission.screen(vote, {id(r): single_metric_record(r.content) for r in passed})
        for reply in [r for r in passed if id(r) in outliers]:
            reject(server_round, reply.metadata.src_node_id, outliers[id(reply)], traffic)
        return [r for r in passed if id(r) not in outliers]
