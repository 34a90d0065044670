"""Screening stage: who may reply, with which metrics and which integer entries, before any decoding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from flwr.app import Message

from fedquant.metrics.bandwidth import RoundTraffic
from fedquant.strategies.admission import (
    REASON_DUPLICATE,
    REASON_NON_FLOAT,
    REASON_UNEXPECTED,
    REASON_WEIGHT,
    AdmissionRules,
    single_metric_record,
)
from fedquant.strategies.influence import InfluenceBounds
from fedquant.strategies.metric_screen import MetricSchema, check_record, vote_schema
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.stages.state import TrainRound, reject


class Screening(RoundStage):
    """Drops replies from unexpected or repeated nodes, with metrics off the round's schema, with
    outlying weights, or with bad integer and bool entries (the cheap rules, cheapest first)."""

    def __init__(self, admission: AdmissionRules, weight_key: str, bounds: InfluenceBounds) -> None:
        self.admission = admission
        self._weight_key = weight_key
        self.bounds = bounds

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Fill ``state.screened`` (node id -> reply, in arrival order) and ``state.schema``."""
        server_round, traffic = state.server_round, state.traffic
        content_replies = [r for r in replies if not r.has_error()]
        screened, state.schema = self.screen(server_round, content_replies, state.sent, "train", traffic)
        state.screened, clipped = self.bounds.screen_non_float(
            {r.metadata.src_node_id: r for r in screened},
            state.received,
            lambda node_id, problem: reject(server_round, node_id, problem, traffic),
        )
        traffic.clipped_reasons += [REASON_NON_FLOAT] * clipped

    def screen(
        self,
        server_round: int,
        content_replies: list[Message],
        expected: Container[int] | None,
        kind: str,
        traffic: RoundTraffic | None,
    ) -> tuple[list[Message], MetricSchema | None]:
        """The replies whose sender and metrics pass the admission rules, and the round's metric schema.

        A reply from a node not in ``expected`` (None: any node) or from a node that replied more
        than once is dropped, as is one whose MetricRecord fails
        :func:`~fedquant.strategies.metric_screen.check_record` against the schema the expected
        nodes' replies vote (:func:`~fedquant.strategies.metric_screen.vote_schema`).
        """
        rules, weight_key = self.admission, self._weight_key
        copies = Counter(r.metadata.src_node_id for r in content_replies)
        peers = [
            single_metric_record(r.content)
            for r in content_replies
            if (expected is None or r.metadata.src_node_id in expected) and copies[r.metadata.src_node_id] == 1
        ]
        schema = vote_schema(peers, weight_key, rules)
        seen: set[int] = set()
        passed = []
        for reply in content_replies:
            node_id = reply.metadata.src_node_id
            if expected is not None and node_id not in expected:
                problem = (REASON_UNEXPECTED, f"the node was not sent a {kind} message this round")
            elif node_id in seen or (rules.reject_duplicates and copies[node_id] > 1):
                problem = (REASON_DUPLICATE, f"the node sent {copies[node_id]} {kind} replies this round")
            else:
                problem = check_record(single_metric_record(reply.content), schema, weight_key, rules)
            seen.add(node_id)
            if problem is None:
                passed.append(reply)
            else:
                reject(server_round, node_id, problem, traffic)
        outliers = self.bounds.screen_weights({id(r): single_metric_record(r.content) for r in passed}, kind)
        for reply in [r for r in passed if id(r) in outliers]:
            reject(server_round, reply.metadata.src_node_id, (REASON_WEIGHT, outliers[id(reply)]), traffic)
        return [r for r in passed if id(r) not in outliers], schema
