"""Sums over a scaled grid's decoded values read straight from its packed symbols (the server's fast path).

A server that aggregates updates needs, of each decoded update ``u``: its squared norm, a check
that ``base + u`` stays finite in float32, ``u`` added to running sums, and later its inner
products with the round's consensus. Writing ``u`` out (4 bytes per element) and reading it back
for each of those costs more than decoding it again: the packed symbols are 4-8 bits per element.
These kernels decode each chunk's symbols into a buffer that stays in L1 (the unpacking of
:mod:`fedquant.codecs.kernels.grid`'s decoder) and use the values there, element ``i`` being
``float32(code_i - s) * steps[i // d]``: bit for bit the value :func:`~fedquant.codecs.kernels.grid.unpack_dequant`
writes. Every kernel also counts the symbols above ``2s`` (a malformed payload), which the
caller must refuse.

The sums of squares and inner products are float64 per chunk, added in chunk order, like those of
:mod:`fedquant.codecs.kernels.norms` (within ~1e-12 of the exact sums).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from fedquant.codecs.kernels.common import CHUNK, unpack_from
from fedquant.codecs.kernels.norms import REASSOCIATE
from fedquant.jit import parallel_kernel

_F32_MAX = np.float32(np.finfo(np.float32).max)


@njit(cache=True, fastmath=REASSOCIATE)
def _segment_accumulate(codes, s, step, bs, cs, ws, weight, check):
    """One bucket's part of a chunk: ``(sum (code - s)**2, largest code, non-finite base + u)``, sums added.

    The squares are summed exactly, in integers (``u**2 = (code - s)**2 step**2``); the check of
    ``base + u`` runs only when the caller could not bound it (``check``).
    """
    squares = np.int64(0)
    top = np.int32(0)
    nonfinite = 0
    s32 = np.int32(s)
    for k in range(codes.size):
        c = np.int32(codes[k])
        top = max(top, c)
        q = c - s32
        squares += np.int64(q) * np.int64(q)
        u = np.float32(q) * step
        if check:
            nonfinite += not abs(bs[k] + u) <= _F32_MAX
        if cs.size:
            cs[k] += u
        if ws.size:
            ws[k] += weight * np.float64(u)
    return squares, top, nonfinite


@njit(cache=True)
def _buckets_accumulate(codes, c0, c1, d, steps, s, base, consensus, weighted, weight, check):
    """:func:`_segment_accumulate` over the buckets of elements ``c0 .. c1`` (symbols in ``codes``):
    ``(sum u**2 in float64, largest code, non-finite base + u)``."""
    squares = 0.0
    top = 0
    nonfinite = 0
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        cs = consensus[i:hi] if consensus.size else consensus
        ws = weighted[i:hi] if weighted.size else weighted
        step = steps[b]
        q, t, f = _segment_accumulate(codes[i - c0 : hi - c0], s, step, base[i:hi], cs, ws, weight, check)
        squares += np.float64(q) * (np.float64(step) * np.float64(step))
        top = max(top, t)
        nonfinite += f
        i = hi
    return squares, top, nonfinite


@njit(cache=True)
def _chunk_accumulate(data, n, d, steps, s, width, base, consensus, weighted, weight, check, c):
    c0 = c * CHUNK
    c1 = min(c0 + CHUNK, n)
    if width <= 8:  # byte symbols: half the traffic through the chunk buffer
        small = np.empty(CHUNK, np.uint8)
        unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
        return _buckets_accumulate(small, c0, c1, d, steps, s, base, consensus, weighted, weight, check)
    wide = np.empty(CHUNK, np.uint16)
    unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
    return _buckets_accumulate(wide, c0, c1, d, steps, s, base, consensus, weighted, weight, check)


@parallel_kernel(count_arg=1)
def packed_accumulate(data, n, d, steps, s, width, base, consensus, weighted, weight, check):
    """The checks and running sums of a decoded grid update, from its packed symbols.

    Element ``i``'s value is ``u_i = float32(code_i - s) * steps[i // d]``. Adds ``u`` to
    ``consensus`` (float32) and ``weight x u`` to ``weighted`` (float64); either may be empty (not
    kept). Returns ``(sum(u**2), largest symbol, how many float32 base + u are not finite)``, the
    last counted only with ``check`` (0 otherwise: the caller has bounded ``|base| + |u|``); the
    sums are written whatever the result (a caller that refuses the update discards them).
    ``sum(u**2)`` is ``sum_b steps[b]**2 sum (code - s)**2``, the inner sums exact: within a few
    float64 roundings of the sum of the float64 squares of the float32 values.
    """
    nchunks = (n + CHUNK - 1) // CHUNK
    squares = np.zeros(nchunks, np.float64)
    top = np.zeros(nchunks, np.int64)
    nonfinite = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        squares[c], top[c], nonfinite[c] = _chunk_accumulate(
            data, n, d, steps, s, width, base, consensus, weighted, weight, check, c
        )
    return squares.sum(), top.max() if nchunks else 0, nonfinite.sum()


@njit(cache=True, fastmath=REASSOCIATE)
def _segment_dot(codes, s, cs):
    """``sum (code - s) c`` of one bucket's part of a chunk (its step applied by the caller)."""
    dot = 0.0
    s32 = np.int32(s)
    for k in range(codes.size):
        dot += np.float64(np.int32(codes[k]) - s32) * np.float64(cs[k])
    return dot


@njit(cache=True)
def _buckets_dot(codes, c0, c1, d, steps, s, consensus):
    dot = 0.0
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        dot += np.float64(steps[b]) * _segment_dot(codes[i - c0 : hi - c0], s, consensus[i:hi])
        i = hi
    return dot


@njit(cache=True)
def _chunk_dot(data, n, d, steps, s, width, consensus, c):
    c0 = c * CHUNK
    c1 = min(c0 + CHUNK, n)
    if width <= 8:
        small = np.empty(CHUNK, np.uint8)
        unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
        return _buckets_dot(small, c0, c1, d, steps, s, consensus)
    wide = np.empty(CHUNK, np.uint16)
    unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
    return _buckets_dot(wide, c0, c1, d, steps, s, consensus)


@parallel_kernel(count_arg=1)
def packed_dot(data, n, d, steps, s, width, consensus):
    """``<u, consensus>`` of a decoded grid update, from its packed symbols (float64: each bucket's
    ``sum (code - s) c`` times its step; within a few float64 roundings of the inner product of
    the float32 values). The caller has refused updates with symbols above ``2s`` before."""
    nchunks = (n + CHUNK - 1) // CHUNK
    dots = np.zeros(nchunks, np.float64)
    for c in prange(nchunks):
        dots[c] = _chunk_dot(data, n, d, steps, s, width, consensus, c)
    return dots.sum()
