"""Numba CPU kernels of EDEN (:mod:`fedquant.codecs.quantizers.eden`), integer and fractional bits.

The torch twin stays next to its caller in the quantizer module (the CUDA path, and CPU with
``force_torch=True``). Both compute, per bucket of ``d`` coordinates: the float64 sum of squares
``sq``, the normalization ``sqrt(count / sq)`` (0 for a zero bucket), the index of the nearest
Lloyd–Max centroid of each normalized coordinate (``torch.bucketize`` semantics: the number of
boundaries strictly below it) and ``dot = sum(c * y)`` in float64. The float64 sums are taken in
a different order than torch's, so ``sq`` and ``dot`` may differ in their last bit; the indices
and the bfloat16 scales derived from them agree except with negligible probability.

Work is split in chunks of ``CHUNK`` coordinates; every bucket size of EDEN (64..512) divides
``CHUNK``, so a chunk holds whole buckets and its packed indices start on a byte boundary.

Fractional bits (``split_*``): the coordinates at ``ceil(B)`` bits are the ``k`` with the
smallest ``(u_i, i)``, ``u_i`` the 24-bit uniform of coordinate ``i`` of the split stream. That
set is "every ``u_i < T``, and the first ``r`` coordinates with ``u_i = T``";
:func:`split_plan` finds ``T`` and ``r`` in one pass that only counts (the threshold lies, but
for a probability below ``1e-30``, in a narrow window around ``k / n``, whose few members it
keeps), and how many chosen coordinates each chunk holds, so that every chunk knows where its
indices start in the two packed streams. The quantize and dequantize passes redraw ``u_i``
inline; the streams' bytes that two chunks share are merged after the pass
(:func:`~fedquant.codecs.kernels.common.pack_at`).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from fedquant.codecs.kernels import common
from fedquant.codecs.kernels.common import (
    CHUNK,
    _sum_f64,
    _total_f64,
    add_counts,
    counter,
    group_chunks,
    hash24_fill,
    merge_by_flags,
    merge_edges,
    pack_at,
    pack_into,
    parallel_kernel,
    split_by_flags,
    unpack_at,
    unpack_from,
)
from fedquant.codecs.kernels.hadamard import (
    chunk_in_cache,
    forward_span,
    inverse_after_first4,
    inverse_scaled,
    inverse_span,
    keep_head,
    kept_blocks,
    lookup_first4x16,
)
from fedquant.codecs.kernels.norms import block_accumulate

#: Half-width of the threshold window of :func:`split_plan`, in standard deviations of the count.
WINDOW_SIGMAS = 12.0
_TOP = 1 << 24
_ONE32 = np.float32(1.0)


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
def _nearest_2(xs, m, norm, t0, c0, c1, codes, prods):
    """1 bit: ``codes[i] = t0 < z_i`` (``z_i = xs[i] * norm``, float64), ``prods[i]`` = its centroid times ``xs[i]``."""
    for i in range(m):
        v = np.float64(xs[i])
        up = t0 < v * norm
        codes[i] = up
        prods[i] = (c1 if up else c0) * v


@njit(cache=True)
def _nearest_4(xs, m, norm, bounds, cents, codes, prods):
    """2 bits: as :func:`_nearest_2` with the three ascending ``bounds`` and four ``cents``."""
    t0, t1, t2 = bounds[0], bounds[1], bounds[2]
    c0, c1, c2, c3 = cents[0], cents[1], cents[2], cents[3]
    for i in range(m):
        v = np.float64(xs[i])
        z = v * norm
        u0 = t0 < z
        u1 = t1 < z
        u2 = t2 < z
        codes[i] = np.uint8(u0) + np.uint8(u1) + np.uint8(u2)
        prods[i] = (c3 if u2 else (c2 if u1 else (c1 if u0 else c0))) * v


@njit(cache=True)
def _bucket(xs, m, bounds, centroids, codes, prods, z):
    """One bucket ``xs[:m]``: centroid indices into ``codes[:m]``; returns ``(sq, dot)``.

    One and two bits pick the centroid with compares and selects (vectorized); more bits count
    boundaries over the bucket (:func:`_nearest`) and look the centroids up. Either way every
    value is computed as before: ``z = x * sqrt(m / sq)`` in float64, ``dot`` in the lane order
    of ``_sum_f64`` (float32 ``xs``; ``prods``, ``z``: float64 scratch).
    """
    sq = _sum_f64(xs, 0, m, True)
    norm = np.sqrt(m / sq) if sq > 0 else 0.0
    nb = bounds.size
    if nb == 1:
        _nearest_2(xs, m, norm, bounds[0], centroids[0], centroids[1], codes, prods)
    elif nb == 3:
        _nearest_4(xs, m, norm, bounds, centroids, codes, prods)
    else:
        for i in range(m):
            z[i] = np.float64(xs[i]) * norm
        _nearest(z, m, bounds, codes)
        for i in range(m):
            prods[i] = centroids[codes[i]] * np.float64(xs[i])
    return sq, _total_f64(prods, 0, m)


# ---------------------------------------------------------------- integer bits
@parallel_kernel(count_arg=1)
def quantize(x, n, d, bounds, centroids, width, pack, out, sq, dot, counts, layout, scales, key):
    """Centroid indices of ``n`` float32 values and the per-bucket ``sq`` / ``dot`` (float64, written).

    The values are ``x`` (``n`` of them), or with a rotation (``layout`` / ``scales`` /
    ``key`` of :class:`~fedquant.codecs.transforms.rht.FusedRotation`, an empty ``layout``
    for none) ``rht``'s rotation of ``x``, ``n`` its laid-out size: each chunk is rotated in
    cache first (:func:`~fedquant.codecs.kernels.hadamard.forward_span`).
    ``out`` receives the indices packed at ``width`` bits (``pack``: ``packed_size(n, width)``
    bytes) or one uint8 per coordinate; then ``counts`` (``(groups, 2**width)`` int64, or
    ``(groups, 0)`` for none) receives their histogram per run of chunks. Returns the number of
    rotated blocks that hold NaN or Inf (0 without a rotation).
    """
    chunks = (n + CHUNK - 1) // CHUNK
    groups = counts.shape[0]
    rotate = layout.shape[0] > 0
    bad = np.zeros(groups, np.int64)
    for g in prange(groups):
        first, end = group_chunks(g, groups, chunks)
        codes = np.empty(CHUNK, np.uint8)
        rotated = np.empty(CHUNK if rotate else 0, np.float32)
        prods = np.empty(d, np.float64)
        z = np.empty(d, np.float64)
        for c in range(first, end):
            start = c * CHUNK
            stop = min(start + CHUNK, n)
            if rotate:
                bad[g] += forward_span(x, start, stop, layout, scales, key, rotated)
                xs = rotated[: stop - start]
            else:
                xs = x[start:stop]
            for lo in range(0, stop - start, d):
                m = min(d, stop - start - lo)
                b = (start + lo) // d
                sq[b], dot[b] = _bucket(xs[lo : lo + m], m, bounds, centroids, codes[lo : lo + m], prods, z)
            if pack:
                pack_into(codes, stop - start, width, out, start // 8 * width)
            else:
                out[start:stop] = codes[: stop - start]
                if counts.shape[1]:
                    add_counts(codes, stop - start, counts[g])
    return bad.sum()


@njit(cache=True)
def _values(codes, m, centroids, scale, c, dst):
    """``dst[i] = (centroids[codes[i]] * scale) * c`` (codes clamped to the table; float32, each product
    rounded), by selects for 2 and 4 centroids. ``c`` is ``rht``'s block scale, or 1 (exact) without
    a rotation."""
    top = centroids.size - 1
    if top == 1:
        c0, c1 = centroids[0], centroids[1]
        for i in range(m):
            dst[i] = ((c1 if codes[i] else c0) * scale) * c
    elif top == 3:
        c0, c1, c2, c3 = centroids[0], centroids[1], centroids[2], centroids[3]
        for i in range(m):
            k = codes[i]
            dst[i] = ((c0 if k == 0 else (c1 if k == 1 else (c2 if k == 2 else c3))) * scale) * c
    else:
        for i in range(m):
            dst[i] = (centroids[min(codes[i], top)] * scale) * c


@njit(cache=True)
def _rotated_values(codes, start, stop, d, scales, centroids, layout, rot_scales, key, out):
    """The values of laid-out positions ``start .. stop`` (``codes[: stop - start]``) through ``rht``'s
    inverse into ``out`` (its first ``out.size`` positions), block by block in L1: each block's
    values are written scaled by the block's ``c`` straight into it, then transformed in place
    (:func:`~fedquant.codecs.kernels.hadamard.inverse_scaled`), the values :func:`inverse_span`
    gives from the chunk's values, bit for bit, without that chunk buffer. Returns 1 if a value
    of ``out`` is not finite, else 0."""
    blocks = kept_blocks(layout, start, stop, out.size - start)
    size = out.size
    bad = 0
    for j in range(blocks.shape[0]):
        p = blocks[j, 0]
        length = blocks[j, 1]
        cut = p + length > size
        seg = np.empty(length, np.float32) if cut else out[p : p + length]
        q = p
        while q < p + length:  # the buckets the block holds, or the part of one
            b = q // d
            e = min(p + length, (b + 1) * d)
            _values(codes[q - start : e - start], e - q, centroids, scales[b], rot_scales[blocks[j, 2]], seg[q - p :])
            q = e
        block_bad = inverse_scaled(seg, key, p)
        bad |= keep_head(seg, out[p:size]) if cut else block_bad
    return bad


@njit(cache=True)
def _packed_word(data, q, width):
    """The ``2 width`` bytes (``width`` 1 or 2) that hold the packed indices of positions ``q .. q + 15``
    (``q`` a multiple of 8), as a uint32, LSB first."""
    o = q * width // 8
    word = np.uint32(data[o]) | (np.uint32(data[o + 1]) << np.uint32(8))
    if width == 2:
        word |= (np.uint32(data[o + 2]) << np.uint32(16)) | (np.uint32(data[o + 3]) << np.uint32(24))
    return word


@njit(cache=True)
def _rotated_packed(data, width, start, stop, d, scales, centroids, layout, rot_scales, key, out):
    """:func:`_rotated_values` of the chunk ``start .. stop`` from its indices packed at ``width`` bits
    (1 or 2; as many centroids as codes), read straight into the first sweep of each block's
    inverse (:func:`~fedquant.codecs.kernels.hadamard.lookup_first4x16`): no unpacking pass and no
    pass that writes the values. The same values, bit for bit. Returns -1, having written
    nothing, when the chunk holds a block of fewer than 32 or one ``out`` keeps only in part
    (the caller takes the general path)."""
    blocks = kept_blocks(layout, start, stop, out.size - start)
    for j in range(blocks.shape[0]):
        if blocks[j, 1] < 32 or blocks[j, 0] + blocks[j, 1] > out.size:
            return -1
    c0, c1 = centroids[0], centroids[1]
    c2, c3 = (centroids[2], centroids[3]) if centroids.size == 4 else (c0, c1)  # (1 bit: never selected)
    bad = 0
    for j in range(blocks.shape[0]):
        p = blocks[j, 0]
        seg = out[p : p + blocks[j, 1]]
        c = rot_scales[blocks[j, 2]]
        b = p // d
        edge = p  # a bucket (a multiple of 64) holds whole groups of 16: its table is set at its first
        t0 = t1 = t2 = t3 = c0
        for g in range(seg.size // 16):
            q = p + 16 * g
            if q == edge:
                s = scales[b]
                t0, t1, t2, t3 = c0 * s, c1 * s, c2 * s, c3 * s
                edge = (b + 1) * d
                b += 1
            lookup_first4x16(_packed_word(data, q, width), width, seg, 16 * g, t0, t1, t2, t3, c)
        bad |= inverse_after_first4(seg, key, p)
    return bad


@njit(cache=True)
def _dequantize_chunk(c, data, numel, d, scales, centroids, width, packed, out, layout, rot_scales, key):
    """Chunk ``c`` of :func:`dequantize`: ``(indices beyond the table, 1 if a value is not finite)``."""
    top = centroids.size - 1
    start = c * CHUNK
    stop = min(start + CHUNK, numel)
    rotate = layout.shape[0] > 0
    if rotate and packed and width <= 2 and (1 << width) == top + 1:
        done = _rotated_packed(data, width, start, stop, d, scales, centroids, layout, rot_scales, key, out)
        if done >= 0:
            return 0, done
    if packed:
        codes = np.empty(stop - start, np.uint8)
        unpack_from(data, start // 8 * width, stop - start, width, codes)
    else:
        codes = data[start:stop]
    over = 0
    if not packed or (1 << width) > top + 1:  # packed at width bits: beyond the table only if wider
        for i in range(stop - start):
            over += codes[i] > top
    if rotate:
        return over, _rotated_values(codes, start, stop, d, scales, centroids, layout, rot_scales, key, out)
    values = out[start:stop]
    for lo in range(0, stop - start, d):
        m = min(d, stop - start - lo)
        _values(codes[lo : lo + m], m, centroids, scales[(start + lo) // d], _ONE32, values[lo : lo + m])
    return over, 0


@parallel_kernel(count_arg=1)
def dequantize(data, numel, d, scales, centroids, width, packed, out, layout, rot_scales, key):
    """``centroids[index] * scales[bucket]`` (float32) of ``numel`` indices into ``out``.

    ``data`` holds the indices packed at ``width`` bits (``packed``; the caller checked its size)
    or one uint8 per coordinate. With a rotation (see :func:`quantize`; ``numel`` its laid-out
    size) each chunk's values go through ``rht``'s inverse rotation in cache
    (:func:`~fedquant.codecs.kernels.hadamard.inverse_span`) and ``out`` receives the first
    ``out.size`` values of the result. Returns ``(indices >= centroids.size`` (their values are not
    meaningful: the caller refuses the payload), ``blocks of out`` holding NaN or Inf; 0 without a
    rotation).
    """
    chunks = (numel + CHUNK - 1) // CHUNK
    over = np.zeros(chunks, np.int64)
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        over[c], bad[c] = _dequantize_chunk(
            c, data, numel, d, scales, centroids, width, packed, out, layout, rot_scales, key
        )
    return over.sum(), bad.sum()


@parallel_kernel(count_arg=1)
def dequantize_summed(
    data, numel, d, scales, centroids, width, packed, out, layout, rot_scales, key, consensus, weighted, weight
):
    """:func:`dequantize`, each chunk's values then added to a server's running sums while they are in
    cache, as :func:`~fedquant.codecs.kernels.norms.checked_accumulate` adds them without its check:
    ``consensus += values`` (float32), ``weighted += weight x values`` (float64; either may be
    empty). Returns :func:`dequantize`'s two counts and ``sum(values**2)`` (float64 by chunks)."""
    chunks = (numel + CHUNK - 1) // CHUNK
    over = np.zeros(chunks, np.int64)
    bad = np.zeros(chunks, np.int64)
    squares = np.zeros(chunks, np.float64)
    for c in prange(chunks):
        over[c], bad[c] = _dequantize_chunk(
            c, data, numel, d, scales, centroids, width, packed, out, layout, rot_scales, key
        )
        lo = c * CHUNK
        hi = min(lo + CHUNK, out.size)  # the chunk's values (a rotation's padding is not kept)
        if lo < hi:
            squares[c] = block_accumulate(out, out, consensus, weighted, weight, lo, hi, False)[0]
    return over.sum(), bad.sum(), squares.sum()


# ---------------------------------------------------------------- fractional bits: the split
@parallel_kernel(count_arg=1)
def _split_window(key, n, w_lo, w_hi, below, entries, filled):
    """Per chunk: how many ``u_i < w_lo`` (``below``), and the ``u_i`` in ``[w_lo, w_hi)`` (``entries``, ``filled``).

    ``filled[c]`` may exceed the capacity ``entries.shape[1]`` (only the first ones are kept):
    the caller then falls back to the exact full computation.
    """
    cap = entries.shape[1]
    nchunks = (n + CHUNK - 1) // CHUNK
    lo32 = np.uint32(w_lo)
    hi32 = np.uint32(w_hi)
    for c in prange(nchunks):
        start = c * CHUNK
        stop = min(start + CHUNK, n)
        u = np.empty(64, np.uint32)
        count_below = 0
        kept = 0
        for s0 in range(start, stop, 64):
            m = min(64, stop - s0)
            below64 = np.int32(0)
            inside = np.int32(0)
            hash24_fill(counter(key, s0), u, m)
            for i in range(m):  # 32-bit sums (numba widens int32 + int32 to int64: cast back)
                v = u[i]
                below64 = np.int32(below64 + np.int32(v < lo32))
                inside = np.int32(inside + (np.int32(v >= lo32) & np.int32(v < hi32)))
            count_below += below64
            if inside:
                for i in range(m):
                    if u[i] >= lo32 and u[i] < hi32:
                        if kept < cap:
                            entries[c, kept] = u[i]
                        kept += 1
        below[c] = count_below
        filled[c] = kept


@njit(cache=True)
def _chunk_counts(below, entries, filled, threshold, r):
    """Chosen coordinates per chunk (exclusive prefix, ``nchunks + 1``) and ties before each chunk."""
    nchunks = below.size
    hi_before = np.zeros(nchunks + 1, np.int64)
    ties_before = np.zeros(nchunks, np.int64)
    ties = 0
    for c in range(nchunks):
        less = 0
        equal = 0
        for j in range(filled[c]):
            v = entries[c, j]
            less += v < threshold
            equal += v == threshold
        ties_before[c] = ties
        take = min(equal, max(0, r - ties))
        ties += equal
        hi_before[c + 1] = hi_before[c] + below[c] + less + take
    return hi_before, ties_before


def _plan_exact(key: np.uint64, n: int, k: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """:func:`split_plan` from all ``n`` uniforms at once (``n`` int64 of memory): the fallback."""
    u24 = (common.uniform_stream(key, n, 0) * np.float32(_TOP)).astype(np.int64)
    threshold = int(np.partition(u24, k - 1)[k - 1])
    less = u24 < threshold
    r = k - int(less.sum())
    starts = np.arange(0, n, CHUNK)
    tie = (u24 == threshold).astype(np.int64)
    ties_in = np.add.reduceat(tie, starts)
    ties_before = np.concatenate([[0], np.cumsum(ties_in)[:-1]]).astype(np.int64)
    taken = np.minimum(ties_in, np.maximum(0, r - ties_before))
    per_chunk = np.add.reduceat(less.astype(np.int64), starts) + taken
    hi_before = np.concatenate([[0], np.cumsum(per_chunk)]).astype(np.int64)
    return threshold, r, hi_before, ties_before


def split_plan(key: np.uint64, n: int, k: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """Where the ``k`` coordinates with the smallest ``(u_i, i)`` are, chunk by chunk.

    Parameters
    ----------
    key : np.uint64
        Stream key of the split's uniforms.
    n, k : int
        Coordinates, and how many of them to choose (``0 <= k <= n``).

    Returns
    -------
    threshold, r : int
        The chosen set is every ``u_i < threshold`` and the first ``r`` coordinates with
        ``u_i == threshold``.
    hi_before : np.ndarray
        int64, ``nchunks + 1``: chosen coordinates before each chunk (and in all).
    ties_before : np.ndarray
        int64, ``nchunks``: coordinates with ``u_i == threshold`` before each chunk.
    """
    nchunks = (n + CHUNK - 1) // CHUNK
    if k <= 0 or k >= n:  # none or all: every u_i is below 2**24, none below 0
        sizes = np.minimum(CHUNK, n - CHUNK * np.arange(nchunks)) if k else np.zeros(nchunks, np.int64)
        hi_before = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return (_TOP if k else 0), 0, hi_before, np.zeros(nchunks, np.int64)
    p = k / n
    half = math.ceil(WINDOW_SIGMAS * math.sqrt(n * p * (1 - p)) / n * _TOP) + 64
    centre = round(p * _TOP)
    w_lo, w_hi = max(0, centre - half), min(_TOP, centre + half + 1)
    expected = min(n, CHUNK) * (w_hi - w_lo) / _TOP
    cap = min(CHUNK, math.ceil(expected + WINDOW_SIGMAS * math.sqrt(expected) + 64))
    below = np.empty(nchunks, np.int64)
    filled = np.empty(nchunks, np.int64)
    entries = np.empty((nchunks, cap), np.uint64)
    _split_window(key, n, w_lo, w_hi, below, entries, filled)
    rank = k - int(below.sum())  # 1-based rank of the threshold among the window's members
    if int(filled.max()) > cap or not 1 <= rank <= int(filled.sum()):
        return _plan_exact(key, n, k)
    members = entries[np.arange(cap)[None, :] < filled[:, None]]
    threshold = int(np.partition(members, rank - 1)[rank - 1])
    r = rank - int((members < threshold).sum())
    hi_before, ties_before = _chunk_counts(below, entries, filled, np.uint64(threshold), r)
    return threshold, r, hi_before, ties_before


@njit(cache=True)
def _chosen(key, lo, m, threshold, r, tie, flag, hashes):
    """``flag[:m]`` = whether coordinates ``lo .. lo + m`` are chosen; returns the ties seen so far
    (``hashes``: uint32 scratch of at least ``m``, for their 24 random bits)."""
    t = np.uint32(threshold)
    hash24_fill(counter(key, lo), hashes, m)
    tied = False
    for i in range(m):  # a flag and an OR: vectorized eight (32-bit) lanes wide
        v = hashes[i]
        flag[i] = v < t
        tied |= v == t
    if tied:  # rare: coordinates exactly at the threshold, chosen in position order
        for i in range(m):
            if hashes[i] == t:
                flag[i] = tie < r
                tie += 1
    return tie


# ---------------------------------------------------------------- fractional bits: the passes
@njit(cache=True, inline="always")
def _small_index(z, nb, t0, t1, t2):
    """Index of the nearest of 2 (``nb = 1`` boundary) or 4 (``nb = 3``) centroids: boundaries below ``z``."""
    if nb == 1:
        return np.uint8(t0 < z)
    return np.uint8(t0 < z) + np.uint8(t1 < z) + np.uint8(t2 < z)


@njit(cache=True, inline="always")
def _small_centroid(k, nb, c0, c1, c2, c3):
    """Centroid ``k`` of 2 (``nb = 1``) or 4 (``nb = 3``), by selects."""
    if nb == 1:
        return c1 if k else c0
    return c0 if k == 0 else (c1 if k == 1 else (c2 if k == 2 else c3))


@njit(cache=True, inline="always")
def _table4(values, nb):
    """The first ``nb + 1`` entries of ``values`` (at most 4), padded by repeating the last."""
    top = min(nb, values.size - 1)
    return values[0], values[min(1, top)], values[min(2, top)], values[min(3, top)]


@njit(cache=True, inline="always")
def _split_small(xs, m, norm, flag, lo_bounds, lo_cents, hi_bounds, hi_cents, k_lo, k_hi, prods, lo_nb, hi_nb):
    """Both indices and ``dot``'s products of a bucket by compares and selects (``lo_nb``, ``hi_nb``:
    boundaries of the two widths, constants where inlined: 0 (no low width), 1 or 3)."""
    ht0, ht1, ht2, _ = _table4(hi_bounds, hi_nb - 1)
    hc0, hc1, hc2, hc3 = _table4(hi_cents, hi_nb)
    lt0, lt1, lt2, _ = _table4(lo_bounds, max(lo_nb - 1, 0))
    lc0, lc1, lc2, lc3 = _table4(lo_cents, lo_nb)
    for i in range(m):
        v = np.float64(xs[i])
        z = v * norm
        kh = _small_index(z, hi_nb, ht0, ht1, ht2)
        k_hi[i] = kh
        ch = _small_centroid(kh, hi_nb, hc0, hc1, hc2, hc3)
        if lo_nb:
            kl = _small_index(z, lo_nb, lt0, lt1, lt2)
            k_lo[i] = kl
            cl = _small_centroid(kl, lo_nb, lc0, lc1, lc2, lc3)
        else:
            cl = 0.0
        prods[i] = (ch if flag[i] else cl) * v


@njit(cache=True)
def _split_bucket(xs, m, norm, flag, lo_width, lo_bounds, lo_cents, hi_bounds, hi_cents, k_lo, k_hi, prods, z):
    """A bucket's indices at both widths (``k_lo`` untouched when ``lo_width`` is 0) and ``dot``'s products:
    selects for the rates 0/1 and 1/2 bits, else boundary counting (:func:`_nearest`) and lookups."""
    hi_width = lo_width + 1
    if lo_width == 0 and hi_width == 1:
        _split_small(xs, m, norm, flag, lo_bounds, lo_cents, hi_bounds, hi_cents, k_lo, k_hi, prods, 0, 1)
    elif lo_width == 1 and hi_width == 2:
        _split_small(xs, m, norm, flag, lo_bounds, lo_cents, hi_bounds, hi_cents, k_lo, k_hi, prods, 1, 3)
    else:
        for i in range(m):
            z[i] = np.float64(xs[i]) * norm
        if lo_width:
            _nearest(z, m, lo_bounds, k_lo)
        _nearest(z, m, hi_bounds, k_hi)
        for i in range(m):
            low = lo_cents[k_lo[i]] if lo_width else 0.0
            prods[i] = (hi_cents[k_hi[i]] if flag[i] else low) * np.float64(xs[i])


@parallel_kernel(count_arg=1)
def split_quantize(
    x, n, d, lo_width, hi_width, lo_bounds, lo_cents, hi_bounds, hi_cents,
    key, threshold, r, hi_before, ties_before, lo_out, hi_out, sq, dot, edge_pos, edge_val,
    layout, rot_scales, rot_key,
):  # fmt: skip
    """Fractional EDEN: indices of the chosen coordinates at ``hi_width`` bits into ``hi_out``, of the
    others at ``lo_width`` (0: not sent) into ``lo_out``, in coordinate order; ``sq`` / ``dot`` per bucket.

    The ``n`` coordinates are ``x``, or with a rotation (``layout``, ``rot_scales``, ``rot_key``
    as for :func:`quantize`; an empty ``layout`` for none) ``rht``'s rotation of ``x``, each chunk
    rotated in cache first. ``edge_pos`` / ``edge_val`` (``4 * nchunks``) receive the stream bytes
    that chunks share (:func:`~fedquant.codecs.kernels.common.merge_edges` writes them after the
    pass). Returns ``(chunks whose count of chosen coordinates disagrees with hi_before`` (0; such
    a chunk writes nothing), ``rotated blocks holding NaN or Inf)``.

    Per bucket, the vectorized loops compute everything (norm, choice, both indices, ``dot``'s
    products); one short loop then compacts the indices into the two streams.
    """
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    nonfinite = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        start = c * CHUNK
        stop = min(start + CHUNK, n)
        xc, nonfinite[c] = chunk_in_cache(x, start, stop, layout, rot_scales, rot_key)
        z = np.empty(d, np.float64)
        prods = np.empty(d, np.float64)
        k_lo = np.zeros(d, np.uint8)
        k_hi = np.empty(d, np.uint8)
        flag = np.empty(d, np.uint8)
        hashes = np.empty(d, np.uint32)
        lo_codes = np.empty(CHUNK + 1, np.uint8)
        hi_codes = np.empty(CHUNK + 1, np.uint8)
        n_lo = 0
        n_hi = 0
        tie = ties_before[c]
        for lo in range(0, stop - start, d):
            m = min(d, stop - start - lo)
            b = (start + lo) // d
            xs = xc[lo : lo + m]
            s = _sum_f64(xs, 0, m, True)
            sq[b] = s
            norm = np.sqrt(m / s) if s > 0 else 0.0
            tie = _chosen(key, start + lo, m, threshold, r, tie, flag, hashes)
            _split_bucket(xs, m, norm, flag, lo_width, lo_bounds, lo_cents, hi_bounds, hi_cents, k_lo, k_hi, prods, z)
            dot[b] = _total_f64(prods, 0, m)
            n_hi, n_lo = split_by_flags(flag, m, k_hi, k_lo, hi_codes, n_hi, lo_codes, n_lo)
        h0 = hi_before[c]
        if n_hi != hi_before[c + 1] - h0:
            bad[c] = 1
            for j in range(4):
                edge_pos[4 * c + j] = -1
            continue
        if lo_width:
            pack_at(lo_codes, n_lo, lo_width, lo_out, (start - h0) * lo_width, edge_pos, edge_val, 4 * c)
        else:
            edge_pos[4 * c] = -1
            edge_pos[4 * c + 1] = -1
        pack_at(hi_codes, n_hi, hi_width, hi_out, h0 * hi_width, edge_pos, edge_val, 4 * c + 2)
    return bad.sum(), nonfinite.sum()


def split_streams(lo_out: np.ndarray, hi_out: np.ndarray, edge_pos: np.ndarray, edge_val: np.ndarray) -> None:
    """Write the bytes that chunks of :func:`split_quantize` share (lo stream, then hi stream)."""
    slots = np.arange(edge_pos.size) % 4
    for out, mine in ((lo_out, slots < 2), (hi_out, slots >= 2)):
        merge_edges(out, np.ascontiguousarray(edge_pos[mine]), np.ascontiguousarray(edge_val[mine]))


@njit(cache=True)
def _split_values(codes, flag, m, lo_width, lo_cents, hi_cents, scale, dst):
    """``dst[i] = centroid * scale``: ``hi_cents[codes[i]]`` where ``flag[i]``, else ``lo_cents[codes[i]]``
    (0 when ``lo_width`` is 0); selects for the rates 0/1 and 1/2 bits (float32 centroids)."""
    zero = np.float32(0.0)
    if lo_width == 0 and hi_cents.size == 2:
        h0, h1 = hi_cents[0], hi_cents[1]
        for i in range(m):
            dst[i] = ((h1 if codes[i] else h0) if flag[i] else zero) * scale
    elif lo_width == 1 and hi_cents.size == 4:
        h0, h1, h2, h3 = hi_cents[0], hi_cents[1], hi_cents[2], hi_cents[3]
        l0, l1 = lo_cents[0], lo_cents[1]
        for i in range(m):
            k = codes[i]
            high = h0 if k == 0 else (h1 if k == 1 else (h2 if k == 2 else h3))
            low = l1 if k else l0
            dst[i] = (high if flag[i] else low) * scale
    else:
        for i in range(m):
            k = codes[i]
            dst[i] = (hi_cents[k] if flag[i] else (lo_cents[k] if lo_width else zero)) * scale


@parallel_kernel(count_arg=1)
def split_dequantize(
    lo_data, numel, d, lo_width, hi_width, lo_cents, hi_cents, scales,
    key, threshold, r, hi_before, ties_before, hi_data, out, layout, rot_scales, rot_key,
):  # fmt: skip
    """Fractional EDEN decoding into ``out``: ``centroid * scale`` of the stream each coordinate is in
    (0 where ``lo_width`` is 0). The streams must hold exactly their packed sizes (the caller checks).
    With a rotation (see :func:`split_quantize`; ``numel`` its laid-out size) each chunk's values go
    through ``rht``'s inverse rotation in cache and ``out`` receives the first ``out.size`` values.
    Returns ``(chunks whose chosen coordinates disagree with hi_before`` (0), ``blocks of out
    holding NaN or Inf`` (0 without a rotation)).
    """
    nchunks = (numel + CHUNK - 1) // CHUNK
    rotate = layout.shape[0] > 0
    bad = np.zeros(nchunks, np.int64)
    nonfinite = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        start = c * CHUNK
        stop = min(start + CHUNK, numel)
        h0 = hi_before[c]
        n_hi = hi_before[c + 1] - h0
        n_lo = stop - start - n_hi
        lo_codes = np.zeros(CHUNK + 1, np.uint8)
        hi_codes = np.zeros(CHUNK + 1, np.uint8)
        if n_hi < 0 or n_lo < 0:
            bad[c] = 1
            continue
        if lo_width:
            unpack_at(lo_data, (start - h0) * lo_width, n_lo, lo_width, lo_codes)
        unpack_at(hi_data, h0 * hi_width, n_hi, hi_width, hi_codes)
        flag = np.empty(d, np.uint8)
        hashes = np.empty(d, np.uint32)
        codes = np.empty(d, np.uint8)
        values = np.empty(stop - start, np.float32) if rotate else out[start:stop]
        tie = ties_before[c]
        j_lo = 0
        j_hi = 0
        for lo in range(0, stop - start, d):
            m = min(d, stop - start - lo)
            scale = scales[(start + lo) // d]
            tie = _chosen(key, start + lo, m, threshold, r, tie, flag, hashes)
            j_hi, j_lo = merge_by_flags(flag, m, hi_codes, j_hi, lo_codes, j_lo, codes)
            _split_values(codes, flag, m, lo_width, lo_cents, hi_cents, scale, values[lo : lo + m])
        bad[c] = j_hi != n_hi
        if rotate:
            kept = out[start : min(stop, out.size)]
            nonfinite[c] = inverse_span(values, start, stop, layout, rot_scales, rot_key, kept)
    return bad.sum(), nonfinite.sum()
