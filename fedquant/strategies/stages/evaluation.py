"""The evaluate round: messages pass unchanged; replies go through the train round's admission rules."""

from __future__ import annotations

from flwr.app import Message, MetricRecord
from flwr.serverapp.strategy import Strategy

from fedquant.metrics.bandwidth import (
    ADMISSION_WARNINGS,
    AGGREGATION_FAILED,
    REJECTED_REPLIES,
    REJECTED_SHARE,
    clipped_reason_key,
)
from fedquant.strategies.admission import REASON_WEIGHT, Admission, Vote, warn_rejections
from fedquant.strategies.admission.rules.base import Admitted
from fedquant.strategies.admission.rules.metrics import clamp_metrics, conform, single_metric_record
from fedquant.strategies.inner_guard import guarded_evaluate
from fedquant.strategies.round import reject


class Evaluation:
    """Screens evaluate replies like train replies (sender, metrics, weights) and aggregates the survivors."""

    def __init__(self, strategy: Strategy, admission: Admission) -> None:
        self.strategy = strategy
        self.admission = admission

    def aggregate(self, server_round: int, replies: list[Message], asked: set[int] | None) -> MetricRecord | None:
        """The aggregated metrics of the replies that pass, with ``rejected-replies`` when any were dropped."""
        content_replies = [r for r in replies if not r.has_error()]
        vote = Vote("evaluate")
        admitted = self.admission.screen_replies(
            content_replies, asked, vote, lambda node_id, problem: reject(server_round, node_id, problem, None)
        )
        rules, schema = self.admission.settings, vote.schema
        records = [single_metric_record(r.content) for r in admitted]
        for record in records:
            conform(record, schema)
        nodes = [r.metadata.src_node_id for r in admitted]
        clipped = self.admission.weigh(vote, Admitted("evaluate", records, nodes, list)).count(REASON_WEIGHT)
        survivors = [r for r in replies if r.has_error()] + admitted
        dropped = len(content_replies) - len(admitted)
        metrics, failed = None, False
        if admitted:
            metrics, failed = guarded_evaluate(self.strategy, server_round, survivors)
            metrics = clamp_metrics(metrics, records, schema, rules.metric_trim, self.admission.weight_key)
        warned = warn_rejections(rules, server_round, "evaluate", dropped, len(content_replies))
        if dropped or clipped:
            metrics = MetricRecord() if metrics is None else metrics
            metrics[REJECTED_REPLIES] = dropped
            metrics[REJECTED_SHARE] = dropped / len(content_replies)
            metrics[clipped_reason_key(REASON_WEIGHT)] = clipped
            metrics[ADMISSION_WARNINGS] = warned
        if failed:
            metrics = MetricRecord() if metrics is None else metrics
            metrics[AGGREGATION_FAILED] = 1
        return metrics
