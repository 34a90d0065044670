"""Aggregation stage: the admitted replies, weights bounded by the rules, handed to the inner strategy under a guard."""

from __future__ import annotations

from logging import WARNING

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedquant.metrics.bandwidth import AGGREGATION_FAILED, ZERO_NORM_DROPPED
from fedquant.strategies.admission import Admission
from fedquant.strategies.admission.rules.base import Admitted
from fedquant.strategies.admission.rules.metrics import clamp_metrics, single_metric_record
from fedquant.strategies.dtypes import restore_dtypes
from fedquant.strategies.fedavg_mean import aggregates_like_fedavg, fedavg_weights, weighted_mean, without_arrays
from fedquant.strategies.inner_guard import guarded_train, without_zero_norm_updates
from fedquant.strategies.reply_decoder import decode_threads, float_update
from fedquant.strategies.round import LOG_PREFIX, TrainRound
from fedquant.strategies.stages.base import RoundStage


class Aggregation(RoundStage):
    """Runs the wrapped strategy's ``aggregate_train`` on the survivors; fills ``state.arrays`` and
    ``state.inner_metrics``. If no reply survived, the round returns no arrays (the model is kept).

    An inner strategy that aggregates as FedAvg does gets the replies without their arrays and
    its arrays are the weighted mean of the decoded updates (:mod:`~fedquant.strategies.fedavg_mean`);
    any other gets every reply rebuilt as dense arrays, ``received + update``.
    """

    def __init__(self, strategy: Strategy, admission: Admission) -> None:
        self.strategy = strategy
        self.admission = admission
        self.from_updates = aggregates_like_fedavg(strategy)

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Bound the weights, drop zero-norm updates, aggregate, restore dtypes, clamp the metrics."""
        server_round, admitted, vote = state.server_round, state.admitted, state.vote
        records = [single_metric_record(r.content) for r in admitted]
        nodes = [r.metadata.src_node_id for r in admitted]

        def updates() -> list:
            return [
                float_update(state.decoded[id(r)], state.received(n), deferred=True)
                for r, n in zip(admitted, nodes, strict=True)
            ]

        state.traffic.clipped_reasons += self.admission.weigh(vote, Admitted("train", records, nodes, updates))
        failed = [r for r in replies if r.has_error()]
        if not admitted:
            log(WARNING, "%s: round %s: no reply survived; keeping the current model", LOG_PREFIX, server_round)
            return
        if self.from_updates:
            arrays, metrics = self._mean_of_updates(state, failed)
        else:
            for reply in admitted:
                decoded = state.decoded.pop(id(reply))
                reply.content[decoded.record_name] = decoded.dense(state.received(reply.metadata.src_node_id))
            survivors, state.zero_dropped = without_zero_norm_updates(self.strategy, failed + admitted, state.model)
            arrays, metrics, state.failed = guarded_train(self.strategy, server_round, survivors)
        state.decoded.clear()
        vote.take_consensus()
        vote.sums = None
        state.arrays = restore_dtypes(arrays, state.dtypes)
        rules, weight_key = self.admission.settings, self.admission.weight_key
        state.inner_metrics = clamp_metrics(metrics, records, vote.schema, rules.metric_trim, weight_key)

    def _mean_of_updates(
        self, state: TrainRound, failed: list[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner FedAvg's metrics of the replies (their arrays left out) and the weighted mean of their updates."""
        admitted = state.admitted
        light = failed + [without_arrays(r) for r in admitted]
        arrays, metrics, state.failed = guarded_train(self.strategy, state.server_round, light)
        if arrays is None:
            return None, metrics
        weights, total = fedavg_weights(admitted, self.strategy.weighted_by_key)
        shares = [w / total for w in weights]
        decoded = [state.decoded[id(r)] for r in admitted]
        received = [state.received(r.metadata.src_node_id) for r in admitted]
        running = None if state.vote.sums is None else state.vote.sums.weighted_sum_of(decoded, weights)
        summed, divisor = (None, total) if running is None else running
        # the consensus buffers (float64) the rules are done with hold the mean's sums
        scratch = state.vote.take_consensus()
        with decode_threads(len(state.sent)):
            return weighted_mean(decoded, received, shares, scratch, summed, divisor), metrics

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """Whether the inner strategy failed, and how many zero-norm updates it was spared."""
        return {AGGREGATION_FAILED: int(state.failed), ZERO_NORM_DROPPED: state.zero_dropped}
