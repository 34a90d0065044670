"""Fused numba kernels shared by the scaled-grid codecs (QSGD, TernGrad, scaled sign).

All kernels work on a flat float32 array split into buckets of ``d`` elements (the last bucket
may be short). They read the input once per pass and write packed bytes (or float32 output)
directly, over chunks of ``CHUNK`` elements (in parallel from ``PARALLEL_MIN`` elements on, see
:func:`~fedquant.jit.twins.parallel_kernel`); ``CHUNK`` is a multiple of 8, so every
chunk starts on a byte boundary of the packed stream at any bit width. Each kernel
(``*_into``) writes outputs that its Python wrapper allocated with NumPy (see
:mod:`fedquant.codecs.kernels.common` for why).

Stochastic rounding draws its uniforms inline from the counter-based stream of
:mod:`fedquant.rng`: element ``i`` of the flattened tensor uses
``splitmix64(stream_key(seed) + (i + 1) * GOLDEN_GAMMA) >> 40`` times ``2**-24``, bit for bit
what ``fedquant.rng.uniform(seed, n)[i]`` returns. The torch twins at the end of this module
(``torch_*``, the path of CUDA tensors) perform the same float32 operations in the same order,
so both paths produce identical bytes; the quantizers of :mod:`fedquant.codecs.quantizers.grid`
and :mod:`fedquant.codecs.quantizers.sign` pick one.

The rounding rule (one element ``v`` of a bucket with grid step ``step = scale / s``)::

    t = |v| / step                     # float32 division, exact on grid points
    f = floor(t)
    l = min(f + (u < t - f), s)        # u: the element's 24-bit uniform; min guards t > s by rounding
    q = sign(v) * l                    # signed level in [-s, s]; sign(0) = +1
    code = q + s                       # unsigned symbol in [0, 2s]

(a bucket with ``step = 0`` is all zeros and gets ``q = 0``), and decoding is
``(code - s) * step`` in float32. The kernels take ``|v| / step`` as a float64 product with
``1 / step`` rounded to float32, bit for bit the division
(:func:`~fedquant.codecs.kernels.common.exact_quotient`; a chunk where a quotient may be
subnormal divides), and do the rest in float32 on 32-bit lanes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from fedquant.codecs.kernels.common import (
    _ABS_MASK,
    _ONE32,
    _U_SCALE,
    _ZERO32,
    CHUNK,
    _sum_f64,
    add_counts,
    chunk_quotients,
    count_table,
    group_chunks,
    hash24_run,
    pack_into,
    parallel_kernel,
    unpack_from,
)
from fedquant.codecs.kernels.hadamard import chunk_in_cache, inverse_span, rotation_args
from fedquant.rng import uniform
from fedquant.wire.bitpack import packed_size


# ---------------------------------------------------------------- rounding to the grid
@njit(cache=True, inline="always")
def _grid_symbol(v, t, h, sf):
    """Symbol ``q + s`` of value ``v`` with ``t = |v| / step`` and random bits ``h``.

    In float32 (``sf = float32(s)``; every intermediate is a small integer, exact; the sign goes
    on with ``copysign``, so ``-0.0`` gives ``+s`` like ``0.0``): integer arithmetic would be
    typed int64 and take the loop to 64-bit lanes.
    """
    f = np.floor(t)
    lvl = min(f + _ONE32 if np.float32(h) * _U_SCALE < t - f else f, sf)
    return np.int32(sf + math.copysign(lvl, v))


@njit(cache=True)
def _chunk_codes(xc, d, steps, s, key, c0, c1, codes, hs, ts):
    """Symbols ``q + s`` of elements ``c0 .. c1`` (``xc``: their values, from 0) into ``codes[0 : c1 - c0]``.

    Three loops over the chunk, each vectorized on its own lanes: the random bits into ``hs``
    (uint32, :func:`~fedquant.codecs.kernels.common.hash24_run`, 64-bit lanes), the quotients
    ``|v| / step`` into ``ts`` (float32, :func:`~fedquant.codecs.kernels.common.chunk_quotients`,
    float64 lanes), then the rounding (:func:`_grid_symbol`), 32-bit lanes only, branch-free on
    slices indexed from 0. A chunk where a quotient may be a subnormal float32 is rounded with
    the division instead. ``xc`` may be a rotated chunk in an L1 buffer
    (:func:`scale_round_pack_into`) or a slice of the tensor.
    """
    m = c1 - c0
    hash24_run(key, c0, m, hs)
    sf = np.float32(s)
    cs = codes[:m]
    us = hs[:m]
    xs = xc[:m]
    if not chunk_quotients(xc, d, steps, _ONE32, False, False, c0, c1, ts):
        tt = ts[:m]
        for k in range(m):
            cs[k] = _grid_symbol(xs[k], tt[k], us[k], sf)
        return
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        step = steps[b]
        for k in range(i - c0, hi - c0):
            cs[k] = _grid_symbol(xs[k], abs(xs[k]) / step, us[k], sf) if step > _ZERO32 else s
        i = hi


@njit(cache=True)
def _pack_chunk(xc, d, steps, s, key, width, c0, c1, out):
    """Round elements ``c0 .. c1`` (``c0`` a multiple of 8; ``xc``: their values, from 0) and pack them
    into ``out``."""
    m = c1 - c0  # scratch of the chunk's size: a small tensor allocates little
    hs = np.empty(m, np.uint32)
    ts = np.empty(m, np.float32)
    if width <= 8:  # byte symbols: half the traffic through the chunk buffer
        small = np.empty(m, np.uint8)
        _chunk_codes(xc, d, steps, s, key, c0, c1, small, hs, ts)
        pack_into(small, m, width, out, (c0 * width) // 8)
    else:
        wide = np.empty(m, np.uint16)
        _chunk_codes(xc, d, steps, s, key, c0, c1, wide, hs, ts)
        pack_into(wide, m, width, out, (c0 * width) // 8)


@parallel_kernel
def round_pack_into(x, d, steps, s, key, width, out):
    """Stochastically round ``x`` to the grid ``steps[b] * {-s..s}`` and pack the symbols into ``out``.

    ``out``: uint8, ``ceil(n * width / 8)`` bytes; symbol ``q + s`` of element ``i`` lands at bits
    ``[i * width, (i + 1) * width)``.
    """
    n = x.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        _pack_chunk(x[c0:c1], d, steps, s, key, width, c0, c1, out)


def round_pack(x: np.ndarray, d: int, steps: np.ndarray, s: int, key: np.uint64, width: int) -> np.ndarray:
    """:func:`round_pack_into` a new array: the packed symbols, ``ceil(n * width / 8)`` bytes."""
    out = np.empty(packed_size(x.size, width), np.uint8)
    round_pack_into(x, d, steps, s, key, width, out)
    return out


@njit(cache=True)
def _chunk_scales(xc, d, s, l2, c0, c1, scales, steps):
    """Scales (max |x| or L2) and grid steps of the buckets of elements ``c0 .. c1`` (whole buckets;
    ``xc``: their values, from 0)."""
    bits = xc.view(np.uint32)
    scale_bits = scales.view(np.uint32)
    for b in range(c0 // d, (c1 + d - 1) // d):
        lo = b * d - c0
        hi = min(lo + d, c1 - c0)
        if l2:
            scales[b] = np.float32(np.sqrt(_sum_f64(xc, lo, hi, True)))
        else:
            mb = np.uint32(0)
            seg = bits[lo:hi]
            for i in range(hi - lo):
                mb = max(mb, np.uint32(seg[i] & _ABS_MASK))
            scale_bits[b] = mb  # the float32 max |x|, without an array per bucket to reinterpret it
        steps[b] = scales[b] / np.float32(s)


@parallel_kernel(count_arg=1)
def scale_round_pack_into(x, n, d, s, key, width, l2, scales, out, layout, rot_scales, rot_key):
    """The bucket scales (max |x| or L2) fused with :func:`round_pack_into`: one read of ``x``.

    Each chunk computes the scales of its own buckets and rounds them while they are in cache;
    this needs whole buckets per chunk, so ``CHUNK % d == 0`` (callers check). Writes
    ``scales`` (float32, one per bucket) and ``out`` (the packed symbols), identical to the
    two-pass result. The ``n`` values are ``x``, or with a rotation (``layout``, ``rot_scales``,
    ``rot_key`` of :class:`~fedquant.codecs.transforms.rht.FusedRotation`; an empty ``layout``
    for none) ``rht``'s rotation of ``x``, each chunk rotated in cache first. Returns the number
    of rotated blocks holding NaN or Inf (0 without a rotation).
    """
    steps = np.empty(scales.size, np.float32)
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        xc, bad[c] = chunk_in_cache(x, c0, c1, layout, rot_scales, rot_key)
        _chunk_scales(xc, d, s, l2, c0, c1, scales, steps)
        _pack_chunk(xc, d, steps, s, key, width, c0, c1, out)
    return bad.sum()


def scale_round_pack(
    x: np.ndarray, d: int, s: int, key: np.uint64, width: int, l2: bool, rotation=None
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`scale_round_pack_into` new arrays: ``(scales, packed)``; ``rotation``: a
    :class:`~fedquant.codecs.transforms.rht.FusedRotation` to apply first (it refuses a non-finite result)."""
    n = x.size if rotation is None else rotation.padded
    scales = np.empty((n + d - 1) // d, np.float32)
    out = np.empty(packed_size(n, width), np.uint8)
    nonfinite = scale_round_pack_into(x, n, d, s, key, width, l2, scales, out, *rotation_args(rotation))
    if rotation is not None:
        rotation.check(nonfinite)
    return scales, out


@parallel_kernel
def round_codes_into(x, d, steps, s, key, out, counts):
    """Like :func:`round_pack_into` but writes the unpacked symbols ``q + s`` (uint8 or uint16) into ``out``.

    ``counts`` is a ``(groups, K)`` table (:func:`~fedquant.codecs.kernels.common.count_table`)
    that receives the symbol histogram of each run of chunks, or ``(groups, 0)`` for none.
    """
    n = x.size
    nchunks = (n + CHUNK - 1) // CHUNK
    groups = counts.shape[0]
    for g in prange(groups):
        first, end = group_chunks(g, groups, nchunks)
        hs = np.empty(min(CHUNK, n), np.uint32)
        ts = np.empty(min(CHUNK, n), np.float32)
        for c in range(first, end):
            c0 = c * CHUNK
            c1 = min(c0 + CHUNK, n)
            _chunk_codes(x[c0:c1], d, steps, s, key, c0, c1, out[c0:c1], hs, ts)
            if counts.shape[1]:
                add_counts(out[c0:c1], c1 - c0, counts[g])


def round_codes(
    x: np.ndarray, d: int, steps: np.ndarray, s: int, key: np.uint64, count: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The unpacked symbols ``q + s`` for the entropy coder; with ``count``, also their histogram.

    uint8 while the ``2s + 1`` symbols fit a byte (what the coder reads without a conversion
    pass), else uint16.
    """
    out = np.empty(x.size, np.uint8 if 2 * s + 1 <= 256 else np.uint16)
    counts = count_table(x.size, (2 * s + 1) if count else 0)
    round_codes_into(x, d, steps, s, key, out, counts)
    return (out, counts.sum(axis=0)) if count else out


# ---------------------------------------------------------------- decoding
@parallel_kernel(count_arg=1)
def unpack_dequant_into(data, n, d, steps, s, width, out, layout, rot_scales, rot_key):
    """Decode ``n`` packed symbols into ``out`` (float32). Returns the number of symbols > 2s, and with
    a rotation (see :func:`scale_round_pack_into`; ``n`` its laid-out size, each chunk's values
    rotated back in cache, ``out`` the first ``out.size`` values) the number of blocks of ``out``
    holding NaN or Inf."""
    nchunks = (n + CHUNK - 1) // CHUNK
    rotate = layout.shape[0] > 0
    bad = np.zeros(nchunks, np.int64)
    nonfinite = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        values = np.empty(c1 - c0, np.float32) if rotate else out[c0:c1]
        if width <= 8:
            small = np.empty(c1 - c0, np.uint8)
            unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
            bad[c] = _chunk_dequant(small, d, steps, s, c0, c1, values)
        else:
            wide = np.empty(c1 - c0, np.uint16)
            unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
            bad[c] = _chunk_dequant(wide, d, steps, s, c0, c1, values)
        if rotate:
            nonfinite[c] = inverse_span(values, c0, c1, layout, rot_scales, rot_key, out[c0 : min(c1, out.size)])
    return bad.sum(), nonfinite.sum()


def unpack_dequant(
    data: np.ndarray, n: int, d: int, steps: np.ndarray, s: int, width: int, rotation=None
) -> tuple[np.ndarray, int]:
    """Decode packed symbols into new float32 values. Returns ``(values, number of symbols > 2s)``.

    With ``rotation`` (a :class:`~fedquant.codecs.transforms.rht.FusedRotation`, ``n`` its laid-out
    size) the values are rotated back (``rotation.numel`` of them) and ``rotation.finite`` is set.
    """
    out = np.empty(n if rotation is None else rotation.numel, np.float32)
    bad, nonfinite = unpack_dequant_into(data, n, d, steps, s, width, out, *rotation_args(rotation))
    if rotation is not None:
        rotation.finite = nonfinite == 0
    return out, bad


@njit(cache=True)
def _chunk_dequant(codes, d, steps, s, c0, c1, values):
    """``(code - s) * step`` of elements ``c0 .. c1`` into ``values`` (from 0); returns how many codes
    exceed ``2s``.

    In float32 (symbols below ``2**16`` convert exactly) with a flag for bad codes, so that the
    loop runs on 32-bit lanes; a chunk with a bad code is counted again.
    """
    sf = np.float32(s)
    top = np.float32(2 * s)
    bad = False
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        step = steps[b]
        cs = codes[i - c0 : hi - c0]
        ys = values[i - c0 : hi - c0]
        for k in range(hi - i):
            c = np.float32(cs[k])
            bad |= c > top
            ys[k] = (c - sf) * step
        i = hi
    if not bad:
        return 0
    count = 0
    for k in range(c1 - c0):
        count += np.int64(codes[k]) > 2 * s
    return count


@parallel_kernel
def codes_dequant_into(codes, d, steps, s, out):
    """Decode unpacked symbols (from an entropy decoder) into ``out``. Returns the symbols > 2s."""
    n = codes.size
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        bad[c] = _chunk_dequant(codes[c0:c1], d, steps, s, c0, c1, out[c0:c1])
    return bad.sum()


def codes_dequant(codes: np.ndarray, d: int, steps: np.ndarray, s: int) -> tuple[np.ndarray, int]:
    """Decode unpacked symbols (uint8 or uint16) into new float32 values. Returns ``(values, symbols > 2s)``."""
    out = np.empty(codes.size, np.float32)
    return out, codes_dequant_into(codes, d, steps, s, out)


# ---------------------------------------------------------------- sign bits
@parallel_kernel
def sign_pack_into(x, out):
    """One bit per element into ``out``, LSB first: 1 where ``x < 0`` (so ``sign(0) = +1``)."""
    n = x.size
    full = n // 8
    for j in prange(full):
        acc = 0
        for k in range(8):
            acc |= np.int64(x[8 * j + k] < _ZERO32) << k
        out[j] = acc
    if full < out.size:
        acc = 0
        for k in range(n - 8 * full):
            acc |= np.int64(x[8 * full + k] < _ZERO32) << k
        out[full] = acc


@parallel_kernel
def l1_sign_pack_into(x, d, scales, out):
    """``bucket_l1_mean`` fused with :func:`sign_pack_into`: one read of ``x``.

    Each chunk computes the means of its own buckets (the same float64 sums in the same order)
    and packs its signs (a chunk starts on a byte: ``CHUNK`` is a multiple of 8); this needs whole
    buckets per chunk, so ``CHUNK % d == 0`` (callers check).
    """
    n = x.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        for b in range(c0 // d, (c1 + d - 1) // d):
            lo = b * d
            hi = min(lo + d, n)
            scales[b] = np.float32(_sum_f64(x, lo, hi, False) / (hi - lo))
        xs = x[c0:c1]
        bytes_ = out[c0 // 8 : (c1 + 7) // 8]
        full = (c1 - c0) // 8
        for j in range(full):
            acc = 0
            for k in range(8):
                acc |= np.int64(xs[8 * j + k] < _ZERO32) << k
            bytes_[j] = acc
        if full < bytes_.size:
            acc = 0
            for k in range(c1 - c0 - 8 * full):
                acc |= np.int64(xs[8 * full + k] < _ZERO32) << k
            bytes_[full] = acc


def l1_sign_pack(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`l1_sign_pack_into` new arrays: ``(scales, packed signs)``."""
    scales = np.empty((x.size + d - 1) // d, np.float32)
    out = np.empty(packed_size(x.size, 1), np.uint8)
    l1_sign_pack_into(x, d, scales, out)
    return scales, out


def sign_pack(x: np.ndarray) -> np.ndarray:
    """:func:`sign_pack_into` a new array of ``ceil(n / 8)`` bytes."""
    out = np.empty(packed_size(x.size, 1), np.uint8)
    sign_pack_into(x, out)
    return out


@parallel_kernel
def sign_codes_into(x, out):
    """One symbol per element into ``out`` (uint8): 1 where ``x < 0``. Returns how many are 1."""
    n = x.size
    nchunks = (n + CHUNK - 1) // CHUNK
    ones = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        xs = x[c0:c1]
        cs = out[c0:c1]
        count = 0
        for k in range(c1 - c0):
            neg = xs[k] < _ZERO32
            cs[k] = neg
            count += neg
        ones[c] = count
    return ones.sum()


def sign_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sign symbols (uint8, 1 where ``x < 0``) for the entropy coder and their histogram."""
    out = np.empty(x.size, np.uint8)
    ones = int(sign_codes_into(x, out))
    return out, np.array([x.size - ones, ones], np.int64)


@njit(cache=True)
def _chunk_signs(codes, d, scales, c0, c1, out):
    """``-scale`` where ``codes[i - c0]`` is nonzero, ``+scale`` where it is 0, for elements ``c0 .. c1``."""
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        m = scales[b]
        cs = codes[i - c0 : hi - c0]
        ys = out[i:hi]
        for k in range(hi - i):
            ys[k] = -m if cs[k] else m
        i = hi


@parallel_kernel(count_arg=1)
def sign_unpack_into(data, n, d, scales, out):
    """``-scale`` where the bit is 1, ``+scale`` where it is 0, bucket by bucket, into ``out``."""
    for c in prange((n + CHUNK - 1) // CHUNK):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        bits = np.empty(min(CHUNK, n), np.uint8)
        unpack_from(data, c0 // 8, c1 - c0, 1, bits)
        _chunk_signs(bits, d, scales, c0, c1, out)


def sign_unpack(data: np.ndarray, n: int, d: int, scales: np.ndarray) -> np.ndarray:
    """:func:`sign_unpack_into` new float32 values."""
    out = np.empty(n, np.float32)
    sign_unpack_into(data, n, d, scales, out)
    return out


@parallel_kernel
def sign_values_into(codes, d, scales, out):
    """``-scale`` where the symbol is nonzero, ``+scale`` where it is 0 (unpacked symbols), into ``out``."""
    n = codes.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        _chunk_signs(codes[c0:c1], d, scales, c0, c1, out)


def sign_values(codes: np.ndarray, d: int, scales: np.ndarray) -> np.ndarray:
    """:func:`sign_values_into` new float32 values."""
    out = np.empty(codes.size, np.float32)
    sign_values_into(codes, d, scales, out)
    return out


# ---------------------------------------------------------------- torch twins (CUDA tensors, force_torch)
def _per_element(per_bucket: np.ndarray, d: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(per_bucket, device=device).repeat_interleave(d)[:n]


def torch_round_codes(flat: torch.Tensor, d: int, steps: np.ndarray, s: int, seed: int) -> torch.Tensor:
    """Twin of :func:`round_codes` on ``flat``'s device: symbols ``q + s`` as int32."""
    n = flat.numel()
    step = _per_element(steps, d, n, flat.device)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    t = flat.abs() / safe
    f = torch.floor(t)
    up = uniform(seed, n, device=flat.device) < (t - f)
    lvl = torch.clamp(f.clamp(max=s).to(torch.int32) + up.to(torch.int32), max=s)
    lvl = torch.where(step > 0, lvl, 0)
    return torch.where(flat < 0, -lvl, lvl) + s


def torch_dequantize(codes: torch.Tensor, d: int, steps: np.ndarray, s: int) -> tuple[torch.Tensor, int]:
    """Twin of :func:`codes_dequant`: ``(code - s) * step`` and the number of codes above ``2s``."""
    step = _per_element(steps, d, codes.numel(), codes.device)
    bad = int((codes > 2 * s).sum())
    return (codes - s).to(torch.float32) * step, bad


def torch_sign_values(negative: torch.Tensor, d: int, scales: np.ndarray) -> torch.Tensor:
    """Twin of :func:`sign_unpack` on unpacked bits: ``-scale`` where ``negative``, else ``+scale``."""
    m = _per_element(scales, d, negative.numel(), negative.device)
    return torch.where(negative, -m, m)
