"""Bandwidth accounting: bytes that messages really carry, and their dense float32 equivalent.

All byte counts follow Flower's :meth:`flwr.app.ArrayRecord.count_bytes`: for every entry, the
length of the Array's ``data`` (for a NumPy Array that includes the ``.npy`` header) plus the
length of its key. Metadata strings (dtype, shape, stype) are not counted, the same for every
Array, compressed or not.

The per-round metrics :class:`~fedquant.strategies.QuantizedStrategy` adds to the train
MetricRecord:

``uplink-bytes``             bytes of the ArrayRecords of every reply that carried content,
                             accepted or rejected (what crossed the wire)
``uplink-bytes-dense``       the same replies as float32 ArrayRecords (what plain Flower would
                             have sent for a float32 model; for a float32 model it equals the
                             uplink of the unwrapped strategy)
``compression-ratio``        ``uplink-bytes-dense / uplink-bytes`` (0.0 without replies)
``bits-per-param``           ``8 * uplink-bytes / (replies * parameters)``, all overheads included
                             (codec envelope, unencoded small tensors, keys)
``downlink-bytes``           bytes of the ArrayRecords of the train messages sent
``downlink-bytes-dense``     the same messages' models as float32 ArrayRecords
``downlink-compression-ratio`` ``downlink-bytes-dense / downlink-bytes`` (1.0 without a downlink codec)
``downlink-mse``             mean over messages of the mean squared error of the model a client
                             rebuilds against the server's model (0.0 without a downlink codec)
``cumulative-uplink-bytes``  running sum of ``uplink-bytes`` over this strategy's rounds
``quantization-mse``         mean over accepted replies of the clients' own MSE measurement, clamped
                             into the window of their values (:mod:`fedquant.metrics.robust`) so
                             a few clients cannot move it; negative or non-finite reports are
                             ignored (absent when no client measured it)
``rejected-replies``         replies dropped from the aggregate
``rejected-<reason>``        of those, the ones dropped for each reason of
                             :mod:`fedquant.strategies.admission` (every reason, 0 when none)
``rejected-share``           ``rejected-replies`` over the replies that carried content (0.0 without)
``admission-warnings``       warnings the round logged: it rejected ``warn_rejected_share`` or more
                             of its replies, or its update norms split into two groups more than
                             ``norm_factor`` apart (the norm rule cannot tell which one is honest)
``zero-norm-dropped``        admitted updates whose norm computes as 0, left out before an inner
                             strategy that divides by update norms (Flower's server-side DP
                             clipping; :mod:`fedquant.strategies.inner_guard`), else 0
``aggregation-failed``       1 when the inner strategy's aggregation raised (logged; the round
                             keeps the model), else 0; in evaluate rounds only when it raised
``clipped-<reason>``         replies kept with a clipped weight (``num-examples``), update norm
                             (``update-norm``) or integer change (``non-float``)
``client-state-resets``      accepted replies whose client reset a non-finite error-feedback residual
``update-norm-median``       median L2 norm of the accepted decoded updates, and
``update-norm-max-ratio``    the largest of them over that median: the headroom under the
                             admission rule's ``norm_factor`` (absent without accepted replies)
``simulated-upload-seconds`` only with ``uplink_bandwidth``: max over replies of bytes / bandwidth
``encode-seconds``           mean client encode time (mod; bounded as ``quantization-mse``),
                             ``decode-seconds`` server decode time
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from flwr.app import ArrayRecord, RecordDict

from fedquant.metrics.robust import bounded_mean

# Exact metric keys the strategy adds to the train MetricRecord (see DESIGN.md).
UPLINK_BYTES = "uplink-bytes"
UPLINK_BYTES_DENSE = "uplink-bytes-dense"
COMPRESSION_RATIO = "compression-ratio"
BITS_PER_PARAM = "bits-per-param"
DOWNLINK_BYTES = "downlink-bytes"
DOWNLINK_BYTES_DENSE = "downlink-bytes-dense"
DOWNLINK_COMPRESSION_RATIO = "downlink-compression-ratio"
DOWNLINK_MSE = "downlink-mse"
CUMULATIVE_UPLINK_BYTES = "cumulative-uplink-bytes"
QUANTIZATION_MSE = "quantization-mse"
REJECTED_REPLIES = "rejected-replies"
REJECTED_SHARE = "rejected-share"
ADMISSION_WARNINGS = "admission-warnings"
ZERO_NORM_DROPPED = "zero-norm-dropped"
AGGREGATION_FAILED = "aggregation-failed"
CLIENT_STATE_RESETS = "client-state-resets"
SIMULATED_UPLOAD_SECONDS = "simulated-upload-seconds"
ENCODE_SECONDS = "encode-seconds"
DECODE_SECONDS = "decode-seconds"
UPDATE_NORM_MEDIAN = "update-norm-median"
UPDATE_NORM_MAX_RATIO = "update-norm-max-ratio"


def rejected_reason_key(reason: str) -> str:
    """The per-round metric that counts the replies dropped for ``reason``."""
    return f"rejected-{reason}"


def clipped_reason_key(reason: str) -> str:
    """The per-round metric that counts the replies kept with a value clipped for ``reason``."""
    return f"clipped-{reason}"


def content_bytes(content: RecordDict) -> int:
    """Bytes held by all ArrayRecords of a message's content (``count_bytes`` summed).

    Read from the content's items: Flower's ``content.array_records`` builds a view that writes
    every record back into the content (for each reply of every round)."""
    return sum(record.count_bytes() for record in content.values() if isinstance(record, ArrayRecord))


@lru_cache(maxsize=4096)
def _npy_header_bytes(descr: str, shape: tuple[int, ...]) -> int:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.tell()


def dense_float32_bytes(record: ArrayRecord) -> int:
    """What ``count_bytes()`` gives for ``record`` with every float tensor as float32.

    Non-float entries count as they are. This is the size of an uncompressed reply of a
    float32 model, the reference for ``compression-ratio``.
    """
    total = 0
    for key, array in record.items():
        shape = tuple(int(s) for s in array.shape)
        numel = math.prod(shape)
        if array.dtype in ("float16", "float32", "float64"):
            total += _npy_header_bytes("<f4", shape) + 4 * numel
        else:
            total += len(array.data)
        total += len(key)
    return total


def record_numel(record: ArrayRecord) -> int:
    """Total number of elements (parameters) in an ArrayRecord, from its metadata."""
    return sum(math.prod(int(s) for s in array.shape) for array in record.values())


@dataclass
class RoundTraffic:
    """Accumulates one round's traffic and turns it into the per-round metrics.

    Attributes
    ----------
    downlink_bytes : int
        Bytes of the train messages sent (all their ArrayRecords).
    downlink_dense_bytes : int
        Their models as float32 ArrayRecords.
    downlink_mse : list of float
        Per message, the mean squared error of the model the client rebuilds (0.0 when dense).
    downlink_bytes_of : dict of int to int
        Per node, the bytes of its train message.
    uplink_bytes : int
        Bytes of every reply that carried content (accepted or rejected).
    dense_bytes : int
        The same replies as float32 ArrayRecords.
    params : int
        Parameters in those replies (one model per reply).
    replies : int
        Replies that carried content.
    rejected_reasons : list of str
        One reason (see :mod:`fedquant.strategies.admission`) per reply dropped from the aggregate.
    clipped_reasons : list of str
        One reason per clipping of a reply kept in the aggregate.
    client_mse, client_encode_seconds : list of float
        What accepted replies reported (each checked finite and >= 0).
    client_state_resets : int
        Accepted replies whose client reset its error-feedback state.
    admission_warnings : int
        Warnings the admission rules logged this round.
    update_norms : list of float
        L2 norms of the accepted decoded updates.
    upload_seconds : list of float
        Per reply, bytes / the client's uplink bandwidth (only when bandwidths are given).
    """

    downlink_bytes: int = 0
    downlink_dense_bytes: int = 0
    downlink_mse: list[float] = field(default_factory=list)
    downlink_bytes_of: dict[int, int] = field(default_factory=dict)
    uplink_bytes: int = 0
    dense_bytes: int = 0
    params: int = 0
    replies: int = 0
    rejected_reasons: list[str] = field(default_factory=list)
    clipped_reasons: list[str] = field(default_factory=list)
    client_state_resets: int = 0
    admission_warnings: int = 0
    decode_seconds: float = 0.0
    client_mse: list[float] = field(default_factory=list)
    client_encode_seconds: list[float] = field(default_factory=list)
    upload_seconds: list[float] = field(default_factory=list)
    update_norms: list[float] = field(default_factory=list)

    def add_reply(self, reply_bytes: int, dense_bytes: int, params: int) -> None:
        """Count one reply that carried content."""
        self.uplink_bytes += reply_bytes
        self.dense_bytes += dense_bytes
        self.params += params
        self.replies += 1

    def metrics(
        self,
        cumulative_uplink_bytes: int,
        with_upload_seconds: bool,
        reasons: Iterable[str] = (),
        clip_reasons: Iterable[str] = (),
        trim: float = 0.0,
    ) -> dict[str, int | float]:
        """The round's metrics under their exact keys; ``rejected-<reason>`` / ``clipped-<reason>`` for each reason.

        ``compression-ratio`` and ``bits-per-param`` are 0.0 in a round without replies;
        ``quantization-mse`` and ``encode-seconds`` are left out when no accepted reply reported
        them (codecs that need side information cannot measure their error on the client); both
        are means clamped into the window of the clients' values (``trim``, see
        :mod:`fedquant.metrics.robust`).
        """
        out: dict[str, int | float] = {
            UPLINK_BYTES: self.uplink_bytes,
            UPLINK_BYTES_DENSE: self.dense_bytes,
            COMPRESSION_RATIO: self.dense_bytes / self.uplink_bytes if self.uplink_bytes else 0.0,
            BITS_PER_PARAM: 8.0 * self.uplink_bytes / self.params if self.params else 0.0,
            DOWNLINK_BYTES: self.downlink_bytes,
            DOWNLINK_BYTES_DENSE: self.downlink_dense_bytes,
            DOWNLINK_COMPRESSION_RATIO: (
                self.downlink_dense_bytes / self.downlink_bytes if self.downlink_bytes else 0.0
            ),
            DOWNLINK_MSE: float(np.mean(self.downlink_mse)) if self.downlink_mse else 0.0,
            CUMULATIVE_UPLINK_BYTES: cumulative_uplink_bytes,
            REJECTED_REPLIES: len(self.rejected_reasons),
            **{rejected_reason_key(reason): self.rejected_reasons.count(reason) for reason in reasons},
            REJECTED_SHARE: len(self.rejected_reasons) / self.replies if self.replies else 0.0,
            **{clipped_reason_key(reason): self.clipped_reasons.count(reason) for reason in clip_reasons},
            CLIENT_STATE_RESETS: self.client_state_resets,
            ADMISSION_WARNINGS: self.admission_warnings,
            DECODE_SECONDS: self.decode_seconds,
        }
        if self.client_mse:
            out[QUANTIZATION_MSE] = bounded_mean(self.client_mse, trim)
        if self.client_encode_seconds:
            out[ENCODE_SECONDS] = bounded_mean(self.client_encode_seconds, trim)
        if self.update_norms:
            median = float(np.median(self.update_norms))
            out[UPDATE_NORM_MEDIAN] = median
            out[UPDATE_NORM_MAX_RATIO] = max(self.update_norms) / median if median > 0 else 0.0
        if with_upload_seconds:
            out[SIMULATED_UPLOAD_SECONDS] = max(self.upload_seconds, default=0.0)
        return out
