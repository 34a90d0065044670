"""Fused numba kernels shared by the scaled-grid codecs (QSGD, TernGrad, scaled sign).

All kernels work on a flat float32 array split into buckets of ``d`` elements (the last bucket
may be short). They read the input once per pass and write packed bytes (or float32 output)
directly, in parallel over chunks of ``CHUNK`` elements; ``CHUNK`` is a multiple of 8, so every
chunk starts on a byte boundary of the packed stream at any bit width.

Stochastic rounding draws its uniforms inline from the counter-based stream of
:mod:`fedquant.rng`: element ``i`` of the flattened tensor uses
``splitmix64(stream_key(seed) + (i + 1) * GOLDEN_GAMMA) >> 40`` times ``2**-24``, bit for bit
what ``fedquant.rng.uniform(seed, n)[i]`` returns. The torch implementations in
:mod:`fedquant.codecs.grid` perform the same float32 operations in the same order, so both
paths produce identical bytes.

The rounding rule (one element ``v`` of a bucket with grid step ``step = scale / s``)::

    t = |v| / step                     # float32 division, exact on grid points
    f = floor(t)
    l = min(f + (u < t - f), s)        # u: the element's 24-bit uniform; min guards t > s by rounding
    q = sign(v) * l                    # signed level in [-s, s]; sign(0) = +1
    code = q + s                       # unsigned symbol in [0, 2s]

(a bucket with ``step = 0`` is all zeros and gets ``q = 0``), and decoding is
``(code - s) * step`` in float32.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from fedquant.rng import GOLDEN_GAMMA, MIX1, MIX2, UNIFORM_BITS, UNIFORM_SCALE

CHUNK = 1 << 14

_GAMMA = np.uint64(GOLDEN_GAMMA)
_MIX1 = np.uint64(MIX1)
_MIX2 = np.uint64(MIX2)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_SHIFT_U = np.uint64(64 - UNIFORM_BITS)
_U_SCALE = np.float32(UNIFORM_SCALE)
_ZERO32 = np.float32(0.0)
_ABS_MASK = np.uint32(0x7FFFFFFF)


@njit(cache=True, inline="always")
def uniform24(key: np.uint64, i: np.int64) -> np.float32:
    """Element ``i`` of the stream with key ``key`` (same as ``fedquant.rng.uniform``)."""
    z = key + np.uint64(i + 1) * _GAMMA
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return np.float32(z >> _SHIFT_U) * _U_SCALE


@njit(cache=True, parallel=True)
def uniform_stream(key: np.uint64, n: int, offset: int) -> np.ndarray:
    """``n`` uniforms of the stream starting at ``offset`` (for tests of the inline generator)."""
    out = np.empty(n, np.float32)
    for i in prange(n):
        out[i] = uniform24(key, offset + i)
    return out


# ---------------------------------------------------------------- per-bucket statistics
@njit(cache=True, parallel=True)
def bucket_max_abs(x: np.ndarray, d: int) -> np.ndarray:
    """``max |x|`` of each bucket, float32 (compares the bit patterns: exact for finite input)."""
    bits = x.view(np.uint32)
    n = x.size
    nb = (n + d - 1) // d
    out = np.empty(nb, np.uint32)
    for b in prange(nb):
        lo = b * d
        hi = min(lo + d, n)
        m = np.uint32(0)
        seg = bits[lo:hi]
        for i in range(hi - lo):
            m = max(m, seg[i] & _ABS_MASK)
        out[b] = m
    return out.view(np.float32)


@njit(cache=True)
def _sum_f64(x, lo, hi, square):
    """Sum of ``|x|`` (or ``x**2``) over ``lo .. hi`` in float64, in a fixed order.

    Eight partial sums (lane ``k`` takes the elements ``lo + k (mod 8)``), combined pairwise: the
    order is the same on every machine and the loop vectorizes.
    """
    acc = np.zeros(8, np.float64)
    seg = x[lo:hi]
    full = (hi - lo) // 8
    for g in range(full):
        for k in range(8):
            v = np.float64(seg[8 * g + k])
            acc[k] += v * v if square else abs(v)
    for k in range(hi - lo - 8 * full):
        v = np.float64(seg[8 * full + k])
        acc[k] += v * v if square else abs(v)
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


@njit(cache=True, parallel=True)
def bucket_l2(x: np.ndarray, d: int) -> np.ndarray:
    """Euclidean norm of each bucket, accumulated in float64 and rounded to float32."""
    n = x.size
    nb = (n + d - 1) // d
    out = np.empty(nb, np.float32)
    for b in prange(nb):
        lo = b * d
        out[b] = np.float32(np.sqrt(_sum_f64(x, lo, min(lo + d, n), True)))
    return out


@njit(cache=True, parallel=True)
def bucket_l1_mean(x: np.ndarray, d: int) -> np.ndarray:
    """``||x||_1 / count`` of each bucket (true count of the short last bucket), float32."""
    n = x.size
    nb = (n + d - 1) // d
    out = np.empty(nb, np.float32)
    for b in prange(nb):
        lo = b * d
        hi = min(lo + d, n)
        out[b] = np.float32(_sum_f64(x, lo, hi, False) / (hi - lo))
    return out


# ---------------------------------------------------------------- rounding to the grid
@njit(cache=True)
def _chunk_codes(x, d, steps, s, key, c0, c1, codes):
    """Symbols ``q + s`` of elements ``c0 .. c1`` into ``codes[0 : c1 - c0]``, bucket by bucket.

    Branch-free per element, on slices indexed from 0, so that LLVM vectorizes the loop (the
    hash included).
    """
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        step = steps[b]
        xs = x[i:hi]
        cs = codes[i - c0 : hi - c0]
        if step > _ZERO32:
            for k in range(hi - i):
                v = xs[k]
                t = abs(v) / step
                f = np.floor(t)
                lvl = min(np.int64(f) + np.int64(uniform24(key, i + k) < t - f), s)
                cs[k] = s - lvl if v < _ZERO32 else s + lvl
        else:
            cs[:] = s
        i = hi


@njit(cache=True)
def _pack_into(codes, count, width, out, pos):
    """Pack ``codes[:count]`` LSB-first at ``width`` bits into ``out`` from byte ``pos``.

    Widths up to 8 go by groups of 8 symbols, which fill exactly ``width`` bytes; wider symbols
    and the tail go through a bit accumulator.
    """
    start = 0
    p = pos
    if width <= 8:
        groups = count // 8
        for g in range(groups):
            word = np.uint64(0)
            for k in range(8):
                word |= np.uint64(codes[8 * g + k]) << np.uint64(k * width)
            base = pos + g * width
            for j in range(width):
                out[base + j] = (word >> np.uint64(8 * j)) & np.uint64(255)
        start = groups * 8
        p = pos + groups * width
    acc = np.uint64(0)
    nbits = 0
    for j in range(start, count):
        acc |= np.uint64(codes[j]) << np.uint64(nbits)
        nbits += width
        while nbits >= 8:
            out[p] = acc & np.uint64(255)
            acc >>= np.uint64(8)
            nbits -= 8
            p += 1
    if nbits:
        out[p] = acc & np.uint64(255)


@njit(cache=True, parallel=True)
def round_pack(x, d, steps, s, key, width):
    """Stochastically round ``x`` to the grid ``steps[b] * {-s..s}`` and pack the symbols.

    Returns
    -------
    np.ndarray
        uint8, ``ceil(n * width / 8)`` bytes: symbol ``q + s`` of element ``i`` at bits
        ``[i * width, (i + 1) * width)``.
    """
    n = x.size
    out = np.empty((n * width + 7) // 8, np.uint8)
    nchunks = (n + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        if width <= 8:  # byte symbols: half the traffic through the chunk buffer
            small = np.empty(CHUNK, np.uint8)
            _chunk_codes(x, d, steps, s, key, c0, c1, small)
            _pack_into(small, c1 - c0, width, out, (c0 * width) // 8)
        else:
            wide = np.empty(CHUNK, np.uint16)
            _chunk_codes(x, d, steps, s, key, c0, c1, wide)
            _pack_into(wide, c1 - c0, width, out, (c0 * width) // 8)
    return out


@njit(cache=True, parallel=True)
def scale_round_pack(x, d, s, key, width, l2):
    """:func:`bucket_max_abs` (or :func:`bucket_l2`) fused with :func:`round_pack`: one read of ``x``.

    Each chunk computes the scales of its own buckets and rounds them while they are in cache;
    this needs whole buckets per chunk, so ``CHUNK % d == 0`` (callers check). Returns
    ``(scales, packed)``, identical to the two-pass result.
    """
    n = x.size
    nb = (n + d - 1) // d
    scales = np.empty(nb, np.float32)
    steps = np.empty(nb, np.float32)
    bits = x.view(np.uint32)
    out = np.empty((n * width + 7) // 8, np.uint8)
    nchunks = (n + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        for b in range(c0 // d, (c1 + d - 1) // d):
            lo = b * d
            hi = min(lo + d, n)
            if l2:
                m = np.float32(np.sqrt(_sum_f64(x, lo, hi, True)))
            else:
                mb = np.uint32(0)
                seg = bits[lo:hi]
                for i in range(hi - lo):
                    mb = max(mb, seg[i] & _ABS_MASK)
                m = np.array([mb], np.uint32).view(np.float32)[0]
            scales[b] = m
            steps[b] = m / np.float32(s)
        if width <= 8:
            small = np.empty(CHUNK, np.uint8)
            _chunk_codes(x, d, steps, s, key, c0, c1, small)
            _pack_into(small, c1 - c0, width, out, (c0 * width) // 8)
        else:
            wide = np.empty(CHUNK, np.uint16)
            _chunk_codes(x, d, steps, s, key, c0, c1, wide)
            _pack_into(wide, c1 - c0, width, out, (c0 * width) // 8)
    return scales, out


@njit(cache=True, parallel=True)
def round_codes(x, d, steps, s, key):
    """Like :func:`round_pack` but returns the unpacked symbols ``q + s`` (uint16), for entropy coders."""
    n = x.size
    out = np.empty(n, np.uint16)
    nchunks = (n + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        _chunk_codes(x, d, steps, s, key, c0, c1, out[c0:c1])
    return out


# ---------------------------------------------------------------- decoding
@njit(cache=True)
def _unpack_from(data, pos, count, width, codes):
    """Inverse of :func:`_pack_into`: ``count`` symbols from byte ``pos`` into ``codes``."""
    mask = np.uint64((1 << width) - 1)
    start = 0
    p = pos
    if width <= 8:
        groups = count // 8
        for g in range(groups):
            base = pos + g * width
            word = np.uint64(0)
            for j in range(width):
                word |= np.uint64(data[base + j]) << np.uint64(8 * j)
            for k in range(8):
                codes[8 * g + k] = (word >> np.uint64(k * width)) & mask
        start = groups * 8
        p = pos + groups * width
    acc = np.uint64(0)
    nbits = 0
    for j in range(start, count):
        while nbits < width:
            acc |= np.uint64(data[p]) << np.uint64(nbits)
            nbits += 8
            p += 1
        codes[j] = acc & mask
        acc >>= np.uint64(width)
        nbits -= width


@njit(cache=True, parallel=True)
def unpack_dequant(data, n, d, steps, s, width):
    """Decode packed symbols into float32 values. Returns ``(values, number of symbols > 2s)``."""
    out = np.empty(n, np.float32)
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        if width <= 8:
            small = np.empty(CHUNK, np.uint8)
            _unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
            bad[c] = _chunk_dequant(small, d, steps, s, c0, c1, out)
        else:
            wide = np.empty(CHUNK, np.uint16)
            _unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
            bad[c] = _chunk_dequant(wide, d, steps, s, c0, c1, out)
    return out, bad.sum()


@njit(cache=True)
def _chunk_dequant(codes, d, steps, s, c0, c1, out):
    """``(code - s) * step`` for elements ``c0 .. c1``; returns how many codes exceed ``2s``."""
    bad = 0
    top = 2 * s
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        step = steps[b]
        cs = codes[i - c0 : hi - c0]
        ys = out[i:hi]
        for k in range(hi - i):
            c = np.int64(cs[k])
            bad += c > top
            ys[k] = np.float32(c - s) * step
        i = hi
    return bad


@njit(cache=True, parallel=True)
def codes_dequant(codes, d, steps, s):
    """Decode unpacked symbols (from an entropy decoder). Returns ``(values, symbols > 2s)``."""
    n = codes.size
    out = np.empty(n, np.float32)
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        bad[c] = _chunk_dequant(codes[c0:c1], d, steps, s, c0, c1, out)
    return out, bad.sum()


# ---------------------------------------------------------------- sign bits
@njit(cache=True, parallel=True)
def sign_pack(x):
    """One bit per element, LSB first: 1 where ``x < 0`` (so ``sign(0) = +1``)."""
    n = x.size
    nbytes = (n + 7) // 8
    out = np.empty(nbytes, np.uint8)
    full = n // 8
    for j in prange(full):
        acc = 0
        for k in range(8):
            acc |= np.int64(x[8 * j + k] < _ZERO32) << k
        out[j] = acc
    if full < nbytes:
        acc = 0
        for k in range(n - 8 * full):
            acc |= np.int64(x[8 * full + k] < _ZERO32) << k
        out[full] = acc
    return out


@njit(cache=True, parallel=True)
def sign_unpack(data, n, d, scales):
    """``-scale`` where the bit is 1, ``+scale`` where it is 0, bucket by bucket."""
    out = np.empty(n, np.float32)
    nchunks = (n + CHUNK - 1) // CHUNK
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        i = c0
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            m = scales[b]
            for j in range(i, hi):
                bit = (data[j >> 3] >> (j & 7)) & 1
                out[j] = -m if bit else m
            i = hi
    return out
