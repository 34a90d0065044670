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


@njit(cache=True)
def _nearest(z, m, bounds, k):
    """``k[i]`` = number of ``bounds`` strictly below ``z[i]`` (``torch.bucketize``), ``i < m``.

    Counted boundary by boundary over the whole bucket in uint8 lanes: the inner loop vectorizes,
    which measured faster than a per-coordinate binary search up to 256 levels.
    """
    for i in range(m):
        k[i] = 0
    for j in range(bounds.size):
        t = bounds[j]
        for i in range(m):
            k[i] += np.uint8(t < z[i])


@njit(cache=True)
def _dot_f64(centroids, k, x, lo, m):
    """``sum(centroids[k[i]] * x[lo + i])`` over ``i < m`` in float64, eight lanes as in ``_sum_f64``."""
    acc = np.zeros(8, np.float64)
    full = m // 8
    for g in range(full):
        for j in range(8):
            i = 8 * g + j
            acc[j] += centroids[k[i]] * np.float64(x[lo + i])
    for j in range(m - 8 * full):
        i = 8 * full + j
        acc[j] += centroids[k[i]] * np.float64(x[lo + i])
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


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
        z = np.empty(d, np.float64)
        k = np.empty(d, np.uint8)
        for lo in range(start, stop, d):
            m = min(d, stop - lo)
            b = lo // d
            s = _sum_f64(x, lo, lo + m, True)
            sq[b] = s
            norm = np.sqrt(m / s) if s > 0 else 0.0
            for i in range(m):
                z[i] = np.float64(x[lo + i]) * norm
            _nearest(z, m, bounds, k)
            codes[lo - start : lo - start + m] = k[:m]
            dot[b] = _dot_f64(centroids, k, x, lo, m)
        if pack:
            pack_into(codes, stop - start, width, out, start // 8 * width)
        else:
            out[start:stop] = codes


@parallel_kernel(count_arg=1)
def dequantize(data, numel, d, scales, centroids, width, packed, out):
    """``centroids[index] * scales[bucket]`` (float32) into ``out``; returns the count of indices
    ``>= centroids.size`` (their values are not meaningful: the caller refuses the payload).

    ``data`` holds the indices packed at ``width`` bits (``packed``; the caller checked its size)
    or one uint8 per coordinate.
    """
    top = centroids.size - 1
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
        over = 0
        for i in range(stop - start):
            over += codes[i] > top
        bad += over
        for lo in range(start, stop, d):
            scale = scales[lo // d]
            seg = codes[lo - start : min(lo + d, stop) - start]
            dst = out[lo : lo + seg.size]
            for i in range(seg.size):
                dst[i] = centroids[min(seg[i], top)] * scale
    return bad
