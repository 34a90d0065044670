"""Numba kernels for the CPU path of the distribution-aware codecs (ORQ, Linear, BinGrad).

Each kernel is the per-bucket loop of an algorithm in :mod:`fedquant.codecs.levels` or
:mod:`fedquant.codecs.rounding`, with the same arithmetic (float64 prefix sums accumulated in
order, the same formulas and tie rules), so both paths select the same levels and the same
indices; ``tests/test_orq.py`` and ``tests/test_bingrad.py`` check this. The torch functions are
the CUDA path; on the CPU a batched ``torch.sort`` of 25M values alone takes longer than the whole
encode budget, hence these kernels (one bucket per parallel iteration, sorted in cache).

Random numbers are :func:`fedquant.rng.uniform` computed inline: element ``i`` of the flattened
tensor uses ``splitmix64(key + (i + 1) * GOLDEN_GAMMA) >> 40`` times ``2**-24``.

Index packing follows :func:`fedquant.wire.bitpack.pack_bits` bit for bit (LSB first, ``width``
bits per value, zero padding): groups of 8 values fill exactly ``width`` bytes, so groups are
packed and unpacked in parallel.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from fedquant.codecs.kernels.common import PARALLEL_MIN, uniform24
from fedquant.wire.body import require_items


@njit(inline="always")
def _uniform_at(key, i):
    # The 24-bit variate is exact in float32 and float64 alike.
    return np.float64(uniform24(key, i))


@njit(inline="always")
def _sorted_bucket(x, start, end):
    """A sorted copy of ``x[start:end]``: LSD radix sort on order-preserving uint32 keys.

    Four passes of 8 bits; about five times faster than ``np.sort`` on 512 values. ``-0.0``
    sorts before ``0.0`` (they compare equal, so either order is a valid sort).
    """
    m = end - start
    keys = x[start:end].view(np.uint32).copy()
    for i in range(m):
        k = keys[i]
        keys[i] = ~k if (k >> np.uint32(31)) else (k | np.uint32(0x80000000))
    spare = np.empty(m, np.uint32)
    count = np.empty(256, np.int64)
    src = keys
    dst = spare
    for shift in range(0, 32, 8):
        sh = np.uint32(shift)
        count[:] = 0
        for i in range(m):
            count[(src[i] >> sh) & np.uint32(255)] += 1
        total = 0
        for c in range(256):
            t = count[c]
            count[c] = total
            total += t
        for i in range(m):
            digit = (src[i] >> sh) & np.uint32(255)
            dst[count[digit]] = src[i]
            count[digit] += 1
        src, dst = dst, src
    for i in range(m):
        k = src[i]
        src[i] = (k & np.uint32(0x7FFFFFFF)) if (k >> np.uint32(31)) else ~k
    return src.view(np.float32)


@njit(inline="always")
def _prefix(w):
    m = w.size
    p = np.empty(m + 1, np.float64)
    acc = 0.0
    p[0] = 0.0
    for i in range(m):
        acc += np.float64(w[i])
        p[i + 1] = acc
    return p


# ---------------------------------------------------------------- per-bucket bodies
@njit(cache=True)
def _orq_bucket(x, b, d, s, tree_lo, tree_mid, tree_hi, out):
    start = b * d
    w = _sorted_bucket(x, start, min(start + d, x.size))
    m = w.size
    p = _prefix(w)
    idx = np.empty(s, np.int64)
    idx[0] = 0
    idx[s - 1] = m - 1
    for t in range(tree_mid.size):
        il = idx[tree_lo[t]]
        ir = idx[tree_hi[t]]
        a = np.float64(w[il])
        c = np.float64(w[ir])
        spread = c - a
        pos = il
        if spread > 0:
            count = np.float64(ir - il + 1)
            total = p[ir + 1] - p[il]
            j = np.int64(np.ceil((count * c - total) / spread))
            pos = min(max(il + j - 1, il), ir)
        idx[tree_mid[t]] = pos
    for k in range(s):
        out[b, k] = w[idx[k]]


@njit(cache=True)
def _linear_bucket(x, b, d, s, out):
    start = b * d
    w = _sorted_bucket(x, start, min(start + d, x.size))
    m = w.size
    for k in range(s):
        out[b, k] = w[max((k * m + (s - 2)) // (s - 1) - 1, 0)]


@njit(cache=True)
def _two_means_bucket(x, b, d, out):
    start = b * d
    w = _sorted_bucket(x, start, min(start + d, x.size))
    m = w.size
    if m < 2:
        out[b, 0] = w[0]
        out[b, 1] = w[0]
        return
    p = _prefix(w)
    mean = p[m] / m
    best = 1
    best_score = -1.0
    for j in range(1, m):
        jf = np.float64(j)
        centred = p[j] - jf * mean
        score = centred * centred / (jf * np.float64(m - j))
        if score > best_score:
            best_score = score
            best = j
    out[b, 0] = np.float32(p[best] / np.float64(best))
    out[b, 1] = np.float32((p[m] - p[best]) / np.float64(m - best))


@njit(inline="always")
def _count_le(w, v):
    lo = 0
    hi = w.size
    while lo < hi:
        mid = (lo + hi) // 2
        if w[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(inline="always")
def _pb_slope(p, pk, k, j, b, b1):
    return 2.0 * (np.float64(j) * b - p[j]) - np.float64(k - j) * b1 + (pk - p[j])


@njit(inline="always")
def _pb_right_end(w, k, j, b1):
    if j < k:
        return np.float64(w[j])
    return b1


@njit(inline="always")
def _pb_update_low(w, p, b1_32):
    k = _count_le(w, b1_32)
    pk = p[k]
    b1 = np.float64(b1_32)
    lo = 1
    hi = k
    while lo < hi:
        mid = (lo + hi) // 2
        if _pb_slope(p, pk, k, mid, _pb_right_end(w, k, mid, b1), b1) >= 0:
            hi = mid
        else:
            lo = mid + 1
    j = lo
    stationary = (3.0 * p[j] + np.float64(k - j) * b1 - pk) / (2.0 * np.float64(j))
    left = np.float64(w[j - 1])
    return np.float32(min(max(stationary, left), _pb_right_end(w, k, j, b1)))


@njit(cache=True)
def _pb_bucket(x, b, d, max_sweeps, out):
    start = b * d
    w = _sorted_bucket(x, start, min(start + d, x.size))
    m = w.size
    wr = np.empty(m, np.float32)
    for i in range(m):
        wr[i] = -w[m - 1 - i]
    p = _prefix(w)
    pr = _prefix(wr)
    b0 = w[(m - 1) // 4]
    b1 = w[(3 * (m - 1)) // 4]
    for _ in range(max_sweeps):
        nb0 = _pb_update_low(w, p, b1)
        nb1 = -_pb_update_low(wr, pr, -nb0)
        done = nb0 == b0 and nb1 == b1
        b0 = nb0
        b1 = nb1
        if done:
            break
    out[b, 0] = b0
    out[b, 1] = b1


@njit(cache=True)
def _random_round_bucket(x, levels, b, d, key, out):
    # Two passes that LLVM vectorizes: the interval index of every value (a count over the
    # interior levels), then the random decision. Element i moves up iff u_i (hi - lo) < v - lo,
    # in float64, exactly as in rounding.random_round.
    s = levels.shape[1]
    row = levels[b]
    start = b * d
    end = min(start + d, x.size)
    xs = x[start:end]
    k = np.zeros(end - start, np.int64)
    for q in range(1, s - 1):
        level = row[q]
        for i in range(k.size):
            k[i] += 1 if xs[i] >= level else 0
    top = max(s - 2, 0)
    for i in range(k.size):
        kk = min(k[i], top)
        lo = np.float64(row[kk])
        gap = np.float64(row[min(kk + 1, s - 1)]) - lo
        out[start + i] = kk + (1 if _uniform_at(key, start + i) * gap < np.float64(xs[i]) - lo else 0)


@njit(cache=True)
def _nearest_bucket(x, levels, b, d, out):
    mid = (np.float64(levels[b, 0]) + np.float64(levels[b, 1])) * 0.5
    for i in range(b * d, min(b * d + d, x.size)):
        out[i] = 1 if np.float64(x[i]) >= mid else 0


@njit(cache=True)
def _pack_group(values, width, g, out):
    n = values.size
    acc = np.uint64(0)
    base = g * 8
    for j in range(min(8, n - base)):
        acc |= np.uint64(values[base + j]) << np.uint64(j * width)
    first = g * width
    for q in range(min(width, out.size - first)):
        out[first + q] = np.uint8((acc >> np.uint64(8 * q)) & np.uint64(255))


@njit(inline="always")
def _group_bits(data, width, g):
    first = g * width
    acc = np.uint64(0)
    for q in range(min(width, data.size - first)):
        acc |= np.uint64(data[first + q]) << np.uint64(8 * q)
    return acc


@njit(cache=True)
def _unpack_group(data, width, g, out):
    acc = _group_bits(data, width, g)
    mask = np.uint64((1 << width) - 1)
    base = g * 8
    for j in range(min(8, out.size - base)):
        out[base + j] = np.uint8((acc >> np.uint64(j * width)) & mask)


@njit(cache=True)
def _decode_block(data, width, flat_levels, s, d, first_group, end_group, out):
    # Groups [first_group, end_group); the bucket row advances incrementally (no division per element).
    mask = np.uint64((1 << width) - 1)
    bad = 0
    i = first_group * 8
    row = (i // d) * s
    boundary = (i // d + 1) * d
    for g in range(first_group, end_group):
        acc = _group_bits(data, width, g)
        for j in range(min(8, out.size - g * 8)):
            if i == boundary:
                row += s
                boundary += d
            k = np.int64((acc >> np.uint64(j * width)) & mask)
            if k < s:
                out[i] = flat_levels[row + k]
            else:
                out[i] = 0.0
                bad += 1
            i += 1
    return bad


DECODE_BLOCK_GROUPS = 2048


# ---------------------------------------------------------------- loops: parallel and serial


@njit(cache=True, parallel=True)
def _orq_par(x, d, s, tl, tm, th, out):
    for b in prange(out.shape[0]):
        _orq_bucket(x, b, d, s, tl, tm, th, out)


@njit(cache=True)
def _orq_seq(x, d, s, tl, tm, th, out):
    for b in range(out.shape[0]):
        _orq_bucket(x, b, d, s, tl, tm, th, out)


@njit(cache=True, parallel=True)
def _linear_par(x, d, s, out):
    for b in prange(out.shape[0]):
        _linear_bucket(x, b, d, s, out)


@njit(cache=True)
def _linear_seq(x, d, s, out):
    for b in range(out.shape[0]):
        _linear_bucket(x, b, d, s, out)


@njit(cache=True, parallel=True)
def _two_means_par(x, d, out):
    for b in prange(out.shape[0]):
        _two_means_bucket(x, b, d, out)


@njit(cache=True)
def _two_means_seq(x, d, out):
    for b in range(out.shape[0]):
        _two_means_bucket(x, b, d, out)


@njit(cache=True, parallel=True)
def _pb_par(x, d, max_sweeps, out):
    for b in prange(out.shape[0]):
        _pb_bucket(x, b, d, max_sweeps, out)


@njit(cache=True)
def _pb_seq(x, d, max_sweeps, out):
    for b in range(out.shape[0]):
        _pb_bucket(x, b, d, max_sweeps, out)


@njit(cache=True, parallel=True)
def _random_round_par(x, levels, d, key, out):
    for b in prange(levels.shape[0]):
        _random_round_bucket(x, levels, b, d, key, out)


@njit(cache=True)
def _random_round_seq(x, levels, d, key, out):
    for b in range(levels.shape[0]):
        _random_round_bucket(x, levels, b, d, key, out)


@njit(cache=True, parallel=True)
def _nearest_par(x, levels, d, out):
    for b in prange(levels.shape[0]):
        _nearest_bucket(x, levels, b, d, out)


@njit(cache=True)
def _nearest_seq(x, levels, d, out):
    for b in range(levels.shape[0]):
        _nearest_bucket(x, levels, b, d, out)


@njit(cache=True, parallel=True)
def _pack_par(values, width, out):
    for g in prange((values.size + 7) // 8):
        _pack_group(values, width, g, out)


@njit(cache=True)
def _pack_seq(values, width, out):
    for g in range((values.size + 7) // 8):
        _pack_group(values, width, g, out)


@njit(cache=True, parallel=True)
def _unpack_par(data, width, out):
    for g in prange((out.size + 7) // 8):
        _unpack_group(data, width, g, out)


@njit(cache=True)
def _unpack_seq(data, width, out):
    for g in range((out.size + 7) // 8):
        _unpack_group(data, width, g, out)


@njit(cache=True, parallel=True)
def _decode_par(data, width, flat_levels, s, d, out):
    groups = (out.size + 7) // 8
    blocks = (groups + DECODE_BLOCK_GROUPS - 1) // DECODE_BLOCK_GROUPS
    bad = 0
    for blk in prange(blocks):
        first = blk * DECODE_BLOCK_GROUPS
        bad += _decode_block(data, width, flat_levels, s, d, first, min(first + DECODE_BLOCK_GROUPS, groups), out)
    return bad


@njit(cache=True)
def _decode_seq(data, width, flat_levels, s, d, out):
    return _decode_block(data, width, flat_levels, s, d, 0, (out.size + 7) // 8, out)


def _levels_out(n: int, d: int, s: int) -> np.ndarray:
    return np.empty(((n + d - 1) // d, s), np.float32)


# ---------------------------------------------------------------- public entry points
def orq_levels(x: np.ndarray, d: int, s: int, tree_lo, tree_mid, tree_hi) -> np.ndarray:
    """ORQ-s levels of every bucket of ``x`` (see :func:`fedquant.codecs.levels.orq_levels`)."""
    out = _levels_out(x.size, d, s)
    (_orq_par if x.size >= PARALLEL_MIN else _orq_seq)(x, d, s, tree_lo, tree_mid, tree_hi, out)
    return out


def linear_levels(x: np.ndarray, d: int, s: int) -> np.ndarray:
    """Linear-s levels (see :func:`fedquant.codecs.levels.linear_levels`)."""
    out = _levels_out(x.size, d, s)
    (_linear_par if x.size >= PARALLEL_MIN else _linear_seq)(x, d, s, out)
    return out


def two_means_levels(x: np.ndarray, d: int) -> np.ndarray:
    """BinGrad-b levels (see :func:`fedquant.codecs.levels.two_means_levels`)."""
    out = _levels_out(x.size, d, 2)
    (_two_means_par if x.size >= PARALLEL_MIN else _two_means_seq)(x, d, out)
    return out


def partially_biased_levels(x: np.ndarray, d: int, max_sweeps: int) -> np.ndarray:
    """BinGrad-pb levels (see :func:`fedquant.codecs.levels.partially_biased_levels`)."""
    out = _levels_out(x.size, d, 2)
    (_pb_par if x.size >= PARALLEL_MIN else _pb_seq)(x, d, max_sweeps, out)
    return out


def random_round(x: np.ndarray, levels: np.ndarray, d: int, key: np.uint64) -> np.ndarray:
    """Unbiased random rounding indices (see :func:`fedquant.codecs.rounding.random_round`)."""
    out = np.empty(x.size, np.uint8)
    (_random_round_par if x.size >= PARALLEL_MIN else _random_round_seq)(x, levels, d, np.uint64(key), out)
    return out


def nearest_of_two(x: np.ndarray, levels: np.ndarray, d: int) -> np.ndarray:
    """Deterministic two-level indices (see :func:`fedquant.codecs.rounding.nearest_of_two`)."""
    out = np.empty(x.size, np.uint8)
    (_nearest_par if x.size >= PARALLEL_MIN else _nearest_seq)(x, levels, d, out)
    return out


def pack_indices(values: np.ndarray, width: int) -> np.ndarray:
    """``fedquant.wire.bitpack.pack_bits(values, width)`` for uint8 values and ``width <= 8``."""
    out = np.zeros((values.size * width + 7) // 8, np.uint8)
    (_pack_par if values.size >= PARALLEL_MIN else _pack_seq)(values, width, out)
    return out


def unpack_indices(data: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_indices` (``data`` must hold exactly the packed size)."""
    require_items(data, (count * width + 7) // 8, "packed level indices")
    out = np.empty(count, np.uint8)
    (_unpack_par if count >= PARALLEL_MIN else _unpack_seq)(data, width, out)
    return out


def decode_levels(data: np.ndarray, width: int, levels: np.ndarray, d: int, count: int) -> tuple[np.ndarray, int]:
    """Unpack indices and gather ``levels[i // d, index]``; also counts indices ``>= s``.

    ``data`` must hold exactly ``ceil(count * width / 8)`` bytes (the caller checks).

    Returns
    -------
    (np.ndarray, int)
        float32 values (a bad index decodes to 0) and the number of out-of-range indices.
    """
    require_items(data, (count * width + 7) // 8, "packed level indices")
    require_items(levels, -(-count // d), "per-bucket levels")
    out = np.empty(count, np.float32)
    flat_levels = np.ascontiguousarray(levels).reshape(-1)
    run = _decode_par if count >= PARALLEL_MIN else _decode_seq
    bad = run(data, width, flat_levels, levels.shape[1], d, out)
    return out, int(bad)
