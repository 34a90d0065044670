"""NumPy / Python twins of the Elias kernels of :mod:`fedquant.wire.elias` (same bytes, no compile).

Run while numba's cache is cold (:mod:`fedquant.codecs.kernels.cache`). Encoders are vectorized:
each value becomes up to three pieces of at most 64 bits (a codeword from the short table, or
``prefix(L - 1)``, ``bin(v)``, ``0``), whose bits :func:`_write_bits` lays out MSB first. Decoders
are line-by-line ports of the kernels on Python integers (a prefix code decodes one codeword
after the other): every check of the kernel on untrusted bits, in the same order, with the same
status codes, indices and bit positions.
"""

from __future__ import annotations

import functools

import numpy as np

_OK, _TRUNCATED, _OVERLONG, _TOO_BIG, _GAP_PAST_END = 0, 1, 2, 3, 4
_PEEK = 12
_M64 = (1 << 64) - 1


@functools.cache
def _tables():
    from fedquant.wire import elias

    return elias


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
    """The pieces ``codes`` (uint64, ``widths`` bits each, <= 64) back to back, MSB first; ``(bytes, bits)``."""
    codes, widths = codes.reshape(-1), widths.reshape(-1)
    total = int(widths.sum())
    starts = np.cumsum(widths) - widths
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, widths)
    shift = (np.repeat(widths, widths) - 1 - within).astype(np.uint64)
    bits = ((np.repeat(codes, widths) >> shift) & np.uint64(1)).astype(np.uint8)
    pad = -total % 8
    if pad:
        bits = np.concatenate([bits, np.full(pad, 1 if pad_ones else 0, np.uint8)])
    return np.packbits(bits), total


def omega_lengths(values):
    """Twin of ``elias._omega_lengths_kernel``."""
    return _omega_lengths(values)


def omega_encode(values):
    """Twin of ``elias._omega_encode_kernel``: ``(bytes, total bits)``."""
    return _write_bits(*_omega_pieces(values), False)


def _magnitudes(levels: np.ndarray) -> np.ndarray:
    return np.abs(levels.astype(np.int64)).astype(np.uint64)


def sparse_encode(levels):
    """Twin of ``elias._sparse_encode_kernel`` (Code_s: gap, sign, magnitude per nonzero; 1-bit padding)."""
    nz = np.flatnonzero(levels)
    gaps = np.diff(nz, prepend=-1).astype(np.uint64)
    lv = levels[nz].astype(np.int64)
    gap_codes, gap_widths = _omega_pieces(gaps)
    mag_codes, mag_widths = _omega_pieces(_magnitudes(lv))
    codes = np.concatenate([gap_codes, (lv < 0).astype(np.uint64)[:, None], mag_codes], axis=1)
    widths = np.concatenate([gap_widths, np.ones((nz.size, 1), np.int64), mag_widths], axis=1)
    return _write_bits(codes, widths, True)


def dense_encode(levels):
    """Twin of ``elias._dense_encode_kernel`` (Code'_s: omega(|l| + 1), then a sign bit if ``l != 0``)."""
    lv = levels.astype(np.int64)
    codes, widths = _omega_pieces(_magnitudes(lv) + np.uint64(1))
    codes = np.concatenate([codes, (lv < 0).astype(np.uint64)[:, None]], axis=1)
    widths = np.concatenate([widths, (lv != 0).astype(np.int64)[:, None]], axis=1)
    return _write_bits(codes, widths, False)


# ---------------------------------------------------------------------------------------------- decoders
class _Bits:
    """The kernels' bit reader on a zero-padded byte buffer, with the decode tables as lists."""

    def __init__(self, buf: np.ndarray):
        e = _tables()
        self.buf = buf.tobytes()
        self.dec_val, self.dec_len = e._DEC_VAL.tolist(), e._DEC_LEN.tolist()
        self.dense_val, self.dense_len = e._DENSE_VAL.tolist(), e._DENSE_LEN.tolist()
        self.signed_val, self.signed_len = e._SIGNED_VAL.tolist(), e._SIGNED_LEN.tolist()

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
        window = self.peek(pos, _PEEK)
        width = self.dec_len[window]
        if width != 0 and pos + width <= end:
            return _OK, self.dec_val[window], pos + width
        return self.omega_long(pos, end)


def omega_decode(buf, end, out, max_value):
    """Twin of ``elias._omega_decode_kernel``: ``(status, index, bit position)``."""
    bits = _Bits(buf)
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
    bits = _Bits(buf)
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
        window = bits.peek(pos, _PEEK)
        width = bits.signed_len[window]
        if width != 0 and pos + width <= end:
            level = bits.signed_val[window]
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
    bits = _Bits(buf)
    s = int(s)
    levels = []
    pos = 0
    dense_len, dense_val = bits.dense_len, bits.dense_val
    for i in range(out.size):
        window = bits.peek(pos, _PEEK)
        width = dense_len[window]
        if width != 0 and pos + width <= end:
            level = dense_val[window]
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
