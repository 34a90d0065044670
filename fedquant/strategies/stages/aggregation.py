"""Aggregation stage: the admitted replies, weights bounded, handed to the inner strategy under a guard."""

from __future__ import annotations

from logging import WARNING

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedquant.metrics.bandwidth import AGGREGATION_FAILED, ZERO_NORM_DROPPED
from fedquant.strategies.admission import REASON_DRIFT, REASON_WEIGHT, AdmissionRules, single_metric_record
from fedquant.strategies.drift import DriftLedger
from fedquant.strategies.fedavg_mean import aggregates_like_fedavg, fedavg_weights, weighted_mean, without_arrays
from fedquant.strategies.influence import InfluenceBounds
from fedquant.strategies.inner_guard import guarded_train, without_zero_norm_updates
from fedquant.strategies.metric_screen import clamp_metrics, weights_of, write_weights
from fedquant.strategies.reply_decoder import decode_threads
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.stages.state import LOG_PREFIX, TrainRound
from fedquant.strategies.update_bounds import float_update, restore_dtypes


class Aggregation(RoundStage):
    """Runs the wrapped strategy's ``aggregate_train`` on the survivors; fills ``state.arrays`` and
    ``state.inner_metrics``. If no reply survived, the round returns no arrays (the model is kept).

    An inner strategy that aggregates as FedAvg does gets the replies without their arrays and
    its arrays are the weighted mean of the decoded updates (:mod:`~fedquant.strategies.fedavg_mean`);
    any other gets every reply rebuilt as dense arrays, ``received + update``.
    """

    def __init__(
        self, strategy: Strategy, admission: AdmissionRules, weight_key: str, bounds: InfluenceBounds, seed: int = 0
    ) -> None:
        self.strategy = strategy
        self.admission = admission
        self._weight_key = weight_key
        self.bounds = bounds
        self.from_updates = aggregates_like_fedavg(strategy)
        rule = admission.cross_round
        self.drift = None if rule is None else DriftLedger(rule, seed)

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Bound the weights, drop zero-norm updates, aggregate, restore dtypes, clamp the metrics."""
        server_round, admitted, schema = state.server_round, state.admitted, state.schema
        records = [single_metric_record(r.content) for r in admitted]
        clipped = self.bounds.bound_weights(records, "train")
        state.traffic.clipped_reasons += [REASON_WEIGHT] * clipped
        state.traffic.clipped_reasons += [REASON_DRIFT] * self._bound_drift(state, records)
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
        state.scratch.clear()
        state.vote_sums = None
        state.arrays = restore_dtypes(arrays, state.dtypes)
        state.inner_metrics = clamp_metrics(metrics, records, schema, self.admission.metric_trim, self._weight_key)

    def _bound_drift(self, state: TrainRound, records: list) -> int:
        """Lower the weights the cross-round rule bounds (:mod:`~fedquant.strategies.drift`); how many."""
        weights = weights_of(records, self._weight_key)
        if self.drift is None or weights is None or len(weights) < 2:
            return 0
        nodes = [r.metadata.src_node_id for r in state.admitted]
        updates = [
            float_update(state.decoded[id(r)], state.received(n), deferred=True)
            for r, n in zip(state.admitted, nodes, strict=True)
        ]
        return write_weights(records, self._weight_key, self.drift.bound(nodes, updates, weights))

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
        running = None if state.vote_sums is None else state.vote_sums.weighted_sum_of(decoded, weights)
        summed, divisor = (None, total) if running is None else running
        with decode_threads(len(state.sent)):
            return weighted_mean(decoded, received, shares, state.scratch, summed, divisor), metrics

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """Whether the inner strategy failed, and how many zero-norm updates it was spared."""
        return {AGGREGATION_FAILED: int(state.failed), ZERO_NORM_DROPPED: state.zero_dropped}
