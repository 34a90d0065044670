"""Blocked fast Walsh–Hadamard transform with random signs: numba kernels and their torch twin.

A tensor is laid out as consecutive power-of-two *blocks* (sizes ``2**k``, the last one may run
past the data and is zero-padded). Each block of ``L = 2**k`` elements goes through the
orthonormal randomized Hadamard transform ``y = H_k D x / sqrt(L)``:

* **forward**: ``v_i = x_i * c`` with the sign of ``v_i`` flipped where ``D`` is -1 (``c`` the
  float32 value of ``2**(-k/2)``; exact for even ``k``), then the butterfly stages
  ``h = 1, 2, 4, ..., L/2``: ``(a, b) -> (a + b, a - b)`` on elements ``h`` apart;
* **inverse**: ``v_i = y_i * c``, the same stages, then the sign flips (``H`` is symmetric and
  ``H H = L I``, so this undoes the forward transform up to float32 rounding).

``D_ii`` is -1 where the uniform ``i`` of the counter-based stream of :mod:`fedquant.rng` (``i``
the element's position in the laid-out tensor) is at least 1/2, i.e. where the top bit of its
SplitMix64 hash is set: the numba kernels hash inline and xor that bit into the float's sign,
the torch twin reads that bit (:func:`fedquant.rng.top_bits_negative`).

Both paths perform these float32 operations (one multiply, sign flips, the additions of the
stages in ascending ``h``) on every element, so they give bit-identical results; only the order
in which independent butterflies run differs. The numba path works in two passes over memory:

1. **low pass**: each cache tile of ``TILE = 2**TILE_LOG2`` elements (a part of a larger block,
   or whole smaller blocks of one size) is loaded, scaled and signed, and runs all stages with
   ``h < TILE`` while in cache (the first three in one sweep, then two per sweep);
2. **high pass** (blocks larger than a tile): the block is a ``(rows, TILE)`` matrix and the
   remaining stages are a Hadamard transform down the rows; each strip of columns (about
   ``STRIP_FLOATS`` floats) is copied to a buffer and runs all of them there (butterflies of
   contiguous rows, which vectorize).

Both passes run in parallel (over tiles, over strips) through
:func:`fedquant.codecs.kernels.common.parallel_kernel`, serially below ``PARALLEL_MIN`` elements.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from numba import njit, prange

from fedquant.codecs.kernels.common import _GAMMA, _MIX1, _MIX2, _S27, _S30, parallel_kernel
from fedquant.rng import top_bits_negative

#: A tile: 32 KiB of float32, the L1 data cache.
TILE_LOG2 = 13
TILE = 1 << TILE_LOG2
#: Floats a strip of the high pass holds (256 KiB: in L2), at least ``MIN_STRIP`` columns wide.
STRIP_FLOATS = 1 << 16
MIN_STRIP = 16

_ZERO32 = np.float32(0.0)
_S32 = np.uint64(32)
_SIGN = np.uint32(0x80000000)
_EXP_MASK = np.uint32(0x7F800000)


def block_scale(k: int) -> np.float32:
    """The float32 normalization ``2**(-k/2)`` of a block of ``2**k`` elements."""
    return np.float32(2.0 ** (-k / 2))


# ---------------------------------------------------------------- numba: the butterflies
@njit(cache=True)
def _first3(seg, length):
    """Stages ``h = 1, 2, 4`` in one sweep, eight elements at a time (``length`` a multiple of 8)."""
    for i in range(0, length, 8):
        a0 = seg[i]
        a1 = seg[i + 1]
        a2 = seg[i + 2]
        a3 = seg[i + 3]
        a4 = seg[i + 4]
        a5 = seg[i + 5]
        a6 = seg[i + 6]
        a7 = seg[i + 7]
        b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
        b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
        c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
        c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
        seg[i] = c0 + c4
        seg[i + 1] = c1 + c5
        seg[i + 2] = c2 + c6
        seg[i + 3] = c3 + c7
        seg[i + 4] = c0 - c4
        seg[i + 5] = c1 - c5
        seg[i + 6] = c2 - c6
        seg[i + 7] = c3 - c7


@njit(cache=True)
def _stages(seg, length, unit):
    """Stages ``h = unit, 2 unit, .., length/2`` on the contiguous ``seg[:length]``.

    Two stages per sweep (radix 4) on contiguous runs of ``h`` elements, which vectorize: half
    the loads and stores of one sweep per stage, the same additions. ``length`` and ``unit`` are
    powers of two.
    """
    h = unit
    while 4 * h <= length:
        for i0 in range(0, length, 4 * h):
            q0 = seg[i0 : i0 + h]
            q1 = seg[i0 + h : i0 + 2 * h]
            q2 = seg[i0 + 2 * h : i0 + 3 * h]
            q3 = seg[i0 + 3 * h : i0 + 4 * h]
            for j in range(h):
                a = q0[j]
                b = q1[j]
                c = q2[j]
                d = q3[j]
                s0 = a + b
                s1 = a - b
                s2 = c + d
                s3 = c - d
                q0[j] = s0 + s2
                q1[j] = s1 + s3
                q2[j] = s0 - s2
                q3[j] = s1 - s3
        h *= 4
    if 2 * h <= length:
        for i0 in range(0, length, 2 * h):
            lo = seg[i0 : i0 + h]
            hi = seg[i0 + h : i0 + 2 * h]
            for j in range(h):
                u = lo[j]
                w = hi[j]
                lo[j] = u + w
                hi[j] = u - w


@njit(cache=True)
def _tile_stages(seg, length):
    """All stages of a block that fits a tile."""
    if length >= 8:
        _first3(seg, length)
        _stages(seg, length, 8)
    else:
        _stages(seg, length, 1)


@njit(cache=True)
def _flip_signs(seg, key, o):
    """Flip the sign of ``seg[i]`` where the uniform ``o + i`` of the stream is at least 1/2.

    That uniform is at least 1/2 exactly when the top bit of its 64-bit hash is set; the bit goes
    straight into the float's sign bit.
    """
    bits = seg.view(np.uint32)
    for i in range(seg.size):
        z = key + np.uint64(o + i + 1) * _GAMMA
        z = (z ^ (z >> _S30)) * _MIX1
        z = (z ^ (z >> _S27)) * _MIX2
        bits[i] ^= np.uint32(z >> _S32) & _SIGN


@njit(cache=True)
def _count_nonfinite(seg):
    """How many of ``seg`` are NaN or Inf (all exponent bits set)."""
    bits = seg.view(np.uint32)
    bad = 0
    for i in range(seg.size):
        bad += (bits[i] & _EXP_MASK) == _EXP_MASK
    return bad


@njit(cache=True)
def _low_tile(src, out, tiles, scales, key, inverse, t):
    """Load, scale (and sign, forward) tile ``t`` from ``src`` into ``out``; run its stages.

    ``tiles[t] = (offset, length, block)``, ``scales[t]`` its blocks' ``c``: a tile holds
    ``length / block`` whole blocks of ``block`` elements (the inverse then flips the signs here,
    there is no high pass), or, with ``block > length``, a tile-sized part of a larger block.
    Returns how many of the tile's final values are not finite (0 for a part of a larger block,
    which the high pass counts).
    """
    o = tiles[t, 0]
    length = tiles[t, 1]
    block = tiles[t, 2]
    c = scales[t]
    seg = out[o : o + length]
    m = min(max(src.size - o, 0), length)
    xs = src[o : o + m]
    for i in range(m):
        seg[i] = xs[i] * c
    for i in range(m, length):
        seg[i] = _ZERO32
    if not inverse:
        _flip_signs(seg, key, o)
    step = min(block, length)
    for b in range(0, length, step):
        _tile_stages(seg[b : b + step], step)
    if block > length:
        return 0
    if inverse:
        _flip_signs(seg, key, o)
    return _count_nonfinite(seg)


@njit(cache=True)
def _high_strip(out, strips, key, inverse, s, buf):
    """The stages ``h >= TILE`` of strip ``s``; ``strips[s] = (block offset, rows, column, width)``.

    A strip's rows lie ``TILE`` floats apart, a power of two that maps them all to the same cache
    sets; they are copied into the contiguous ``buf``, transformed there and copied back.
    """
    o = strips[s, 0]
    rows = strips[s, 1]
    col = o + strips[s, 2]
    w = strips[s, 3]
    for r in range(rows):
        buf[r * w : (r + 1) * w] = out[col + r * TILE : col + r * TILE + w]
    _stages(buf, rows * w, w)
    for r in range(rows):
        row = buf[r * w : (r + 1) * w]
        if inverse:
            _flip_signs(row, key, col + r * TILE)
        out[col + r * TILE : col + r * TILE + w] = row
    return _count_nonfinite(buf)


@parallel_kernel(count_arg=1)
def _low_pass(src, out, tiles, scales, key, inverse):
    nt = tiles.shape[0]
    bad = np.zeros(nt, np.int64)
    for t in prange(nt):
        bad[t] = _low_tile(src, out, tiles, scales, key, inverse, t)
    return bad.sum()


@parallel_kernel(count_arg=0)
def _high_pass(out, strips, key, inverse):
    ns = strips.shape[0]
    bad = np.zeros(ns, np.int64)
    for s in prange(ns):
        bad[s] = _high_strip(out, strips, key, inverse, s, np.empty(strips[s, 1] * strips[s, 3], np.float32))
    return bad.sum()


def runs_numel(runs: tuple[tuple[int, int], ...]) -> int:
    """Elements a layout of runs ``(log2 size, count)`` holds."""
    return sum(c << k for k, c in runs)


@lru_cache(maxsize=256)
def _work(runs: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles (and their scales) of the low pass, strips of the high pass, for a layout of runs.

    Blocks of at most a tile share tiles with their run's neighbours (up to ``TILE`` elements);
    larger ones are split into tiles for the low pass and strips of columns for the high pass.
    """
    tiles = []
    scales = []
    strips = []
    o = 0
    for k, count in runs:
        size = 1 << k
        if k <= TILE_LOG2:
            per = TILE >> k
            starts = np.arange(0, count, per, dtype=np.int64)
            lengths = np.minimum(per, count - starts) * size
            tiles.append(np.stack([o + starts * size, lengths, np.full_like(starts, size)], axis=1))
        else:
            rows = size >> TILE_LOG2
            width = min(TILE, max(MIN_STRIP, STRIP_FLOATS // rows))
            blocks = o + size * np.arange(count, dtype=np.int64)
            parts = np.arange(0, size, TILE, dtype=np.int64)
            offsets = (blocks[:, None] + parts[None, :]).reshape(-1)
            tiles.append(np.stack([offsets, np.full_like(offsets, TILE), np.full_like(offsets, size)], axis=1))
            cols = np.arange(0, TILE, width, dtype=np.int64)
            starts = np.repeat(blocks, cols.size)
            strips.append(
                np.stack(
                    [starts, np.full_like(starts, rows), np.tile(cols, count), np.full_like(starts, width)], axis=1
                )
            )
        scales.append(np.full(tiles[-1].shape[0], block_scale(k), np.float32))
        o += count * size
    arrays = (
        np.concatenate(tiles).astype(np.int64) if tiles else np.zeros((0, 3), np.int64),
        np.concatenate(scales) if scales else np.zeros(0, np.float32),
        np.concatenate(strips).astype(np.int64) if strips else np.zeros((0, 4), np.int64),
    )
    for a in arrays:
        a.setflags(write=False)
    return arrays


def fwht_numba(src: np.ndarray, runs: tuple[tuple[int, int], ...], key: int, inverse: bool) -> tuple[np.ndarray, int]:
    """The randomized Hadamard transform of ``src`` (float32, contiguous) on the CPU.

    Parameters
    ----------
    src : np.ndarray
        1-D float32 input, at most as long as the layout (the rest is zero padding).
    runs : tuple of (int, int)
        The block layout as runs ``(log2 block size, number of blocks)``, in order
        (``fedquant.codecs.transforms.rht.block_runs``).
    key : int
        Stream key of the signs (``fedquant.rng.stream_key`` of the sign seed).
    inverse : bool
        Apply the inverse (scale, stages, signs) instead of the forward transform.

    Returns
    -------
    out : np.ndarray
        float32, ``runs_numel(runs)`` elements (a new array; ``src`` is not modified).
    nonfinite : int
        How many of them are NaN or Inf (counted in the same pass).
    """
    tiles, scales, strips = _work(runs)
    total = int(tiles[-1, 0] + tiles[-1, 1]) if tiles.shape[0] else 0
    if src.size > total:
        raise ValueError(f"{src.size} elements do not fit a layout of {total}")
    out = np.empty(total, np.float32)
    if not total:
        return out, 0
    ukey = np.uint64(key)
    bad = _low_pass(src, out, tiles, scales, ukey, inverse)
    if strips.shape[0]:
        bad += _high_pass(out, strips, ukey, inverse)
    return out, int(bad)


# ---------------------------------------------------------------- torch twin (CUDA)
def _stages_torch(v: torch.Tensor) -> None:
    """All butterfly stages, in ascending ``h``, on each row of ``v`` (rows of ``2**k``), in place.

    Each stage writes its sums and differences into the other of two buffers (no copies; one
    at the end if the number of stages is odd).
    """
    count, length = v.shape
    src, dst = v, torch.empty_like(v)
    h = 1
    while h < length:
        w = src.view(count, length // (2 * h), 2, h)
        out = dst.view(count, length // (2 * h), 2, h)
        a, b = w[:, :, 0, :], w[:, :, 1, :]
        torch.add(a, b, out=out[:, :, 0, :])
        torch.sub(a, b, out=out[:, :, 1, :])
        src, dst = dst, src
        h *= 2
    if src is not v:
        v.copy_(src)


def fwht_torch(src: torch.Tensor, runs: tuple[tuple[int, int], ...], sign_seed: int, inverse: bool) -> torch.Tensor:
    """:func:`fwht_numba` in torch, on ``src``'s device (same float32 operations, same results).

    ``sign_seed`` is the seed whose stream (:func:`fedquant.rng.uniform`) gives the signs; each
    run of equal blocks goes as one batch.
    """
    total = runs_numel(runs)
    if src.numel() > total:
        raise ValueError(f"{src.numel()} elements do not fit a layout of {total}")
    out = torch.zeros(total, dtype=torch.float32, device=src.device)
    if not total:
        return out
    out[: src.numel()] = src
    negative = top_bits_negative(sign_seed, total, device=src.device)  # uniform >= 1/2
    o = 0
    for k, count in runs:
        size = count << k
        v = out[o : o + size].view(count, 1 << k)
        neg = negative[o : o + size].view(count, 1 << k)
        v.mul_(float(block_scale(k)))
        if not inverse:
            v.copy_(torch.where(neg, -v, v))
        _stages_torch(v)
        if inverse:
            v.copy_(torch.where(neg, -v, v))
        o += size
    return out
