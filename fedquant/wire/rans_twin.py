"""Pure Python / NumPy twins of the rANS kernels of :mod:`fedquant.wire.rans` (same bytes, no compile).

Run while numba's cache is cold (:mod:`fedquant.jit.cache`). The coder itself is a
chain of dependent steps per lane, which NumPy cannot vectorize over time and the lanes are too
few (8 per block) to amortize a NumPy call per step, so :func:`encode_blocks` and
:func:`decode_blocks` are line-by-line ports of the kernels on Python integers (about 1 us per
symbol; 128-bit products are exact). The decoder keeps every check of the kernel on payload
words and returns the same status codes; its result does not depend on the kernel's unchecked
8-symbol fast path, which only runs where no check can fail. The tables are built with NumPy.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

_LOW = 1 << 31
_HIGH = 1 << 63
_M16 = 0xFFFF
_M24 = (1 << 24) - 1
_M25 = (1 << 25) - 1
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_ABSENT = 1 << 49
_FAST_LANES = 8
_ENC_ROW = 4


def quantize_counts(counts, n, precision):
    """Twin of :func:`fedquant.wire.rans.quantize_counts` (stable sorts as in the kernel)."""
    total = 1 << precision
    freq = np.maximum(1, (counts * total) // n).astype(np.int64)
    excess = int(freq.sum()) - total
    if excess > 0:
        for i in np.argsort(-freq, kind="mergesort"):
            take = min(int(freq[i]) - 1, excess)
            freq[i] -= take
            excess -= take
            if excess == 0:
                break
    elif excess < 0:
        order = np.argsort(freq * n - counts * total, kind="mergesort")
        freq[order[:-excess]] += 1
    return freq


def model_bits(counts, freq, precision):
    """Twin of :func:`fedquant.wire.rans.model_bits` (summed in the kernel's order, libm ``log2``)."""
    total = 0.0
    for c, f in zip(counts.tolist(), freq.tolist(), strict=True):
        total += c * (precision - math.log2(f))
    return total


def encoder_table(symbols, freq, rows, precision):
    """Twin of :func:`fedquant.wire.rans.encoder_table`."""
    table = np.zeros(rows * _ENC_ROW, np.uint64)
    table[1::_ENC_ROW] = _ABSENT
    total = 1 << precision
    start = 0
    for s, f in zip(symbols.tolist(), freq.tolist(), strict=True):
        row = s * _ENC_ROW
        if f == 1:
            rcp, rshift, bias = _M64, 0, start + total - 1
        else:
            shift = (f - 1).bit_length()  # ceil(log2 f)
            rcp, rshift, bias = -((-1 << (63 + shift)) // f), shift - 1, start  # ceil(2**(63+s) / f)
        table[row] = rcp
        table[row + 1] = bias | ((total - f) << 25) | (rshift << 50)
        table[row + 2] = f << (63 - precision)
        start += f
    return table


def direct_table(symbols, freq, precision):
    """Twin of :func:`fedquant.wire.rans.direct_table`.

    Built in place in uint32, whose wraparound is the kernel's store of ``f << 16`` into uint32,
    with at most two slot-sized temporaries alive: a forged section's table (up to ``2**16``
    slots for a stream of 8192 symbols) costs about 0.5 MB here, not the 1.4 MB of int64 steps.
    """
    freq = np.asarray(freq, np.uint32)
    starts = np.cumsum(freq, dtype=np.uint32) - freq
    freq_offset = np.arange(1 << precision, dtype=np.uint32)
    freq_offset -= np.repeat(starts, freq)
    freq_offset |= np.repeat(freq << np.uint32(16), freq)
    return freq_offset, np.repeat(symbols, freq).astype(symbols.dtype, copy=False)


def histogram(symbols, parts, bins):
    """Twin of :func:`fedquant.wire.rans.histogram`: ``bins + 1`` counts, the last for values ``>= bins``."""
    found = np.bincount(symbols, minlength=bins + 1).astype(np.int64)
    counts = found[: bins + 1].copy()
    counts[bins] = found[bins:].sum()
    return counts


# ---------------------------------------------------------------------------------------------- encoder
def _encode_block(sym, lo, hi, lanes, rows, floor, end):
    """Port of ``rans._encode_block``: ``(start, ok, words)``, ``words`` the block's stream from ``start``.

    A block with a symbol the table does not know fails, as in the kernel (which fails on it, or
    on the room it uses up): :func:`encode_blocks` looks for one first. The kernel checks the
    room before each symbol, except in its 8-lane rounds (``[lo, full)``), where it checks
    ``wp >= floor + 8`` once per round; ``wp`` only decreases, so checking before the last symbol
    of each kind (and the last round) is the same.
    """
    x_max, rcp, bias, shift, scale, _ = rows
    states = [_LOW] * lanes
    emitted = []  # words in the order the encoder writes them (decreasing positions)
    wp = end

    def run(top, bottom):  # symbols top .. bottom, last first
        nonlocal wp
        for i in range(top, bottom - 1, -1):
            j = (i - lo) % lanes
            x = states[j]
            v = sym[i]
            if x >= x_max[v]:
                emitted.append(x & _M32)
                wp -= 1
                x >>= 32
            states[j] = x + bias[v] + (((x * rcp[v]) >> 64) >> shift[v]) * scale[v]

    full = lo + ((hi - lo) // lanes) * lanes
    stop = full if lanes == _FAST_LANES else lo  # the per-symbol checks run down to here
    if hi > stop:
        run(hi - 1, stop + 1)
        if wp < floor + 1:
            return wp, False, None
        run(stop, stop)
    if stop > lo:  # 8-lane rounds
        run(stop - 1, lo + 8)
        if wp < floor + 8:
            return wp, False, None
        run(lo + 7, lo)
    if wp < floor + 2 * lanes:
        return wp, False, None
    head = []
    for x in states:  # lane 0's state comes first, low word first
        head += [x & _M32, x >> 32]
    emitted.reverse()
    return wp - 2 * lanes, True, head + emitted


def _division_rows(rows):
    """Per symbol value ``(x_max, f, start, M - f)``: the encoder's step ``x + start + (x // f) (M - f)``.

    The kernel's ``(x * rcp >> 64) >> shift`` is ``x // f`` for every state ``x < 2**63`` (``rcp =
    ceil(2**(63 + s) / f)``, ``2**s >= f``: the product overshoots ``x / f`` by less than ``1 / f``),
    and for ``f = 1`` it is ``x - 1`` with a bias of ``start + M - 1``; Python divides by a small
    integer faster than it multiplies by a 64-bit one. ``f`` follows from the row:
    ``x_max = f * 2**63 / M`` and ``M = f + (M - f)``; absent rows get ``f = 1`` (never used).
    """
    out = []
    for top, rcp, bias, _, scale in zip(*rows[:5], strict=True):
        f = top * scale // ((1 << 63) - top) if 0 < top < 1 << 63 else 1  # M - f = 0: f is not used
        out.append((top, f, bias - scale if rcp == _M64 else bias, scale))
    return out


def _encode_one_lane(sym, lo, hi, step, floor, end):
    """:func:`_encode_block` for one lane (most sections): the state in a local, each symbol's row
    one tuple of :func:`_division_rows`, the room checked before the last symbol (as the kernel
    checks it before each: ``wp`` only decreases); half the time per symbol."""
    emitted = []
    append = emitted.append
    x = _LOW
    for v in reversed(sym[lo + 1 : hi]):
        top, f, b, c = step[v]
        if x >= top:
            append(x & _M32)
            x >>= 32
        x += b + (x // f) * c
    if hi > lo:
        if end - len(emitted) < floor + 1:
            return end - len(emitted), False, None
        top, f, b, c = step[sym[lo]]
        if x >= top:
            append(x & _M32)
            x >>= 32
        x += b + (x // f) * c
    wp = end - len(emitted)
    if wp < floor + 2:
        return wp, False, None
    emitted.reverse()
    return wp - 2, True, [x & _M32, x >> 32, *emitted]


def encode_blocks(symbols, block, lanes, table, out, ends, starts, ok):
    """Twin of :func:`fedquant.wire.rans.encode_blocks` (same words in ``out[starts[b]:ends[b]]``)."""
    n = symbols.size
    sym = symbols.tolist()
    packed = table[1::_ENC_ROW]
    rows = (
        table[2::_ENC_ROW].tolist(),
        table[0::_ENC_ROW].tolist(),
        (packed & np.uint64(_M25)).tolist(),
        (packed >> np.uint64(50)).tolist(),
        ((packed >> np.uint64(25)) & np.uint64(_M24)).tolist(),
        ((packed & np.uint64(_ABSENT)) != 0).tolist(),
    )
    step = _division_rows(rows) if lanes == 1 else None
    for b in range(ends.size):
        lo = b * block
        floor = int(ends[b - 1]) if b else 0
        end = int(ends[b])
        hi = min(lo + block, n)
        if any(rows[5][v] for v in set(sym[lo:hi])):
            start, good, words = end, False, None
        elif lanes == 1:
            start, good, words = _encode_one_lane(sym, lo, hi, step, floor, end)
        else:
            start, good, words = _encode_block(sym, lo, hi, lanes, rows, floor, end)
        starts[b] = start
        ok[b] = good
        if good:
            out[start:end] = words


# ---------------------------------------------------------------------------------------------- decoder
def _items(a: np.ndarray) -> memoryview:
    """``a``'s elements as Python ints on indexing, without a list of them: a forged section's decode
    tables (up to ``2**16`` slots for a stream of a few thousand symbols) and words would cost
    ~36 bytes an entry as lists, several times what the payload and its tensor may (the fuzz
    harness's bound); indexing a memoryview is as fast."""
    return memoryview(np.ascontiguousarray(a))


def _decode_block(words, rp, end, lo, hi, lanes, precision, lookup, out):
    """Port of ``rans._decode_block`` (every word read checked): the same status codes 0-4."""
    freq_offset, symbol, bucket, cum, present = lookup
    if end - rp < 2 * lanes:
        return 2
    states = []
    for _ in range(lanes):
        x = words[rp] | (words[rp + 1] << 32)
        if x < _LOW or x >= _HIGH:
            return 1
        states.append(x)
        rp += 2
    mask = (1 << precision) - 1
    decoded = array(out.dtype.char)  # 1-2 bytes a symbol, not a list of ints
    # Three copies of the step (one lane, direct tables, buckets): a helper call per symbol would
    # cost a third more, and this loop is the twin's hot path.
    if len(freq_offset) and lanes == 1:  # one state, in a local
        freq, offset = freq_offset
        append = decoded.append
        (x,) = states
        for _ in range(hi - lo):
            slot = x & mask
            append(symbol[slot])
            x = freq[slot] * (x >> precision) + offset[slot]
            if x < _LOW:
                if rp >= end:
                    return 2
                x = (x << 32) | words[rp]
                rp += 1
        states[0] = x
    elif len(freq_offset):
        freq, offset = freq_offset
        for k in range(hi - lo):
            j = k % lanes
            x = states[j]
            slot = x & mask
            decoded.append(symbol[slot])
            x = freq[slot] * (x >> precision) + offset[slot]
            if x < _LOW:
                if rp >= end:
                    return 2
                x = (x << 32) | words[rp]
                rp += 1
            states[j] = x
    else:
        bits = 0
        while (1 << bits) < len(bucket):
            bits += 1
        shift = max(precision - bits, 0)
        for k in range(hi - lo):
            j = k % lanes
            x = states[j]
            slot = x & mask
            r = bucket[slot >> shift]
            while cum[r + 1] <= slot:
                r += 1
            decoded.append(present[r])
            x = (cum[r + 1] - cum[r]) * (x >> precision) + slot - cum[r]
            if x < _LOW:
                if rp >= end:
                    return 2
                x = (x << 32) | words[rp]
                rp += 1
            states[j] = x
    out[lo:hi] = np.frombuffer(decoded, out.dtype)
    if rp != end:
        return 3
    if any(x != _LOW for x in states):
        return 4
    return 0


def decode_blocks(words, offsets, out, block, lanes, precision, lookup, status):
    """Twin of :func:`fedquant.wire.rans.decode_blocks`: the same symbols and per-block status."""
    n = out.size
    w = _items(words)
    freq_offset, *rest = lookup
    split = (_items(freq_offset >> 16), _items(freq_offset & _M16)) if freq_offset.size else ()
    tables = (split, *(_items(a) for a in rest))
    for b in range(offsets.size - 1):
        lo = b * block
        hi = min(lo + block, n)
        status[b] = _decode_block(w, int(offsets[b]), int(offsets[b + 1]), lo, hi, lanes, precision, tables, out)


# ---------------------------------------------------------------------------------------------- rans32
_L32 = 1 << 15
_ABSENT32 = 1 << 31


def encoder_table32(symbols, freq, rows, precision):
    """Twin of :func:`fedquant.wire.rans.encoder_table32`."""
    table = np.full(rows, _ABSENT32 << 32, np.uint64)
    total = 1 << precision
    start = 0
    for s, f in zip(symbols.tolist(), freq.tolist(), strict=True):
        if f == 1:
            r, shift, bias = _M32, 0, start + total - 1
        else:
            bits = (f - 1).bit_length()  # ceil(log2 f)
            r, shift, bias = ((1 << (bits + 31)) + f - 1) // f, bits - 1, start
        table[s] = r | (bias | ((total - f) << 13) | (shift << 25)) << 32
        start += f
    return table


def decoder_table32(symbols, freq, precision):
    """Twin of :func:`fedquant.wire.rans.decoder_table32`."""
    freq = np.asarray(freq, np.int64)
    starts = np.cumsum(freq) - freq
    offsets = np.arange(1 << precision, dtype=np.int64) - np.repeat(starts, freq)
    return ((np.repeat(freq, freq) << 20) | (offsets << 8) | np.repeat(symbols.astype(np.int64), freq)).astype(
        np.uint32
    )


def _encode_block32(sym, lo, hi, lanes, step, floor, end):
    """Port of ``rans._encode_block32``: ``(start, ok, words)``, ``words`` the block's stream from ``start``.

    The kernel checks the room before each symbol of the last partial round (and of every symbol
    when it does not run rounds of 32 lanes), and once per round (``wp >= floor + 32``) in its
    rounds; only a symbol without frequency can fail either, and :func:`encode_blocks32` looks for
    one first, so any check that passes for the last symbol passes for all.
    """
    states = [_L32] * lanes
    emitted = []
    for i in range(hi - 1, lo - 1, -1):
        j = (i - lo) % lanes
        x = states[j]
        top, f, bias, cmpl = step[sym[i]]
        if x >= top:
            emitted.append(x & _M16)
            x >>= 16
        states[j] = x + bias + (x // f) * cmpl
    wp = end - len(emitted)
    if wp < floor + 2 * lanes:
        return wp, False, None
    head = []
    for x in states:  # lane 0's state comes first, low word first
        head += [x & _M16, x >> 16]
    emitted.reverse()
    return wp - 2 * lanes, True, head + emitted


def encode_blocks32(symbols, block, lanes, table, precision, out, ends, starts, ok):
    """Twin of :func:`fedquant.wire.rans.encode_blocks32` (same words in ``out[starts[b]:ends[b]]``).

    The reciprocal step ``x + bias + (x * rcp >> 32 >> shift) * (M - f)`` is ``x + c + (x // f) * (M - f)``
    for every state below ``2**31`` (and ``f = 1``: the bias ``c + M - 1`` with ``q = x - 1``), so
    each row is ``(x_max, f, c, M - f)``; absent rows are never used.
    """
    n = symbols.size
    sym = symbols.tolist()
    total = 1 << precision
    step = []
    absent = []
    for k in (table >> np.uint64(32)).tolist():
        cmpl = (k >> 13) & 0xFFF
        f = total - cmpl
        bias = k & 0x1FFF
        step.append((f << (31 - precision), f, bias - cmpl if f == 1 else bias, cmpl))
        absent.append(bool(k & _ABSENT32))
    for b in range(ends.size):
        lo = b * block
        floor = int(ends[b - 1]) if b else 0
        end = int(ends[b])
        hi = min(lo + block, n)
        if any(absent[v] for v in set(sym[lo:hi])):
            start, good, words = end, False, None
        else:
            start, good, words = _encode_block32(sym, lo, hi, lanes, step, floor, end)
        starts[b] = start
        ok[b] = good
        if good:
            out[start:end] = words


def _decode_block32(words, rp, end, lo, hi, lanes, precision, freq, offset, symbol, out):
    """Port of ``rans._decode_block32`` (every word read checked): the same status codes 0-4."""
    if end - rp < 2 * lanes:
        return 2
    states = []
    for _ in range(lanes):
        x = words[rp] | (words[rp + 1] << 16)
        if x < _L32 or x >= 1 << 31:
            return 1
        states.append(x)
        rp += 2
    mask = (1 << precision) - 1
    decoded = array(out.dtype.char)  # 1-2 bytes a symbol, not a list of ints
    append = decoded.append
    for k in range(hi - lo):
        j = k % lanes
        x = states[j]
        slot = x & mask
        append(symbol[slot])
        x = freq[slot] * (x >> precision) + offset[slot]
        if x < _L32:
            if rp >= end:
                return 2
            x = (x << 16) | words[rp]
            rp += 1
        states[j] = x
    out[lo:hi] = np.frombuffer(decoded, out.dtype)
    if rp != end:
        return 3
    if any(x != _L32 for x in states):
        return 4
    return 0


def decode_blocks32(words, offsets, out, block, lanes, precision, lookup, status):
    """Twin of :func:`fedquant.wire.rans.decode_blocks32`: the same symbols and per-block status."""
    n = out.size
    w = _items(words)
    _, freq_offset, symbol = lookup
    freq, offset, sym = _items(freq_offset >> 16), _items(freq_offset & _M16), _items(symbol)
    for b in range(offsets.size - 1):
        lo = b * block
        hi = min(lo + block, n)
        status[b] = _decode_block32(
            w, int(offsets[b]), int(offsets[b + 1]), lo, hi, lanes, precision, freq, offset, sym, out
        )
