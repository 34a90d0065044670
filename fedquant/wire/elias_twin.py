"""NumPy / Python twins of the Elias kernels of :mod:`fedquant.wire.elias` (same bytes, no compile).

Run while numba's cache is cold (:mod:`fedquant.jit.cache`). Encoders are vectorized:
each value becomes up to three pieces of at most 64 bits (a codeword from the short table, or
``prefix(L - 1)``, ``bin(v)``, ``0``), whose bits :func:`_write_bits` lays out MSB first. Decoders
are line-by-line ports of the kernels on Python integers (a prefix code decodes one codeword
after the other): every check of the kernel on untrusted bits, in the same order, with the same
status codes, indices and bit positions.
"""

from __future__ import annotations

import numpy as np

from fedquant.wire import elias_tables

_OK, _TRUNCATED, _OVERLONG, _TOO_BIG, _GAP_PAST_END = 0, 1, 2, 3, 4
_PEEK = 12
_M64 = (1 << 64) - 1


def _tables():
    return elias_tables


def _bit_lengths(v: np.ndarray) -> np.ndarray:
    """Bit length of each uint64 ``v >= 1`` (exact: no float conversion)."""
    out = np.zeros(v.size, np.int64)
    x = v.copy()
    for step in (32, 16, 8, 4, 2, 1):
        big = x >= (np.uint64(1) << np.uint64(step))
        x[big] >>= np.uint64(step)
        out[big] += step
    return out + 1


def _omega_pieces(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, widths)`` of shape ``(n, 3)``: the codeword of each uint64 ``v >= 1`` in up to three pieces."""
    e = _tables()
    codes = np.zeros((v.size, 3), np.uint64)
    widths = np.zeros((v.size, 3), np.int64)
    short = v < np.uint64(e._SHORT)
    sv = v[short].astype(np.int64)
    codes[short, 0] = e._ENC_CODE[sv]
    widths[short, 0] = e._ENC_LEN[sv]
    long_ = ~short
    lengths = _bit_lengths(v[long_])
    codes[long_, 0] = e._PCODE[lengths]
    widths[long_, 0] = e._PLEN[lengths]
    codes[long_, 1] = v[long_]
    widths[long_, 1] = lengths
    widths[long_, 2] = 1  # the final 0
    return codes, widths


def _omega_lengths(v: np.ndarray) -> np.ndarray:
    return _omega_pieces(v)[1].sum(axis=1)


def _write_bits(codes: np.ndarray, widths: np.ndarray, pad_ones: bool) -> tuple[np.ndarray, int]:
    """The pieces ``codes`` (uint64, ``widths`` bits each, <= 64) back to back, MSB first; ``(bytes, bits)``.

    Each piece lands in one or two big-endian 64-bit words; the parts in each word are ORed
    together (``reduceat`` over the pieces that start in it: they do not overlap).
    """
    codes, widths = codes.reshape(-1), widths.reshape(-1)
    if widths.size and int(widths.min()) == 0:
        used = widths > 0
        codes, widths = codes[used], widths[used]
    total = int(widths.sum())
    if total == 0:
        return np.zeros(0, np.uint8), 0
    start = np.cumsum(widths) - widths
    word, off = start >> 6, start & 63
    spill = off + widths - 64  # bits that go on into the next word (> 0)
    split = spill > 0
    first = np.where(split, codes >> np.maximum(spill, 0).astype(np.uint64),
                     codes << np.maximum(-spill, 0).astype(np.uint64))  # fmt: skip
    heads = np.flatnonzero(np.r_[True, word[1:] != word[:-1]])
    words = np.zeros((total + 63) >> 6, np.uint64)
    words[word[heads]] = np.bitwise_or.reduceat(first, heads)
    # At most one piece crosses each word boundary: the spilled parts go to distinct words.
    words[word[split] + 1] |= codes[split] << (64 - spill[split]).astype(np.uint64)
    out = words.astype(">u8").view(np.uint8)[: (total + 7) >> 3].copy()
    pad = -total % 8
    if pad and pad_ones:
        out[-1] |= (1 << pad) - 1
    return out, total


def omega_lengths(values):
    """Twin of ``elias._omega_lengths_kernel``."""
    return _omega_lengths(values)


def omega_encode(values):
    """Twin of ``elias._omega_encode_kernel``: ``(bytes, total bits)``."""
    return _write_bits(*_omega_pieces(values), False)


def _magnitudes(levels: np.ndarray) -> np.ndarray:
    return np.abs(levels.astype(np.int64)).astype(np.uint64)


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray] | None:
    """Consecutive short pieces (one per element each) as one piece per element, if all fit in 64 bits.

    The common case (every value below the short table's bound): a third of the memory and
    of the work of separate pieces.
    """
    code, width = parts[0]
    for c, w in parts[1:]:
        code = (code << w.astype(np.uint64)) | c
        width = width + w
    return (code, width) if width.size == 0 or int(width.max()) <= 64 else None


def _short(v: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(code, width)`` of each uint64 ``v`` from the short table, or None if one is not in it."""
    e = _tables()
    if v.size and int(v.max()) >= e._SHORT:
        return None
    i = v.astype(np.int64)
    return e._ENC_CODE[i], e._ENC_LEN[i]


def sparse_encode(levels):
    """Twin of ``elias._sparse_encode_kernel`` (Code_s: gap, sign, magnitude per nonzero; 1-bit padding)."""
    nz = np.flatnonzero(levels)
    gaps = np.diff(nz, prepend=-1).astype(np.uint64)
    lv = levels[nz].astype(np.int64)
    sign = ((lv < 0).astype(np.uint64), np.ones(nz.size, np.int64))
    mags = _magnitudes(lv)
    gap_short, mag_short = _short(gaps), _short(mags)
    if gap_short is not None and mag_short is not None:
        joined = _joined([gap_short, sign, mag_short])
        if joined is not None:
            return _write_bits(*joined, True)
    gap_codes, gap_widths = _omega_pieces(gaps)
    mag_codes, mag_widths = _omega_pieces(mags)
    codes = np.concatenate([gap_codes, sign[0][:, None], mag_codes], axis=1)
    widths = np.concatenate([gap_widths, sign[1][:, None], mag_widths], axis=1)
    return _write_bits(codes, widths, True)


def dense_encode(levels):
    """Twin of ``elias._dense_encode_kernel`` (Code'_s: omega(|l| + 1), then a sign bit if ``l != 0``)."""
    lv = levels.astype(np.int64)
    v = _magnitudes(lv) + np.uint64(1)
    sign = ((lv < 0).astype(np.uint64), (lv != 0).astype(np.int64))
    short = _short(v)
    if short is not None:
        joined = _joined([short, sign])
        if joined is not None:
            return _write_bits(*joined, False)
    codes, widths = _omega_pieces(v)
    codes = np.concatenate([codes, sign[0][:, None]], axis=1)
    widths = np.concatenate([widths, sign[1][:, None]], axis=1)
    return _write_bits(codes, widths, False)


# ---------------------------------------------------------------------------------------------- decoders
class _Bits:
    """The kernels' bit reader on a zero-padded byte buffer.

    ``at(table)`` is ``table[window]`` for the 12-bit window at every bit position up to ``end``
    (a list, computed in one NumPy pass), so the decode loops look codewords up by position.
    """

    def __init__(self, buf: np.ndarray, end: int, *tables: np.ndarray):
        self.buf = buf.tobytes()
        pos = np.arange(end + 1, dtype=np.int64)
        b = pos >> 3
        three = (buf[b].astype(np.int64) << 16) | (buf[b + 1].astype(np.int64) << 8) | buf[b + 2]
        self.window = (three >> (12 - (pos & 7))) & ((1 << _PEEK) - 1)
        e = _tables()
        self.dec_len, self.dec_val = self.at(e._DEC_LEN), self.at(e._DEC_VAL)

    def at(self, table: np.ndarray) -> list:
        return table[self.window].tolist()

    def peek(self, pos: int, width: int) -> int:
        b = pos >> 3
        word = int.from_bytes(self.buf[b : b + 8], "big")
        return ((word << (pos & 7)) & _M64) >> (64 - width)

    def omega_long(self, pos: int, end: int):
        n = 1
        while True:
            if pos >= end:
                return _TRUNCATED, n, pos
            if self.peek(pos, 1) == 0:
                return _OK, n, pos + 1
            if n > 63:
                return _OVERLONG, n, pos
            width = n + 1
            if pos + width > end:
                return _TRUNCATED, n, pos
            if width <= 57:
                n = self.peek(pos, width)
            else:
                n = (self.peek(pos, width - 32) << 32) | self.peek(pos + width - 32, 32)
            pos += width

    def omega(self, pos: int, end: int):
        width = self.dec_len[pos]
        if width != 0 and pos + width <= end:
            return _OK, self.dec_val[pos], pos + width
        return self.omega_long(pos, end)


def omega_decode(buf, end, out, max_value):
    """Twin of ``elias._omega_decode_kernel``: ``(status, index, bit position)``."""
    bits = _Bits(buf, end)
    max_value = int(max_value)
    values = []
    pos = 0
    for i in range(out.size):
        status, v, pos = bits.omega(pos, end)
        if status != _OK:
            return status, i, pos
        if v > max_value:
            return _TOO_BIG, i, pos
        values.append(v)
    out[:] = np.array(values, np.uint64)
    return _OK, out.size, pos


def sparse_decode(buf, end, self_delimiting, out, s):
    """Twin of ``elias._sparse_decode_kernel``: ``(status, bit position)``; ``out`` (zeroed) filled."""
    bits = _Bits(buf, end)
    signed_len, signed_val = bits.at(_tables()._SIGNED_LEN), bits.at(_tables()._SIGNED_VAL)
    s = int(s)
    n = out.size
    pos, last = 0, -1
    where, levels = [], []
    status = _OK
    while True:
        if self_delimiting:
            rest = end - pos
            if rest < 8 and (rest == 0 or bits.peek(pos, rest) == (1 << rest) - 1):
                break
        elif pos == end:
            break
        status, gap, pos = bits.omega(pos, end)
        if status != _OK:
            break
        if gap > n - 1 - last:
            status = _GAP_PAST_END
            break
        last += gap
        width = signed_len[pos]
        if width != 0 and pos + width <= end:
            level = signed_val[pos]
            pos += width
        else:
            if pos >= end:
                status = _TRUNCATED
                break
            negative = bits.peek(pos, 1) == 1
            pos += 1
            status, mag, pos = bits.omega(pos, end)
            if status != _OK:
                break
            if mag > s:
                status = _TOO_BIG
                break
            level = -mag if negative else mag
        if abs(level) > s:
            status = _TOO_BIG
            break
        where.append(last)
        levels.append(level)
    out[np.array(where, np.int64)] = np.array(levels, np.int64)
    return status, pos


def dense_decode(buf, end, out, s):
    """Twin of ``elias._dense_decode_kernel``: ``(status, index, bit position)``."""
    bits = _Bits(buf, end)
    dense_len, dense_val = bits.at(_tables()._DENSE_LEN), bits.at(_tables()._DENSE_VAL)
    s = int(s)
    levels = []
    pos = 0
    for i in range(out.size):
        width = dense_len[pos]
        if width != 0 and pos + width <= end:
            level = dense_val[pos]
            pos += width
        else:
            status, v, pos = bits.omega(pos, end)
            if status != _OK:
                return status, i, pos
            if v > s + 1:
                return _TOO_BIG, i, pos
            level = 0
            if v != 1:
                if pos >= end:
                    return _TRUNCATED, i, pos
                negative = bits.peek(pos, 1) == 1
                pos += 1
                level = -(v - 1) if negative else v - 1
        if abs(level) > s:
            return _TOO_BIG, i, pos
        levels.append(level)
    out[:] = np.array(levels, np.int64)
    return _OK, out.size, pos
