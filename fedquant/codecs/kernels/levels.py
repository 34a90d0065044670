"""Numba kernels of the per-bucket levels family (ORQ, Linear, BinGrad): the CPU path.

Level selection (:func:`select_levels`: runs of buckets in parallel, scratch allocated once per
run): :func:`orq_levels`, :func:`linear_levels`, :func:`two_means_levels`,
:func:`partially_biased_levels`. Buckets are sorted in cache, ``LANES`` full buckets at a time by
a bitonic sorting network over int32 keys with one bucket per vector lane
(:func:`_sorted_lanes`, about three times faster than the radix sort on 512 values); the rest
(a short last bucket, left-overs, buckets over ``NETWORK_MAX_D``) by a radix sort
(:func:`_sorted_bucket`). Both order the same keys, so they give the same bits, ``-0.0``
before ``0.0``. Each is the per-bucket loop of the batched torch function of
the same name in :mod:`fedquant.codecs.kernels.levels_torch` (the CUDA path), with the same
arithmetic (float64 prefix sums accumulated in order, the same formulas and tie rules), so both
paths select the same levels; ``tests/codecs/quantizers/test_orq.py`` and
``tests/codecs/quantizers/test_bingrad.py`` check this. On the CPU a batched ``torch.sort`` of
25M values alone takes longer than the whole encode budget, hence these kernels.

Rounding onto the levels and decoding work on chunks of ``CHUNK`` elements (a multiple of 8, so
every chunk starts on a byte boundary of the packed stream) and pack or unpack them with the
shared chunk packer of :mod:`fedquant.codecs.kernels.common` (LSB first, the layout of
:mod:`fedquant.wire.bitpack`): :func:`round_pack_into` encodes, :func:`unpack_gather_into` decodes; at
width 8 they write and read one byte per index, the unpacked symbols of the entropy coder.
Random numbers are :func:`fedquant.rng.uniform` computed inline
(:func:`~fedquant.codecs.kernels.common.hash24_run`, a chunk at a time), so the torch twin's ``random_round``
gives the same indices. Random rounding onto at most ``VECTOR_LEVELS`` (16) levels runs 16 values
at a time in an LLVM-IR intrinsic (:func:`_round16`): the bucket's row in one 512-bit register,
each value's interval by a branch-free binary search over it (``vpermps`` lookups), the float64
decision on two ``<8 x double>`` halves; the scalar ladder (:func:`_random_round_bucket`) takes
the fewer than 16 values at the end of each bucket's part of a chunk and two-level rows. Both give
the same index, the number of interior levels at or below the value (rows are non-decreasing).
At 25M elements on one thread, 16 levels: ``round_pack`` 62 -> 31 ms (the ladder, 14 compare
and select steps per value, did not fit the vector units' ports). Every kernel runs in parallel
from ``PARALLEL_MIN`` elements on (:func:`~fedquant.jit.twins.parallel_kernel`).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fedquant.codecs.kernels.common import (
    CHUNK,
    add_counts,
    c_array_of,
    count_table,
    group_chunks,
    hash24_run,
    pack_into,
    parallel_kernel,
    unpack_from,
)
from fedquant.jit import target
from fedquant.wire.bitpack import packed_size

#: Level selection runs over this many runs of buckets (each with its own scratch buffers).
BUCKET_GROUPS = 64
#: Buckets that the sorting network sorts together, one per lane of its rows.
LANES = 16
#: Largest bucket size sorted by the network (more rows cost more stages); larger ones go to the radix sort.
NETWORK_MAX_D = 1024
_U_SCALE64 = np.float64(2.0**-24)
_ZERO32 = np.float32(0.0)
_ONE32 = np.float32(1.0)


@njit(cache=True)
def _sorted_bucket(x, start, end, keys, spare, count):
    """``x[start:end]`` sorted, in ``keys`` or ``spare`` (scratch of at least ``end - start``): LSD radix sort.

    Order-preserving uint32 keys, four digits of 8 bits whose histograms are counted in one
    pass; a digit that is the same for the whole bucket needs no pass. ``-0.0`` sorts before
    ``0.0`` (they compare equal, so either order is a valid sort). ``count`` is scratch of 1024 int64.
    """
    m = end - start
    src = keys[:m]
    dst = spare[:m]
    raw = x[start:end].view(np.uint32)
    for i in range(m):
        k = raw[i]
        src[i] = ~k if (k >> np.uint32(31)) else (k | np.uint32(0x80000000))
    count[:] = 0
    for i in range(m):
        v = src[i]
        count[v & np.uint32(255)] += 1
        count[256 + ((v >> np.uint32(8)) & np.uint32(255))] += 1
        count[512 + ((v >> np.uint32(16)) & np.uint32(255))] += 1
        count[768 + (v >> np.uint32(24))] += 1
    for digit_pass in range(4):
        base = 256 * digit_pass
        sh = np.uint32(8 * digit_pass)
        if count[base + ((src[0] >> sh) & np.uint32(255))] == m:
            continue  # one value of this digit: the pass would not move anything
        total = 0
        for c in range(256):
            t = count[base + c]
            count[base + c] = total
            total += t
        for i in range(m):
            digit = base + ((src[i] >> sh) & np.uint32(255))
            dst[count[digit]] = src[i]
            count[digit] += 1
        src, dst = dst, src
    for i in range(m):
        k = src[i]
        src[i] = (k & np.uint32(0x7FFFFFFF)) if (k >> np.uint32(31)) else ~k
    return src.view(np.float32)


@njit(inline="always")
def _cx(a, b):
    return min(a, b), max(a, b)


@njit(inline="always")
def _half_clean(t, a0, b0, cnt, asc):
    """One compare-exchange stage: ``t[a0 + r]`` against ``t[b0 + r]`` for ``r < cnt``, minimum first if ``asc``."""
    ta = t[a0 : a0 + cnt]
    tb = t[b0 : b0 + cnt]
    if asc:
        for r in range(cnt):
            u = ta[r]
            v = tb[r]
            ta[r] = min(u, v)
            tb[r] = max(u, v)
    else:
        for r in range(cnt):
            u = ta[r]
            v = tb[r]
            ta[r] = max(u, v)
            tb[r] = min(u, v)


@njit(inline="always")
def _merge16(t, r0, asc):
    """The last four stages of a bitonic merge (distances 8, 4, 2, 1) on rows ``r0 .. r0 + 15``, in registers."""
    blk = t[r0 * LANES : (r0 + 16) * LANES]
    for q in range(LANES):
        a0 = blk[0 * LANES + q]
        a1 = blk[1 * LANES + q]
        a2 = blk[2 * LANES + q]
        a3 = blk[3 * LANES + q]
        a4 = blk[4 * LANES + q]
        a5 = blk[5 * LANES + q]
        a6 = blk[6 * LANES + q]
        a7 = blk[7 * LANES + q]
        a8 = blk[8 * LANES + q]
        a9 = blk[9 * LANES + q]
        a10 = blk[10 * LANES + q]
        a11 = blk[11 * LANES + q]
        a12 = blk[12 * LANES + q]
        a13 = blk[13 * LANES + q]
        a14 = blk[14 * LANES + q]
        a15 = blk[15 * LANES + q]
        a0, a8 = _cx(a0, a8)
        a1, a9 = _cx(a1, a9)
        a2, a10 = _cx(a2, a10)
        a3, a11 = _cx(a3, a11)
        a4, a12 = _cx(a4, a12)
        a5, a13 = _cx(a5, a13)
        a6, a14 = _cx(a6, a14)
        a7, a15 = _cx(a7, a15)
        a0, a4 = _cx(a0, a4)
        a1, a5 = _cx(a1, a5)
        a2, a6 = _cx(a2, a6)
        a3, a7 = _cx(a3, a7)
        a8, a12 = _cx(a8, a12)
        a9, a13 = _cx(a9, a13)
        a10, a14 = _cx(a10, a14)
        a11, a15 = _cx(a11, a15)
        a0, a2 = _cx(a0, a2)
        a1, a3 = _cx(a1, a3)
        a4, a6 = _cx(a4, a6)
        a5, a7 = _cx(a5, a7)
        a8, a10 = _cx(a8, a10)
        a9, a11 = _cx(a9, a11)
        a12, a14 = _cx(a12, a14)
        a13, a15 = _cx(a13, a15)
        a0, a1 = _cx(a0, a1)
        a2, a3 = _cx(a2, a3)
        a4, a5 = _cx(a4, a5)
        a6, a7 = _cx(a6, a7)
        a8, a9 = _cx(a8, a9)
        a10, a11 = _cx(a10, a11)
        a12, a13 = _cx(a12, a13)
        a14, a15 = _cx(a14, a15)
        if asc:
            blk[0 * LANES + q] = a0
            blk[1 * LANES + q] = a1
            blk[2 * LANES + q] = a2
            blk[3 * LANES + q] = a3
            blk[4 * LANES + q] = a4
            blk[5 * LANES + q] = a5
            blk[6 * LANES + q] = a6
            blk[7 * LANES + q] = a7
            blk[8 * LANES + q] = a8
            blk[9 * LANES + q] = a9
            blk[10 * LANES + q] = a10
            blk[11 * LANES + q] = a11
            blk[12 * LANES + q] = a12
            blk[13 * LANES + q] = a13
            blk[14 * LANES + q] = a14
            blk[15 * LANES + q] = a15
        else:
            blk[0 * LANES + q] = a15
            blk[1 * LANES + q] = a14
            blk[2 * LANES + q] = a13
            blk[3 * LANES + q] = a12
            blk[4 * LANES + q] = a11
            blk[5 * LANES + q] = a10
            blk[6 * LANES + q] = a9
            blk[7 * LANES + q] = a8
            blk[8 * LANES + q] = a7
            blk[9 * LANES + q] = a6
            blk[10 * LANES + q] = a5
            blk[11 * LANES + q] = a4
            blk[12 * LANES + q] = a3
            blk[13 * LANES + q] = a2
            blk[14 * LANES + q] = a1
            blk[15 * LANES + q] = a0


@njit(cache=True)
def _network_sort(t, rows):
    """Bitonic sort of ``rows`` (a power of two, at least 16) rows of ``LANES`` int32 keys, every lane on its own.

    ``t[i * LANES + q]`` is element ``i`` of lane ``q``: each compare-exchange of two rows is one
    vectorized min/max over the lanes. Stages at distances 8 .. 1 of the merges of 16 rows and
    more run fused in registers (:func:`_merge16`).
    """
    k = 2
    while k <= rows:
        j = k // 2
        while j >= 1:
            if k >= 16 and j == 8:
                for blk in range(0, rows, 16):
                    _merge16(t, blk, (blk & k) == 0)
                break
            for blk in range(0, rows, 2 * j):
                _half_clean(t, blk * LANES, (blk + j) * LANES, j * LANES, (blk & k) == 0)
            j //= 2
        k *= 2


@njit(inline="always")
def _signed_key(k):
    """Order-preserving int32 key of float32 bits ``k`` (int32), and its own inverse."""
    return k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF))


@njit(cache=True)
def _sorted_lanes(x, start, d, t):
    """The ``LANES`` full buckets of ``x`` from ``start`` on, sorted as int32 keys into ``t``.

    ``t[i * LANES + q]`` is the key (:func:`_signed_key`) of rank ``i`` of bucket ``q``;
    ``t`` holds ``rows * LANES`` keys, ``rows`` the power of two of :func:`network_rows`; the
    rows from ``d`` on are padding with the largest key and stay there. The keys' order is the
    radix sort's (:func:`_sorted_bucket`), so are the sorted values, ``-0.0`` before ``0.0``.
    """
    rows = t.size // LANES
    raw = x[start : start + LANES * d].view(np.int32)
    for i in range(d):
        ti = t[i * LANES : (i + 1) * LANES]
        for q in range(LANES):
            ti[q] = _signed_key(raw[q * d + i])
    t[d * LANES :] = np.int32(0x7FFFFFFF)
    _network_sort(t, rows)


@njit(inline="always")
def _lane_values(t, q, d, w):
    """Sorted values of lane ``q`` of :func:`_sorted_lanes` into ``w[:d]`` (float32); returns that view."""
    out = w[:d]
    bits = out.view(np.int32)
    for i in range(d):
        bits[i] = _signed_key(t[i * LANES + q])
    return out


@njit(inline="always")
def _prefix(w, p):
    """``p[: w.size + 1]``: float64 prefix sums of ``w``, accumulated in order; returns that view."""
    m = w.size
    acc = 0.0
    p[0] = 0.0
    for i in range(m):
        acc += np.float64(w[i])
        p[i + 1] = acc
    return p[: m + 1]


# ---------------------------------------------------------------- per-bucket level selection
@njit(cache=True)
def _orq_bucket(w, p, s, tree_lo, tree_mid, tree_hi, idx, row):
    m = w.size
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
        row[k] = w[idx[k]]


@njit(inline="always")
def _linear_rank(m, s, k):
    return max((k * m + (s - 2)) // (s - 1) - 1, 0)


@njit(cache=True)
def _linear_bucket(w, s, row):
    m = w.size
    for k in range(s):
        row[k] = w[_linear_rank(m, s, k)]


@njit(cache=True)
def _linear_lane(t, q, d, s, row):
    """:func:`_linear_bucket` of lane ``q`` of :func:`_sorted_lanes`, read from its keys."""
    bits = row.view(np.int32)
    for k in range(s):
        bits[k] = _signed_key(t[_linear_rank(d, s, k) * LANES + q])


@njit(cache=True)
def _two_means_bucket(w, p, row):
    m = w.size
    if m < 2:
        row[0] = w[0]
        row[1] = w[0]
        return
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
    row[0] = np.float32(p[best] / np.float64(best))
    row[1] = np.float32((p[m] - p[best]) / np.float64(m - best))


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


@njit(inline="always")
def _pb_sweeps(w, p, wr, pr, max_sweeps, row):
    """BinGrad-pb levels from ``w`` and its reversed negation ``wr``, with their prefix sums."""
    m = w.size
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
    row[0] = b0
    row[1] = b1


@njit(cache=True)
def _pb_bucket(w, p, wr_buf, pr_buf, max_sweeps, row):
    m = w.size
    wr = wr_buf[:m]
    for i in range(m):
        wr[i] = -w[m - 1 - i]
    _pb_sweeps(w, p, wr, _prefix(wr, pr_buf), max_sweeps, row)


# ---------------------------------------------------------------- the same, LANES sorted buckets at a time
# Values and prefix sums in the layout of _sorted_lanes (element i of bucket q at i * LANES + q): the
# float64 prefix sums, each a chain of dependent additions, run LANES chains side by side in vectors,
# each accumulated in the order of _prefix.
@njit(inline="always")
def _lane_prefix(v, d, p):
    """``p[: (d + 1) * LANES]``: per-lane float64 prefix sums of the first ``d`` rows of ``v``; returns that view."""
    p[:LANES] = 0.0
    for i in range(d):
        src = v[i * LANES : (i + 1) * LANES]
        prev = p[i * LANES : (i + 1) * LANES]
        nxt = p[(i + 1) * LANES : (i + 2) * LANES]
        for q in range(LANES):
            nxt[q] = prev[q] + np.float64(src[q])
    return p[: (d + 1) * LANES]


@njit(inline="always")
def _two_means_lanes(p, d, rows):
    """:func:`_two_means_bucket` of every lane (``d >= 2``), from :func:`_lane_prefix` sums; the same arithmetic."""
    total = p[d * LANES : (d + 1) * LANES]
    best = np.ones(LANES, np.int64)
    best_score = np.full(LANES, -1.0)
    mean = np.empty(LANES)
    for q in range(LANES):
        mean[q] = total[q] / d
    for j in range(1, d):
        jf = np.float64(j)
        den = jf * np.float64(d - j)
        pj = p[j * LANES : (j + 1) * LANES]
        for q in range(LANES):
            centred = pj[q] - jf * mean[q]
            score = centred * centred / den
            better = score > best_score[q]
            best_score[q] = score if better else best_score[q]
            best[q] = j if better else best[q]
    for q in range(LANES):
        b = best[q]
        rows[q, 0] = np.float32(p[b * LANES + q] / np.float64(b))
        rows[q, 1] = np.float32((total[q] - p[b * LANES + q]) / np.float64(d - b))


@njit(cache=True)
def _lanes_levels(t, d, family, s, tree_lo, tree_mid, tree_hi, max_sweeps, p_buf, wr_buf, pr_buf, idx, rows):
    """Levels of the ``LANES`` buckets sorted by :func:`_sorted_lanes` into ``rows`` (``LANES`` rows).

    Overwrites the keys in ``t`` with their float32 values. ``p_buf`` and ``pr_buf`` hold
    ``(d + 1) * LANES`` float64, ``wr_buf`` ``d * LANES`` float32 (BinGrad-pb only).
    """
    if family == 1:
        for q in range(LANES):
            _linear_lane(t, q, d, s, rows[q])
        return
    for j in range(d * LANES):
        t[j] = _signed_key(t[j])
    v = t[: d * LANES].view(np.float32)
    p = _lane_prefix(v, d, p_buf)
    if family == 2 and d >= 2:
        _two_means_lanes(p, d, rows)
        return
    w2 = v.reshape(d, LANES)
    p2 = p.reshape(d + 1, LANES)
    if family == 3:
        wr = wr_buf[: d * LANES]
        for i in range(d):
            dst = wr[i * LANES : (i + 1) * LANES]
            src = v[(d - 1 - i) * LANES : (d - i) * LANES]
            for q in range(LANES):
                dst[q] = -src[q]
        wr2 = wr.reshape(d, LANES)
        pr2 = _lane_prefix(wr, d, pr_buf).reshape(d + 1, LANES)
    for q in range(LANES):
        if family == 0:
            _orq_bucket(w2[:, q], p2[:, q], s, tree_lo, tree_mid, tree_hi, idx, rows[q])
        elif family == 2:
            _two_means_bucket(w2[:, q], p2[:, q], rows[q])
        else:
            _pb_sweeps(w2[:, q], p2[:, q], wr2[:, q], pr2[:, q], max_sweeps, rows[q])


# ---------------------------------------------------------------- level selection
@njit(inline="always")
def _bucket_levels(w, family, s, tree_lo, tree_mid, tree_hi, max_sweeps, p_buf, wr_buf, pr_buf, idx, row):
    """Levels of one sorted bucket ``w`` into ``row`` (``family`` as in :func:`select_levels`)."""
    if family == 1:
        _linear_bucket(w, s, row)
        return
    p = _prefix(w, p_buf)
    if family == 0:
        _orq_bucket(w, p, s, tree_lo, tree_mid, tree_hi, idx, row)
    elif family == 2:
        _two_means_bucket(w, p, row)
    else:
        _pb_bucket(w, p, wr_buf, pr_buf, max_sweeps, row)


def network_rows(d: int) -> int:
    """Rows of the sorting network for buckets of ``d`` values: the power of two ``>= max(d, 16)``."""
    rows = 16
    while rows < d:
        rows *= 2
    return rows


_network_rows = njit(cache=True)(network_rows)


@parallel_kernel
def select_levels(x, d, s, family, tree_lo, tree_mid, tree_hi, max_sweeps):
    """The ``(buckets, s)`` float32 levels of every bucket of ``x`` for one level family.

    ``family``: 0 ORQ (``tree_*``: the ``(left, middle, right)`` level indices of
    ``levels_torch.level_schedule``), 1 Linear, 2 BinGrad-b (two-means), 3 BinGrad-pb (at most
    ``max_sweeps`` sweeps). Each family is the per-bucket loop of the batched torch function of
    the same name in ``levels_torch``.

    Full buckets of at most ``NETWORK_MAX_D`` values are sorted ``LANES`` at a time by the sorting
    network (:func:`_sorted_lanes`), the others (the last partial bucket, the fewer than
    ``LANES`` left over) one at a time by the radix sort; both give the same sorted values. The
    work goes in ``BUCKET_GROUPS`` runs, each with its scratch allocated once.
    """
    n = x.size
    nb = (n + d - 1) // d
    out = np.empty((nb, s), np.float32)
    lane_groups = (n // d) // LANES if d <= NETWORK_MAX_D else 0
    units = lane_groups + (nb - lane_groups * LANES)  # a unit: LANES buckets for the network, or one bucket
    groups = min(units, BUCKET_GROUPS)
    rows = _network_rows(d)
    for g in prange(groups):
        t = np.empty(rows * LANES if lane_groups else 0, np.int32)
        lane_p = np.empty((d + 1) * LANES if lane_groups else 0, np.float64)
        lane_wr = np.empty(d * LANES if lane_groups and family == 3 else 0, np.float32)
        lane_pr = np.empty((d + 1) * LANES if lane_groups and family == 3 else 0, np.float64)
        keys = np.empty(d, np.uint32)
        spare = np.empty(d, np.uint32)
        count = np.empty(1024, np.int64)
        p_buf = np.empty(d + 1, np.float64)
        wr_buf = np.empty(d if family == 3 else 0, np.float32)
        pr_buf = np.empty(d + 1 if family == 3 else 0, np.float64)
        idx = np.empty(s, np.int64)
        for u in range((g * units) // groups, ((g + 1) * units) // groups):
            if u < lane_groups:
                _sorted_lanes(x, u * LANES * d, d, t)
                rows_out = out[u * LANES : (u + 1) * LANES]
                _lanes_levels(
                    t, d, family, s, tree_lo, tree_mid, tree_hi, max_sweeps, lane_p, lane_wr, lane_pr, idx, rows_out
                )
            else:
                b = lane_groups * LANES + (u - lane_groups)
                start = b * d
                w = _sorted_bucket(x, start, min(start + d, n), keys, spare, count)
                _bucket_levels(w, family, s, tree_lo, tree_mid, tree_hi, max_sweeps, p_buf, wr_buf, pr_buf, idx, out[b])
    return out


_NO_TREE = np.zeros(0, np.int64)


def orq_levels(x, d, s, tree_lo, tree_mid, tree_hi):
    """ORQ-s levels of every bucket of ``x``, ``(buckets, s)`` float32 (see ``levels_torch.orq_levels``)."""
    return select_levels(x, d, s, 0, tree_lo, tree_mid, tree_hi, 0)


def linear_levels(x, d, s):
    """Linear-s levels, ``(buckets, s)`` float32 (see ``levels_torch.linear_levels``)."""
    return select_levels(x, d, s, 1, _NO_TREE, _NO_TREE, _NO_TREE, 0)


def two_means_levels(x, d):
    """BinGrad-b levels, ``(buckets, 2)`` float32 (see ``levels_torch.two_means_levels``)."""
    return select_levels(x, d, 2, 2, _NO_TREE, _NO_TREE, _NO_TREE, 0)


def partially_biased_levels(x, d, max_sweeps):
    """BinGrad-pb levels, ``(buckets, 2)`` float32 (see ``levels_torch.partially_biased_levels``)."""
    return select_levels(x, d, 2, 3, _NO_TREE, _NO_TREE, _NO_TREE, max_sweeps)


# ---------------------------------------------------------------- rounding onto the levels
@njit(cache=True, inline="always")
def _random_round_bucket(xs, row, us, cs, s):
    """Random rounding of one bucket onto ``row`` (``s`` levels, a constant where inlined).

    The levels loop is innermost: with ``s`` constant LLVM unrolls it and vectorizes over the
    elements, the interval ``[lo, hi]`` and index of every value in registers (selects: rows are
    non-decreasing, so the levels at or below ``v`` are ``1 .. index``); the index counts in
    float32 so that every lane is 32 bits wide.
    """
    first = row[0]
    second = row[1]
    for k in range(xs.size):
        v = xs[k]
        lo = first
        hi = second
        index = _ZERO32
        for q in range(1, s - 1):
            below = v >= row[q]
            lo = row[q] if below else lo
            hi = row[q + 1] if below else hi
            index = index + _ONE32 if below else index
        base = np.float64(lo)
        up = np.float64(us[k]) * _U_SCALE64 * (np.float64(hi) - base) < np.float64(v) - base
        cs[k] = np.int32(index + _ONE32 if up else index)


#: Levels per row that :func:`_round16` takes (one 512-bit register), and elements per step.
VECTOR_LEVELS = 16


def _array_c(t, dtype) -> bool:
    return c_array_of(t, dtype) and t.ndim == 1


def _permute_ir(builder, floats, words, native: bool):
    """A function ``(table, index) -> table[index]`` lane by lane on 16-lane IR vectors.

    With ``native`` one ``vpermps`` (``llvm.x86.avx512.permvar.sf.512``, AVX-512F only); without,
    a lane-by-lane extract and insert that any LLVM target lowers (slower, the same values): the
    kernels then still compile on other CPUs (ARM, x86 without AVX-512).
    """
    if native:
        permvar = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(floats, [floats, words]), "llvm.x86.avx512.permvar.sf.512"
        )
        return lambda table, index: builder.call(permvar, [table, index])
    i32 = ir.IntType(32)

    def lanewise(table, index):
        out = ir.Constant(floats, None)
        for j in range(floats.count):
            lane = ir.Constant(i32, j)
            picked = builder.extract_element(table, builder.extract_element(index, lane))
            out = builder.insert_element(out, picked, lane)
        return out

    return lanewise


@intrinsic
def _round16(typingctx, xs, us, cs, row, s, groups):
    """Random rounding of ``xs[: 16 * groups]`` onto the ``s <= 16`` levels ``row[:s]``, 16 values per step.

    ``row`` holds at least 16 floats (those from ``s`` on are ignored), ``us`` the random bits
    (uint32) and ``cs`` (uint8) receives the indices: the same as :func:`_random_round_bucket`.
    The row lives in one zmm register. Each value's index, the number of interior levels
    ``row[1 .. s - 2]`` at or below it, comes by a branch-free binary search over the
    thresholds ``t`` (the row with ``+inf`` from lane ``s - 1`` on): rows are non-decreasing, so
    the thresholds at or below a finite ``v`` are ``t[1 .. index]`` and four steps
    ``v >= t[index + 8, 4, 2, 1]`` find ``index`` (the shifted ``t`` are built once per call,
    each step one ``vpermps``). Then ``lo = row[index]``, ``hi = row[index + 1]`` by two more
    permutes and the float64 decision of :func:`_random_round_bucket` on two ``<8 x double>``
    halves, in the same operations (no contraction into FMAs). Said in IR because LLVM
    vectorizes neither a search nor a gather from a row by itself; ``vpermps`` needs AVX-512F,
    elsewhere the lookups go lane by lane (:func:`_permute_ir`).
    """
    f32, u32, u8 = types.float32, types.uint32, types.uint8
    if not (_array_c(xs, f32) and _array_c(us, u32) and _array_c(cs, u8) and _array_c(row, f32)):
        return None
    sig = types.void(xs, us, cs, row, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        x_arr, u_arr, c_arr, r_arr = (
            context.make_array(signature.args[k])(context, builder, args[k]) for k in range(4)
        )
        i32 = ir.IntType(32)
        lanes = VECTOR_LEVELS
        floats = ir.VectorType(ir.FloatType(), lanes)
        doubles = ir.VectorType(ir.DoubleType(), lanes)
        words = ir.VectorType(i32, lanes)
        bytes_ = ir.VectorType(ir.IntType(8), lanes)

        def splat_int(value):
            return ir.Constant(words, [ir.Constant(i32, value)] * lanes)

        def shifted(vector, k):  # lane j: lane j + k (the lanes past the end are never read)
            return builder.shuffle_vector(
                vector, vector, ir.Constant(words, [min(j + k, lanes - 1) for j in range(lanes)])
            )

        permute = _permute_ir(builder, floats, words, target.has_avx512f())
        levels = builder.load(builder.bitcast(r_arr.data, floats.as_pointer()), align=4)
        s32 = builder.trunc(args[4], i32)
        lane = ir.Constant(words, [ir.Constant(i32, j) for j in range(lanes)])
        last = builder.insert_element(
            ir.Constant(words, None), builder.sub(s32, ir.Constant(i32, 1)), ir.Constant(i32, 0)
        )
        past = builder.icmp_signed(">=", lane, builder.shuffle_vector(last, last, splat_int(0)))  # lanes >= s - 1
        inf = ir.Constant(floats, [ir.Constant(ir.FloatType(), float("inf"))] * lanes)
        thresholds = builder.select(past, inf, levels)
        first = builder.shuffle_vector(thresholds, thresholds, ir.Constant(words, [8] * lanes))
        steps = [(4, shifted(thresholds, 4)), (2, shifted(thresholds, 2)), (1, shifted(thresholds, 1))]
        above = shifted(levels, 1)
        scale = ir.Constant(doubles, [ir.Constant(ir.DoubleType(), 2.0**-24)] * lanes)
        with cgutils.for_range(builder, args[5]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, lanes))
            v = builder.load(builder.bitcast(builder.gep(x_arr.data, [at]), floats.as_pointer()), align=4)
            u = builder.load(builder.bitcast(builder.gep(u_arr.data, [at]), words.as_pointer()), align=4)
            index = builder.select(builder.fcmp_ordered(">=", v, first), splat_int(8), splat_int(0))
            for k, t in steps:
                below = builder.fcmp_ordered(">=", v, permute(t, index))
                index = builder.select(below, builder.or_(index, splat_int(k)), index)
            lo = builder.fpext(permute(levels, index), doubles)
            hi = builder.fpext(permute(above, index), doubles)
            below_up = builder.fmul(builder.fmul(builder.uitofp(u, doubles), scale), builder.fsub(hi, lo))
            up = builder.fcmp_ordered("<", below_up, builder.fsub(builder.fpext(v, doubles), lo))
            code = builder.trunc(builder.add(index, builder.zext(up, words)), bytes_)
            builder.store(code, builder.bitcast(builder.gep(c_arr.data, [at]), bytes_.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def _chunk_indices(x, levels, d, key, nearest, c0, c1, codes, hs, count, pad):
    """Level indices of elements ``c0 .. c1`` into ``codes[0 : c1 - c0]`` (uint8), bucket by bucket.

    Random rounding: the elements' random bits go to ``hs`` first (uint32,
    :func:`~fedquant.codecs.kernels.common.hash24_run`), then each value's interval between
    its bucket's levels (:func:`_round16` for 3 to 16 levels, 16 values at a time with the rest
    by :func:`_random_round_bucket`, which also takes 2 levels; more levels count over the interior
    levels into ``count``, int32 scratch, one pass per level) and the random
    decision: element ``i`` moves up iff ``u_i (hi - lo) < v - lo``, in float64, exactly as
    ``levels_torch.random_round``. Nearest rounding (two levels): 1 where ``v >= (b0 + b1) / 2``,
    as ``levels_torch.nearest_of_two``. ``pad``: 16 float32 of scratch, the row of fewer than
    16 levels where :func:`_round16` reads 16.
    """
    s = levels.shape[1]
    m = c1 - c0
    if not nearest:
        hash24_run(key, c0, m, hs)
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        row = levels[b]
        xs = x[i:hi]
        cs = codes[i - c0 : hi - c0]
        us = hs[i - c0 : hi - c0]
        if nearest:
            mid = (np.float64(row[0]) + np.float64(row[1])) * 0.5
            for k in range(hi - i):
                cs[k] = 1 if np.float64(xs[k]) >= mid else 0
        elif 2 < s <= VECTOR_LEVELS:
            if s == VECTOR_LEVELS:
                row16 = row
            else:
                pad[:s] = row
                row16 = pad
            full = VECTOR_LEVELS * ((hi - i) // VECTOR_LEVELS)
            _round16(xs, us, cs, row16, s, full // VECTOR_LEVELS)
            _random_round_bucket(xs[full:], row, us[full:], cs[full:], s)
        elif s == 2:
            _random_round_bucket(xs, row, us, cs, 2)
        else:
            # rows are non-decreasing: the levels at or below v are 1 .. count, so count <= s - 2
            cnt = count[: hi - i]
            cnt[:] = 0
            for q in range(1, s - 1):
                level = row[q]
                for k in range(hi - i):
                    cnt[k] += np.int32(xs[k] >= level)
            for k in range(hi - i):
                kk = cnt[k]
                lo = np.float64(row[kk])
                gap = np.float64(row[min(kk + 1, s - 1)]) - lo
                u = np.float64(us[k]) * _U_SCALE64
                cs[k] = kk + np.int32(u * gap < np.float64(xs[k]) - lo)
        i = hi


@parallel_kernel
def round_pack_into(x, levels, d, key, nearest, width, out, counts):
    """Round ``x`` onto its buckets' ``levels`` and pack the indices at ``width`` bits (at most 8) into ``out``.

    Parameters
    ----------
    x : np.ndarray
        float32 values.
    levels : np.ndarray
        ``(buckets, s)`` float32, non-decreasing rows.
    d : int
        Bucket size.
    key : np.uint64
        ``fedquant.rng.stream_key(seed)`` of the rounding stream.
    nearest : bool
        Deterministic nearest of two levels instead of unbiased random rounding.
    width : int
        Bits per index; 8 gives one byte per index, the unpacked symbols for the entropy coder.
    out : np.ndarray
        uint8, ``ceil(n * width / 8)`` bytes (``fedquant.wire.bitpack.pack_bits`` layout).
    counts : np.ndarray
        ``(groups, s)`` int64 (:func:`~fedquant.codecs.kernels.common.count_table`): receives the
        index histogram of each run of chunks (width 8 only), or ``(groups, 0)`` for none.
    """
    n = x.size
    nchunks = (n + CHUNK - 1) // CHUNK
    groups = counts.shape[0]
    for g in prange(groups):
        first, end = group_chunks(g, groups, nchunks)
        codes = np.empty(min(CHUNK, n), np.uint8)
        hs = np.empty(min(CHUNK, n), np.uint32)
        count = np.empty(min(CHUNK, n), np.int32)
        pad = np.zeros(VECTOR_LEVELS, np.float32)
        for c in range(first, end):
            c0 = c * CHUNK
            c1 = min(c0 + CHUNK, n)
            if width == 8:  # one byte per index: nothing to pack
                _chunk_indices(x, levels, d, key, nearest, c0, c1, out[c0:c1], hs, count, pad)
                if counts.shape[1]:
                    add_counts(out[c0:c1], c1 - c0, counts[g])
            else:
                _chunk_indices(x, levels, d, key, nearest, c0, c1, codes, hs, count, pad)
                pack_into(codes, c1 - c0, width, out, (c0 * width) // 8)


def round_pack(
    x: np.ndarray, levels: np.ndarray, d: int, key: np.uint64, nearest: bool, width: int, count: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """:func:`round_pack_into` a new array; with ``count`` (width 8), also the index histogram.

    ``x`` and ``levels`` are made contiguous first (the vector rounding reads whole rows).
    """
    x = np.ascontiguousarray(x)
    levels = np.ascontiguousarray(levels)
    out = np.empty(packed_size(x.size, width), np.uint8)
    counts = count_table(x.size, levels.shape[1] if count else 0)
    round_pack_into(x, levels, d, key, nearest, width, out, counts)
    return (out, counts.sum(axis=0)) if count else out


# ---------------------------------------------------------------- decoding
@njit(cache=True)
def _chunk_gather(codes, flat_levels, s, d, c0, c1, out):
    """``levels[bucket, index]`` for elements ``c0 .. c1``; returns how many indices are ``>= s``."""
    bad = 0
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        row = flat_levels[b * s : (b + 1) * s]
        cs = codes[i - c0 : hi - c0]
        ys = out[i:hi]
        for k in range(hi - i):
            c = np.int64(cs[k])
            if c < s:
                ys[k] = row[c]
            else:
                ys[k] = 0.0
                bad += 1
        i = hi
    return bad


@parallel_kernel(count_arg=1)
def unpack_gather_into(data, n, flat_levels, s, d, width, out):
    """Decode ``n`` indices packed at ``width`` bits into their buckets' levels, in ``out``.

    ``data`` (uint8) must hold exactly ``ceil(n * width / 8)`` bytes and ``flat_levels`` the
    ``ceil(n / d) * s`` levels, bucket by bucket (the caller checks). Returns the number of
    indices ``>= s``; a bad index decodes to 0.
    """
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        if width == 8:
            bad[c] = _chunk_gather(data[c0:c1], flat_levels, s, d, c0, c1, out)
        else:
            codes = np.empty(min(CHUNK, n), np.uint8)
            unpack_from(data, (c0 * width) // 8, c1 - c0, width, codes)
            bad[c] = _chunk_gather(codes, flat_levels, s, d, c0, c1, out)
    return bad.sum()


def unpack_gather(
    data: np.ndarray, n: int, flat_levels: np.ndarray, s: int, d: int, width: int
) -> tuple[np.ndarray, int]:
    """:func:`unpack_gather_into` new float32 values: ``(values, number of indices >= s)``."""
    out = np.empty(n, np.float32)
    return out, unpack_gather_into(data, n, flat_levels, s, d, width, out)
