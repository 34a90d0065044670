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
  divides only in buckets where that product lies within ``2**-20`` of a half-integer, or whose
  side information is large or not finite). The decoding kernels check every value they write
  for NaN/Inf (``Quantizer.values_finite``), so the codec skips its own pass over the result.

A zero step (all-zero bucket) divides by 1 instead. The kernels loop over chunks of
``common.CHUNK`` elements (a multiple of 8, so each chunk starts on a byte of the packed stream);
each loop is written once and compiled parallel and serial by
:func:`fedquant.jit.twins.parallel_kernel`.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from fedquant.codecs.buckets import torch_bucket_stat
from fedquant.codecs.buffers import output_array
from fedquant.codecs.kernels.common import (
    _ABS_MASK,
    _GAMMA,
    _U_SCALE,
    CHUNK,
    add_counts,
    chunk_quotients,
    count_table,
    counter,
    group_chunks,
    hash24_at,
    hash24_run,
    pack_into,
    parallel_kernel,
    unpack_from,
)
from fedquant.codecs.kernels.hadamard import (
    TILE,
    apply_masks_into,
    block_at,
    butterflies_checked,
    chunk_in_cache,
    forward_span,
    inverse_span,
    rotation_args,
    scale_masked,
    scaled_butterflies,
    sign_masks,
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
#: NDQSG decoding checks ``round(r / step2)`` where ``r * (1 / step2)`` is at least this far from
#: its nearest integer (within ``2**-20`` of a half-integer) or at least ``_FAR`` in magnitude.
_NEAR_HALF = np.float64(0.5 - 2.0**-20)
_FAR = np.float64(2.0**20)
_FLOAT32_MAX = np.float32(np.finfo(np.float32).max)
_BIG_STEP = np.float64(2.0**126)
_U_SCALE64 = np.float64(_U_SCALE)
_HALF_UNITS = np.int64(1 << 23)  # 1/2 in units of the dither's 2**-24
_BIG_SIDE = np.float64(2.0**127)


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
def _chunk_symbols(xc, d, steps, nested, levels, rho, alpha, key, c0, c1, codes, hs, ts):
    """Symbols of elements ``c0 .. c1`` (``xc``: their values, from 0) into ``codes[0 : c1 - c0]``.

    DQSG (``nested`` False): ``clamp(round(v / step + u), -M, M) + M``. NDQSG: ``s + rho // 2``.
    ``alpha`` is float32. Three loops over the chunk, each vectorized on its own lanes: the random
    bits into ``hs`` (uint32, :func:`~fedquant.codecs.kernels.common.hash24_run`), the quotients
    ``(alpha v) / step`` into ``ts`` (:func:`~fedquant.codecs.kernels.common.chunk_quotients`,
    bit for bit the float32 division), then the symbols on 32-bit lanes. A chunk where a quotient
    may be a subnormal float32 takes the division instead. ``xc`` may be a rotated chunk in an
    L1 buffer (:func:`_steps_pack`) or a slice of the tensor.
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
    if chunk_quotients(xc, d, steps, scale, True, True, c0, c1, ts):
        i = c0
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            safe = steps[b] if steps[b] > _ZERO32 else _ONE32
            for k in range(i - c0, hi - c0):
                tt[k] = (scale * xc[k]) / safe
            i = hi
    if nested:
        for k in range(m):
            cs[k] = _ndqsg_symbol(tt[k], us[k], rf, inv_rho, half)
    else:
        for k in range(m):
            cs[k] = _dqsg_symbol(tt[k], us[k], lv)


@njit(cache=True)
def _encode_chunk(xc, d, steps, nested, levels, rho, alpha, key, width, c0, c1, out):
    """Symbols of elements ``c0 .. c1`` (``xc``: their values, from 0), packed into ``out``."""
    m = c1 - c0  # scratch of the chunk's size: a small tensor allocates little
    hs = np.empty(m, np.uint32)
    ts = np.empty(m, np.float32)
    if width <= 8:
        small = np.empty(m, np.uint8)
        _chunk_symbols(xc, d, steps, nested, levels, rho, alpha, key, c0, c1, small, hs, ts)
        pack_into(small, m, width, out, (c0 * width) // 8)
    else:
        wide = np.empty(m, np.uint16)
        _chunk_symbols(xc, d, steps, nested, levels, rho, alpha, key, c0, c1, wide, hs, ts)
        pack_into(wide, m, width, out, (c0 * width) // 8)


@parallel_kernel
def _pack(x, d, steps, nested, levels, rho, alpha, key, width, out):
    n = x.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        _encode_chunk(x[c0:c1], d, steps, nested, levels, rho, alpha, key, width, c0, c1, out)


@njit(cache=True)
def _chunk_steps(xc, d, levels, c0, c1, steps):
    """``steps[b] = max |x| / levels`` (float32) of the buckets of elements ``c0 .. c1`` (whole buckets;
    ``xc``: their values, from 0), the maximum over the bit patterns as
    :func:`~fedquant.codecs.kernels.common.bucket_max_abs` (on uint32 lanes; the maximum goes into
    ``steps[b]`` as bits, then is divided there: no array per bucket to reinterpret it)."""
    bits = xc.view(np.uint32)
    step_bits = steps.view(np.uint32)
    lv = np.float32(levels)
    for b in range(c0 // d, (c1 + d - 1) // d):
        lo = b * d - c0
        hi = min(lo + d, c1 - c0)
        mb = np.uint32(0)
        seg = bits[lo:hi]
        for i in range(hi - lo):
            mb = max(mb, np.uint32(seg[i] & _ABS_MASK))
        step_bits[b] = mb
        steps[b] = steps[b] / lv


@parallel_kernel(count_arg=1)
def _steps_pack(x, n, d, nested, levels, rho, alpha, key, width, steps, out, layout, rot_scales, rot_key):
    """The bucket steps fused with :func:`_pack` (``CHUNK % d == 0``: each chunk holds whole buckets):
    one read of ``x``. With a rotation (``layout``, ``rot_scales``, ``rot_key`` of
    :class:`~fedquant.codecs.transforms.rht.FusedRotation`; an empty ``layout`` for none) the ``n``
    values are ``rht``'s rotation of ``x``, each chunk rotated in cache first. Returns the number of
    rotated blocks holding NaN or Inf (0 without a rotation)."""
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        xc, bad[c] = chunk_in_cache(x, c0, c1, layout, rot_scales, rot_key)
        _chunk_steps(xc, d, levels, c0, c1, steps)
        _encode_chunk(xc, d, steps, nested, levels, rho, alpha, key, width, c0, c1, out)
    return bad.sum()


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
            _chunk_symbols(x[c0:c1], d, steps, nested, levels, rho, alpha, key, c0, c1, out[c0:c1], hs, ts)
            if counts.shape[1]:
                add_counts(out[c0:c1], c1 - c0, counts[g])


@parallel_kernel(count_arg=1)
def _steps_codes(x, n, d, nested, levels, rho, alpha, key, steps, out, counts, layout, rot_scales, rot_key):
    """The bucket steps fused with :func:`_codes` (``CHUNK % d == 0``) behind ``rht``'s rotation
    (``layout``, ``rot_scales``, ``rot_key``; see :func:`_steps_pack`): each chunk of the ``n``
    rotated values is rotated into an L1 buffer, its buckets' steps taken, its symbols written to
    ``out`` and counted into its group's row of ``counts`` (no columns: not counted). Returns the
    number of rotated blocks holding NaN or Inf."""
    nchunks = (n + CHUNK - 1) // CHUNK
    groups = counts.shape[0]
    bad = np.zeros(groups, np.int64)
    for g in prange(groups):
        first, end = group_chunks(g, groups, nchunks)
        xs = np.empty(min(CHUNK, n), np.float32)
        hs = np.empty(min(CHUNK, n), np.uint32)
        ts = np.empty(min(CHUNK, n), np.float32)
        for c in range(first, end):
            c0 = c * CHUNK
            c1 = min(c0 + CHUNK, n)
            xc = xs[: c1 - c0]
            bad[g] += forward_span(x, c0, c1, layout, rot_scales, rot_key, xc)
            _chunk_steps(xc, d, levels, c0, c1, steps)
            _chunk_symbols(xc, d, steps, nested, levels, rho, alpha, key, c0, c1, out[c0:c1], hs, ts)
            if counts.shape[1]:
                add_counts(out[c0:c1], c1 - c0, counts[g])
    return bad.sum()


# ---------------------------------------------------------------- decoding
@njit(cache=True)
def _largest(codes, m):
    """The largest of ``codes[:m]`` (a pass of its own: a narrow max that vectorizes)."""
    top = codes[0]
    for k in range(1, m):
        top = max(top, codes[k])
    return np.int64(top)


@njit(cache=True, inline="always")
def _ndqsg_value(shifted, yv, st1, st2, z_of_r, alpha, exact):
    """Float64 NDQSG value, rounded to float32, of ``shifted = s - rho // 2 - u`` (the symbol less
    its offset and dither, float64) against side value ``yv``; ``z_of_r``: ``1 / st2``, or ``st2``
    with ``exact``. Also returns ``z`` (``r / st2`` or ``r * (1 / st2)``) and its rounding ``k``."""
    r = shifted * st1 - alpha * yv
    z = r / z_of_r if exact else r * z_of_r
    k = np.rint(z)
    return np.float32(yv + alpha * (r - st2 * k)), z, k


@njit(cache=True, inline="always")
def _may_round_apart(z, k):
    """Whether ``z = r * (1 / st2)``, rounded to ``k``, may round to another integer than ``r / st2``
    while ``|z| < 2**20``: ``z`` lies within a relative ``2**-52`` of the quotient, so only a ``z``
    within ``2**-20`` of a half-integer may."""
    return abs(z - k) >= _NEAR_HALF


@njit(cache=True, inline="always")
def _shifted(c, w, offset):
    """``c - rho // 2 - u`` exactly for symbol ``c``, ``offset = 1/2 - rho // 2`` and the dither
    ``u = bits 2**-24 - 1/2`` of counter term ``w``: every term is a multiple of ``2**-24`` below ``2**17``."""
    return (np.float64(c) + offset) - np.float64(hash24_at(w)) * _U_SCALE64


@njit(cache=True, inline="always")
def _shifted_units(c, w, base):
    """:func:`_shifted` times ``2**24``, an int64, for ``base = 2**23 - (rho // 2) 2**24``:
    ``(c - rho // 2) 2**24 + 2**23 - bits``, exactly, as every term is an integer below ``2**41``.

    Its float64 (exact: below ``2**53``) times ``st1 2**-24`` is the product ``_shifted(...) * st1``
    bit for bit: ``st1`` is a positive float32 widened, at least ``2**-149``, so ``st1 2**-24``
    is a normal float64 scaled by a power of two (exact), and both products have the same real
    value ``(c - rho // 2 - u) st1``, hence the same rounding (no overflow or underflow: its
    magnitude lies between ``2**-173`` and ``2**145``, or is 0). It saves the fast loop a
    conversion, an addition and a multiplication per element.
    """
    return (np.int64(c) << 24) + (base - np.int64(hash24_at(w)))


@njit(cache=True, inline="always")
def _nested_pass(cs, w, side, ys, st1s, st2, inv2, base, alpha):
    """The fast pass of :func:`_nested_bucket` (``alpha`` a constant where inlined): the values
    from ``r * (1 / st2)``, and whether the bucket needs the exact pass. ``st1s`` is
    ``st1 2**-24`` and ``base`` that of :func:`_shifted_units`, whose products with it are
    :func:`_shifted`'s with ``st1``.

    It does when some ``z`` :func:`_may_round_apart`, or some side value is not below
    :func:`_side_bound`: that bound keeps ``|z| < 2**20`` (``|r| <= st2 / 2 + alpha |y|``) and every
    value finite (``|value| <= |y| + st2 / 2``), and a NaN or Inf is not below it. One flag, not
    one per check: each is a reduction the vectorized loop carries (at 25M, one flag measured
    36 ms, three 60 ms).
    """
    bound = _side_bound(st2)
    flag = False
    for k in range(cs.size):
        yv = np.float64(side[k])
        value, z, q = _ndqsg_value(np.float64(_shifted_units(cs[k], w, base)), yv, st1s, st2, inv2, alpha, False)
        w += _GAMMA
        ys[k] = value
        flag |= _may_round_apart(z, q) | (not abs(yv) < bound)
    return flag


@njit(cache=True, inline="always")
def _side_bound(st2):
    """Side values below this keep :func:`_nested_pass`'s ``|z|`` below ``2**20`` and its values
    finite: ``min((2**20 - 1) st2, 2**127)``, and 0 (every value checked) for ``st2 >= 2**126``."""
    if st2 >= _BIG_STEP:
        return 0.0
    return min((_FAR - 1.0) * st2, _BIG_SIDE)


@njit(cache=True, inline="always")
def _nested_bucket(cs, w, side, side_bits, ys, st1, st2, half, alpha):
    """NDQSG values of one bucket (step ``st1 > 0``); returns whether some side information, and
    whether some value, is not finite.

    The dither is hashed in the loop from the counter term ``w`` of the bucket's first element
    (:func:`~fedquant.codecs.kernels.common.counter`): the loop runs on 64-bit lanes anyway, and a
    separate pass into a buffer measured 9 ms slower at 25M elements. ``round(r / st2)`` is taken
    from ``r * (1 / st2)`` (:func:`_nested_pass`); a bucket where the two may round apart, or
    whose side information is large or not finite, is done again with the division
    (:func:`_nested_exact`), which also tells the two checks apart. ``alpha`` 1 has a loop of its
    own without the multiplications by it (exact either way). Inlined into the bucket loop of
    :func:`_chunk_values`: a call per bucket (its array arguments and their reference counts)
    cost 5 ms at 25M elements, one core, in a standalone loop (about 1 ms in the decoder).
    """
    inv2 = 1.0 / st2
    st1s = st1 * _U_SCALE64
    base = _HALF_UNITS - (np.int64(half) << 24)
    if alpha == 1.0:
        flag = _nested_pass(cs, w, side, ys, st1s, st2, inv2, base, 1.0)
    else:
        flag = _nested_pass(cs, w, side, ys, st1s, st2, inv2, base, alpha)
    if not flag:
        return False, False
    return _nested_exact(cs, w, side, side_bits, ys, st1, st2, half, alpha)


@njit(cache=True)
def _nested_exact(cs, w, side, side_bits, ys, st1, st2, half, alpha):
    """:func:`_nested_bucket`'s values of a bucket with ``round(r / st2)`` from the division, and its
    two checks (a call of its own: rarely taken)."""
    offset = 0.5 - half
    bad_side = False
    bad_out = False
    for k in range(cs.size):
        value = _ndqsg_value(_shifted(cs[k], w, offset), np.float64(side[k]), st1, st2, st2, alpha, True)[0]
        w += _GAMMA
        ys[k] = value
        bad_side |= (side_bits[k] & _EXP_MASK) == _EXP_MASK
        bad_out |= abs(value) > _FLOAT32_MAX
    return bad_side, bad_out


@njit(cache=True)
def _chunk_values(codes, d, steps, nested, levels, rho, alpha, key, yc, c0, c1, vals, hs):
    """Values of elements ``c0 .. c1`` into ``vals`` (from 0) from their symbols ``codes[0 : c1 - c0]``.

    Returns the largest symbol seen (the caller rejects symbols beyond the alphabet), whether the
    side information of these elements holds a NaN or Inf (NDQSG, which reads it anyway) and
    whether a value written holds one (an overflow: the last two are checked in the same pass);
    ``alpha`` is float64 and ``yc`` the float32 side information of these elements, from 0
    (NDQSG only). DQSG's random bits go to ``hs`` first
    (:func:`~fedquant.codecs.kernels.common.hash24_run`); NDQSG hashes them in its loop.
    """
    m = c1 - c0
    top = _largest(codes, m) if m else 0
    bad_side = False
    bad_out = False
    i = c0
    if nested:
        half = np.float64(rho // 2)
        y_bits = yc.view(np.uint32)
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            step = steps[b]
            ys = vals[i - c0 : hi - c0]
            if step > _ZERO32:
                st1 = np.float64(step)
                cs = codes[i - c0 : hi - c0]
                side_bad, out_bad = _nested_bucket(
                    cs, counter(key, i), yc[i - c0 : hi - c0], y_bits[i - c0 : hi - c0], ys, st1,
                    np.float64(rho) * st1, half, alpha,
                )  # fmt: skip
                bad_side |= side_bad
                bad_out |= out_bad
            else:
                ys[:] = _ZERO32
                bad_side |= _count_nonfinite(y_bits, i - c0, hi - c0) > 0
            i = hi
    else:
        hash24_run(key, c0, m, hs)
        lv = np.float32(levels)
        while i < c1:
            b = i // d
            hi = min((b + 1) * d, c1)
            step = steps[b]
            cs = codes[i - c0 : hi - c0]
            us = hs[i - c0 : hi - c0]
            ys = vals[i - c0 : hi - c0]
            for k in range(hi - i):
                u = np.float32(us[k]) * _U_SCALE - _HALF
                value = step * ((np.float32(cs[k]) - lv) - u)
                ys[k] = value
                bad_out |= not abs(value) <= _FLOAT32_MAX
            i = hi
    return top, bad_side, bad_out


@njit(cache=True)
def _decode_chunk(data, d, steps, nested, levels, rho, alpha, key, yc, width, c0, c1, vals):
    """Unpack the symbols of elements ``c0 .. c1`` and reconstruct them into ``vals`` (from 0)."""
    m = c1 - c0
    hs = np.empty(0 if nested else m, np.uint32)
    if width <= 8:
        small = np.empty(m, np.uint8)
        unpack_from(data, (c0 * width) // 8, m, width, small)
        return _chunk_values(small, d, steps, nested, levels, rho, alpha, key, yc, c0, c1, vals, hs)
    wide = np.empty(m, np.uint16)
    unpack_from(data, (c0 * width) // 8, m, width, wide)
    return _chunk_values(wide, d, steps, nested, levels, rho, alpha, key, yc, c0, c1, vals, hs)


@njit(cache=True)
def _decode_chunk_rotated(codes, d, steps, levels, rho, alpha, key, y, c0, c1, out, layout, rot_scales, rot_key):
    """NDQSG's :func:`_chunk_values` of elements ``c0 .. c1`` between ``rht``'s two rotations, block by
    block in L1.

    Each block of the side information ``y`` (given before the rotation, zero padded) is rotated,
    the block's values reconstructed against it, rotated back and written to ``out`` (its first
    ``out.size`` elements); the block's signs are hashed once for both rotations. (DQSG, which has
    no side information, goes chunk by chunk: per block it measured slower, 65 ms against 42.)
    Returns
    ``(largest symbol, 1 if a value written to out is not finite, 1 if a rotated side value is not)``.
    """
    top = 0
    bad_out = 0
    bad_side = 0
    seg_y = np.empty(TILE, np.float32)
    seg_v = np.empty(TILE, np.float32)
    masks = np.empty(TILE, np.uint32)
    no_hashes = np.empty(0, np.uint32)
    n_y = y.size
    size = out.size
    p = c0
    while p < c1:
        length, c = block_at(layout, rot_scales, p)
        sy = seg_y[:length]
        sv = seg_v[:length]
        mk = masks[:length]
        sign_masks(mk, rot_key, p)
        m = min(max(n_y - p, 0), length)
        ys = y[p : p + m]
        scale_masked(ys, m, sy, c, mk)  # scaling and signs in one pass (25M, one core: 1.5-2 ms less)
        bad_side |= butterflies_checked(sy, length)
        block_top, _, _ = _chunk_values(
            codes[p - c0 :], d, steps, True, levels, rho, alpha, key, sy, p, p + length, sv, no_hashes
        )  # (a rotated side value that is not finite is bad_side's already)
        top = max(top, block_top)
        scaled_butterflies(sv, c)
        if p < size:  # the padded tail block: only what is kept is written and checked
            bad_out |= apply_masks_into(sv, mk, out[p : min(p + length, size)])
        p += length
    return top, bad_out, bad_side


@parallel_kernel(count_arg=1)
def _unpack(data, n, d, steps, nested, levels, rho, alpha, key, y, width, out, layout, rot_scales, rot_key):
    """Decode ``n`` packed symbols into ``out``; returns ``(largest symbol, blocks or chunks of out with
    NaN or Inf, chunks of the side information with NaN or Inf)``.

    Without a rotation, the values and the side information ``y`` (NDQSG) are checked in the
    decoding pass. With a rotation (see :func:`_steps_pack`; ``n`` its laid-out size) each
    chunk's values are rotated back in cache and ``out`` receives the first ``out.size`` values;
    the side information is then given before the rotation, each chunk of it is rotated in cache,
    and the third count is of rotated blocks holding NaN or Inf.
    """
    nchunks = (n + CHUNK - 1) // CHUNK
    rotate = layout.shape[0] > 0
    tops = np.zeros(nchunks, np.int64)
    bad_out = np.zeros(nchunks, np.int64)
    bad_side = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        if not rotate:
            yc = y[c0:c1] if nested else y
            tops[c], bad_side[c], bad_out[c] = _decode_chunk(
                data, d, steps, nested, levels, rho, alpha, key, yc, width, c0, c1, out[c0:c1]
            )
            continue
        if not nested:  # DQSG: the chunk's values, then rotated back
            vals = np.empty(c1 - c0, np.float32)
            tops[c], _, _ = _decode_chunk(data, d, steps, nested, levels, rho, alpha, key, y, width, c0, c1, vals)
            bad_out[c] = inverse_span(vals, c0, c1, layout, rot_scales, rot_key, out[c0 : min(c1, out.size)])
            continue
        if width <= 8:
            small = np.empty(c1 - c0, np.uint8)
            unpack_from(data, (c0 * width) // 8, c1 - c0, width, small)
            tops[c], bad_out[c], bad_side[c] = _decode_chunk_rotated(
                small, d, steps, levels, rho, alpha, key, y, c0, c1, out, layout, rot_scales, rot_key
            )
        else:
            wide = np.empty(c1 - c0, np.uint16)
            unpack_from(data, (c0 * width) // 8, c1 - c0, width, wide)
            tops[c], bad_out[c], bad_side[c] = _decode_chunk_rotated(
                wide, d, steps, levels, rho, alpha, key, y, c0, c1, out, layout, rot_scales, rot_key
            )
    return (tops.max() if nchunks else 0), bad_out.sum(), bad_side.sum()


@parallel_kernel(count_arg=1)
def _values(codes, n, d, steps, nested, levels, rho, alpha, key, y, out, layout, rot_scales, rot_key):
    """Decode ``n`` unpacked symbols (as an entropy decoder returns them) into ``out``, as :func:`_unpack`
    decodes packed ones, with or without ``rht``'s inverse rotation (same arguments after ``y``,
    same returns)."""
    nchunks = (n + CHUNK - 1) // CHUNK
    rotate = layout.shape[0] > 0
    tops = np.zeros(nchunks, np.int64)
    bad_out = np.zeros(nchunks, np.int64)
    bad_side = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        c0 = c * CHUNK
        c1 = min(c0 + CHUNK, n)
        if not rotate:
            yc = y[c0:c1] if nested else y
            hs = np.empty(0 if nested else c1 - c0, np.uint32)
            tops[c], bad_side[c], bad_out[c] = _chunk_values(
                codes[c0:c1], d, steps, nested, levels, rho, alpha, key, yc, c0, c1, out[c0:c1], hs
            )
        elif nested:
            tops[c], bad_out[c], bad_side[c] = _decode_chunk_rotated(
                codes[c0:c1], d, steps, levels, rho, alpha, key, y, c0, c1, out, layout, rot_scales, rot_key
            )
        else:  # DQSG: the chunk's values, then rotated back
            vals = np.empty(c1 - c0, np.float32)
            hs = np.empty(c1 - c0, np.uint32)
            tops[c], _, _ = _chunk_values(codes[c0:c1], d, steps, nested, levels, rho, alpha, key, y, c0, c1, vals, hs)
            bad_out[c] = inverse_span(vals, c0, c1, layout, rot_scales, rot_key, out[c0 : min(c1, out.size)])
    return (tops.max() if nchunks else 0), bad_out.sum(), bad_side.sum()


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
    rotation=None,
) -> tuple[np.ndarray, np.ndarray]:
    """The bucket steps ``max|v| / levels`` fused with :func:`encode_packed`: one read of ``x``.

    Each chunk computes the steps of its own buckets, so ``CHUNK % d == 0`` (callers check).
    Returns ``(steps, packed)``, identical to ``bucket_max_abs(v, d) / float32(levels)`` and
    :func:`encode_packed` with those steps, for ``v`` = ``x``, or with ``rotation`` (a
    :class:`~fedquant.codecs.transforms.rht.FusedRotation`, which refuses a rotated tensor that is
    not finite) ``rht``'s rotation of ``x`` (``rotation.padded`` values), each chunk rotated in
    cache: the bytes of the unfused route.
    """
    nested, levels, rho = _args(nested, levels, rho)
    n = x.size if rotation is None else rotation.padded
    steps = np.empty(-(-n // d), np.float32)
    out = np.empty((n * width + 7) // 8, np.uint8)
    nonfinite = _steps_pack(
        x, n, d, nested, levels, rho, np.float32(alpha), np.uint64(key), width, steps, out, *rotation_args(rotation)
    )
    if rotation is not None:
        rotation.check(nonfinite)
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


def step_encode_symbols(
    x: np.ndarray,
    d: int,
    key: np.uint64,
    rotation,
    *,
    levels: int,
    nested: bool = False,
    rho: int = 1,
    alpha: float = 1.0,
    count: bool = False,
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bucket steps fused with :func:`encode_symbols` behind ``rht``'s rotation: one read of ``x``.

    ``rotation`` is a :class:`~fedquant.codecs.transforms.rht.FusedRotation` (it refuses a rotated
    tensor that is not finite); each chunk of its ``rotation.padded`` values is rotated in cache,
    and ``CHUNK % d == 0`` (callers check). Returns ``(steps, symbols)``, with ``count``
    ``(steps, symbols, histogram)``: those of :func:`step_encode_packed`'s steps and
    :func:`encode_symbols` on the rotated tensor, the bytes of the unfused route.
    """
    nested, levels, rho = _args(nested, levels, rho)
    k = rho if nested else 2 * levels + 1
    n = rotation.padded
    steps = np.empty(-(-n // d), np.float32)
    out = np.empty(n, np.uint8 if k <= 256 else np.uint16)
    counts = count_table(n, k if count else 0)
    nonfinite = _steps_codes(
        x, n, d, nested, levels, rho, np.float32(alpha), np.uint64(key), steps, out, counts, *rotation_args(rotation)
    )
    rotation.check(nonfinite)
    return (steps, out, counts.sum(axis=0)) if count else (steps, out)


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
    rotation=None,
) -> tuple[np.ndarray, int, bool, bool]:
    """Unpack ``n`` symbols from ``data`` (exactly the packed size) and reconstruct the values.

    With ``rotation`` (a :class:`~fedquant.codecs.transforms.rht.FusedRotation`, ``n`` its laid-out
    size) the values come back through ``rht``'s inverse rotation (``rotation.numel`` of them,
    ``rotation.finite`` set) and ``side_info`` is given before the rotation (``rotation.numel``
    values; a rotated side information that is not finite is refused as the rotation refuses it).

    Returns
    -------
    (np.ndarray, int, bool, bool)
        float32 values, the largest symbol found (the caller rejects it when beyond the
        alphabet), whether the side information is all finite (checked in the same pass;
        True without side information, and with a rotation, which refuses it instead) and
        whether every value returned is finite (checked in the same pass). NDQSG needs
        ``side_info`` (float32, ``n`` values); with a NaN or Inf in it the values are
        meaningless.
    """
    nested, levels, rho = _args(nested, levels, rho)
    require_items(data, (n * width + 7) // 8, "packed indices")
    out = _decode_output(n, d, steps, nested, side_info, rotation)
    top, bad_out, bad_side = _unpack(
        data, n, d, steps, nested, levels, rho, float(alpha), np.uint64(key), _side(side_info), width, out,
        *rotation_args(rotation),
    )  # fmt: skip
    return _decoded(out, top, bad_out, bad_side, rotation)


def _decode_output(n: int, d: int, steps: np.ndarray, nested: bool, side_info, rotation) -> np.ndarray:
    """The checked bucket steps and side information of ``n`` decoded symbols, and the array their
    values go to (``rotation.numel`` of them behind a rotation, whose side information is given
    before it)."""
    if rotation is None:
        _require_buckets(n, d, steps, nested, side_info)
        return output_array(n)
    _require_buckets(n, d, steps, False, None)
    if nested:
        require_items(_side(side_info), rotation.numel, "side information")
    return output_array(rotation.numel)


def _decoded(out: np.ndarray, top: int, bad_out: int, bad_side: int, rotation) -> tuple[np.ndarray, int, bool, bool]:
    """A decoding kernel's result as :func:`decode_packed` returns it. Behind a rotation, the rotation
    refuses non-finite side information and records whether the values are finite (the side
    information then counts as checked)."""
    if rotation is None:
        return out, int(top), bad_side == 0, bad_out == 0
    rotation.check(bad_side)
    rotation.finite = bad_out == 0
    return out, int(top), True, rotation.finite


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
    rotation=None,
) -> tuple[np.ndarray, int, bool, bool]:
    """Like :func:`decode_packed` from unpacked symbols (as an entropy decoder returns them), with or
    without ``rotation`` (then ``codes.size`` is its laid-out size)."""
    nested, levels, rho = _args(nested, levels, rho)
    codes = np.ascontiguousarray(codes, dtype=codes.dtype if codes.dtype in (np.uint8, np.uint16) else np.uint16)
    out = _decode_output(codes.size, d, steps, nested, side_info, rotation)
    top, bad_out, bad_side = _values(
        codes, codes.size, d, steps, nested, levels, rho, float(alpha), np.uint64(key), _side(side_info), out,
        *rotation_args(rotation),
    )  # fmt: skip
    return _decoded(out, top, bad_out, bad_side, rotation)
