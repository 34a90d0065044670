"""Arrival stage: count what every reply carried, before anything is checked or decoded."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Message, MetricRecord, RecordDict

from fedquant.metrics.bandwidth import content_bytes, dense_float32_bytes, record_numel
from fedquant.metrics.links import transfer_seconds
from fedquant.metrics.robust import finite, is_number
from fedquant.protocol import (
    CLIENT_METRICRECORD_NAME,
    METRIC_CLIENT_ENCODE_SECONDS,
    METRIC_CLIENT_MSE,
    METRIC_CLIENT_STATE_RESETS,
)
from fedquant.strategies.round import TrainRound
from fedquant.strategies.stages.base import RoundStage


class Arrival(RoundStage):
    """Uplink bytes of every reply that arrived (admitted or not), and the mod's own metrics taken out.

    With ``uplink_bandwidth`` (``node_id -> bytes per second``) it also times each upload.
    """

    def __init__(self, uplink_bandwidth: Callable[[int], float] | None) -> None:
        self.uplink_bandwidth = uplink_bandwidth

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Fill ``state.reply_bytes`` and ``state.client_metrics``; count the uplink traffic."""
        traffic = state.traffic
        content_replies = [r for r in replies if not r.has_error()]
        state.reply_bytes = {  # as they arrived: decoding replaces the payloads by dense arrays
            r.metadata.src_node_id: content_bytes(r.content)
            for r in content_replies
            if r.metadata.src_node_id in state.sent
        }
        state.client_metrics = {id(r): _pop_client_metrics(r.content) for r in content_replies}
        for reply in content_replies:  # every reply that arrived counts as uplink, admitted or not
            node_id = reply.metadata.src_node_id
            reply_bytes = content_bytes(reply.content)
            sent = state.sent.get(node_id)
            traffic.add_reply(
                reply_bytes,
                dense_float32_bytes(sent) if sent is not None else reply_bytes,
                record_numel(sent) if sent is not None else 0,
            )
            if self.uplink_bandwidth is not None and sent is not None:
                traffic.upload_seconds.append(transfer_seconds(reply_bytes, self.uplink_bandwidth(node_id)))
            state.bytes_of.setdefault(node_id, reply_bytes)


def _pop_client_metrics(content: RecordDict) -> tuple[float | None, float | None, bool]:
    """Take the mod's own entries out of the reply's MetricRecords: ``(mse, encode seconds, state reset)``.

    Done before the admission rules look at the metrics, so the inner strategy's metric keys are
    compared, not fedquant's. The values count only if the reply is accepted; a negative or
    non-finite MSE or time is ignored (no client measures one), and the round reports means
    clamped into the window of the accepted values.
    """
    mse = seconds = None
    reset = False
    metric_records = [(name, r) for name, r in content.items() if isinstance(r, MetricRecord)]  # no synced view
    for name, record in metric_records:
        if METRIC_CLIENT_MSE in record:
            mse = _non_negative(record.pop(METRIC_CLIENT_MSE))
        if METRIC_CLIENT_ENCODE_SECONDS in record:
            seconds = _non_negative(record.pop(METRIC_CLIENT_ENCODE_SECONDS))
        if METRIC_CLIENT_STATE_RESETS in record:
            reset = bool(_non_negative(record.pop(METRIC_CLIENT_STATE_RESETS)))
        if name == CLIENT_METRICRECORD_NAME and len(record) == 0:
            del content[name]
    return mse, seconds, reset


def _non_negative(value: object) -> float | None:
    if is_number(value) and finite(value) and value >= 0:  # type: ignore[operator]
        return float(value)  # type: ignore[arg-type]
    return None
