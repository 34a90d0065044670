"""The two paths of the dithered quantizers (DQSG and NDQSG): torch functions and numba kernels.

The torch functions (first half) run on any device and are the CUDA path; the numba kernels
(second half) are the CPU path. Each kernel performs, element by element, exactly the operations
of the torch functions, in the same dtypes and order, so both paths write the same bytes and
decode to the same values (``force_torch = True`` on a quantizer runs the torch path on CPU; the
tests compare the two):

* the dither ``u = uniform - 1/2`` of element ``i`` is element ``i`` of :func:`fedquant.rng.uniform`'s
  stream, drawn inline by the kernels with :func:`fedquant.codecs.kernels.common.uniform24`;
* encoding is float32 throughout: ``round(v / step + u)`` (DQSG, clamped to ``[-M, M]``) or
  ``q1 = round((alpha v) / step + u)``, ``s = q1 - rho round(q1 / rho)`` (NDQSG), with
  ``alpha`` rounded to float32 as torch does for a Python scalar, true division (no reciprocal)
  and ``np.rint`` (round half to even, as ``torch.round``);
* DQSG decoding is float32 ``step * ((code - M) - u)``; NDQSG decoding is float64 per element:
  ``r = (s - u) step1 - alpha y``, ``r -= step2 round(r / step2)``, ``y + alpha r`` rounded to
  float32, and 0 in buckets whose step is 0.

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
    CHUNK,
    add_counts,
    count_table,
    group_chunks,
    pack_into,
    parallel_kernel,
    uniform24,
    unpack_from,
)
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
_ONE32 = np.float32(1.0)
_ZERO32 = np.float32(0.0)


# ---------------------------------------------------------------- encoding
@njit(cache=True)
def _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, codes):
    """Symbols of elements ``c0 .. c1`` into ``codes[0 : c1 - c0]``.

    DQSG (``nested`` False): ``clamp(round(v / step + u), -M, M) + M``. NDQSG: ``s + rho // 2``.
    ``alpha`` is float32.
    """
    lv = np.float32(levels)
    rf = np.float32(rho)
    half = rho // 2
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        step = steps[b]
        safe = step if step > _ZERO32 else _ONE32
        xs = x[i:hi]
        cs = codes[i - c0 : hi - c0]
        if nested:
            for k in range(hi - i):
                u = uniform24(key, i + k) - _HALF
                q1 = np.rint((alpha * xs[k]) / safe + u)
                cs[k] = np.int64(q1 - rf * np.rint(q1 / rf)) + half
        else:
            for k in range(hi - i):
                u = uniform24(key, i + k) - _HALF
                q = min(max(np.rint(xs[k] / safe + u), -lv), lv)
                cs[k] = np.int64(q) + levels
        i = hi


@njit(cache=True)
def _encode_chunk(x, d, steps, nested, levels, rho, alpha, key, width, c, out):
    n = x.size
    c0 = c * CHUNK
    c1 = min(c0 + CHUNK, n)
    if width <= 8:
        small = np.empty(CHUNK, np.uint8)
        _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, small)
        pack_into(small, c1 - c0, width, out, (c0 * width) // 8)
    else:
        wide = np.empty(CHUNK, np.uint16)
        _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, wide)
        pack_into(wide, c1 - c0, width, out, (c0 * width) // 8)


@parallel_kernel
def _pack(x, d, steps, nested, levels, rho, alpha, key, width, out):
    for c in prange((x.size + CHUNK - 1) // CHUNK):
        _encode_chunk(x, d, steps, nested, levels, rho, alpha, key, width, c, out)


@parallel_kernel
def _codes(x, d, steps, nested, levels, rho, alpha, key, out, counts):
    n = x.size
    nchunks = (n + CHUNK - 1) // CHUNK
    groups = counts.shape[0]
    for g in prange(groups):
        first, end = group_chunks(g, groups, nchunks)
        for c in range(first, end):
            c0 = c * CHUNK
            c1 = min(c0 + CHUNK, n)
            _chunk_symbols(x, d, steps, nested, levels, rho, alpha, key, c0, c1, out[c0:c1])
            if counts.shape[1]:
                add_counts(out[c0:c1], c1 - c0, counts[g])


# ---------------------------------------------------------------- decoding
@njit(cache=True)
def _chunk_values(codes, d, steps, nested, levels, rho, alpha, key, y, c0, c1, out):
    """Values of elements ``c0 .. c1`` from their symbols ``codes[0 : c1 - c0]``.

    Returns the largest symbol seen (the caller rejects symbols beyond the alphabet); ``alpha``
    is float64 and ``y`` the float32 side information (NDQSG only).
    """
    top = 0
    i = c0
    if nested:
        half = rho // 2
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            step = steps[b]
            cs = codes[i - c0 : hi - c0]
            ys = out[i:hi]
            if step > _ZERO32:
                st1 = np.float64(step)
                st2 = np.float64(rho) * st1
                side = y[i:hi]
                for k in range(hi - i):
                    c = np.int64(cs[k])
                    top = max(top, c)
                    u = np.float64(uniform24(key, i + k) - _HALF)
                    yv = np.float64(side[k])
                    r = (np.float64(c - half) - u) * st1 - alpha * yv
                    r = r - st2 * np.rint(r / st2)
                    ys[k] = np.float32(yv + alpha * r)
            else:
                for k in range(hi - i):
                    top = max(top, np.int64(cs[k]))
                    ys[k] = _ZERO32
            i = hi
    else:
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            step = steps[b]
            cs = codes[i - c0 : hi - c0]
            ys = out[i:hi]
            for k in range(hi - i):
                c = np.int64(cs[k])
                top = max(top, c)
                u = uniform24(key, i + k) - _HALF
                ys[k] = step * (np.float32(c - levels) - u)
            i = hi
    return top


@njit(cache=True)
def _decode_chunk(data, d, steps, nested, levels, rho, alpha, key, y, width, c, out):
    n = out.size
    c0 = c * CHUNK
    c1 = min(c0 + CHUNK, n)
    if width <= 8:
        small = np.empty(CHUNK, np.uint8)
        unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
        return _chunk_values(small, d, steps, nested, levels, rho, alpha, key, y, c0, c1, out)
    wide = np.empty(CHUNK, np.uint16)
    unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
    return _chunk_values(wide, d, steps, nested, levels, rho, alpha, key, y, c0, c1, out)


@parallel_kernel(count_arg=10)
def _unpack(data, d, steps, nested, levels, rho, alpha, key, y, width, out):
    nchunks = (out.size + CHUNK - 1) // CHUNK
    tops = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        tops[c] = _decode_chunk(data, d, steps, nested, levels, rho, alpha, key, y, width, c, out)
    return tops.max() if nchunks else 0


@parallel_kernel
def _values(codes, d, steps, nested, levels, rho, alpha, key, y, out):
    n = out.size
    nchunks = (n + CHUNK - 1) // CHUNK
    tops = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        tops[c] = _chunk_values(codes[c0:c1], d, steps, nested, levels, rho, alpha, key, y, c0, c1, out)
    return tops.max() if nchunks else 0


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
    _pack(x, d, steps, nested, levels, rho, np.float32(alpha), np.uint64(key), width, out)
    return out


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
) -> tuple[np.ndarray, int]:
    """Unpack ``n`` symbols from ``data`` (exactly the packed size) and reconstruct the values.

    Returns
    -------
    (np.ndarray, int)
        float32 values and the largest symbol found (the caller rejects it when beyond the
        alphabet). NDQSG needs ``side_info`` (float32, ``n`` values).
    """
    nested, levels, rho = _args(nested, levels, rho)
    require_items(data, (n * width + 7) // 8, "packed indices")
    _require_buckets(n, d, steps, nested, side_info)
    out = np.empty(n, np.float32)
    top = _unpack(data, d, steps, nested, levels, rho, float(alpha), np.uint64(key), _side(side_info), width, out)
    return out, int(top)


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
) -> tuple[np.ndarray, int]:
    """Like :func:`decode_packed` from unpacked symbols (as an entropy decoder returns them)."""
    nested, levels, rho = _args(nested, levels, rho)
    codes = np.ascontiguousarray(codes, dtype=codes.dtype if codes.dtype in (np.uint8, np.uint16) else np.uint16)
    _require_buckets(codes.size, d, steps, nested, side_info)
    out = np.empty(codes.size, np.float32)
    top = _values(codes, d, steps, nested, levels, rho, float(alpha), np.uint64(key), _side(side_info), out)
    return out, int(top)
