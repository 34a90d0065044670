"""Bandwidth accounting and per-round history export (JSON + CSV)."""

from fedquant.metrics.bandwidth import (
    BITS_PER_PARAM,
    COMPRESSION_RATIO,
    CUMULATIVE_UPLINK_BYTES,
    DOWNLINK_BYTES,
    DOWNLINK_BYTES_DENSE,
    DOWNLINK_COMPRESSION_RATIO,
    DOWNLINK_MSE,
    QUANTIZATION_MSE,
    REJECTED_REPLIES,
    SIMULATED_UPLOAD_SECONDS,
    UPLINK_BYTES,
    UPLINK_BYTES_DENSE,
    content_bytes,
    dense_float32_bytes,
)
from fedquant.metrics.history import HistoryRecorder, result_rows
from fedquant.metrics.message_bytes import message_bytes, messages_bytes

__all__ = [
    "BITS_PER_PARAM",
    "COMPRESSION_RATIO",
    "CUMULATIVE_UPLINK_BYTES",
    "DOWNLINK_BYTES",
    "DOWNLINK_BYTES_DENSE",
    "DOWNLINK_COMPRESSION_RATIO",
    "DOWNLINK_MSE",
    "QUANTIZATION_MSE",
    "REJECTED_REPLIES",
    "SIMULATED_UPLOAD_SECONDS",
    "UPLINK_BYTES",
    "UPLINK_BYTES_DENSE",
    "HistoryRecorder",
    "content_bytes",
    "dense_float32_bytes",
    "message_bytes",
    "messages_bytes",
    "result_rows",
]
