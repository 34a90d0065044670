"""The two paths of the dithered quantizers (DQSG and NDQSG): torch functions and numba kernels.

The torch functions (first half) run on any device and are the CUDA path; the numba kernels
(second half) are the CPU path. Each kernel performs, element by element, exactly the operations
of the torch functions, in the same dtypes and order, so both paths write the same bytes and
decode to the same values (``force_torch = True`` on a quantizer runs the torch path on CPU; the
tests compare the two):

* the dither ``u = uniform - 1/2`` of element ``i`` is element ``i`` of :func:`fedquant.rng.uniform`'s
  stream, drawn by the kernels a chunk at a time with :func:`fedquant.codecs.kernels.common.hash24_run`;
* encoding is float32 throughout: ``round(v / step + u)`` (DQSG, clamped to ``[-M, M]``) or
  ``q1 = round((alpha v) / step + u)``, ``s = q1 - rho round(q1 / rho)`` (NDQSG), with
  ``alpha`` rounded to float32 as torch does for a Python scalar, true division (no float32
  reciprocal) and ``np.rint`` (round half to even, as ``torch.round``). The kernels get the
  quotients bit for bit from float64 products
  (:func:`~fedquant.codecs.kernels.common.exact_quotient`, falling back to the division where
  a quotient may be subnormal) and ``round(q1 / rho)`` from ``q1 * float32(1 / rho)`` (the same
  integer, see :func:`_ndqsg_symbol`);
* DQSG decoding is float32 ``step * ((code - M) - u)``; NDQSG decoding is float64 per element:
  ``r = (s - u) step1 - alpha y``, ``r -= step2 round(r / step2)``, ``y + alpha r`` rounded to
  float32, and 0 in buckets whose step is 0 (the kernel takes ``round(r * (1 / step2))`` and
  divides only in buckets where that product lies within ``2**-20`` of a half-integer).

A zero step (all-zero bucket) divides by 1 instead. The kernels loop over chunks of
``common.CHUNK`` elements (a multiple of 8, so each chunk starts on a byte of the packed stream);
each loop is written once and compiled parallel and serial by
:func:`fedquant.codecs.kernels.common.parallel_kernel`.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from fedquant.codecs.buckets import torch_bucket_stat
from fedquant.codecs.kernels.common import (
    _U_SCALE,
    CHUNK,
    add_counts,
    chunk_quotients,
    count_table,
    group_chunks,
    hash24_run,
    pack_into,
    parallel_kernel,
    unpack_from,
)
from fedquant.codecs.kernels.grid import _chunk_scales
from fedquant.rng import uniform
from fedquant.wire.body import require_items


# ================================================================ torch path (any device)
def dither(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The dither of a tensor in units of its step: ``n`` float32 values on ``[-1/2, 1/2)``.

    Element ``i`` is element ``i`` of :func:`fedquant.rng.uniform`'s stream for ``seed``, minus
    one half (exact in float32), so encoder and decoder agree bit for bit on any device.
    """
    return uniform(seed, n, device=device) - 0.5


def bucket_steps(flat: torch.Tensor, d: int, levels: int) -> torch.Tensor:
    """Step ``max|v| / levels`` of each bucket of ``d`` elements of ``flat``, shape ``(buckets, 1)``."""
    # A true division on every device: CUDA turns division by a Python scalar into a
    # multiplication by its reciprocal, which can move the step by one ulp.
    divisor = torch.tensor(float(levels), dtype=flat.dtype, device=flat.device)
    return torch_bucket_stat(flat, d, "max").view(-1, 1) / divisor


def _safe(step: torch.Tensor) -> torch.Tensor:
    """Steps with zeros replaced by one (a zero step means an all-zero bucket: its input is 0)."""
    return torch.where(step > 0, step, torch.ones_like(step))


def dithered_quantize(v: torch.Tensor, step: torch.Tensor, u: torch.Tensor, levels: int) -> torch.Tensor:
    """DQSG indices ``round(v / step + u)`` clamped to ``{-levels..levels}``.

    ``u`` is the dither in units of ``step``. The clamp only acts when rounding of ``v / step``
    lands a hair above ``levels`` at the bucket maximum; all-zero buckets (``step = 0``) give 0.
    """
    return torch.round(v / _safe(step) + u).clamp_(-levels, levels)


def dithered_reconstruct(q: torch.Tensor, step: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """DQSG decoder ``step * (q - u)``: the dither is subtracted again."""
    return step * (q - u)


def nested_quantize(v: torch.Tensor, step1: torch.Tensor, u: torch.Tensor, rho: int, alpha: float) -> torch.Tensor:
    """Nested indices ``s = Q1(t) - Q2(t)``, ``t = alpha v + u step1``, in units of ``step1``.

    With ``q1 = round(t / step1)`` and odd ``rho``, ``Q2(t) / step1 = rho * round(q1 / rho)``
    (``q1 / rho`` is never a half-integer), so ``s`` lies in ``{-(rho-1)/2 .. (rho-1)/2}``.
    """
    q1 = torch.round(alpha * v / _safe(step1) + u)
    return q1 - rho * torch.round(q1 / rho)


def nested_reconstruct(
    s: torch.Tensor, step1: torch.Tensor, u: torch.Tensor, rho: int, alpha: float, y: torch.Tensor
) -> torch.Tensor:
    """Nested decoder with side information ``y`` (computed in the dtype of ``y``).

    ``r = (s - u) step1 - alpha y``, reduced to ``[-Delta2/2, Delta2/2]`` (``Delta2 = rho step1``),
    then ``y + alpha r``: of all values consistent with ``s``, the one in the coarse cell of ``y``.
    Buckets whose step is 0 were all zeros at the encoder and decode to 0.
    """
    step1 = step1.to(y.dtype)
    step2 = rho * step1
    r = (s.to(y.dtype) - u.to(y.dtype)) * step1 - alpha * y
    r = r - step2 * torch.round(r / _safe(step2))
    return torch.where(step1 > 0, y + alpha * r, torch.zeros_like(y))


# ================================================================ numba kernels (CPU)
_HALF = np.float32(0.5)
_HALF64 = np.float64(0.5)
_ONE32 = np.float32(1.0)
_ZERO32 = np.float32(0.0)
#: NDQSG decoding checks ``round(r / step2)`` where ``r * (1 / step2)`` is at least this far from
#: its nearest integer (within ``2**-20`` of a half-integer) or at least ``_FAR`` in magnitude.
_NEAR_HALF = np.float64(0.5 - 2.0**-20)
_FAR = np.float64(2.0**20)


# ---------------------------------------------------------------- encoding
@njit(cache=True, inline="always")
def _dqsg_symbol(t, h, lv):
    """``clamp(round(t + u), -M, M) + M`` in float32 for ``t = v / step`` and random bits ``h``."""
    u = np.float32(h) * _U_SCALE - _HALF
    return np.int32(min(max(np.rint(t + u), -lv), lv) + lv)


@njit(cache=True, inline="always")
def _ndqsg_symbol(t, h, rf, inv_rho, half):
    """``q1 - rho round(q1 / rho) + rho // 2`` in float32 for ``t = alpha v / step``, ``q1 = round(t + u)``.

    ``round(q1 / rho)`` is ``round(q1 * inv_rho)`` (``inv_rho = float32(1 / rho)``): the nearest
    integer to ``q1 / rho`` either way, since ``q1`` is an integer with ``|q1| < 2**22`` and
    ``rho`` odd, so ``q1 / rho`` lies at least ``1 / (2 rho)`` from every half-integer while both
    float32 results lie within ``|q1| 2**-23 / rho`` of it. Every other intermediate is an
    integer below ``2**24``, exact.
    """
    q1 = np.rint(t + (np.float32(h) * _U_SCALE - _HALF))
    return np.int32(q1 - rf * np.rint(q1 * inv_rho) + half)


@njit(cache=True)
def _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, codes, hs, ts):
    """Symbols of elements ``c0 .. c1`` into ``codes[0 : c1 - c0]``.

    DQSG (``nested`` False): ``clamp(round(v / step + u), -M, M) + M``. NDQSG: ``s + rho // 2``.
    ``alpha`` is float32. Three loops over the chunk, each vectorized on its own lanes: the random
    bits into ``hs`` (uint32, :func:`~fedquant.codecs.kernels.common.hash24_run`), the quotients
    ``(alpha v) / step`` into ``ts`` (:func:`~fedquant.codecs.kernels.common.chunk_quotients`,
    bit for bit the float32 division), then the symbols on 32-bit lanes. A chunk where a quotient
    may be a subnormal float32 takes the division instead.
    """
    m = c1 - c0
    hash24_run(key, c0, m, hs)
    lv = np.float32(levels)
    rf = np.float32(rho)
    inv_rho = _ONE32 / rf
    half = np.float32(rho // 2)
    scale = alpha if nested else _ONE32
    cs = codes[:m]
    us = hs[:m]
    tt = ts[:m]
    if chunk_quotients(x, d, steps, scale, True, True, c0, c1, ts):
        i = c0
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            safe = steps[b] if steps[b] > _ZERO32 else _ONE32
            for k in range(i - c0, hi - c0):
                tt[k] = (scale * x[c0 + k]) / safe
            i = hi
    if nested:
        for k in range(m):
            cs[k] = _ndqsg_symbol(tt[k], us[k], rf, inv_rho, half)
    else:
        for k in range(m):
            cs[k] = _dqsg_symbol(tt[k], us[k], lv)


@njit(cache=True)
def _encode_chunk(x, d, steps, nested, levels, rho, alpha, key, width, c, out):
    n = x.size
    c0 = c * CHUNK
    c1 = min(c0 + CHUNK, n)
    hs = np.empty(min(CHUNK, n), np.uint32)
    ts = np.empty(min(CHUNK, n), np.float32)
    if width <= 8:
        small = np.empty(min(CHUNK, n), np.uint8)
        _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, small, hs, ts)
        pack_into(small, c1 - c0, width, out, (c0 * width) // 8)
    else:
        wide = np.empty(min(CHUNK, n), np.uint16)
        _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, wide, hs, ts)
        pack_into(wide, c1 - c0, width, out, (c0 * width) // 8)


@parallel_kernel
def _pack(x, d, steps, nested, levels, rho, alpha, key, width, out, maxima):
    """Encode every chunk; with ``maxima`` (one float32 per bucket, else empty) each chunk first
    computes its buckets' maxima and steps ``max / levels`` (whole buckets per chunk: ``CHUNK % d == 0``)."""
    n = x.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        if maxima.size:
            _chunk_scales(x, d, levels, False, c * CHUNK, min(c * CHUNK + CHUNK, n), maxima, steps)
        _encode_chunk(x, d, steps, nested, levels, rho, alpha, key, width, c, out)


@parallel_kernel
def _codes(x, d, steps, nested, levels, rho, alpha, key, out, counts):
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
            _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, out[c0:c1], hs, ts)
            if counts.shape[1]:
                add_counts(out[c0:c1], c1 - c0, counts[g])


# ---------------------------------------------------------------- decoding
@njit(cache=True)
def _largest(codes, m):
    """The largest of ``codes[:m]`` (a pass of its own: a narrow max that vectorizes)."""
    top = codes[0]
    for k in range(1, m):
        top = max(top, codes[k])
    return np.int64(top)


@njit(cache=True, inline="always")
def _ndqsg_value(c, u, yv, st1, st2, z_of_r, half, alpha, exact):
    """Float64 NDQSG value of symbol ``c`` (float64); ``z_of_r``: ``1 / st2``, or ``st2`` with ``exact``.

    Also returns whether ``z = r * (1 / st2)`` may round to another integer than ``r / st2``: ``z``
    lies within a relative ``2**-52`` of the quotient, so below ``|z| < 2**20`` only a ``z`` within
    ``2**-20`` of a half-integer may.
    """
    r = (c - half - u) * st1 - alpha * yv
    z = r / z_of_r if exact else r * z_of_r
    k = np.rint(z)
    near = (abs(z - k) >= _NEAR_HALF) | (abs(z) >= _FAR)
    return np.float32(yv + alpha * (r - st2 * k)), near


@njit(cache=True)
def _nested_bucket(cs, us, side, side_bits, ys, st1, st2, half, alpha):
    """NDQSG values of one bucket (step ``st1 > 0``); returns whether some side information is not finite.

    ``round(r / st2)`` is taken from ``r * (1 / st2)``; a bucket where the two may round apart
    (:func:`_ndqsg_value`) is done again with the division. ``alpha`` 1 has a loop of its own
    without the multiplications by it (exact either way).
    """
    inv2 = 1.0 / st2
    near = False
    bad = False
    if alpha == 1.0:
        for k in range(cs.size):
            u = np.float64(np.float32(us[k]) * _U_SCALE - _HALF)
            value, close = _ndqsg_value(np.float64(cs[k]), u, np.float64(side[k]), st1, st2, inv2, half, 1.0, False)
            ys[k] = value
            near |= close
            bad |= (side_bits[k] & _EXP_MASK) == _EXP_MASK
    else:
        for k in range(cs.size):
            u = np.float64(np.float32(us[k]) * _U_SCALE - _HALF)
            value, close = _ndqsg_value(np.float64(cs[k]), u, np.float64(side[k]), st1, st2, inv2, half, alpha, False)
            ys[k] = value
            near |= close
            bad |= (side_bits[k] & _EXP_MASK) == _EXP_MASK
    if near:
        for k in range(cs.size):
            u = np.float64(np.float32(us[k]) * _U_SCALE - _HALF)
            ys[k] = _ndqsg_value(np.float64(cs[k]), u, np.float64(side[k]), st1, st2, st2, half, alpha, True)[0]
    return bad


@njit(cache=True)
def _chunk_values(codes, d, steps, nested, levels, rho, alpha, key, y, c0, c1, out, hs):
    """Values of elements ``c0 .. c1`` from their symbols ``codes[0 : c1 - c0]``.

    Returns the largest symbol seen (the caller rejects symbols beyond the alphabet) and, for
    NDQSG, whether the side information of these elements holds a NaN or Inf (it is read here
    anyway); ``alpha`` is float64 and ``y`` the float32 side information (NDQSG only). The random
    bits go to ``hs`` first (:func:`~fedquant.codecs.kernels.common.hash24_run`).
    """
    m = c1 - c0
    hash24_run(key, c0, m, hs)
    top = _largest(codes, m) if m else 0
    bad = False
    i = c0
    if nested:
        half = np.float64(rho // 2)
        y_bits = y.view(np.uint32)
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            step = steps[b]
            ys = out[i:hi]
            if step > _ZERO32:
                st1 = np.float64(step)
                cs = codes[i - c0 : hi - c0]
                us = hs[i - c0 : hi - c0]
                bad |= _nested_bucket(cs, us, y[i:hi], y_bits[i:hi], ys, st1, np.float64(rho) * st1, half, alpha)
            else:
                ys[:] = _ZERO32
                bad |= _count_nonfinite(y_bits, i, hi) > 0
            i = hi
    else:
        lv = np.float32(levels)
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            step = steps[b]
            cs = codes[i - c0 : hi - c0]
            us = hs[i - c0 : hi - c0]
            ys = out[i:hi]
            for k in range(hi - i):
                u = np.float32(us[k]) * _U_SCALE - _HALF
                ys[k] = step * ((np.float32(cs[k]) - lv) - u)
            i = hi
    return top, bad


@njit(cache=True)
def _decode_chunk(data, d, steps, nested, levels, rho, alpha, key, y, width, c, out):
    n = out.size
    c0 = c * CHUNK
    c1 = min(c0 + CHUNK, n)
    hs = np.empty(min(CHUNK, n), np.uint32)
    if width <= 8:
        small = np.empty(min(CHUNK, n), np.uint8)
        unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
        return _chunk_values(small, d, steps, nested, levels, rho, alpha, key, y, c0, c1, out, hs)
    wide = np.empty(min(CHUNK, n), np.uint16)
    unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
    return _chunk_values(wide, d, steps, nested, levels, rho, alpha, key, y, c0, c1, out, hs)


@parallel_kernel(count_arg=10)
def _unpack(data, d, steps, nested, levels, rho, alpha, key, y, width, out):
    """Decode every chunk; returns the largest symbol and how many chunks hold non-finite side information."""
    nchunks = (out.size + CHUNK - 1) // CHUNK
    tops = np.zeros(nchunks, np.int64)
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        tops[c], bad[c] = _decode_chunk(data, d, steps, nested, levels, rho, alpha, key, y, width, c, out)
    return (tops.max() if nchunks else 0), bad.sum()


@parallel_kernel
def _values(codes, d, steps, nested, levels, rho, alpha, key, y, out):
    n = out.size
    nchunks = (n + CHUNK - 1) // CHUNK
    tops = np.zeros(nchunks, np.int64)
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        hs = np.empty(min(CHUNK, n), np.uint32)
        tops[c], bad[c] = _chunk_values(codes[c0:c1], d, steps, nested, levels, rho, alpha, key, y, c0, c1, out, hs)
    return (tops.max() if nchunks else 0), bad.sum()


# ---------------------------------------------------------------- side information check
_EXP_MASK = np.uint32(0x7F800000)


@njit(cache=True)
def _count_nonfinite(bits, lo, hi):
    bad = 0
    seg = bits[lo:hi]
    for i in range(hi - lo):
        bad += (seg[i] & _EXP_MASK) == _EXP_MASK
    return bad


@parallel_kernel
def _nonfinite(bits):
    n = bits.size
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        bad[c] = _count_nonfinite(bits, c * CHUNK, min(c * CHUNK + CHUNK, n))
    return bad.sum()


# ---------------------------------------------------------------- public entry points
def all_finite(y: np.ndarray) -> bool:
    """Whether every element of the contiguous float32 array ``y`` is finite (no NaN, no Inf).

    Reads the exponent bits: one pass without the boolean temporary of ``torch.isfinite``.
    """
    bits = y.view(np.uint32)
    return _nonfinite(bits) == 0


_NO_MAXIMA = np.zeros(0, np.float32)


def _args(nested: bool, levels: int, rho: int) -> tuple[bool, int, int]:
    # NDQSG ignores levels in the symbol loops, DQSG ignores rho: both get valid integers.
    return bool(nested), int(levels), int(rho) if nested else 1


def encode_packed(
    x: np.ndarray,
    d: int,
    steps: np.ndarray,
    key: np.uint64,
    width: int,
    *,
    levels: int,
    nested: bool = False,
    rho: int = 1,
    alpha: float = 1.0,
) -> np.ndarray:
    """Dither, quantize and pack every element of float32 ``x`` at ``width`` bits (uint8 array).

    Parameters
    ----------
    x : np.ndarray
        float32, contiguous, the flat tensor.
    d : int
        Bucket size (the last bucket may be short).
    steps : np.ndarray
        float32 step of each bucket (as :func:`bucket_steps` computes them).
    key : np.uint64
        ``fedquant.rng.stream_key(seed)``.
    width : int
        Bits per symbol, at most 16.
    levels, nested, rho, alpha
        DQSG (``nested=False``: symbols ``q + levels``) or NDQSG (symbols ``s + rho // 2``).
    """
    nested, levels, rho = _args(nested, levels, rho)
    out = np.empty((x.size * width + 7) // 8, np.uint8)
    _pack(x, d, steps, nested, levels, rho, np.float32(alpha), np.uint64(key), width, out, _NO_MAXIMA)
    return out


def step_encode_packed(
    x: np.ndarray,
    d: int,
    key: np.uint64,
    width: int,
    *,
    levels: int,
    nested: bool = False,
    rho: int = 1,
    alpha: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The bucket steps ``max|v| / levels`` fused with :func:`encode_packed`: one read of ``x``.

    Each chunk computes the steps of its own buckets, so ``CHUNK % d == 0`` (callers check).
    Returns ``(steps, packed)``, identical to ``bucket_max_abs(x, d) / float32(levels)`` and
    :func:`encode_packed` with those steps.
    """
    nested, levels, rho = _args(nested, levels, rho)
    nb = (x.size + d - 1) // d
    steps = np.empty(nb, np.float32)
    out = np.empty((x.size * width + 7) // 8, np.uint8)
    _pack(x, d, steps, nested, levels, rho, np.float32(alpha), np.uint64(key), width, out, np.empty(nb, np.float32))
    return steps, out


def encode_symbols(
    x: np.ndarray,
    d: int,
    steps: np.ndarray,
    key: np.uint64,
    *,
    levels: int,
    nested: bool = False,
    rho: int = 1,
    alpha: float = 1.0,
    count: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Like :func:`encode_packed` but returns the unpacked symbols, for entropy coding.

    uint8 while the alphabet fits a byte (what the coder reads without a conversion pass), else
    uint16. With ``count``, returns ``(symbols, histogram)``, the histogram counted in the same pass.
    """
    nested, levels, rho = _args(nested, levels, rho)
    k = rho if nested else 2 * levels + 1
    out = np.empty(x.size, np.uint8 if k <= 256 else np.uint16)
    counts = count_table(x.size, k if count else 0)
    _codes(x, d, steps, nested, levels, rho, np.float32(alpha), np.uint64(key), out, counts)
    return (out, counts.sum(axis=0)) if count else out


def _side(y: np.ndarray | None) -> np.ndarray:
    return np.zeros(0, np.float32) if y is None else np.ascontiguousarray(y, dtype=np.float32)


def _require_buckets(n: int, d: int, steps: np.ndarray, nested: bool, side_info: np.ndarray | None) -> None:
    """The kernels index ``steps`` by bucket and the side information by element, unchecked."""
    require_items(steps, -(-n // d), "bucket steps")
    if nested:
        require_items(_side(side_info), n, "side information")


def decode_packed(
    data: np.ndarray,
    n: int,
    d: int,
    steps: np.ndarray,
    key: np.uint64,
    width: int,
    *,
    levels: int,
    nested: bool = False,
    rho: int = 1,
    alpha: float = 1.0,
    side_info: np.ndarray | None = None,
) -> tuple[np.ndarray, int, bool]:
    """Unpack ``n`` symbols from ``data`` (exactly the packed size) and reconstruct the values.

    Returns
    -------
    (np.ndarray, int, bool)
        float32 values, the largest symbol found (the caller rejects it when beyond the
        alphabet) and whether the side information is all finite (checked in the same pass;
        True without side information). NDQSG needs ``side_info`` (float32, ``n`` values); with
        a NaN or Inf in it the values are meaningless.
    """
    nested, levels, rho = _args(nested, levels, rho)
    require_items(data, (n * width + 7) // 8, "packed indices")
    _require_buckets(n, d, steps, nested, side_info)
    out = np.empty(n, np.float32)
    top, bad = _unpack(data, d, steps, nested, levels, rho, float(alpha), np.uint64(key), _side(side_info), width, out)
    return out, int(top), bad == 0


def decode_symbols(
    codes: np.ndarray,
    d: int,
    steps: np.ndarray,
    key: np.uint64,
    *,
    levels: int,
    nested: bool = False,
    rho: int = 1,
    alpha: float = 1.0,
    side_info: np.ndarray | None = None,
) -> tuple[np.ndarray, int, bool]:
    """Like :func:`decode_packed` from unpacked symbols (as an entropy decoder returns them)."""
    nested, levels, rho = _args(nested, levels, rho)
    codes = np.ascontiguousarray(codes, dtype=codes.dtype if codes.dtype in (np.uint8, np.uint16) else np.uint16)
    _require_buckets(codes.size, d, steps, nested, side_info)
    out = np.empty(codes.size, np.float32)
    top, bad = _values(codes, d, steps, nested, levels, rho, float(alpha), np.uint64(key), _side(side_info), out)
    return out, int(top), bad == 0
