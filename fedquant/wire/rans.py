"""Interleaved static rANS and the symbol histogram: the numba kernels of :mod:`fedquant.wire.entropy`.

Two coders share the section format: ``rans32`` (32-bit states, 16-bit words, models of at most
12 bits, 32 lanes coded a round at a time with vector instructions: the section "rans32" below,
every fedquant codec stream) and ``rans64``, described first (version 3's coder, for models
above 12 bits).

A rans64 coder state is a 64-bit integer in ``[2**31, 2**63)`` with 32-bit renormalization (Duda 2013;
the layout of Giesen's ``rans64``). A model of precision ``P`` gives each symbol a frequency
``f >= 1`` and a start ``c`` (frequencies sum to ``M = 2**P``, ``P <= 24``).

* Encoding a symbol: if ``x >= f << (63 - P)`` the low 32 bits of ``x`` go out as a word and ``x``
  drops them; then ``x = (x // f) * M + x % f + c``. The division is a multiplication by a
  reciprocal (Alverson's: ``ceil(2**(63 + s) / f)`` with ``s = ceil(log2 f)``, exact for
  ``x < 2**63``; ``_mulhi64`` gives the upper 64 bits of the 128-bit product).
* Decoding: ``slot = x % M`` names the symbol whose range ``[c, c + f)`` holds it, then
  ``x = f * (x >> P) + slot - c``, and if ``x < 2**31`` the next word comes in below.

A block of symbols is coded by ``lanes`` states: symbol ``i`` of the block by lane ``i % lanes``,
all lanes sharing one stream of words in decoding order (the encoder runs backwards from the
state ``2**31`` in every lane, writing words from the end of its buffer). The block's stream
starts with each lane's final state (lane 0 first, low word then high word). Lanes are
independent chains of multiplications and table reads, so a core overlaps them: with 8 lanes
held in registers the decoder spends a few cycles per symbol, where one state waits on each
symbol's table read and multiplication in turn. Blocks are independent streams, coded and decoded
in parallel.

Decoding reads the symbol and ``f << 16 | slot - c`` from direct tables of ``2**P`` entries
when ``P <= 16``; for larger models (or a direct
table too large for a short stream) a table of ``2**B`` buckets of slots (``B <= 16``) names the
first candidate symbol and a search finds the one that holds the slot (at most ``2**(P - B)``
steps: the ranges that start inside the bucket).

Each kernel called from Python has a twin in :mod:`fedquant.wire.rans_twin` (same bytes and
statuses), run while numba's cache is cold.

Kernels do not check the indices they compute from their own tables; every index computed from
payload words is checked (the state against ``[2**31, 2**63)`` or, rans32, ``[2**15, 2**31)``,
every word read against the block's end, once per round of 8 or 32 symbols on the fast paths),
and a decoded block must end with every word consumed and every lane back at the initial state.
The rans32 vector decoder's table reads need no check: a valid state stays below ``2**31``, and
its slot ``x % 2**P`` indexes a table of ``2**P`` entries.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from fedquant.jit import parallel_kernel, with_twin
from fedquant.wire import rans_twin

STATE_LOW = 1 << 31
FAST_LANES = 8  # lanes of the register-held fast paths
MAX_DIRECT_PRECISION = 16  # decode tables of at most 2**16 entries; above, buckets
BUCKET_BITS = 16
ENC_ROW = 4  # uint64 per symbol value in the encoder table

_LOW = np.uint64(STATE_LOW)
_HIGH = np.uint64(1 << 63)
_ONE = np.uint64(1)
_S2 = np.uint64(2)
_S16 = np.uint64(16)
_S25 = np.uint64(25)
_S32 = np.uint64(32)
_S50 = np.uint64(50)
_M16 = np.uint64(0xFFFF)
_M24 = np.uint64((1 << 24) - 1)
_M25 = np.uint64((1 << 25) - 1)
_M32 = np.uint64(0xFFFFFFFF)
_ABSENT = np.uint64(1 << 49)  # the spare bit between M - f and the shift in a packed encoder word
_EIGHT = np.uint64(8)
# Offsets within a round, unsigned: indices that numba knows are not negative need no wraparound code.
_U1, _U2, _U3, _U4, _U5, _U6, _U7 = (np.uint64(j) for j in range(1, 8))


@intrinsic
def _mulhi64(typingctx, a, b):
    """Upper 64 bits of the 128-bit product ``a * b`` (uint64 operands)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        wide = ir.IntType(128)
        product = builder.mul(builder.zext(args[0], wide), builder.zext(args[1], wide))
        return builder.trunc(builder.lshr(product, ir.Constant(wide, 64)), ir.IntType(64))

    return sig, codegen


# ---------------------------------------------------------------------------------------------- tables
@with_twin(rans_twin.quantize_counts)
@njit(cache=True, nogil=True)
def quantize_counts(counts, n, precision):
    """Integer frequencies ``>= 1`` summing to ``2**precision``, about ``counts * 2**precision / n``.

    Floors first; slots left over go to the symbols furthest below their share (largest
    ``counts * 2**P - f * n``, ties to the lower index), and floors bumped up to 1 that overshoot
    are taken back from the largest frequencies (ties to the lower index). Integer arithmetic
    and stable sorts: encoder and decoder agree bit for bit.
    """
    total = np.int64(1) << precision
    k = counts.size
    freq = np.empty(k, np.int64)
    excess = -total
    for i in range(k):
        freq[i] = max(1, (counts[i] * total) // n)
        excess += freq[i]
    if excess > 0:  # the bumps to 1 overshot: take back from the largest frequencies first
        for i in np.argsort(-freq, kind="mergesort"):
            take = min(freq[i] - 1, excess)
            freq[i] -= take
            excess -= take
            if excess == 0:
                break
    elif excess < 0:  # at most one slot per symbol is missing: to the largest deficits
        order = np.argsort(freq * n - counts * total, kind="mergesort")
        for j in range(-excess):
            freq[order[j]] += 1
    return freq


@with_twin(rans_twin.model_bits)
@njit(cache=True, nogil=True)
def model_bits(counts, freq, precision):
    """Bits that ``counts`` cost under frequencies ``freq`` of ``precision`` (the cross-entropy, float)."""
    total = 0.0
    for i in range(counts.size):
        total += counts[i] * (precision - np.log2(freq[i]))
    return total


@with_twin(rans_twin.encoder_table)
@njit(cache=True, nogil=True)
def encoder_table(symbols, freq, rows, precision):
    """Per symbol value, ``ENC_ROW`` uint64: reciprocal, packed ``bias | M - f << 25 | shift << 50``, ``x_max``.

    ``symbols`` are the present symbol values (increasing, below ``rows``), ``freq`` their
    frequencies (>= 1, summing to ``2**precision``). Rows of absent values hold only ``ABSENT`` in
    the packed word: the encoder ORs the packed words it uses and fails if that bit is set.
    The reciprocal of ``f >= 2`` is ``ceil(2**(63 + s) / f)`` with ``s = ceil(log2 f)``, by long
    division in 32-bit digits (``2**(63 + s) = 2**(s - 1) * 2**64`` and ``2**(s - 1) < f < 2**24``:
    every partial remainder shifted by 32 bits fits in 64); ``f = 1`` takes ``2**64 - 1``
    (``x * (2**64 - 1) >> 64 = x - 1``).
    """
    table = np.zeros(rows * ENC_ROW, np.uint64)
    for r in range(rows):
        table[r * ENC_ROW + 1] = _ABSENT
    total = np.uint64(1) << np.uint64(precision)
    start = np.uint64(0)
    for i in range(symbols.size):
        f = np.uint64(freq[i])
        row = symbols[i] * ENC_ROW
        if f == _ONE:
            rcp, rshift, bias = ~np.uint64(0), np.uint64(0), start + total - _ONE
        else:
            shift = np.uint64(0)
            while (_ONE << shift) < f:
                shift += _ONE
            rem = _ONE << (shift - _ONE)
            high = (rem << _S32) // f
            rem = (rem << _S32) % f
            low = ((rem << _S32) + f - _ONE) // f
            rcp, rshift, bias = (high << _S32) + low, shift - _ONE, start
        table[row] = rcp
        table[row + 1] = bias | ((total - f) << _S25) | (rshift << _S50)
        table[row + 2] = f << np.uint64(63 - precision)
        start += f
    return table


@with_twin(rans_twin.direct_table)
@njit(cache=True, nogil=True)
def direct_table(symbols, freq, precision):
    """The decoder's tables of ``2**precision`` slots: ``f << 16 | slot - c`` (uint32) and the symbol."""
    size = 1 << precision
    freq_offset = np.empty(size, np.uint32)
    symbol = np.empty(size, symbols.dtype)
    slot = 0
    for i in range(freq.size):
        f = freq[i]
        for off in range(f):
            freq_offset[slot + off] = (f << 16) | off
            symbol[slot + off] = symbols[i]
        slot += f
    return freq_offset, symbol


def bucket_table(freq: np.ndarray, precision: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(bucket, cum)``: ``bucket[slot >> (precision - bits)]`` is the first rank whose range may hold ``slot``."""
    cum = np.zeros(freq.size + 1, np.uint64)
    np.cumsum(freq, out=cum[1:])
    starts = np.arange(1 << bits, dtype=np.uint64) << np.uint64(precision - bits)
    return np.searchsorted(cum[1:], starts, side="right").astype(np.int64), cum


# ---------------------------------------------------------------------------------------------- encoder
@njit(inline="always")
def _enc_step(x, wp, out, table, s):
    """Code symbol ``s`` into state ``x``; a word goes to ``out[wp - 1]`` when the state must shrink.

    Returns the new state and ``wp``, and the symbol's packed word (``ABSENT`` set: no frequency).
    """
    row = np.uint64(s) << _S2
    emit = x >= table[row + _S2]
    out[wp - _ONE] = np.uint32(x & _M32)  # always written, kept only when wp moves
    wp -= np.uint64(emit)
    if emit:
        x >>= _S32
    packed = table[row + _ONE]
    q = _mulhi64(x, table[row]) >> (packed >> _S50)
    return x + (packed & _M25) + q * ((packed >> _S25) & _M24), wp, packed


@njit(cache=True, nogil=True)
def _encode_rounds8(symbols, lo, rounds, table, out, wp, floor, states):
    """Rounds ``rounds - 1 .. 0`` of 8 symbols from ``symbols[lo]``, states in registers; ``(wp, ok)``."""
    x0, x1, x2, x3 = states[0], states[1], states[2], states[3]
    x4, x5, x6, x7 = states[4], states[5], states[6], states[7]
    seen = np.uint64(0)
    room = np.uint64(floor) + _EIGHT
    for r in range(rounds - 1, -1, -1):
        if wp < room:  # only with symbols the table does not know
            return wp, False
        b = np.uint64(lo + 8 * r)
        x7, wp, p7 = _enc_step(x7, wp, out, table, symbols[b + _U7])
        x6, wp, p6 = _enc_step(x6, wp, out, table, symbols[b + _U6])
        x5, wp, p5 = _enc_step(x5, wp, out, table, symbols[b + _U5])
        x4, wp, p4 = _enc_step(x4, wp, out, table, symbols[b + _U4])
        x3, wp, p3 = _enc_step(x3, wp, out, table, symbols[b + _U3])
        x2, wp, p2 = _enc_step(x2, wp, out, table, symbols[b + _U2])
        x1, wp, p1 = _enc_step(x1, wp, out, table, symbols[b + _U1])
        x0, wp, p0 = _enc_step(x0, wp, out, table, symbols[b])
        seen |= p0 | p1 | p2 | p3 | p4 | p5 | p6 | p7
    states[0], states[1], states[2], states[3] = x0, x1, x2, x3
    states[4], states[5], states[6], states[7] = x4, x5, x6, x7
    return wp, (seen & _ABSENT) == np.uint64(0)


@njit(cache=True, nogil=True)
def _encode_block(symbols, lo, hi, lanes, table, out, floor, end):
    """Code ``symbols[lo:hi]`` into ``out[floor:end]``, ending at ``end``: ``(start, ok)``.

    ``ok`` is False when a symbol has no frequency (an absent row) or the room ran out (which
    only such a symbol can cause: ``end - floor`` words hold any valid block).
    """
    states = np.full(lanes, _LOW, np.uint64)
    wp = np.uint64(end)
    low = np.uint64(floor) + _ONE
    count = hi - lo
    full = lo + (count // lanes) * lanes
    ok = True
    fast = lanes == FAST_LANES
    # Backwards: the last partial round, then the full rounds (fast path for 8 lanes).
    stop = full if fast else lo
    if lanes == 1:  # one state, held in a register
        x = _LOW
        seen = np.uint64(0)
        for i in range(hi - 1, lo - 1, -1):
            if wp < low:
                return wp, False
            x, wp, packed = _enc_step(x, wp, out, table, symbols[i])
            seen |= packed
        states[0] = x
        ok = (seen & _ABSENT) == np.uint64(0)
        stop = hi
    for i in range(hi - 1, stop - 1, -1):
        if wp < low:
            return wp, False
        j = (i - lo) % lanes
        x, wp, packed = _enc_step(states[j], wp, out, table, symbols[i])
        states[j] = x
        ok &= (packed & _ABSENT) == np.uint64(0)
    if fast:
        wp, good = _encode_rounds8(symbols, lo, (full - lo) // 8, table, out, wp, floor, states)
        ok &= good
    if not ok or wp < np.uint64(floor) + np.uint64(2 * lanes):
        return wp, False
    for j in range(lanes - 1, -1, -1):  # lane 0's state comes first, low word first
        wp -= _ONE
        out[wp] = np.uint32(states[j] >> _S32)
        wp -= _ONE
        out[wp] = np.uint32(states[j] & _M32)
    return wp, True


@parallel_kernel(twin=rans_twin.encode_blocks)
def encode_blocks(symbols, block, lanes, table, out, ends, starts, ok):
    """Code each block of ``block`` symbols into ``out[ends[b - 1]:ends[b]]``; its words start at ``starts[b]``."""
    n = symbols.size
    for b in prange(ends.size):
        lo = b * block
        floor = ends[b - 1] if b else 0
        start, good = _encode_block(symbols, lo, min(lo + block, n), lanes, table, out, floor, ends[b])
        starts[b] = start
        ok[b] = good


# ---------------------------------------------------------------------------------------------- decoder
@njit(inline="always")
def _dec_step(x, rp, words, freq_offset, symbol, out, i, mask, precision):
    slot = x & mask
    e = np.uint64(freq_offset[slot])
    out[i] = symbol[slot]
    x = (e >> _S16) * (x >> precision) + (e & _M16)
    w = np.uint64(words[rp])  # rp < the block's end: checked once per round
    refill = x < _LOW
    if refill:
        x = (x << _S32) | w
    return x, rp + np.uint64(refill)


@njit(cache=True, nogil=True)
def _decode_rounds8(words, rp, end, out, lo, rounds, states, precision, freq_offset, symbol):
    """Full rounds of 8 symbols from ``out[lo]`` while 8 words are left: ``(rp, rounds done)``."""
    x0, x1, x2, x3 = states[0], states[1], states[2], states[3]
    x4, x5, x6, x7 = states[4], states[5], states[6], states[7]
    mask = np.uint64((1 << precision) - 1)
    p = np.uint64(precision)
    rp = np.uint64(rp)
    last = np.uint64(end - 8)  # the caller guarantees end >= 16
    r = 0
    while r < rounds and rp <= last:
        b = np.uint64(lo + 8 * r)
        x0, rp = _dec_step(x0, rp, words, freq_offset, symbol, out, b, mask, p)
        x1, rp = _dec_step(x1, rp, words, freq_offset, symbol, out, b + _U1, mask, p)
        x2, rp = _dec_step(x2, rp, words, freq_offset, symbol, out, b + _U2, mask, p)
        x3, rp = _dec_step(x3, rp, words, freq_offset, symbol, out, b + _U3, mask, p)
        x4, rp = _dec_step(x4, rp, words, freq_offset, symbol, out, b + _U4, mask, p)
        x5, rp = _dec_step(x5, rp, words, freq_offset, symbol, out, b + _U5, mask, p)
        x6, rp = _dec_step(x6, rp, words, freq_offset, symbol, out, b + _U6, mask, p)
        x7, rp = _dec_step(x7, rp, words, freq_offset, symbol, out, b + _U7, mask, p)
        r += 1
    states[0], states[1], states[2], states[3] = x0, x1, x2, x3
    states[4], states[5], states[6], states[7] = x4, x5, x6, x7
    return np.int64(rp), r


@njit(cache=True, nogil=True)
def _decode_checked(words, rp, end, out, i, hi, lo, lanes, states, precision, lookup):
    """Symbols ``i .. hi - 1`` one at a time, every word read checked: ``(status, rp)``."""
    freq_offset, symbol, bucket, cum, present = lookup
    mask = np.uint64((1 << precision) - 1)
    p = np.uint64(precision)
    if lanes == 1 and freq_offset.size:  # one state, held in a register
        x = states[0]
        for k in range(i, hi):
            slot = x & mask
            e = np.uint64(freq_offset[slot])
            out[k] = symbol[slot]
            x = (e >> _S16) * (x >> p) + (e & _M16)
            if x < _LOW:
                if rp >= end:
                    return 2, rp
                x = (x << _S32) | np.uint64(words[rp])
                rp += 1
        states[0] = x
        return 0, rp
    bits = 0
    while (1 << bits) < bucket.size:
        bits += 1
    shift = np.uint64(max(precision - bits, 0))
    for k in range(i, hi):
        j = (k - lo) % lanes
        x = states[j]
        slot = x & mask
        if freq_offset.size:
            e = np.uint64(freq_offset[slot])
            out[k] = symbol[slot]
            x = (e >> _S16) * (x >> p) + (e & _M16)
        else:
            r = bucket[slot >> shift]
            while cum[r + 1] <= slot:
                r += 1
            out[k] = present[r]
            x = (cum[r + 1] - cum[r]) * (x >> p) + slot - cum[r]
        if x < _LOW:
            if rp >= end:
                return 2, rp
            x = (x << _S32) | np.uint64(words[rp])
            rp += 1
        states[j] = x
    return 0, rp


@njit(cache=True, nogil=True)
def _decode_block(words, rp, end, out, lo, hi, lanes, precision, lookup):
    """Decode ``out[lo:hi]`` from ``words[rp:end]``: 0, or 1 bad initial state, 2 words run out,
    3 words left over, 4 a lane does not end in the coder's initial state.

    ``lookup``: ``(freq_offset, symbol, bucket, cum, present)``, the direct tables (empty when the
    model decodes through buckets), the buckets and cumulative frequencies, the present symbols.
    """
    freq_offset, symbol = lookup[0], lookup[1]
    if end - rp < 2 * lanes:
        return 2
    states = np.empty(lanes, np.uint64)
    for j in range(lanes):
        x = np.uint64(words[rp]) | (np.uint64(words[rp + 1]) << _S32)
        if x < _LOW or x >= _HIGH:
            return 1
        states[j] = x
        rp += 2
    i = lo
    if lanes == FAST_LANES and freq_offset.size:
        rp, done = _decode_rounds8(words, rp, end, out, lo, (hi - lo) // 8, states, precision, freq_offset, symbol)
        i = lo + 8 * done
    status, rp = _decode_checked(words, rp, end, out, i, hi, lo, lanes, states, precision, lookup)
    if status:
        return status
    if rp != end:
        return 3
    for j in range(lanes):
        if states[j] != _LOW:
            return 4
    return 0


@parallel_kernel(count_arg=2, twin=rans_twin.decode_blocks)
def decode_blocks(words, offsets, out, block, lanes, precision, lookup, status):
    """Decode each block (``block`` symbols of ``out``) from ``words[offsets[b]:offsets[b + 1]]`` into ``status[b]``."""
    n = out.size
    for b in prange(offsets.size - 1):
        lo = b * block
        hi = min(lo + block, n)
        status[b] = _decode_block(words, offsets[b], offsets[b + 1], out, lo, hi, lanes, precision, lookup)


# ---------------------------------------------------------------------------------------------- rans32
# 32-bit states in [2**15, 2**31) with 16-bit words (the arithmetic of Giesen's ``rans_byte`` with
# the word size of htscodecs' ``rans32x16``), models of at most 2**12 slots, 32 lanes. One round
# codes 32 symbols, one per lane, as four vectors of eight lanes: the table reads are gathers and
# the words of a round are compressed into (encoder) or expanded from (decoder) the shared stream
# in lane order, so a round is a few dozen vector instructions and no lane waits on another.
L32 = 1 << 15
LANES32 = 32
MAX_PRECISION32 = 12
ABSENT32 = 1 << 31  # bit of a packed encoder entry: the symbol has no frequency
_ENC_VEC = 16  # lanes per vector of the encoder's rounds (measured: 16 codes 25% faster than 8)
_DEC_VEC = 8  # and of the decoder's (8 decodes 12% faster than 16)

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(b) for b in (1, 8, 16, 32, 64))


def _vec_type(t, width):
    return ir.VectorType(t, width)


def _splat(builder, t, value, width):
    """A vector of ``width`` copies of ``value`` (an ``ir.Value`` of type ``t``, or a Python int)."""
    if isinstance(value, int):
        return ir.Constant(_vec_type(t, width), [ir.Constant(t, value)] * width)
    one = builder.insert_element(ir.Constant(_vec_type(t, width), None), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(_vec_type(_I32, width), [0] * width)
    return builder.shuffle_vector(one, ir.Constant(_vec_type(t, width), None), zeros)


def _llvm_fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _array_data(context, builder, aty, ary):
    return context.make_array(aty)(context, builder, ary).data


def _vec_at(builder, base, index, t, width):
    """Pointer to ``width`` elements of type ``t`` at ``base[index]``."""
    return builder.bitcast(builder.gep(base, [index]), _vec_type(t, width).as_pointer())


def _gather(builder, base, index, t, width):
    """``base[index]`` (``base``: a table of ``t``, 32 or 64 bits) for a vector of uint32 indices in range."""
    size = t.width // 8
    addr = _splat(builder, _I64, builder.ptrtoint(base, _I64), width)
    offset = builder.shl(
        builder.zext(index, _vec_type(_I64, width)), _splat(builder, _I64, size.bit_length() - 1, width)
    )
    ptrs = builder.inttoptr(builder.add(addr, offset), ir.VectorType(t.as_pointer(), width))
    vt = _vec_type(t, width)
    fn = _llvm_fn(
        builder, f"llvm.masked.gather.v{width}i{t.width}.v{width}p0", vt, [ptrs.type, _I32, _vec_type(_I1, width), vt]
    )
    return builder.call(fn, [ptrs, ir.Constant(_I32, size), _splat(builder, _I1, 1, width), ir.Constant(vt, None)])


def _popcount(builder, mask, width):
    fn = _llvm_fn(builder, f"llvm.ctpop.i{width}", ir.IntType(width), [ir.IntType(width)])
    return builder.zext(builder.call(fn, [builder.bitcast(mask, ir.IntType(width))]), _I64)


@intrinsic
def _enc_round32(typingctx, states, symbols, i, table, out, wp, precision, seen):
    """Code ``symbols[i : i + 32]`` (uint8), symbol ``i + j`` into lane ``j``; returns the new ``wp``.

    Lanes 31 down to 0: each vector of 8 lanes gathers its symbols' entries (reciprocal and packed
    word, ``encoder_table32``), compresses the low 16 bits of the states that must shrink into
    ``out[wp - count : wp]`` in lane order and moves ``wp`` down by ``count``, then divides by the
    reciprocal. The caller leaves room for 32 words below ``wp``. ``seen`` (8 uint32) accumulates
    the OR of the packed entries (``ABSENT32``: a symbol without frequency).
    """
    sig = types.int64(states, symbols, i, table, out, wp, precision, seen)

    def codegen(context, builder, signature, args):
        wp, p = args[5], args[6]
        sp, yp, tp, op, ep = (_array_data(context, builder, signature.args[a], args[a]) for a in (0, 1, 3, 4, 7))
        i = args[2]
        w = _ENC_VEC
        v32 = _vec_type(_I32, w)
        p32 = builder.trunc(p, _I32)
        total = _splat(builder, _I32, builder.shl(ir.Constant(_I32, 1), p32), w)
        top_shift = _splat(builder, _I32, builder.sub(ir.Constant(_I32, 31), p32), w)
        v16 = _vec_type(_I16, w)
        compress = _llvm_fn(
            builder, f"llvm.masked.compressstore.v{w}i16", ir.VoidType(), [v16, op.type, _vec_type(_I1, w)]
        )
        seen_ptr = builder.bitcast(ep, v32.as_pointer())
        acc = builder.load(seen_ptr, align=4)
        for q in reversed(range(LANES32 // w)):
            xp = _vec_at(builder, sp, ir.Constant(_I64, q * w), _I32, w)
            x = builder.load(xp, align=4)
            s = builder.zext(
                builder.load(_vec_at(builder, yp, builder.add(i, ir.Constant(_I64, q * w)), _I8, w), align=1), v32
            )
            entry = _gather(builder, tp, s, _I64, w)
            r = builder.trunc(entry, v32)
            k = builder.trunc(builder.lshr(entry, _splat(builder, _I64, 32, w)), v32)
            acc = builder.or_(acc, k)
            bias = builder.and_(k, _splat(builder, _I32, 0x1FFF, w))
            cmpl = builder.and_(builder.lshr(k, _splat(builder, _I32, 13, w)), _splat(builder, _I32, 0xFFF, w))
            shift = builder.and_(builder.lshr(k, _splat(builder, _I32, 25, w)), _splat(builder, _I32, 0xF, w))
            emit = builder.icmp_unsigned(">=", x, builder.shl(builder.sub(total, cmpl), top_shift))
            wp = builder.sub(wp, _popcount(builder, emit, w))
            builder.call(compress, [builder.trunc(x, v16), builder.gep(op, [wp]), emit])
            x = builder.select(emit, builder.lshr(x, _splat(builder, _I32, 16, w)), x)
            product = builder.mul(builder.zext(x, _vec_type(_I64, w)), builder.zext(r, _vec_type(_I64, w)))
            quotient = builder.lshr(builder.trunc(builder.lshr(product, _splat(builder, _I64, 32, w)), v32), shift)
            builder.store(builder.add(builder.add(x, bias), builder.mul(quotient, cmpl)), xp, align=4)
        builder.store(acc, seen_ptr, align=4)
        return wp

    return sig, codegen


@intrinsic
def _dec_round32(typingctx, states, words, rp, table, out, o, precision):
    """Decode ``out[o : o + 32]`` (uint8), symbol ``o + j`` from lane ``j``; returns the new ``rp``.

    Lanes 0 to 31, 8 at a time: gather ``f << 20 | slot - c << 8 | symbol`` (``decoder_table32``)
    at ``slot = x % 2**P``, step the states, and expand the next ``count`` words of the stream
    into the lanes that fell below ``2**15``. The caller guarantees 32 words from ``rp``.
    """
    sig = types.int64(states, words, rp, table, out, o, precision)

    def codegen(context, builder, signature, args):
        rp, o, p = args[2], args[5], args[6]
        sp, wp_, tp, op = (_array_data(context, builder, signature.args[a], args[a]) for a in (0, 1, 3, 4))
        w = _DEC_VEC
        v32 = _vec_type(_I32, w)
        pvec = _splat(builder, _I32, builder.trunc(p, _I32), w)
        mask = builder.sub(builder.shl(_splat(builder, _I32, 1, w), pvec), _splat(builder, _I32, 1, w))
        v16 = _vec_type(_I16, w)
        expand = _llvm_fn(builder, f"llvm.masked.expandload.v{w}i16", v16, [wp_.type, _vec_type(_I1, w), v16])
        for q in range(LANES32 // w):
            xp = _vec_at(builder, sp, ir.Constant(_I64, q * w), _I32, w)
            x = builder.load(xp, align=4)
            e = _gather(builder, tp, builder.and_(x, mask), _I32, w)
            dst = _vec_at(builder, op, builder.add(o, ir.Constant(_I64, q * w)), _I8, w)
            builder.store(builder.trunc(e, _vec_type(_I8, w)), dst, align=1)
            offset = builder.and_(builder.lshr(e, _splat(builder, _I32, 8, w)), _splat(builder, _I32, 0xFFF, w))
            x = builder.add(builder.mul(builder.lshr(e, _splat(builder, _I32, 20, w)), builder.lshr(x, pvec)), offset)
            need = builder.icmp_unsigned("<", x, _splat(builder, _I32, L32, w))
            words = builder.call(expand, [builder.gep(wp_, [rp]), need, ir.Constant(v16, None)])
            refilled = builder.or_(builder.shl(x, _splat(builder, _I32, 16, w)), builder.zext(words, v32))
            builder.store(builder.select(need, refilled, x), xp, align=4)
            rp = builder.add(rp, _popcount(builder, need, w))
        return rp

    return sig, codegen


@with_twin(rans_twin.encoder_table32)
@njit(cache=True, nogil=True)
def encoder_table32(symbols, freq, rows, precision):
    """Per symbol value, one uint64: the reciprocal (low half) and ``bias | M - f << 13 | shift << 25`` (high half).

    ``symbols``: the present values (increasing, below ``rows``); ``freq``: their frequencies
    (``>= 1``, summing to ``M = 2**precision``, ``precision <= 12``). Coding a symbol into a
    state ``x < 2**31`` is ``x + bias + q * (M - f)`` with ``q = x * rcp >> 32 >> shift``, which is
    ``x // f`` for ``rcp = ceil(2**(31 + s) / f)``, ``shift = s - 1``, ``s = ceil(log2 f)``
    (Alverson; exact below ``2**31``), and ``bias = c``; for ``f = 1``: ``rcp = 2**32 - 1``,
    ``shift = 0`` (``q = x - 1``) and ``bias = c + M - 1``. Absent rows hold ``ABSENT32`` in the
    high half. One gather reads both halves.
    """
    table = np.full(rows, np.uint64(ABSENT32) << _S32, np.uint64)
    total = np.int64(1) << precision
    start = np.int64(0)
    for i in range(symbols.size):
        f = np.int64(freq[i])
        if f == 1:
            r, shift, bias = np.int64(0xFFFFFFFF), np.int64(0), start + total - 1
        else:
            s = np.int64(0)
            while (np.int64(1) << s) < f:
                s += 1
            r, shift, bias = ((np.int64(1) << (s + 31)) + f - 1) // f, s - 1, start
        table[symbols[i]] = np.uint64(r) | (np.uint64(bias | ((total - f) << 13) | (shift << 25)) << _S32)
        start += f
    return table


@with_twin(rans_twin.decoder_table32)
@njit(cache=True, nogil=True)
def decoder_table32(symbols, freq, precision):
    """The vector decoder's table of ``2**precision`` slots (``precision <= 12``, uint8 symbols):
    ``f << 20 | slot - c << 8 | symbol`` (uint32)."""
    table = np.empty(1 << precision, np.uint32)
    slot = 0
    for i in range(freq.size):
        f = freq[i]
        for off in range(f):
            table[slot + off] = np.uint32((f << 20) | (off << 8) | symbols[i])
        slot += f
    return table


@njit(inline="always")
def _enc_step32(x, wp, out, table, s, total, top_shift):
    """Code symbol ``s`` into ``x`` (< 2**31); a word goes to ``out[wp - 1]`` when the state must shrink.

    Returns the new state, ``wp`` and the symbol's packed entry (``ABSENT32`` set: no frequency).
    """
    entry = table[s]
    k = entry >> _S32
    cmpl = (k >> np.uint64(13)) & np.uint64(0xFFF)
    emit = x >= (total - cmpl) << top_shift
    out[wp - _ONE] = np.uint16(x & _M16)  # always written, kept only when wp moves
    wp -= np.uint64(emit)
    if emit:
        x >>= _S16
    q = ((x * (entry & _M32)) >> _S32) >> ((k >> np.uint64(25)) & np.uint64(0xF))
    return (x + (k & np.uint64(0x1FFF)) + q * cmpl) & _M32, wp, k


@njit(cache=True, nogil=True)
def _encode_block32(symbols, lo, hi, lanes, table, precision, out, floor, end):
    """Code ``symbols[lo:hi]`` into ``out[floor:end]`` (uint16 words), ending at ``end``: ``(start, ok)``.

    ``ok`` is False when a symbol has no frequency or the room ran out (which only such a symbol
    can cause). 32 lanes of uint8 symbols go round by round through :func:`_enc_round32`; the
    last partial round, and every other layout, one symbol at a time.
    """
    states = np.full(lanes, L32, np.uint32)
    total = np.uint64(1) << np.uint64(precision)
    top_shift = np.uint64(31 - precision)
    wp = np.uint64(end)
    low = np.uint64(floor) + _ONE
    count = hi - lo
    full = lo + (count // lanes) * lanes
    vector = lanes == LANES32 and symbols.itemsize == 1
    stop = full if vector else lo
    seen = np.uint64(0)
    for i in range(hi - 1, stop - 1, -1):
        if wp < low:
            return wp, False
        j = (i - lo) % lanes
        x, wp, k = _enc_step32(np.uint64(states[j]), wp, out, table, symbols[i], total, top_shift)
        states[j] = x
        seen |= k
    if vector:
        acc = np.zeros(_ENC_VEC, np.uint32)
        room = np.int64(floor) + LANES32
        w = np.int64(wp)
        for r in range((full - lo) // LANES32 - 1, -1, -1):
            if w < room:  # only with symbols the table does not know
                return wp, False
            w = _enc_round32(states, symbols, lo + LANES32 * r, table, out, w, precision, acc)
        wp = np.uint64(w)
        for j in range(_ENC_VEC):
            seen |= np.uint64(acc[j])
    if seen & np.uint64(ABSENT32) or wp < np.uint64(floor) + np.uint64(2 * lanes):
        return wp, False
    for j in range(lanes - 1, -1, -1):  # lane 0's state comes first, low word first
        wp -= _ONE
        out[wp] = np.uint16(states[j] >> 16)
        wp -= _ONE
        out[wp] = np.uint16(states[j] & 0xFFFF)
    return wp, True


@parallel_kernel(twin=rans_twin.encode_blocks32)
def encode_blocks32(symbols, block, lanes, table, precision, out, ends, starts, ok):
    """Code each block of ``block`` symbols into ``out[ends[b - 1]:ends[b]]`` (uint16 words from ``starts[b]``)."""
    n = symbols.size
    for b in prange(ends.size):
        lo = b * block
        floor = ends[b - 1] if b else 0
        start, good = _encode_block32(symbols, lo, min(lo + block, n), lanes, table, precision, out, floor, ends[b])
        starts[b] = start
        ok[b] = good


@njit(cache=True, nogil=True)
def _finish_lane32(symbols, lo, i, x, wp, seen, out, table, precision, floor):
    """Code ``symbols[lo:i]`` on one lane from state ``x`` (the rest of :func:`_encode_block32`'s
    one-lane loop, from ``i`` down), then write the state: ``(start, ok)``."""
    total = np.uint64(1) << np.uint64(precision)
    top_shift = np.uint64(31 - precision)
    low = np.uint64(floor) + _ONE
    for j in range(i - 1, lo - 1, -1):
        if wp < low:
            return wp, False
        x, wp, k = _enc_step32(x, wp, out, table, symbols[j], total, top_shift)
        seen |= k
    if seen & np.uint64(ABSENT32) or wp < np.uint64(floor) + np.uint64(2):
        return wp, False
    wp -= _ONE
    out[wp] = np.uint16(x >> _S16)
    wp -= _ONE
    out[wp] = np.uint16(x & _M16)
    return wp, True


@njit(cache=True, nogil=True)
def _encode_four32(symbols, seg, tables, out, starts, ok):
    """Four one-lane blocks (rows of ``seg``: ``lo, hi, table row, precision, floor, end``) coded in
    one loop, a symbol of each in turn, as :func:`_encode_block32` codes each alone."""
    t0, t1, t2, t3 = tables[seg[0, 2]], tables[seg[1, 2]], tables[seg[2, 2]], tables[seg[3, 2]]
    n0, n1, n2, n3 = seg[0, 3], seg[1, 3], seg[2, 3], seg[3, 3]
    a0 = np.uint64(1) << np.uint64(n0)
    a1 = np.uint64(1) << np.uint64(n1)
    a2 = np.uint64(1) << np.uint64(n2)
    a3 = np.uint64(1) << np.uint64(n3)
    s0, s1, s2, s3 = np.uint64(31 - n0), np.uint64(31 - n1), np.uint64(31 - n2), np.uint64(31 - n3)
    w0, w1, w2, w3 = np.uint64(seg[0, 5]), np.uint64(seg[1, 5]), np.uint64(seg[2, 5]), np.uint64(seg[3, 5])
    f0, f1, f2, f3 = np.uint64(seg[0, 4]), np.uint64(seg[1, 4]), np.uint64(seg[2, 4]), np.uint64(seg[3, 4])
    x0 = x1 = x2 = x3 = np.uint64(L32)
    e0 = e1 = e2 = e3 = np.uint64(0)
    common = min(seg[0, 1] - seg[0, 0], seg[1, 1] - seg[1, 0], seg[2, 1] - seg[2, 0], seg[3, 1] - seg[3, 0])
    for r in range(1, common + 1):
        # words out of a block's room only come with symbols its table does not know: then code
        # each block alone, which finds them
        if (w0 <= f0) | (w1 <= f1) | (w2 <= f2) | (w3 <= f3):
            for b in range(4):
                starts[b], ok[b] = _encode_block32(
                    symbols, seg[b, 0], seg[b, 1], 1, tables[seg[b, 2]], seg[b, 3], out, seg[b, 4], seg[b, 5]
                )
            return
        x0, w0, k0 = _enc_step32(x0, w0, out, t0, symbols[seg[0, 1] - r], a0, s0)
        x1, w1, k1 = _enc_step32(x1, w1, out, t1, symbols[seg[1, 1] - r], a1, s1)
        x2, w2, k2 = _enc_step32(x2, w2, out, t2, symbols[seg[2, 1] - r], a2, s2)
        x3, w3, k3 = _enc_step32(x3, w3, out, t3, symbols[seg[3, 1] - r], a3, s3)
        e0 |= k0
        e1 |= k1
        e2 |= k2
        e3 |= k3
    starts[0], ok[0] = _finish_lane32(symbols, seg[0, 0], seg[0, 1] - common, x0, w0, e0, out, t0, n0, seg[0, 4])
    starts[1], ok[1] = _finish_lane32(symbols, seg[1, 0], seg[1, 1] - common, x1, w1, e1, out, t1, n1, seg[1, 4])
    starts[2], ok[2] = _finish_lane32(symbols, seg[2, 0], seg[2, 1] - common, x2, w2, e2, out, t2, n2, seg[2, 4])
    starts[3], ok[3] = _finish_lane32(symbols, seg[3, 0], seg[3, 1] - common, x3, w3, e3, out, t3, n3, seg[3, 4])


@parallel_kernel
def encode_one_lane32(symbols, seg, tables, out, starts, ok):
    """Code one-lane rans32 blocks of ``symbols`` (rows of ``seg``: ``lo, hi, row of tables, precision,
    floor, end``; words into ``out[floor:end]``, from ``starts``) four at a time: four states'
    chains of multiplications overlap where one waits on each (the same words as
    :func:`encode_blocks32` with one lane, block by block)."""
    groups = seg.shape[0] // 4
    for g in prange(groups):
        _encode_four32(symbols, seg[4 * g : 4 * g + 4], tables, out, starts[4 * g : 4 * g + 4], ok[4 * g : 4 * g + 4])
    for b in prange(4 * groups, seg.shape[0]):
        starts[b], ok[b] = _encode_block32(
            symbols, seg[b, 0], seg[b, 1], 1, tables[seg[b, 2]], seg[b, 3], out, seg[b, 4], seg[b, 5]
        )


@njit(cache=True, nogil=True)
def _decode_block32(words, rp, end, out, lo, hi, lanes, precision, lookup):
    """Decode ``out[lo:hi]`` from ``words[rp:end]`` (uint16): 0, or the status codes of :func:`_decode_block`.

    ``lookup``: ``(table, freq_offset, symbol)``, the vector table (:func:`decoder_table32`, empty
    unless the symbols are uint8) and the direct tables of the one-at-a-time loop.
    """
    table, freq_offset, symbol = lookup
    if end - rp < 2 * lanes:
        return 2
    states = np.empty(lanes, np.uint32)
    for j in range(lanes):
        x = np.uint64(words[rp]) | (np.uint64(words[rp + 1]) << _S16)
        if x < np.uint64(L32) or x >= np.uint64(1 << 31):
            return 1
        states[j] = x
        rp += 2
    i = lo
    if lanes == LANES32 and table.size:
        last = end - LANES32
        while i + LANES32 <= hi and rp <= last:
            rp = _dec_round32(states, words, rp, table, out, i, precision)
            i += LANES32
    mask = np.uint64((1 << precision) - 1)
    p = np.uint64(precision)
    for k in range(i, hi):
        j = (k - lo) % lanes
        x = np.uint64(states[j])
        slot = x & mask
        e = np.uint64(freq_offset[slot])
        out[k] = symbol[slot]
        x = (e >> _S16) * (x >> p) + (e & _M16)
        if x < np.uint64(L32):
            if rp >= end:
                return 2
            x = (x << _S16) | np.uint64(words[rp])
            rp += 1
        states[j] = x
    if rp != end:
        return 3
    for j in range(lanes):
        if states[j] != L32:
            return 4
    return 0


@parallel_kernel(count_arg=2, twin=rans_twin.decode_blocks32)
def decode_blocks32(words, offsets, out, block, lanes, precision, lookup, status):
    """Decode each block (``block`` symbols of ``out``) from ``words[offsets[b]:offsets[b + 1]]`` into ``status[b]``."""
    n = out.size
    for b in prange(offsets.size - 1):
        lo = b * block
        hi = min(lo + block, n)
        status[b] = _decode_block32(words, offsets[b], offsets[b + 1], out, lo, hi, lanes, precision, lookup)


# ---------------------------------------------------------------------------------------------- histogram
@parallel_kernel(twin=rans_twin.histogram)
def histogram(symbols, parts, bins):
    """Counts of ``symbols`` in ``parts`` parallel pieces: ``bins + 1`` entries, the last for values ``>= bins``.

    Alphabets up to 4096 keep four tables per piece, filled in turn, so a run of one symbol does
    not wait on its own counter's last increment.
    """
    n = symbols.size
    width = bins + 1
    ways = 4 if bins <= 4096 else 1
    per = (n + parts - 1) // parts
    tables = np.zeros((parts, ways * width), np.int64)
    top = np.uint64(bins)
    for part in prange(parts):
        h = tables[part]
        i = part * per
        hi = min(n, i + per)
        if ways == 4:
            while i + 4 <= hi:
                h[min(np.uint64(symbols[i]), top)] += 1
                h[width + min(np.uint64(symbols[i + 1]), top)] += 1
                h[2 * width + min(np.uint64(symbols[i + 2]), top)] += 1
                h[3 * width + min(np.uint64(symbols[i + 3]), top)] += 1
                i += 4
        while i < hi:
            h[min(np.uint64(symbols[i]), top)] += 1
            i += 1
    counts = np.zeros(width, np.int64)
    for part in range(parts):
        for w in range(ways):
            for v in range(width):
                counts[v] += tables[part, w * width + v]
    return counts
