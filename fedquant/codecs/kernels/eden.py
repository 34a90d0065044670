"""Numba CPU kernels of EDEN (:mod:`fedquant.codecs.quantizers.eden`), integer bits.

The torch twin stays next to its caller in the quantizer module (the CUDA path, and CPU with
``force_torch=True``). Both compute, per bucket of ``d`` coordinates: the float64 sum of squares
``sq``, the normalization ``sqrt(count / sq)`` (0 for a zero bucket), the index of the nearest
Lloyd–Max centroid of each normalized coordinate (``torch.bucketize`` semantics: the number of
boundaries strictly below it) and ``dot = sum(c * y)`` in float64. The float64 sums are taken in
a different order than torch's, so ``sq`` and ``dot`` may differ in their last bit; the indices
and the bfloat16 scales derived from them agree except with negligible probability.

Work is split in chunks of ``CHUNK`` coordinates; every bucket size of EDEN (64..512) divides
``CHUNK``, so a chunk holds whole buckets and its packed indices start on a byte boundary.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from fedquant.codecs.kernels.common import CHUNK, _sum_f64, pack_into, parallel_kernel, unpack_from


@njit(cache=True, inline="always")
def _bucketize(z, bounds):
    """Number of ``bounds`` (ascending) strictly below ``z``."""
    lo = 0
    hi = bounds.size
    while lo < hi:
        mid = (lo + hi) >> 1
        if bounds[mid] < z:
            lo = mid + 1
        else:
            hi = mid
    return lo


@parallel_kernel
def quantize(x, d, bounds, centroids, width, pack, out, sq, dot):
    """Centroid indices of float32 ``x`` and the per-bucket ``sq`` / ``dot`` (float64, written).

    ``out`` receives the indices packed at ``width`` bits (``pack``: ``packed_size(x.size, width)``
    bytes) or one uint8 per coordinate.
    """
    n = x.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        start = c * CHUNK
        stop = min(start + CHUNK, n)
        codes = np.empty(stop - start, np.uint8)
        for lo in range(start, stop, d):
            hi = min(lo + d, stop)
            b = lo // d
            s = _sum_f64(x, lo, hi, True)
            sq[b] = s
            norm = np.sqrt((hi - lo) / s) if s > 0 else 0.0
            acc = 0.0
            for i in range(lo, hi):
                y = np.float64(x[i])
                k = _bucketize(y * norm, bounds)
                codes[i - start] = k
                acc += centroids[k] * y
            dot[b] = acc
        if pack:
            pack_into(codes, stop - start, width, out, start // 8 * width)
        else:
            out[start:stop] = codes


@parallel_kernel(count_arg=1)
def dequantize(data, numel, d, scales, centroids, width, packed, out):
    """``centroids[index] * scales[bucket]`` (float32) into ``out``; returns the count of indices
    ``>= centroids.size`` (decoded as 0).

    ``data`` holds the indices packed at ``width`` bits (``packed``; the caller checked its size)
    or one uint8 per coordinate.
    """
    k = centroids.size
    chunks = (numel + CHUNK - 1) // CHUNK
    bad = 0
    for c in prange(chunks):
        start = c * CHUNK
        stop = min(start + CHUNK, numel)
        if packed:
            codes = np.empty(stop - start, np.uint8)
            unpack_from(data, start // 8 * width, stop - start, width, codes)
        else:
            codes = data[start:stop]
        for i in range(start, stop):
            j = codes[i - start]
            if j < k:
                out[i] = centroids[j] * scales[i // d]
            else:
                out[i] = 0.0
                bad += 1
    return bad
