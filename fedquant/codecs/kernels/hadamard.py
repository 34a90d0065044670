"""Blocked fast Walsh–Hadamard transform with random signs: numba kernels and their torch twin.

A tensor is laid out as consecutive power-of-two *blocks* (sizes ``2**k``, the last one may run
past the data and is zero-padded). Each block of ``L = 2**k`` elements goes through the
orthonormal randomized Hadamard transform ``y = H_k D x / sqrt(L)``:

* **forward**: ``v_i = x_i * c`` with the sign of ``v_i`` flipped where ``D`` is -1 (``c`` the
  float32 value of ``2**(-k/2)``; exact for even ``k``), then the butterfly stages
  ``h = 1, 2, 4, ..., L/2``: ``(a, b) -> (a + b, a - b)`` on elements ``h`` apart;
* **inverse**: ``v_i = y_i * c``, the same stages, then the sign flips (``H`` is symmetric and
  ``H H = L I``, so this undoes the forward transform up to float32 rounding).

``D_ii`` is -1 where bit ``i mod 64`` of the SplitMix64 hash of word ``i // 64`` of the
counter-based stream of :mod:`fedquant.rng` is set (``i`` the element's position in the laid-out
tensor; :func:`fedquant.rng.rotation_negative`): the numba kernels hash once per 64 elements and
shift those bits straight into the floats' sign bits, the torch twin expands the same bits.

Both paths perform these float32 operations (one multiply, sign flips, the additions of the
stages in ascending ``h``) on every element, so they give bit-identical results; only the order
in which independent butterflies run differs.

The numba path, blocks of at most a tile (``TILE = 2**TILE_LOG2`` floats, 32 KiB; the default
layout's blocks of 512): one pass, chunk by chunk (``common.CHUNK``, a multiple of every such
block, which never straddle one), each block loaded, scaled, signed and run through all its
stages while in L1, then written once (:func:`forward_span`, :func:`inverse_span`). The non-finite
check happens there too. Kernels of the quantizers call the same two functions on their own
chunks (:func:`fusable`): the rotated tensor then never goes to memory at all.

Where the time goes: docs/kernels.md (Measurements, Hadamard transform).

Blocks larger than a tile (``rht:max_log2=16``) take two passes over memory:

1. **low pass**: each tile of such a block is loaded, scaled and signed, and runs all stages with
   ``h < TILE`` while in cache;
2. **high pass**: the block is a ``(rows, TILE)`` matrix and the remaining stages are a Hadamard
   transform down the rows; each strip of columns (about ``STRIP_FLOATS`` floats) is copied to a
   buffer and runs all of them there (butterflies of contiguous rows, which vectorize).

Every pass runs in parallel (over chunks, tiles, strips) through
:func:`fedquant.jit.twins.parallel_kernel`, serially below ``PARALLEL_MIN`` elements.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fedquant.codecs.kernels.common import CHUNK, c_array_of, counter, mix64
from fedquant.jit import parallel_kernel
from fedquant.rng import rotation_negative

#: A tile: 32 KiB of float32, the L1 data cache.
TILE_LOG2 = 13
TILE = 1 << TILE_LOG2
#: Floats a strip of the high pass holds (256 KiB: in L2), at least ``MIN_STRIP`` columns wide.
STRIP_FLOATS = 1 << 16
MIN_STRIP = 16

_ZERO32 = np.float32(0.0)
_S32 = np.uint64(32)
_S31_32 = np.uint32(31)
_ONE64 = np.uint64(1)
_SIGN = np.uint32(0x80000000)
_EXP_MASK = np.uint32(0x7F800000)
_EXP_ONE = np.uint32(0x00800000)


def block_scale(k: int) -> np.float32:
    """The float32 normalization ``2**(-k/2)`` of a block of ``2**k`` elements."""
    return np.float32(2.0 ** (-k / 2))


# ---------------------------------------------------------------- numba: the butterflies
def _float32_c(seg) -> bool:
    """Whether a numba type is a contiguous float32 array (all the vector intrinsics accept)."""
    return c_array_of(seg, types.float32)


def _vector_ptrs(context, builder, sig, args, count, lanes=8):
    """Pointers ``&seg[i + j h]``, ``j < count``, as ``<lanes x float>*`` (``args``: seg, i, h)."""
    arr = context.make_array(sig.args[0])(context, builder, args[0])
    vector = ir.VectorType(ir.FloatType(), lanes)
    ptrs = []
    offset = args[1]
    for _ in range(count):
        ptrs.append(builder.bitcast(builder.gep(arr.data, [offset]), vector.as_pointer()))
        offset = builder.add(offset, args[2])
    return ptrs


@intrinsic
def _radix2x8(typingctx, seg, i, h):
    """``(a, b) -> (a + b, a - b)`` on the 8 floats at ``seg[i]`` and the 8 at ``seg[i + h]``.

    LLVM chooses badly by itself for these loops: with ``h = 8`` the vectorizer's main loop (32 or
    more elements) never runs and the stage goes scalar, and a loop written per group of 32 gets
    vectorized across groups with gathers and scatters. Eight floats per operation, said in IR,
    made the stages ``h >= 8`` of a 512 block three times faster (8.2 ms -> 2.9 ms at 25M).
    """

    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        p = _vector_ptrs(context, builder, sig, args, 2)
        a, b = (builder.load(q, align=4) for q in p)
        builder.store(builder.fadd(a, b), p[0], align=4)
        builder.store(builder.fsub(a, b), p[1], align=4)
        return context.get_dummy_value()

    return types.void(seg, types.intp, types.intp), codegen


@intrinsic
def _radix4x8(typingctx, seg, i, h):
    """Stages ``h`` then ``2 h`` on the 8-float vectors at ``seg[i + j h]``, ``j < 4`` (see :func:`_radix2x8`)."""

    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        p = _vector_ptrs(context, builder, sig, args, 4)
        a, b, c, d = (builder.load(q, align=4) for q in p)
        s0, s1 = builder.fadd(a, b), builder.fsub(a, b)
        s2, s3 = builder.fadd(c, d), builder.fsub(c, d)
        results = (builder.fadd(s0, s2), builder.fadd(s1, s3), builder.fsub(s0, s2), builder.fsub(s1, s3))
        for q, v in zip(p, results):
            builder.store(v, q, align=4)
        return context.get_dummy_value()

    return types.void(seg, types.intp, types.intp), codegen


@intrinsic
def _radix4x16(typingctx, seg, i, h):
    """:func:`_radix4x8` on 16-float vectors (``h`` a multiple of 16): explicit 512-bit vectors are
    zmm registers even where LLVM's vectorizers prefer 256 bits."""
    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        p = _vector_ptrs(context, builder, sig, args, 4, 16)
        a, b, c, d = (builder.load(q, align=4) for q in p)
        s0, s1 = builder.fadd(a, b), builder.fsub(a, b)
        s2, s3 = builder.fadd(c, d), builder.fsub(c, d)
        results = (builder.fadd(s0, s2), builder.fadd(s1, s3), builder.fsub(s0, s2), builder.fsub(s1, s3))
        for q, v in zip(p, results):
            builder.store(v, q, align=4)
        return context.get_dummy_value()

    return types.void(seg, types.intp, types.intp), codegen


def _nonfinite_bits(builder, vectors):
    """OR over the lanes of ``vectors`` (16 floats each) of ``(bits & EXP) + 2**23``: its top bit is set
    exactly when a value is NaN or Inf (see :func:`any_nonfinite`), as a uint32."""
    words = ir.VectorType(ir.IntType(32), 16)
    exp = ir.Constant(words, [ir.Constant(ir.IntType(32), 0x7F800000)] * 16)
    one = ir.Constant(words, [ir.Constant(ir.IntType(32), 0x00800000)] * 16)
    acc = None
    for v in vectors:
        t = builder.add(builder.and_(builder.bitcast(v, words), exp), one)
        acc = t if acc is None else builder.or_(acc, t)
    reduce_or = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.IntType(32), [words]), "llvm.vector.reduce.or.v16i32"
    )
    return builder.call(reduce_or, [acc])


@intrinsic
def _radix4x16_checked(typingctx, seg, i, h):
    """:func:`_radix4x16`, returning :func:`_nonfinite_bits` of its 64 results (the last sweep of a block)."""
    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        p = _vector_ptrs(context, builder, sig, args, 4, 16)
        a, b, c, d = (builder.load(q, align=4) for q in p)
        s0, s1 = builder.fadd(a, b), builder.fsub(a, b)
        s2, s3 = builder.fadd(c, d), builder.fsub(c, d)
        results = (builder.fadd(s0, s2), builder.fadd(s1, s3), builder.fsub(s0, s2), builder.fsub(s1, s3))
        for q, v in zip(p, results):
            builder.store(v, q, align=4)
        return _nonfinite_bits(builder, results)

    return types.uint32(seg, types.intp, types.intp), codegen


@intrinsic
def _radix2x16_checked(typingctx, seg, i, h):
    """:func:`_radix2x16`, returning :func:`_nonfinite_bits` of its 32 results."""
    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        p = _vector_ptrs(context, builder, sig, args, 2, 16)
        a, b = (builder.load(q, align=4) for q in p)
        results = (builder.fadd(a, b), builder.fsub(a, b))
        for q, v in zip(p, results):
            builder.store(v, q, align=4)
        return _nonfinite_bits(builder, results)

    return types.uint32(seg, types.intp, types.intp), codegen


@intrinsic
def _radix2x16(typingctx, seg, i, h):
    """:func:`_radix2x8` on 16-float vectors (``h`` a multiple of 16)."""
    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        p = _vector_ptrs(context, builder, sig, args, 2, 16)
        a, b = (builder.load(q, align=4) for q in p)
        builder.store(builder.fadd(a, b), p[0], align=4)
        builder.store(builder.fsub(a, b), p[1], align=4)
        return context.get_dummy_value()

    return types.void(seg, types.intp, types.intp), codegen


def _first4_stages(builder, v):
    """The IR of :func:`_first4x16`'s stages on the 16-float vector ``v``; returns the result."""
    vector = ir.VectorType(ir.FloatType(), 16)
    index = ir.VectorType(ir.IntType(32), 16)
    fma = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vector, [vector, vector, vector]), "llvm.fma.v16f32"
    )
    for h in (1, 2, 4, 8):
        partner = builder.shuffle_vector(v, v, ir.Constant(index, [j ^ h for j in range(16)]))
        signs = ir.Constant(vector, [-1.0 if j & h else 1.0 for j in range(16)])
        v = builder.call(fma, [v, signs, partner])
    return v


@intrinsic
def _first4x16(typingctx, seg, i):
    """Stages ``h = 1, 2, 4, 8`` of the 16 floats at ``seg[i]``, in one register.

    Stage ``h``: each lane's partner ``i ^ h`` comes by a shuffle; lanes without bit ``h`` get
    ``partner + own``, the others ``partner - own``, both as one fused ``partner + own * (+-1)``
    (the product is exact, so the single rounding is that of the addition: the sums of
    :func:`_first3` and the stage ``h = 8``, bit for bit), two instructions per stage and vector.
    """
    if not _float32_c(seg):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        vector = ir.VectorType(ir.FloatType(), 16)
        ptr = builder.bitcast(builder.gep(arr.data, [args[1]]), vector.as_pointer())
        builder.store(_first4_stages(builder, builder.load(ptr, align=4)), ptr, align=4)
        return context.get_dummy_value()

    return types.void(seg, types.intp), codegen


def _splat16(builder, value):
    """The IR value ``value`` (an int or a float) in all 16 lanes of a vector."""
    kind = ir.VectorType(value.type, 16)
    first = builder.insert_element(ir.Constant(kind, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, first, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))


def _store_scaled_first4(context, builder, seg_type, seg, i, v, c):
    """Store at ``seg[i : i + 16]`` the stages of :func:`_first4x16` of the 16 floats ``v`` times the
    float32 ``c`` (the product rounded as a pass of its own rounds it)."""
    vector = ir.VectorType(ir.FloatType(), 16)
    target = context.make_array(seg_type)(context, builder, seg)
    ptr = builder.bitcast(builder.gep(target.data, [i]), vector.as_pointer())
    builder.store(_first4_stages(builder, builder.fmul(v, _splat16(builder, c))), ptr, align=4)


@intrinsic
def _scaled_first4x16(typingctx, src, seg, i, c):
    """``seg[i : i + 16]`` = :func:`_first4x16` of ``src[i : i + 16] * c`` (float32 ``c``): the product
    rounded to float32 as a pass of its own would round it, then the same stages, without storing
    and reloading the scaled block (the first sweep of :func:`_scaled_stages`)."""
    if not (_float32_c(src) and _float32_c(seg) and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        vector = ir.VectorType(ir.FloatType(), 16)
        source = context.make_array(sig.args[0])(context, builder, args[0])
        load = builder.bitcast(builder.gep(source.data, [args[2]]), vector.as_pointer())
        _store_scaled_first4(context, builder, sig.args[1], args[1], args[2], builder.load(load, align=4), args[3])
        return context.get_dummy_value()

    return types.void(src, seg, types.intp, types.float32), codegen


@intrinsic
def lookup_first4x16(typingctx, word, width, seg, i, t0, t1, t2, t3, c):
    """``seg[i : i + 16]`` = :func:`_first4x16` of ``t[k_j] * c``: ``k_j`` the ``j``-th ``width``-bit field
    of ``word`` (LSB first, ``width`` 1 or 2; ``t1`` / ``t0`` by its low bit, ``t3`` / ``t2`` by the
    high one), the product rounded to float32 as a pass of its own rounds it.

    The first sweep of an inverse transform whose values come from a table of four by packed
    codes (EDEN's centroids times the bucket's scale), with no pass that unpacks the codes and
    none that writes the values: a shift, a mask and three selects per sixteen values.
    """
    if not (_float32_c(seg) and all(t == types.float32 for t in (t0, t1, t2, t3, c))):
        return None

    def codegen(context, builder, sig, args):
        word, width, seg_arg, i, *table, c = args
        words = ir.VectorType(ir.IntType(32), 16)
        zeros16 = ir.Constant(words, [0] * 16)
        w = builder.trunc(width, ir.IntType(32)) if width.type.width > 32 else width
        shifts = builder.mul(ir.Constant(words, list(range(16))), _splat16(builder, w))
        word = builder.trunc(word, ir.IntType(32)) if word.type.width > 32 else word
        mask = builder.sub(builder.shl(ir.Constant(ir.IntType(32), 1), w), ir.Constant(ir.IntType(32), 1))
        fields = builder.and_(builder.lshr(_splat16(builder, word), shifts), _splat16(builder, mask))
        low = builder.icmp_unsigned("!=", builder.and_(fields, ir.Constant(words, [1] * 16)), zeros16)
        high = builder.icmp_unsigned("!=", builder.and_(fields, ir.Constant(words, [2] * 16)), zeros16)
        t = [_splat16(builder, value) for value in table]
        v = builder.select(high, builder.select(low, t[3], t[2]), builder.select(low, t[1], t[0]))
        _store_scaled_first4(context, builder, sig.args[2], seg_arg, i, v, c)
        return context.get_dummy_value()

    f32 = types.float32
    return types.void(word, width, seg, types.intp, f32, f32, f32, f32, f32), codegen


@njit(cache=True)
def _first4(seg, length):
    """Stages ``h = 1, 2, 4, 8`` (``length`` a multiple of 16), sixteen elements per register."""
    for g in range(length // 16):
        _first4x16(seg, 16 * g)


@njit(cache=True)
def _wide_stages16(seg, length, h):
    """Stages ``h, 2 h, .., length/2`` (``h`` a multiple of 16) on 16-float vectors, two per sweep."""
    while 4 * h <= length:
        for i0 in range(0, length, 4 * h):
            for j in range(0, h, 16):
                _radix4x16(seg, i0 + j, h)
        h *= 4
    if 2 * h <= length:
        for i0 in range(0, length, 2 * h):
            for j in range(0, h, 16):
                _radix2x16(seg, i0 + j, h)


@njit(cache=True)
def _wide_stages16_checked(seg, length, h):
    """:func:`_wide_stages16` (``2 h <= length``), and 1 if a result is NaN or Inf: the last sweep checks
    what it stores (no separate pass over the block)."""
    acc = np.uint32(0)
    while 4 * h <= length:
        last = 8 * h > length  # no sweep after this one
        for i0 in range(0, length, 4 * h):
            for j in range(0, h, 16):
                if last:
                    acc |= _radix4x16_checked(seg, i0 + j, h)
                else:
                    _radix4x16(seg, i0 + j, h)
        h *= 4
    if 2 * h <= length:
        for i0 in range(0, length, 2 * h):
            for j in range(0, h, 16):
                acc |= _radix2x16_checked(seg, i0 + j, h)
    return np.int64((acc & _SIGN) != 0)


@njit(cache=True)
def butterflies_checked(seg, length):
    """:func:`butterflies`, and 1 if a result is NaN or Inf, else 0."""
    if length >= 32:
        _first4(seg, length)
        return _wide_stages16_checked(seg, length, 16)
    butterflies(seg, length)
    return any_nonfinite(seg[:length])


@njit(cache=True)
def _first3(seg, length):
    """Stages ``h = 1, 2, 4`` in one sweep, eight elements at a time (``length`` a multiple of 8).

    The loop counts groups (``i = 8 g``), not elements with a step of 8: numba then knows every
    index is non-negative and LLVM vectorizes the groups (interleaved loads, 3.5x faster).
    """
    for g in range(length // 8):
        i = 8 * g
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
def _wide_stages(seg, length, h):
    """Stages ``h, 2 h, .., length/2`` on ``seg[:length]`` (``h`` a multiple of 8), two per sweep."""
    while 4 * h <= length:
        for i0 in range(0, length, 4 * h):
            for j in range(0, h, 8):
                _radix4x8(seg, i0 + j, h)
        h *= 4
    if 2 * h <= length:
        for i0 in range(0, length, 2 * h):
            for j in range(0, h, 8):
                _radix2x8(seg, i0 + j, h)


@njit(cache=True)
def _small_stages(seg, length):
    """All stages of a block of fewer than 8 elements."""
    h = 1
    while h < length:
        for i0 in range(0, length, 2 * h):
            for j in range(h):
                u = seg[i0 + j]
                w = seg[i0 + h + j]
                seg[i0 + j] = u + w
                seg[i0 + h + j] = u - w
        h *= 2


@njit(cache=True)
def butterflies(seg, length):
    """All stages of a block of ``length`` elements (a power of two) in ``seg``, ascending ``h``."""
    if length >= 16:
        _first4(seg, length)
        _wide_stages16(seg, length, 16)
    elif length == 8:
        _first3(seg, length)
    else:
        _small_stages(seg, length)


@njit(cache=True, inline="always")
def _sign_word(key, q):
    """The 64-bit hash whose bits are the signs of laid-out positions ``64 q .. 64 q + 63`` (bit ``j``,
    LSB first, that of ``64 q + j``): SplitMix64 of the counter term ``key + (q + 1) GAMMA``."""
    return mix64(counter(key, q))


@njit(cache=True, inline="always")
def _flip_one(bits, i, key, p):
    """Flip ``bits[i]``'s sign bit where the rotation flips laid-out position ``p`` (one element: the
    ends of a span that does not start or end on a multiple of 64)."""
    bits[i] ^= np.uint32((_sign_word(key, p >> 6) >> np.uint64(p & 63)) & _ONE64) << _S31_32


@intrinsic
def _flip64(typingctx, seg, i, word):
    """Flip the sign of ``seg[i + j]`` where bit ``j`` of the 64-bit ``word`` is set, ``j < 64``: per
    16 floats a broadcast of 16 of the bits, a shift by ``31 - lane`` and a mask make the sign bits
    (LLVM's own vectorization of the loop ran on half-width registers, twice the instructions)."""
    if not (_float32_c(seg) and isinstance(word, types.Integer) and word.bitwidth == 64):
        return None

    def codegen(context, builder, sig, args):
        seg_arg, i, word = args
        words = ir.VectorType(ir.IntType(32), 16)
        arr = context.make_array(sig.args[0])(context, builder, seg_arg)
        shifts = ir.Constant(words, [31 - lane for lane in range(16)])
        sign = ir.Constant(words, [0x80000000] * 16)
        offset = i
        for quarter in range(4):
            part = builder.trunc(builder.lshr(word, ir.Constant(word.type, 16 * quarter)), ir.IntType(32))
            masks = builder.and_(builder.shl(_splat16(builder, part), shifts), sign)
            ptr = builder.bitcast(builder.gep(arr.data, [offset]), words.as_pointer())
            builder.store(builder.xor(builder.load(ptr, align=4), masks), ptr, align=4)
            offset = builder.add(offset, ir.Constant(offset.type, 16))
        return context.get_dummy_value()

    return types.void(seg, types.intp, word), codegen


@njit(cache=True)
def _flip_signs(seg, key, o):
    """Flip the sign of ``seg[i]`` where the rotation flips laid-out position ``o + i``
    (:func:`fedquant.rng.rotation_negative`): 64 positions per hash, whose bits go straight into
    the floats' sign bits (:func:`_flip64`); positions before the first multiple of 64, and after
    the last, one at a time."""
    bits = seg.view(np.uint32)
    n = seg.size
    head = min(n, (-o) & 63)
    for i in range(head):
        _flip_one(bits, i, key, o + i)
    i = head
    while i + 64 <= n:
        _flip64(seg, i, _sign_word(key, (o + i) >> 6))
        i += 64
    for j in range(i, n):
        _flip_one(bits, j, key, o + j)


@njit(cache=True)
def _scale_flip(xs, m, seg, c, key, o):
    """``seg`` = ``xs[:m] * c`` then zeros, with :func:`_flip_signs`'s signs (a flip is exact)."""
    for i in range(m):
        seg[i] = xs[i] * c
    for i in range(m, seg.size):
        seg[i] = _ZERO32
    _flip_signs(seg, key, o)


@njit(cache=True)
def sign_masks(masks, key, o):
    """``masks[i]`` = the sign bit the rotation flips at laid-out position ``o + i`` (0 or ``0x80000000``).

    For a kernel that rotates the same positions twice (forward and back: NDQSG's side information
    and its decoded values) and hashes them once; :func:`scale_masked` and :func:`apply_masks_into` flip.
    """
    masks[:] = 0
    _flip_signs(masks.view(np.float32), key, o)


@njit(cache=True)
def scale_masked(xs, m, seg, c, masks):
    """``seg`` = ``xs[:m] * c`` then zeros, with the signs of ``masks`` (:func:`sign_masks`) flipped: as
    :func:`_scale_flip` with the signs hashed already (the zero padding flipped is the mask itself:
    the bits of +0 are 0)."""
    bits = seg.view(np.uint32)
    for i in range(m):
        seg[i] = xs[i] * c
        bits[i] ^= masks[i]
    for i in range(m, seg.size):
        bits[i] = masks[i]


@njit(cache=True)
def apply_masks_into(seg, masks, dst):
    """``dst[: dst.size]`` = ``seg`` with the signs of ``masks`` flipped (``dst`` at most as long),
    and 1 if one of those values is NaN or Inf (checked in the same loop)."""
    bits = seg.view(np.uint32)
    out = dst.view(np.uint32)
    acc = np.uint32(0)
    for i in range(dst.size):
        b = bits[i] ^ masks[i]
        out[i] = b
        acc |= (b & _EXP_MASK) + _EXP_ONE
    return np.int64((acc & _SIGN) != 0)


@njit(cache=True)
def block_at(layout, scales, p):
    """``(length, scale)`` of the block that starts at laid-out position ``p`` (see :func:`layout_table`)."""
    r = _run_at(layout, p)
    return np.int64(1) << layout[r, 0], scales[r]


@njit(cache=True)
def any_nonfinite(seg):
    """1 if any of ``seg`` is NaN or Inf (all exponent bits set), else 0.

    ``(bits & EXP) + 2**23`` carries into the top bit exactly when the exponent is all ones: an OR
    of those over the array (a 32-bit OR reduction, vectorized; a max of the exponents took 1.5x
    as long).
    """
    bits = seg.view(np.uint32)
    acc = np.uint32(0)
    for i in range(seg.size):
        acc |= (bits[i] & _EXP_MASK) + _EXP_ONE
    return np.int64((acc & _SIGN) != 0)


@njit(cache=True)
def _forward_block(xs, m, seg, c, key, o):
    """``seg`` = the forward transform of the block at laid-out position ``o`` whose first ``m`` values
    are ``xs[:m]`` (zeros after); ``c`` its scale. Returns 1 if a result is not finite, else 0."""
    length = seg.size
    _scale_flip(xs, m, seg, c, key, o)
    return butterflies_checked(seg, length)


@njit(cache=True)
def _inverse_block(ys, seg, c, key, o):
    """``seg`` = the inverse transform of the block ``ys`` (as long as ``seg``) at laid-out position ``o``;
    returns 1 if a result is not finite, else 0.

    The scaling rides on the first sweep of stages and the check on the last (the sign flips after
    it change no value's finiteness): two passes over the block fewer than scaling, transforming
    and flipping with a check each on its own (1M elements, one core: 1.03 -> 0.7 ms).
    """
    bad = _scaled_stages(ys, seg, c, True)
    _flip_signs(seg, key, o)
    return bad


@njit(cache=True)
def _run_at(layout, p):
    """Index of the run of ``layout`` that holds laid-out position ``p``."""
    r = 0
    while layout[r, 2] + (layout[r, 1] << layout[r, 0]) <= p:
        r += 1
    return r


@njit(cache=True)
def forward_span(src, lo, hi, layout, scales, key, dst):
    """``dst[: hi - lo]`` = the forward transform of laid-out positions ``lo .. hi``.

    ``lo`` and ``hi`` fall on block boundaries of blocks of at most ``TILE`` elements; ``src``
    holds the tensor from position 0 (positions from ``src.size`` on are the zero padding);
    ``layout`` / ``scales`` are :func:`layout_table`'s. Each block is rotated in L1 and written once.
    Returns 1 if a value of ``dst[: hi - lo]`` is not finite, else 0.
    """
    r = _run_at(layout, lo)
    p = lo
    n = src.size
    bad = 0
    while p < hi:
        k = layout[r, 0]
        length = 1 << k
        end = min(hi, layout[r, 2] + (layout[r, 1] << k))
        c = scales[r]
        while p < end:
            m = min(max(n - p, 0), length)
            s = p - lo
            bad |= _forward_block(src[p : p + m], m, dst[s : s + length], c, key, p)
            p += length
        r += 1
    return bad


@njit(cache=True, inline="always")
def chunk_in_cache(x, c0, c1, layout, scales, key):
    """The values of positions ``c0 .. c1`` a fused kernel quantizes: ``x[c0:c1]`` itself, or with
    a rotation (a non-empty ``layout``) :func:`forward_span` of them in a new chunk-sized buffer
    (it stays in cache while the kernel works on it); and 1 if a rotated value is not finite, else 0."""
    if layout.shape[0] > 0:
        xc = np.empty(c1 - c0, np.float32)
        return xc, forward_span(x, c0, c1, layout, scales, key, xc)
    return x[c0:c1], 0


@njit(cache=True)
def inverse_span(src, lo, hi, layout, scales, key, dst):
    """``dst`` = the first ``dst.size`` values (at most ``hi - lo``) of the inverse transform of
    ``src[: hi - lo]``, the laid-out positions ``lo .. hi`` (whole blocks of at most ``TILE``).

    Returns 1 if a value of ``dst`` is not finite, else 0; a block that ``dst`` cuts goes through a
    scratch block.
    """
    blocks = kept_blocks(layout, lo, hi, dst.size)
    size = dst.size
    bad = 0
    for j in range(blocks.shape[0]):
        s = blocks[j, 0] - lo
        length = blocks[j, 1]
        c = scales[blocks[j, 2]]
        if s + length <= size:
            bad |= _inverse_block(src[s : s + length], dst[s : s + length], c, key, lo + s)
        else:
            block = np.empty(length, np.float32)
            _inverse_block(src[s : s + length], block, c, key, lo + s)
            bad |= keep_head(block, dst[s:size])
    return bad


@njit(cache=True)
def kept_blocks(layout, lo, hi, size):
    """``(position, length, run)`` rows of the blocks of laid-out positions ``lo .. hi`` (whole blocks)
    that start before ``lo + size``: those an inverse transform into ``size`` values writes."""
    r = _run_at(layout, lo)
    count = 0
    p = lo
    while p < hi and p - lo < size:  # count first: the table is exact-sized
        k = layout[r, 0]
        end = min(hi, layout[r, 2] + (layout[r, 1] << k))
        while p < end and p - lo < size:
            count += 1
            p += 1 << k
        r += 1
    blocks = np.empty((count, 3), np.int64)
    r = _run_at(layout, lo)
    p = lo
    for j in range(count):
        while layout[r, 2] + (layout[r, 1] << layout[r, 0]) <= p:
            r += 1
        blocks[j, 0] = p
        blocks[j, 1] = 1 << layout[r, 0]
        blocks[j, 2] = r
        p += blocks[j, 1]
    return blocks


@njit(cache=True)
def keep_head(block, dst):
    """``dst`` = the first ``dst.size`` values of ``block`` (a block the kept values end in); 1 if one of
    them is not finite (the padding's values are dropped unchecked)."""
    dst[:] = block[: dst.size]
    return any_nonfinite(dst)


@njit(cache=True)
def _scaled_stages(src, seg, c, check):
    """``seg`` = :func:`butterflies` of ``src * c`` (float32 ``c``; ``src`` may be ``seg``), each product
    rounded as a pass of its own rounds it, the scaling riding on the first sweep of stages where
    the block has 32 or more; with ``check``, 1 if a result is not finite (the last sweep checks),
    else 0."""
    length = seg.size
    if length >= 32:
        for g in range(length // 16):
            _scaled_first4x16(src, seg, 16 * g, c)
        if check:
            return _wide_stages16_checked(seg, length, 16)
        _wide_stages16(seg, length, 16)
        return 0
    for i in range(length):
        seg[i] = src[i] * c
    if check:
        return butterflies_checked(seg, length)
    butterflies(seg, length)
    return 0


@njit(cache=True)
def scaled_butterflies(seg, c):
    """:func:`butterflies` of ``seg * c`` in place (see :func:`_scaled_stages`)."""
    _scaled_stages(seg, seg, c, False)


@njit(cache=True)
def inverse_after_first4(seg, key, o):
    """The rest of the inverse transform, in place, of the block ``seg`` (32 or more) at laid-out
    position ``o`` whose first sweep (stages ``h = 1, 2, 4, 8`` of the scaled values, e.g. by
    :func:`lookup_first4x16`) is done; 1 if a result is not finite, else 0."""
    bad = _wide_stages16_checked(seg, seg.size, 16)
    _flip_signs(seg, key, o)
    return bad


@njit(cache=True)
def inverse_scaled(seg, key, o):
    """The inverse transform, in place, of the block ``seg`` at laid-out position ``o`` whose values are
    already scaled (as :func:`_inverse_block` scales them); 1 if a result is not finite, else 0."""
    bad = butterflies_checked(seg, seg.size)
    _flip_signs(seg, key, o)
    return bad


@parallel_kernel(count_arg=1)
def _span_pass(src, out, lo0, layout, scales, key, inverse):
    """Both directions on the blocks of at most a tile, ``out[lo0:]``, one chunk per iteration."""
    n = out.size
    nchunks = (n - lo0 + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        lo = lo0 + c * CHUNK
        hi = min(lo + CHUNK, n)
        if inverse:
            bad[c] = inverse_span(src[lo:hi], lo, hi, layout, scales, key, out[lo:hi])
        else:
            bad[c] = forward_span(src, lo, hi, layout, scales, key, out[lo:hi])
    return bad.sum()


@parallel_kernel(count_arg=1)
def rotate_into_bytes(src, out, layout, scales, key):
    """The forward transform (blocks of at most a tile) as little-endian float32 bytes into the uint8
    ``out`` (4 bytes per laid-out element, any alignment: a payload's body), chunk by chunk through
    a cache-sized buffer. Returns the number of chunks holding NaN or Inf."""
    n = out.size // 4
    nchunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(nchunks, np.int64)
    for c in prange(nchunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        rotated = np.empty(hi - lo, np.float32)
        bad[c] = forward_span(src, lo, hi, layout, scales, key, rotated)
        out[4 * lo : 4 * hi] = rotated.view(np.uint8)
    return bad.sum()


@njit(cache=True)
def _big_tile(src, out, tiles, scales, key, inverse, t):
    """Tile ``t`` of a block larger than a tile: load and scale it (and sign, forward), run its stages.

    ``tiles[t] = (offset, length)``, ``scales[t]`` its block's ``c``; the high pass does the rest.
    """
    o = tiles[t, 0]
    length = tiles[t, 1]
    c = scales[t]
    seg = out[o : o + length]
    m = min(max(src.size - o, 0), length)
    xs = src[o : o + m]
    if inverse:
        for i in range(m):
            seg[i] = xs[i] * c
        for i in range(m, length):
            seg[i] = _ZERO32
    else:
        _scale_flip(xs, m, seg, c, key, o)
    butterflies(seg, length)


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
    _wide_stages(buf, rows * w, w)
    for r in range(rows):
        row = buf[r * w : (r + 1) * w]
        if inverse:
            _flip_signs(row, key, col + r * TILE)
        out[col + r * TILE : col + r * TILE + w] = row
    return any_nonfinite(buf[: rows * w])


@parallel_kernel(count_arg=1)
def _low_pass(src, out, tiles, scales, key, inverse):
    for t in prange(tiles.shape[0]):
        _big_tile(src, out, tiles, scales, key, inverse, t)


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
def layout_table(runs: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The runs as kernels take them: ``(k, count, offset)`` rows (int64) and each run's scale (float32)."""
    table = np.zeros((len(runs), 3), np.int64)
    o = 0
    for j, (k, count) in enumerate(runs):
        table[j] = (k, count, o)
        o += count << k
    scales = np.array([block_scale(k) for k, _ in runs], np.float32)
    table.setflags(write=False)
    scales.setflags(write=False)
    return table, scales


#: Kernel arguments that mean "no rotation": an empty layout.
NO_ROTATION = (np.zeros((0, 3), np.int64), np.zeros(0, np.float32), np.uint64(0))


def rotation_args(rotation) -> tuple[np.ndarray, np.ndarray, np.uint64]:
    """``(layout, scales, key)`` of a :class:`~fedquant.codecs.transforms.rht.FusedRotation` for a kernel
    that rotates as it goes; :data:`NO_ROTATION` for None."""
    return NO_ROTATION if rotation is None else (rotation.layout, rotation.scales, rotation.key)


def fusable(runs: tuple[tuple[int, int], ...]) -> bool:
    """Whether every block fits a tile, so any chunk-aligned span of the layout is whole blocks.

    Blocks are laid out largest first and each starts at a multiple of its own size, so then no
    block crosses a multiple of ``CHUNK``: a kernel working chunk by chunk can rotate its chunk
    (:func:`forward_span`, :func:`inverse_span`) instead of reading a rotated copy from memory.
    """
    return all(k <= TILE_LOG2 for k, _ in runs)


@lru_cache(maxsize=256)
def _work(runs: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Tiles (and their scales) of the low pass and strips of the high pass of the blocks larger
    than a tile (they come first), and where the blocks of at most a tile start."""
    tiles = []
    scales = []
    strips = []
    o = 0
    for k, count in runs:
        if k <= TILE_LOG2:
            break
        size = 1 << k
        rows = size >> TILE_LOG2
        width = min(TILE, max(MIN_STRIP, STRIP_FLOATS // rows))
        blocks = o + size * np.arange(count, dtype=np.int64)
        parts = np.arange(0, size, TILE, dtype=np.int64)
        offsets = (blocks[:, None] + parts[None, :]).reshape(-1)
        tiles.append(np.stack([offsets, np.full_like(offsets, TILE)], axis=1))
        cols = np.arange(0, TILE, width, dtype=np.int64)
        starts = np.repeat(blocks, cols.size)
        strips.append(
            np.stack([starts, np.full_like(starts, rows), np.tile(cols, count), np.full_like(starts, width)], axis=1)
        )
        scales.append(np.full(tiles[-1].shape[0], block_scale(k), np.float32))
        o += count * size
    arrays = (
        np.concatenate(tiles).astype(np.int64) if tiles else np.zeros((0, 2), np.int64),
        np.concatenate(scales) if scales else np.zeros(0, np.float32),
        np.concatenate(strips).astype(np.int64) if strips else np.zeros((0, 4), np.int64),
    )
    for a in arrays:
        a.setflags(write=False)
    return (*arrays, o)


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
        0 when every value of ``out`` is finite, else a positive count (of blocks, tiles or
        strips holding NaN or Inf), found in the same pass.
    """
    total = runs_numel(runs)
    if src.size > total:
        raise ValueError(f"{src.size} elements do not fit a layout of {total}")
    out = np.empty(total, np.float32)
    if not total:
        return out, 0
    ukey = np.uint64(key)
    tiles, scales, strips, small = _work(runs)
    bad = 0
    if small:
        _low_pass(src, out, tiles, scales, ukey, inverse)
        bad += _high_pass(out, strips, ukey, inverse)
    if small < total:
        layout, run_scales = layout_table(runs)
        bad += _span_pass(src, out, small, layout, run_scales, ukey, inverse)
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

    ``sign_seed`` is the seed whose stream gives the signs (:func:`fedquant.rng.rotation_negative`); each
    run of equal blocks goes as one batch.
    """
    total = runs_numel(runs)
    if src.numel() > total:
        raise ValueError(f"{src.numel()} elements do not fit a layout of {total}")
    out = torch.zeros(total, dtype=torch.float32, device=src.device)
    if not total:
        return out
    out[: src.numel()] = src
    negative = rotation_negative(sign_seed, total, device=src.device)
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
