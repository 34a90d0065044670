"""Primitives shared by every kernel family, written once.

* ``uniform24``: element ``i`` of the counter-based uniform stream of :mod:`fedquant.rng` with
  key ``kernel_key(seed)`` (``splitmix64(stream_key(seed) + (i + 1) * GOLDEN_GAMMA) >> 40``
  times ``2**-24``), bit for bit what ``fedquant.rng.uniform(seed, n)[i]`` returns; drawn
  inline, never stored.
* Bucket statistics: ``bucket_max_abs``, ``bucket_l2``, ``bucket_l1_mean`` (float64 sums in a
  fixed order, so the result does not depend on the thread count).
* Bit packing of a chunk: ``pack_into`` / ``unpack_from``, the layout of
  :mod:`fedquant.wire.bitpack` (LSB first). Kernels split a tensor into chunks of ``CHUNK``
  elements, a multiple of 8, so every chunk starts on a byte boundary at any width.
* the parallel/serial switch and the twins: :mod:`fedquant.jit.twins`.

Outputs are allocated by NumPy, not inside kernels
--------------------------------------------------
A large array that a kernel allocates is faulted in 4 KiB pages on first write, where NumPy asks
for transparent huge pages; so each kernel's Python wrapper allocates its outputs with ``np.empty``
and the kernel (``*_into``) writes them (measured: docs/kernels.md, Shape of a kernel).

Symbol histograms
-----------------
Kernels that produce unpacked symbols for the entropy coder can count them in the same pass
(the chunk's symbols are still in L1): the chunks are split into :func:`chunk_groups` runs, one
per thread, each with its own row of a ``(groups, K)`` count table (:func:`add_counts`); the
rows are summed after the call.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba import types as nbtypes
from numba.core import cgutils
from numba.extending import intrinsic

from fedquant.jit import PARALLEL_MIN, parallel_kernel, target
from fedquant.rng import GOLDEN_GAMMA, MIX1, MIX2, UNIFORM_BITS, UNIFORM_SCALE, stream_key

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
_ONE32 = np.float32(1.0)
_ONE_U32 = np.uint32(1)
_ALL_ONES = np.uint32(0xFFFFFFFF)
#: A nonzero :func:`exact_quotient` below this may be a subnormal float32, which its proof does not cover.
_TINY32 = np.float32(2.0**-125)


def kernel_key(seed: int) -> np.uint64:
    """The key of ``seed``'s uniform stream (``fedquant.rng.stream_key``) as kernels take it."""
    return np.uint64(stream_key(seed))


@njit(cache=True, inline="always")
def mix64(w: np.uint64) -> np.uint64:
    """SplitMix64's finalizer of counter term ``w`` (see :func:`counter`): the stream's 64-bit hash,
    ``fedquant.rng.random_bits``."""
    u = np.uint64(w)  # an int64 would mix with the uint64 constants into float64
    z = (u ^ (u >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def hash24(key: np.uint64, i: np.int64) -> np.uint64:
    """The 24 random bits of element ``i`` of the stream with key ``key`` (``uniform24`` times ``2**24``)."""
    return mix64(counter(key, i)) >> _SHIFT_U


@njit(cache=True, inline="always")
def counter(key: np.uint64, i: np.int64) -> np.uint64:
    """The counter term ``key + (i + 1) * GAMMA`` of element ``i``: :func:`uniform_at` of it is
    ``uniform24(key, i)``, and element ``i + 1``'s is this plus ``GAMMA`` (``_GAMMA``).

    A loop that adds ``_GAMMA`` per element instead of multiplying saves one of the three 64-bit
    multiplies of every uniform (and LLVM keeps the counter as a vector induction).
    """
    return key + np.uint64(i + 1) * _GAMMA


@njit(cache=True, inline="always")
def hash24_at(w: np.uint64) -> np.uint64:
    """The 24 random bits of counter term ``w`` (see :func:`counter`): ``hash24(key, i)``."""
    return mix64(w) >> _SHIFT_U


def c_array_of(t, *dtypes) -> bool:
    """Whether numba type ``t`` is a C-contiguous array of one of ``dtypes``: what the LLVM-IR
    intrinsics, which address an array's data directly, accept."""
    return isinstance(t, nbtypes.Array) and t.layout == "C" and t.dtype in dtypes


@intrinsic
def _hash24_groups(typingctx, w, out, groups):
    """``out[j] = hash24_at(w + j * GAMMA)`` (uint32) for ``j < 8 * groups``, eight per ``<8 x i64>`` vector.

    For loops whose other work is narrow (a compare, a flag): LLVM vectorizes those hashes four
    64-bit lanes at a time, this eight (zmm where the CPU has them).
    """
    if not c_array_of(out, nbtypes.uint32):
        return None
    sig = nbtypes.void(nbtypes.uint64, out, nbtypes.intp)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        words = ir.VectorType(i64, 8)

        def splat(value):
            return ir.Constant(words, [ir.Constant(i64, value)] * 8)

        index = ir.VectorType(ir.IntType(32), 8)
        start = builder.insert_element(ir.Constant(words, None), args[0], ir.Constant(ir.IntType(32), 0))
        start = builder.shuffle_vector(start, ir.Constant(words, None), ir.Constant(index, [0] * 8))
        lanes = ir.Constant(words, [ir.Constant(i64, (j * GOLDEN_GAMMA) % (1 << 64)) for j in range(8)])
        counter_slot = cgutils.alloca_once_value(builder, builder.add(start, lanes))
        arr = context.make_array(signature.args[1])(context, builder, args[1])
        halves = index
        with cgutils.for_range(builder, args[2]) as loop:
            wv = builder.load(counter_slot)
            z = builder.mul(builder.xor(wv, builder.lshr(wv, splat(30))), splat(MIX1))
            z = builder.mul(builder.xor(z, builder.lshr(z, splat(27))), splat(MIX2))
            z = builder.xor(z, builder.lshr(z, splat(31)))
            bits = builder.trunc(builder.lshr(z, splat(64 - UNIFORM_BITS)), halves)
            ptr = builder.gep(arr.data, [builder.mul(loop.index, ir.Constant(loop.index.type, 8))])
            builder.store(bits, builder.bitcast(ptr, halves.as_pointer()), align=4)
            builder.store(builder.add(wv, splat((8 * GOLDEN_GAMMA) % (1 << 64))), counter_slot)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True)
def hash24_fill(w, out, m):
    """``out[j] = hash24_at(w + j * GAMMA)`` (the 24 random bits, as uint32) for ``j < m``."""
    groups = m // 8
    _hash24_groups(w, out, groups)
    v = np.uint64(w) + np.uint64(8 * groups) * _GAMMA
    for j in range(8 * groups, m):
        out[j] = np.uint32(hash24_at(v))
        v += _GAMMA


@njit(cache=True, inline="always")
def uniform_at(w: np.uint64) -> np.float32:
    """The uniform of counter term ``w`` (see :func:`counter`)."""
    return np.float32(hash24_at(w)) * _U_SCALE


@njit(cache=True, inline="always")
def uniform24(key: np.uint64, i: np.int64) -> np.float32:
    """Element ``i`` of the stream with key ``key`` (same as ``fedquant.rng.uniform``)."""
    return np.float32(hash24(key, i)) * _U_SCALE


@njit(cache=True)
def hash24_run(key: np.uint64, start: np.int64, count: np.int64, out: np.ndarray) -> None:
    """``hash24(key, start + k)`` for ``k < count`` into ``out[:count]`` (uint32 or wider).

    For kernels that round a run of elements: the counter ``key + (i + 1) GOLDEN_GAMMA`` advances
    by one addition per element instead of a multiplication (a third of the 64-bit multiplies
    less), and the loop does nothing but hash, so LLVM vectorizes it on 64-bit lanes while the
    rounding loop that reads ``out`` runs on 32-bit ones. Measured, 25M elements in runs of
    ``CHUNK`` into an L2-resident buffer, one core: 5.6 ms, against 8.2 ms for ``hash24`` in a loop.
    """
    z = counter(key, start)
    dst = out[:count]
    for k in range(count):
        dst[k] = mix64(z) >> _SHIFT_U
        z += _GAMMA


@njit(cache=True, inline="always")
def exact_quotient(a: np.float32, inv: np.float64) -> np.float32:
    """``a / b`` in float32, bit for bit, from ``inv = 1.0 / float64(b)`` (``b`` a finite nonzero float32).

    A float32 division (``vdivps``) is not pipelined: 0.6 cycles per element, more than all
    other rounding arithmetic of a kernel together; two float64 multiplications and two
    conversions are pipelined. Exact because the float64 product ``P = a * inv`` lies within
    a relative ``2**-52`` of ``a / b`` (two roundings of ``2**-53``), while ``a / b`` lies at least
    a relative ``2**-50`` from every rounding boundary (midpoint) of float32: with ``a = A 2**i``,
    ``b = B 2**j`` (``A, B < 2**24`` integers) and a midpoint ``(2M + 1) 2**k`` of the binade,
    ``|a / b - (2M + 1) 2**k| = |A 2**(i - j - k) - (2M + 1) B| 2**k / B``, a nonzero integer
    (never 0: ``(2M + 1) B`` would need at least 25 bits for 24) times ``2**k / B``. So ``P`` and
    ``a / b`` round to the same float32, and a quotient that is a float32 stays that float32.
    Subnormal ``a`` or ``b`` have fewer significant bits and only a wider margin. Not so a
    quotient below ``2**-126``: a subnormal float32 has fewer bits than the argument needs, and
    the quotient can lie exactly halfway between two (``147 * 2**-149 / 98``), where the product
    may round the other way; :func:`chunk_quotients` finds such buckets for its callers.
    """
    return np.float32(np.float64(a) * inv)


@njit(cache=True)
def chunk_quotients(xc, d, steps, alpha, signed, unit_zero_steps, c0, c1, ts):
    """The float32 quotients ``(alpha * v) / step`` of elements ``c0 .. c1`` into ``ts[0 : c1 - c0]``.

    ``xc`` holds the values of those elements from 0 (a slice of the tensor, or a chunk rotated
    in an L1 buffer); ``steps`` is indexed by the bucket of the element, ``(c0 + k) // d``.
    ``alpha * v`` is a float32 product (``alpha`` float32; 1 leaves ``v`` as it is); ``signed``
    False divides ``|alpha * v|``. A bucket whose step is 0 gets quotients 0, or with
    ``unit_zero_steps`` is divided by 1. Each quotient is :func:`exact_quotient` of the bucket's
    ``1 / step``, bit for bit the float32 division, in a loop that does nothing else (float64
    lanes), so that the rounding loop that reads ``ts`` runs on 32-bit lanes. Returns True when
    some bucket's smallest nonzero ``|v|`` gives a quotient below ``_TINY32``: there, and only
    there (a quotient is monotonic in ``|v|``), one may be a subnormal float32 exactly halfway
    between two, which the proof of :func:`exact_quotient` does not cover; callers then divide.
    """
    bits = xc.view(np.uint32)
    box = np.empty(1, np.uint32)  # reinterprets a bit pattern as float32 (one array per call)
    tiny = False
    i = c0
    while i < c1:
        b = i // d
        hi = min((b + 1) * d, c1)
        step = steps[b]
        xs = xc[i - c0 : hi - c0]
        tt = ts[i - c0 : hi - c0]
        if step > _ZERO32 or unit_zero_steps:
            inv = 1.0 / np.float64(step) if step > _ZERO32 else 1.0
            if signed:
                for k in range(hi - i):
                    tt[k] = exact_quotient(alpha * xs[k], inv)
            else:
                for k in range(hi - i):
                    tt[k] = exact_quotient(abs(alpha * xs[k]), inv)
            xb = bits[i - c0 : hi - c0]
            low = _ALL_ONES
            for k in range(hi - i):
                low = min(low, np.uint32((xb[k] & _ABS_MASK) - _ONE_U32))  # 0 wraps to the top
            if low != _ALL_ONES:
                box[0] = low + _ONE_U32
                tiny |= exact_quotient(abs(alpha * box.view(np.float32)[0]), inv) < _TINY32
        else:
            tt[:] = _ZERO32
        i = hi
    return tiny


def _uniform_stream_numpy(key: np.uint64, n: int, offset: int) -> np.ndarray:
    """The twin of :func:`uniform_stream` (wrapping uint64 arithmetic in NumPy)."""
    z = np.uint64(key) + np.arange(offset + 1, offset + n + 1, dtype=np.uint64) * _GAMMA
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return (z >> _SHIFT_U).astype(np.float32) * _U_SCALE


@parallel_kernel(count_arg=1, twin=_uniform_stream_numpy)
def uniform_stream(key: np.uint64, n: int, offset: int) -> np.ndarray:
    """``n`` uniforms of the stream starting at ``offset`` (for tests of the inline generator)."""
    out = np.empty(n, np.float32)
    for i in prange(n):
        out[i] = uniform24(key, offset + i)
    return out


# ---------------------------------------------------------------- per-bucket statistics
@parallel_kernel
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
            m = max(m, np.uint32(seg[i] & _ABS_MASK))  # uint32 lanes: numba types the & as 64-bit
        out[b] = m
    return out.view(np.float32)


@intrinsic
def _lane_sums(typingctx, x, lo, groups, square):
    """Eight float64 sums: lane ``k`` adds ``f(x[lo + 8 g + k])`` for ``g = 0 .. groups - 1``, in that order.

    ``f`` is ``v * v`` (``square``) or ``|v|`` of the float32 ``x`` widened to float64, or the
    identity for a float64 ``x``. The lanes are one ``<8 x double>`` vector in LLVM IR: the same
    additions in the same order as eight scalar accumulators, which LLVM would not vectorize by
    itself (strict floating-point order), at a quarter of their time.
    """
    if not c_array_of(x, nbtypes.float32, nbtypes.float64):
        return None
    wide = x.dtype == nbtypes.float64
    sig = nbtypes.UniTuple(nbtypes.float64, 8)(x, nbtypes.intp, nbtypes.intp, nbtypes.boolean)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        lo, groups, square = args[1], args[2], args[3]
        doubles = ir.VectorType(ir.DoubleType(), 8)
        acc = cgutils.alloca_once_value(builder, ir.Constant(doubles, None))
        base = builder.gep(arr.data, [lo])
        with cgutils.for_range(builder, groups) as loop:
            ptr = builder.gep(base, [builder.mul(loop.index, ir.Constant(loop.index.type, 8))])
            if wide:
                term = builder.load(builder.bitcast(ptr, doubles.as_pointer()), align=8)
            else:
                floats = ir.VectorType(ir.FloatType(), 8)
                v = builder.fpext(builder.load(builder.bitcast(ptr, floats.as_pointer()), align=4), doubles)
                words = ir.VectorType(ir.IntType(64), 8)
                magnitude = ir.Constant(words, [ir.Constant(ir.IntType(64), (1 << 63) - 1)] * 8)
                absolute = builder.bitcast(builder.and_(builder.bitcast(v, words), magnitude), doubles)
                term = builder.select(square, builder.fmul(v, v), absolute)
            builder.store(builder.fadd(builder.load(acc), term), acc)
        total = builder.load(acc)
        lanes = [builder.extract_element(total, ir.Constant(ir.IntType(32), j)) for j in range(8)]
        return context.make_tuple(builder, signature.return_type, lanes)

    return sig, codegen


@njit(cache=True, inline="always")
def _add_lane(lanes, k, t):
    """``lanes`` with ``t`` added to lane ``k`` (0 .. 6: the tail of a sum of eight lanes)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = lanes
    if k == 0:
        a0 += t
    elif k == 1:
        a1 += t
    elif k == 2:
        a2 += t
    elif k == 3:
        a3 += t
    elif k == 4:
        a4 += t
    elif k == 5:
        a5 += t
    else:
        a6 += t
    return a0, a1, a2, a3, a4, a5, a6, a7


@njit(cache=True, inline="always")
def _combine(lanes):
    """The eight lanes summed pairwise, in a fixed order."""
    a0, a1, a2, a3, a4, a5, a6, a7 = lanes
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(cache=True)
def _sum_f64(x, lo, hi, square):
    """Sum of ``|x|`` (or ``x**2``) over ``lo .. hi`` of float32 ``x`` in float64, in a fixed order.

    Eight partial sums (lane ``k`` takes the elements ``lo + k (mod 8)``, in order), combined
    pairwise: the order is the same on every machine, and the lanes run as one vector
    (:func:`_lane_sums`; 2.5 ms instead of 11.5 ms for buckets of 512 over 25M elements).
    """
    full = (hi - lo) // 8
    lanes = _lane_sums(x, lo, full, square)
    i = lo + 8 * full
    for k in range(hi - i):
        v = np.float64(x[i + k])
        lanes = _add_lane(lanes, k, v * v if square else abs(v))
    return _combine(lanes)


@njit(cache=True)
def _total_f64(p, lo, hi):
    """Sum of float64 ``p[lo:hi]`` in the lane order of :func:`_sum_f64`."""
    full = (hi - lo) // 8
    lanes = _lane_sums(p, lo, full, False)
    i = lo + 8 * full
    for k in range(hi - i):
        lanes = _add_lane(lanes, k, p[i + k])
    return _combine(lanes)


@parallel_kernel
def bucket_l2(x: np.ndarray, d: int) -> np.ndarray:
    """Euclidean norm of each bucket, accumulated in float64 and rounded to float32."""
    n = x.size
    nb = (n + d - 1) // d
    out = np.empty(nb, np.float32)
    for b in prange(nb):
        lo = b * d
        out[b] = np.float32(np.sqrt(_sum_f64(x, lo, min(lo + d, n), True)))
    return out


@parallel_kernel
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


@njit(cache=True, inline="always")
def _pack_groups_at(codes, groups, width, dst):
    """Groups of 8 symbols of ``width`` bits (a constant where inlined) into ``dst[: groups * width]``.

    SWAR: the 8 symbols of a group sit one per byte of a 64-bit word; shifting byte ``k`` right
    by ``k * (8 - width)`` and masking moves its symbol to bits ``[k * width, (k + 1) * width)``.
    ``dst`` and ``codes`` are indexed from 0 with provably non-negative indices: an index that
    might be negative makes numba add a wraparound select to every access, which stops LLVM from
    combining and vectorizing them (that made the packer 4-5x slower).
    """
    mask = np.uint64((1 << width) - 1)
    for g in range(groups):
        v = np.uint64(0)
        for k in range(8):
            v |= np.uint64(codes[8 * g + k]) << np.uint64(8 * k)
        word = v & mask
        for k in range(1, 8):
            word |= (v >> np.uint64(k * (8 - width))) & (mask << np.uint64(k * width))
        for j in range(width):
            dst[g * width + j] = (word >> np.uint64(8 * j)) & np.uint64(255)


@njit(cache=True, inline="always")
def _unpack_groups_at(src, groups, width, codes):
    """Inverse of :func:`_pack_groups_at`: ``groups * 8`` symbols from ``src[: groups * width]``."""
    mask = np.uint64((1 << width) - 1)
    for g in range(groups):
        word = np.uint64(0)
        for j in range(width):
            word |= np.uint64(src[g * width + j]) << np.uint64(8 * j)
        v = word & mask
        for k in range(1, 8):
            v |= (word << np.uint64(k * (8 - width))) & (mask << np.uint64(8 * k))
        for k in range(8):
            codes[8 * g + k] = (v >> np.uint64(8 * k)) & np.uint64(255)


def _u8_c(t) -> bool:
    return c_array_of(t, nbtypes.uint8)


def _bit_groups(instruction: str, packing: bool):
    """An intrinsic ``(src, groups, width, dst) -> groups done`` moving groups of 8 symbols of ``width``
    bits (3 to 7) between a byte each and ``width`` packed bytes, one BMI2 ``instruction`` per group.

    ``pdep`` (unpacking) spreads a group's ``8 * width`` bits to the low ``width`` bits of eight
    bytes, ``pext`` (packing) gathers them back, each through a 64-bit mask of ``width`` low bits
    per byte. Every group is one unaligned 64-bit load and one 64-bit store, so the caller passes
    only groups whose 8 bytes lie within both arrays (:func:`_word_groups`); a packed store's bytes
    past its group are zeros that the next group overwrites. It does all ``groups`` where the target
    has fast BMI2 (:func:`~fedquant.jit.target.has_fast_bmi2`) and both arrays are
    contiguous uint8, and none otherwise, leaving them to the shifts of :func:`_pack_groups_at` /
    :func:`_unpack_groups_at` (the same bytes).
    """

    def typer(typingctx, src, groups, width, dst):
        sig = nbtypes.intp(src, nbtypes.intp, nbtypes.intp, dst)
        usable = _u8_c(src) and _u8_c(dst)

        def codegen(context, builder, signature, args):
            if not (usable and target.has_fast_bmi2()):
                return context.get_constant(nbtypes.intp, 0)
            i64 = ir.IntType(64)
            src_arr, dst_arr = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 3))
            bits = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]), instruction)
            width = args[2]
            low = builder.sub(builder.shl(ir.Constant(i64, 1), width), ir.Constant(i64, 1))
            mask = builder.mul(low, ir.Constant(i64, 0x0101010101010101))
            eight = ir.Constant(i64, 8)
            with cgutils.for_range(builder, args[1]) as loop:
                packed_at = builder.mul(loop.index, width)
                bytes_at = builder.mul(loop.index, eight)
                read, write = (bytes_at, packed_at) if packing else (packed_at, bytes_at)
                word = builder.load(builder.bitcast(builder.gep(src_arr.data, [read]), i64.as_pointer()), align=1)
                moved = builder.call(bits, [word, mask])
                builder.store(moved, builder.bitcast(builder.gep(dst_arr.data, [write]), i64.as_pointer()), align=1)
            return args[1]

        return sig, codegen

    typer.__name__ = f"_bmi_{'pext' if packing else 'pdep'}_groups"
    return intrinsic(typer)


_extract_groups = _bit_groups("llvm.x86.bmi.pext.64", packing=True)
_deposit_groups = _bit_groups("llvm.x86.bmi.pdep.64", packing=False)


@njit(cache=True, inline="always")
def _word_groups(groups, width, nbytes):
    """How many of the first ``groups`` groups of ``width`` packed bytes can be moved as whole 64-bit
    words within ``nbytes`` bytes (group ``g`` reads or writes bytes ``g * width .. g * width + 7``)."""
    return min(groups, max(nbytes - 8, -1) // width + 1)


@njit(cache=True, inline="always")
def _pack_bytes(codes, nbytes, width, dst):
    """``nbytes`` bytes of ``8 // width`` whole symbols each, for ``width`` 1, 2 or 4 (a constant where
    inlined): LLVM vectorizes this form (an interleaved load) where it cannot the general groups."""
    per = 8 // width
    mask = (1 << width) - 1
    for j in range(nbytes):
        b = 0
        for t in range(per):
            b |= (codes[per * j + t] & mask) << (width * t)
        dst[j] = b


@njit(cache=True, inline="always")
def _unpack_bytes(src, nbytes, width, codes):
    """Inverse of :func:`_pack_bytes`."""
    per = 8 // width
    mask = (1 << width) - 1
    for j in range(nbytes):
        b = src[j]
        for t in range(per):
            codes[per * j + t] = (b >> (width * t)) & mask


@njit(cache=True, inline="always")
def _pack_wide_groups(codes, groups, width, dst):
    """Groups of ``width`` 3, 5, 6 or 7 (a constant where inlined): BMI2 where it can, shifts for the rest."""
    done = _extract_groups(codes, _word_groups(groups, width, dst.size), width, dst)
    _pack_groups_at(codes[done * 8 :], groups - done, width, dst[done * width :])


@njit(cache=True, inline="always")
def _unpack_wide_groups(src, groups, width, codes):
    """Inverse of :func:`_pack_wide_groups`."""
    done = _deposit_groups(src, _word_groups(groups, width, src.size), width, codes)
    _unpack_groups_at(src[done * width :], groups - done, width, codes[done * 8 :])


@njit(cache=True)
def _pack_groups(codes, groups, width, dst):
    """``groups`` groups of 8 symbols at ``width`` bits (1 to 7, a constant in each branch) into
    ``dst[: groups * width]``: whole bytes of symbols (:func:`_pack_bytes`) for 1, 2 and 4, BMI2 or
    shifts for the others (:func:`_pack_wide_groups`). At 25M symbols, one core, in cache, every
    width measured 0.5-1.0 ms, against 1.1-4.0 ms by shifts alone."""
    if width == 1:
        _pack_bytes(codes, groups, 1, dst)
    elif width == 2:
        _pack_bytes(codes, 2 * groups, 2, dst)
    elif width == 3:
        _pack_wide_groups(codes, groups, 3, dst)
    elif width == 4:
        _pack_bytes(codes, 4 * groups, 4, dst)
    elif width == 5:
        _pack_wide_groups(codes, groups, 5, dst)
    elif width == 6:
        _pack_wide_groups(codes, groups, 6, dst)
    else:
        _pack_wide_groups(codes, groups, 7, dst)


@njit(cache=True)
def _unpack_groups(src, groups, width, codes):
    """Inverse of :func:`_pack_groups`, the same way per width (at 25M symbols, one core, in cache:
    0.6-0.9 ms at every width, against 3.7-5.6 ms by shifts alone)."""
    if width == 1:
        _unpack_bytes(src, groups, 1, codes)
    elif width == 2:
        _unpack_bytes(src, 2 * groups, 2, codes)
    elif width == 3:
        _unpack_wide_groups(src, groups, 3, codes)
    elif width == 4:
        _unpack_bytes(src, 4 * groups, 4, codes)
    elif width == 5:
        _unpack_wide_groups(src, groups, 5, codes)
    elif width == 6:
        _unpack_wide_groups(src, groups, 6, codes)
    else:
        _unpack_wide_groups(src, groups, 7, codes)


@njit(cache=True)
def pack_into(codes, count, width, out, pos):
    """Pack ``codes[:count]`` LSB-first at ``width`` bits into ``out`` from byte ``pos``.

    Width 8 is a copy; widths below 8 go by groups of 8 symbols, which fill exactly ``width``
    bytes (:func:`_pack_groups`); wider symbols and the tail go through a bit accumulator.
    """
    dst = out[pos : pos + (count * width + 7) // 8]
    if width == 8:
        for j in range(count):
            dst[j] = codes[j]
        return
    start = 0
    p = 0
    if width < 8:
        groups = count // 8
        _pack_groups(codes, groups, width, dst)
        start = groups * 8
        p = groups * width
    acc = np.uint64(0)
    nbits = 0
    for j in range(start, count):
        acc |= np.uint64(codes[j]) << np.uint64(nbits)
        nbits += width
        while nbits >= 8:
            dst[p] = acc & np.uint64(255)
            acc >>= np.uint64(8)
            nbits -= 8
            p += 1
    if nbits:
        dst[p] = acc & np.uint64(255)


@njit(cache=True)
def unpack_from(data, pos, count, width, codes):
    """Inverse of :func:`pack_into`: ``count`` symbols from byte ``pos`` into ``codes``."""
    src = data[pos : pos + (count * width + 7) // 8]
    if width == 8:
        for j in range(count):
            codes[j] = src[j]
        return
    mask = np.uint64((1 << width) - 1)
    start = 0
    p = 0
    if width < 8:
        groups = count // 8
        _unpack_groups(src, groups, width, codes)
        start = groups * 8
        p = groups * width
    acc = np.uint64(0)
    nbits = 0
    for j in range(start, count):
        while nbits < width:
            acc |= np.uint64(src[p]) << np.uint64(nbits)
            nbits += 8
            p += 1
        codes[j] = acc & mask
        acc >>= np.uint64(width)
        nbits -= width


@njit(cache=True, inline="always")
def _emit(out, p, first, byte, edge_pos, edge_val, slot):
    """Write byte ``p`` of a :func:`pack_at` stream, or keep it as an edge if it is the shared first one."""
    if p == first:
        edge_pos[slot] = p
        edge_val[slot] = byte
    else:
        out[p] = byte


@njit(cache=True)
def pack_at(codes, count, width, out, bitpos, edge_pos, edge_val, slot):
    """Pack ``codes[:count]`` at ``width`` bits into ``out`` from bit ``bitpos`` (any bit, LSB first).

    For streams that chunks fill in parallel at offsets that are not byte aligned: the bytes
    wholly inside ``[bitpos, bitpos + count * width)`` are written; a first or last byte that
    neighbouring chunks may share is not, its bits go to ``edge_pos[slot + j]`` /
    ``edge_val[slot + j]`` (``j`` = 0, 1; position -1 when unused) for :func:`merge_edges`. The
    byte-aligned middle goes eight symbols at a time through :func:`pack_into`.
    """
    edge_pos[slot] = -1
    edge_pos[slot + 1] = -1
    first = bitpos >> 3
    p = first
    acc = np.uint64(0)
    nbits = bitpos & 7
    j = 0
    while j < count and (bitpos + j * width) & 7:  # head: up to a byte boundary
        acc |= np.uint64(codes[j]) << np.uint64(nbits)
        nbits += width
        j += 1
        while nbits >= 8:
            _emit(out, p, first, acc & np.uint64(255), edge_pos, edge_val, slot)
            acc >>= np.uint64(8)
            nbits -= 8
            p += 1
    if nbits == 0:  # on a byte boundary: whole groups of 8 symbols end on one too
        whole = 8 * ((count - j) // 8)
        if whole:
            pack_into(codes[j : j + whole], whole, width, out, p)
            j += whole
            p += whole * width // 8
    for i in range(j, count):  # tail: its last byte may be shared
        acc |= np.uint64(codes[i]) << np.uint64(nbits)
        nbits += width
        while nbits >= 8:
            _emit(out, p, first, acc & np.uint64(255), edge_pos, edge_val, slot)
            acc >>= np.uint64(8)
            nbits -= 8
            p += 1
    if nbits:  # a last byte that the next chunk (or the padding) completes
        k = slot if p == first else slot + 1
        edge_pos[k] = p
        edge_val[k] = acc & np.uint64(255)


@njit(cache=True)
def merge_edges(out, edge_pos, edge_val):
    """Write the shared edge bytes of :func:`pack_at` calls: each the OR of its parts."""
    for i in range(edge_pos.size):
        if edge_pos[i] >= 0:
            out[edge_pos[i]] = 0
    for i in range(edge_pos.size):
        if edge_pos[i] >= 0:
            out[edge_pos[i]] |= edge_val[i]


@njit(cache=True)
def unpack_at(data, bitpos, count, width, codes):
    """Inverse of :func:`pack_at`: ``count`` symbols of ``width`` bits from bit ``bitpos`` into ``codes``.

    Reads only the bytes that hold those bits: symbol by symbol up to a byte boundary, then
    :func:`unpack_from`.
    """
    if count == 0:
        return
    mask = np.uint64((1 << width) - 1)
    p = bitpos >> 3
    acc = np.uint64(0)
    nbits = 0
    skip = bitpos & 7
    if skip:
        acc = np.uint64(data[p]) >> np.uint64(skip)
        nbits = 8 - skip
        p += 1
    j = 0
    while j < count and (bitpos + j * width) & 7:
        while nbits < width:
            acc |= np.uint64(data[p]) << np.uint64(nbits)
            nbits += 8
            p += 1
        codes[j] = acc & mask
        acc >>= np.uint64(width)
        nbits -= width
        j += 1
    if j < count:  # now on a byte boundary, nothing left in the accumulator
        unpack_from(data, p, count - j, width, codes[j:count])


# ---------------------------------------------------------------- splitting a stream by flags
def _flag_mask(context, builder, flags, i):
    """``<32 x i1>``: whether each of ``flags[i : i + 32]`` (uint8) is nonzero."""
    v = ir.VectorType(ir.IntType(8), SPLIT_LANES)
    loaded = builder.load(builder.bitcast(builder.gep(flags.data, [i]), v.as_pointer()), align=1)
    return builder.icmp_unsigned("!=", loaded, ir.Constant(v, None))


def _popcount(builder, mask):
    ctpop = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]), "llvm.ctpop.i32"
    )
    return builder.zext(builder.call(ctpop, [builder.bitcast(mask, ir.IntType(32))]), ir.IntType(64))


#: Elements :func:`_split_by_flags` and :func:`_merge_by_flags` take at a time.
SPLIT_LANES = 32


def _compress_in_register(builder, values, which, count, dst):
    """Store the ``count`` lanes of ``values`` (``<32 x i8>``) that ``which`` selects, in order, at ``dst``:
    ``vpcompressb`` into a register, then a masked store of the first ``count`` bytes."""
    v = ir.VectorType(ir.IntType(8), SPLIT_LANES)
    m = ir.VectorType(ir.IntType(1), SPLIT_LANES)
    compress = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v, [v, v, m]), "llvm.x86.avx512.mask.compress.v32i8"
    )
    store = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [v, v.as_pointer(), ir.IntType(32), m]),
        "llvm.masked.store.v32i8.p0v32i8",
    )
    packed = builder.call(compress, [values, ir.Constant(v, None), which])
    i32 = ir.IntType(32)
    lanes = ir.Constant(v, list(range(SPLIT_LANES)))
    splat = builder.insert_element(ir.Constant(v, None), builder.trunc(count, ir.IntType(8)), ir.Constant(i32, 0))
    splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(i32, SPLIT_LANES), [0] * SPLIT_LANES))
    first = builder.icmp_unsigned("<", lanes, splat)
    builder.call(store, [packed, builder.bitcast(dst, v.as_pointer()), ir.Constant(ir.IntType(32), 1), first])


@intrinsic
def _split_by_flags(typingctx, flags, i, a, b, out_a, pos_a, out_b, pos_b):
    """Of elements ``i .. i + 32``: ``a[j]`` where ``flags[j]`` is nonzero go to ``out_a`` from ``pos_a`` on,
    ``b[j]`` where it is zero to ``out_b`` from ``pos_b``, in order; returns how many went to ``out_a``.

    Where the target has AVX-512 VBMI2 (:func:`~fedquant.jit.target.has_avx512_vbmi2`) the bytes are
    compressed in a register and stored with a masked store of their count; elsewhere LLVM's
    compress store (portable IR). The loop that does this one element at a time advances two
    positions that each store depends on, 7x slower. All arrays uint8; the outputs get exactly the
    elements they take, nothing past them.
    """
    if not all(_u8_c(t) for t in (flags, a, b, out_a, out_b)):
        return None
    sig = nbtypes.int64(flags, nbtypes.intp, a, b, out_a, nbtypes.intp, out_b, nbtypes.intp)

    def codegen(context, builder, signature, args):
        fl, va, vb, oa, ob = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 3, 4, 6))
        i = args[1]
        v = ir.VectorType(ir.IntType(8), SPLIT_LANES)
        m = ir.VectorType(ir.IntType(1), SPLIT_LANES)
        mask = _flag_mask(context, builder, fl, i)
        taken = _popcount(builder, mask)
        left = builder.sub(ir.Constant(ir.IntType(64), SPLIT_LANES), taken)
        sides = ((va, oa, args[5], mask, taken), (vb, ob, args[7], builder.not_(mask), left))
        for arr, out, pos, which, count in sides:
            values = builder.load(builder.bitcast(builder.gep(arr.data, [i]), v.as_pointer()), align=1)
            if target.has_avx512_vbmi2():
                _compress_in_register(builder, values, which, count, builder.gep(out.data, [pos]))
            else:  # portable IR
                fnty = ir.FunctionType(ir.VoidType(), [v, ir.IntType(8).as_pointer(), m])
                store = cgutils.get_or_insert_function(builder.module, fnty, "llvm.masked.compressstore.v32i8")
                builder.call(store, [values, builder.gep(out.data, [pos]), which])
        return taken

    return sig, codegen


@intrinsic
def _merge_by_flags(typingctx, flags, i, src_a, pos_a, src_b, pos_b, out):
    """The inverse of :func:`_split_by_flags`: ``out[j]`` for ``j = i .. i + 32`` is the next element of
    ``src_a`` (from ``pos_a``) where ``flags[j]`` is nonzero, else the next of ``src_b`` (from ``pos_b``);
    returns how many came from ``src_a``. Reads only the elements it takes (expand loads)."""
    if not all(_u8_c(t) for t in (flags, src_a, src_b, out)):
        return None
    sig = nbtypes.int64(flags, nbtypes.intp, src_a, nbtypes.intp, src_b, nbtypes.intp, out)

    def codegen(context, builder, signature, args):
        fl, sa, sb, o = (context.make_array(signature.args[k])(context, builder, args[k]) for k in (0, 2, 4, 6))
        i = args[1]
        v = ir.VectorType(ir.IntType(8), SPLIT_LANES)
        m = ir.VectorType(ir.IntType(1), SPLIT_LANES)
        mask = _flag_mask(context, builder, fl, i)
        fnty = ir.FunctionType(v, [ir.IntType(8).as_pointer(), m, v])
        load = cgutils.get_or_insert_function(builder.module, fnty, "llvm.masked.expandload.v32i8")
        zero = ir.Constant(v, None)
        from_a = builder.call(load, [builder.gep(sa.data, [args[3]]), mask, zero])
        from_b = builder.call(load, [builder.gep(sb.data, [args[5]]), builder.not_(mask), zero])
        merged = builder.select(mask, from_a, from_b)
        builder.store(merged, builder.bitcast(builder.gep(o.data, [i]), v.as_pointer()), align=1)
        return _popcount(builder, mask)

    return sig, codegen


@njit(cache=True)
def split_by_flags(flags, m, a, b, out_a, pos_a, out_b, pos_b):
    """:func:`_split_by_flags` over ``m`` elements (32 at a time, then one by one); returns the new positions."""
    full = m // SPLIT_LANES
    for g in range(full):
        taken = _split_by_flags(flags, SPLIT_LANES * g, a, b, out_a, pos_a, out_b, pos_b)
        pos_a += taken
        pos_b += SPLIT_LANES - taken
    for j in range(SPLIT_LANES * full, m):
        f = flags[j] != 0
        out_a[pos_a] = a[j]
        out_b[pos_b] = b[j]
        pos_a += f
        pos_b += 1 - f
    return pos_a, pos_b


@njit(cache=True)
def merge_by_flags(flags, m, src_a, pos_a, src_b, pos_b, out):
    """:func:`_merge_by_flags` over ``m`` elements; returns the new positions."""
    full = m // SPLIT_LANES
    for g in range(full):
        taken = _merge_by_flags(flags, SPLIT_LANES * g, src_a, pos_a, src_b, pos_b, out)
        pos_a += taken
        pos_b += SPLIT_LANES - taken
    for j in range(SPLIT_LANES * full, m):
        if flags[j]:
            out[j] = src_a[pos_a]
            pos_a += 1
        else:
            out[j] = src_b[pos_b]
            pos_b += 1
    return pos_a, pos_b


# ---------------------------------------------------------------- symbol histograms
def chunk_groups(n: int) -> int:
    """Runs of chunks a counting kernel splits ``n`` elements into (one count row each).

    One below ``PARALLEL_MIN`` (the serial version), else one per thread numba may use.
    """
    chunks = (n + CHUNK - 1) // CHUNK
    if n < PARALLEL_MIN:
        return 1
    return max(1, min(chunks, numba.config.NUMBA_NUM_THREADS))


@njit(cache=True, inline="always")
def group_chunks(g, groups, nchunks):
    """``(first, end)`` chunk of run ``g`` of ``groups`` (contiguous, sizes within one)."""
    return (g * nchunks) // groups, ((g + 1) * nchunks) // groups


@njit(cache=True)
def add_counts(codes, m, row):
    """``row[c] += 1`` for each of ``codes[:m]`` (each below ``row.size``).

    Four interleaved sub-tables while the alphabet is small: a run of equal symbols then does not
    wait on the previous increment of the same counter.
    """
    k = row.size
    if k <= 1024:
        sub = np.zeros(4 * k, np.int64)
        full = m // 4
        for i in range(full):
            sub[np.int64(codes[4 * i])] += 1
            sub[k + np.int64(codes[4 * i + 1])] += 1
            sub[2 * k + np.int64(codes[4 * i + 2])] += 1
            sub[3 * k + np.int64(codes[4 * i + 3])] += 1
        for i in range(4 * full, m):
            sub[np.int64(codes[i])] += 1
        for j in range(k):
            row[j] += (sub[j] + sub[k + j]) + (sub[2 * k + j] + sub[3 * k + j])
    else:
        for i in range(m):
            row[np.int64(codes[i])] += 1


def count_table(n: int, num_symbols: int) -> np.ndarray:
    """A zeroed ``(chunk_groups(n), num_symbols)`` int64 table for a counting kernel."""
    return np.zeros((chunk_groups(n), num_symbols), np.int64)
