"""Elias recursive (omega) code and QSGD's lossless integer codes Code_s and Code'_s.

Elias omega code of an integer ``k >= 1`` (Elias 1975; QSGD paper §3.1): start with ``0``; while
``k > 1`` prepend ``bin(k)`` and set ``k = bitlen(k) - 1``. So ``1 -> 0``, ``2 -> 100``,
``4 -> 101000``, ``16 -> 10100100000``. Equivalently, for ``k >= 2`` with ``L = bitlen(k)``::

    omega(k) = prefix(L - 1) + bin(k) + "0"      prefix(m) = omega(m) without its final 0

which is how the kernels write it (``prefix`` comes from a 65-entry table). Values up to
``2**64 - 1`` (76-bit codewords) are supported.

Bit order: MSB first within each byte, codewords back to back, the last byte padded.

Streams
-------
- :func:`elias_omega_encode`: codewords of ``values``; padding bits are 0. The decoder is told
  the count.
- :func:`code_s_encode` (Code_s, sparse regime): for each nonzero level, ``omega(gap)`` with
  1-based gaps (the first gap is the 1-based position of the first nonzero), one sign bit
  (1 = negative) and ``omega(|level|)``. Zeros are implicit. Padding bits are **1**: every
  codeword ends in a 0, so fewer than 8 trailing 1 bits can never hold a codeword, and the
  stream is self-delimiting (``total_bits`` is optional at decode).
- :func:`code_s_dense_encode` (Code'_s, dense regime): for every coordinate
  ``omega(|level| + 1)``, followed by a sign bit when the level is nonzero. Padding bits are 0.

Every encoder returns ``(uint8 bytes, total_bits)`` with ``len(bytes) == ceil(total_bits / 8)``
and ``total_bits`` equal to the sum of the codeword (and sign bit) lengths. Every decoder checks
untrusted input: a stream that ends early, an over-long (malformed) codeword, a value beyond
its bound, a gap past the end of the vector, wrong padding or trailing bytes raise
:class:`~fedquant.errors.PayloadError`. Kernels are numba-compiled (cached on disk); while the cache
is cold their twins in :mod:`fedquant.wire.elias_twin` run (same bytes, same checks).
"""

from __future__ import annotations

import numba
import numpy as np

from fedquant.errors import PayloadError
from fedquant.jit import with_twin
from fedquant.wire import elias_twin

# Tables built once in Python; numba freezes these module-level arrays into the kernels as constants.
from fedquant.wire.elias_tables import (
    _DEC_LEN,
    _DEC_VAL,
    _DENSE_LEN,
    _DENSE_VAL,
    _ENC_CODE,
    _ENC_LEN,
    _PCODE,
    _PEEK,
    _PLEN,
    _SHORT,
    _SIGNED_LEN,
    _SIGNED_VAL,
)

__all__ = [
    "code_s_decode",
    "code_s_dense_decode",
    "code_s_dense_encode",
    "code_s_encode",
    "elias_omega_decode",
    "elias_omega_decode_prefix",
    "elias_omega_encode",
    "elias_omega_lengths",
]


# Kernel status codes.
_OK, _TRUNCATED, _OVERLONG, _TOO_BIG, _GAP_PAST_END = 0, 1, 2, 3, 4


# ----------------------------------------------------------------------------------------------
# Bit-level primitives. The hot paths only call helpers on scalars; the helpers that write the
# output array run once per 32 bits (``_flush``) or for rare long codewords (``_put_long``):
# numba does not inline array-writing helpers well, which cost 10x in throughput.


@numba.njit(inline="always")
def _bitlen(x):
    """Number of bits of a uint64 ``x >= 1``."""
    n = 1
    if x >= np.uint64(1) << np.uint64(32):
        x >>= np.uint64(32)
        n += 32
    if x >= np.uint64(1) << np.uint64(16):
        x >>= np.uint64(16)
        n += 16
    if x >= np.uint64(256):
        x >>= np.uint64(8)
        n += 8
    if x >= np.uint64(16):
        x >>= np.uint64(4)
        n += 4
    if x >= np.uint64(4):
        x >>= np.uint64(2)
        n += 2
    if x >= np.uint64(2):
        n += 1
    return n


@numba.njit(inline="always")
def _omega_len(v):
    if v < np.uint64(_SHORT):
        return _ENC_LEN[v]
    length = _bitlen(v)
    return _PLEN[length] + length + 1


@numba.njit(inline="always")
def _omega_short(v):
    """(codeword, width) if the codeword of ``v`` has at most 32 bits, else (0, 0)."""
    if v < np.uint64(_SHORT):
        return _ENC_CODE[v], _ENC_LEN[v]
    length = _bitlen(v)
    width = _PLEN[length] + length + 1
    if width > 32:
        return np.uint64(0), 0
    return (_PCODE[length] << np.uint64(length + 1)) | (v << np.uint64(1)), width


@numba.njit(inline="always")
def _push(acc, nacc, code, width):
    """Append ``width`` (<= 32) bits to the accumulator, which holds ``nacc < 32`` bits."""
    return (acc << np.uint64(width)) | code, nacc + width


@numba.njit
def _flush(out, op, acc, nacc):
    """Write the oldest 32 of the ``nacc >= 32`` pending bits, big-endian."""
    nacc -= 32
    word = acc >> np.uint64(nacc)
    out[op] = np.uint8((word >> np.uint64(24)) & np.uint64(0xFF))
    out[op + 1] = np.uint8((word >> np.uint64(16)) & np.uint64(0xFF))
    out[op + 2] = np.uint8((word >> np.uint64(8)) & np.uint64(0xFF))
    out[op + 3] = np.uint8(word & np.uint64(0xFF))
    return op + 4, nacc


@numba.njit
def _put_bits(out, op, acc, nacc, code, width):
    acc, nacc = _push(acc, nacc, code, width)
    if nacc >= 32:
        op, nacc = _flush(out, op, acc, nacc)
    return op, acc, nacc


@numba.njit
def _put_long(out, op, acc, nacc, v):
    """Write a codeword longer than 32 bits: prefix(L - 1), bin(v), 0."""
    length = _bitlen(v)
    op, acc, nacc = _put_bits(out, op, acc, nacc, _PCODE[length], _PLEN[length])
    if length > 32:
        op, acc, nacc = _put_bits(out, op, acc, nacc, v >> np.uint64(32), length - 32)
        op, acc, nacc = _put_bits(out, op, acc, nacc, v & np.uint64(0xFFFFFFFF), 32)
    else:
        op, acc, nacc = _put_bits(out, op, acc, nacc, v, length)
    return _put_bits(out, op, acc, nacc, np.uint64(0), 1)


@numba.njit
def _finish(out, op, acc, nacc, pad_ones):
    """Flush the pending ``nacc < 32`` bits, padding the last byte with 1 or 0 bits."""
    nbytes = (nacc + 7) >> 3
    pad = nbytes * 8 - nacc
    last = acc << np.uint64(pad)
    if pad_ones:
        last |= (np.uint64(1) << np.uint64(pad)) - np.uint64(1)
    for j in range(nbytes):
        out[op + j] = np.uint8((last >> np.uint64(8 * (nbytes - 1 - j))) & np.uint64(0xFF))
    return op + nbytes


@numba.njit(inline="always")
def _out_buffer(total):
    # Room for whole 32-bit words; the kernel returns the first ceil(total / 8) bytes.
    return np.empty(((total + 31) >> 5) * 4, np.uint8)


@numba.njit(inline="always")
def _peek(buf, pos, width):
    """``width`` (1..57) bits starting at bit ``pos`` of ``buf`` (zero-padded by 8 bytes)."""
    b = pos >> 3
    word = np.uint64(0)
    for j in range(8):
        word = (word << np.uint64(8)) | np.uint64(buf[b + j])
    return (word << np.uint64(pos & 7)) >> np.uint64(64 - width)


@numba.njit
def _get_omega_long(buf, pos, end):
    """Decode one codeword at bit ``pos`` bit by bit; returns (status, value, new_pos)."""
    n = np.uint64(1)
    while True:
        if pos >= end:
            return _TRUNCATED, n, pos
        if _peek(buf, pos, 1) == np.uint64(0):
            return _OK, n, pos + 1
        # Compare before converting: a 64-bit group can read n >= 2**63, which as int64 would
        # give a negative width that passes the bounds checks below and walks pos out of buf.
        if n > np.uint64(63):
            return _OVERLONG, n, pos
        width = np.int64(n) + 1
        if pos + width > end:
            return _TRUNCATED, n, pos
        if width <= 57:
            n = _peek(buf, pos, width)
        else:
            hi = _peek(buf, pos, width - 32)
            lo = _peek(buf, pos + width - 32, 32)
            n = (hi << np.uint64(32)) | lo
        pos += width


@numba.njit(inline="always")
def _get_omega(buf, pos, end):
    """Decode one codeword: one table lookup for short ones; returns (status, value, new_pos)."""
    window = _peek(buf, pos, _PEEK)
    width = _DEC_LEN[window]
    if width != 0 and pos + width <= end:
        return _OK, _DEC_VAL[window], pos + width
    return _get_omega_long(buf, pos, end)


# ----------------------------------------------------------------------------------------------
# Kernels.


@with_twin(elias_twin.omega_lengths)
@numba.njit(cache=True, nogil=True)
def _omega_lengths_kernel(values):
    out = np.empty(values.size, np.int64)
    for i in range(values.size):
        out[i] = _omega_len(values[i])
    return out


@with_twin(elias_twin.omega_encode)
@numba.njit(cache=True, nogil=True)
def _omega_encode_kernel(values):
    total = 0
    for i in range(values.size):
        total += _omega_len(values[i])
    out = _out_buffer(total)
    op, acc, nacc = 0, np.uint64(0), 0
    for i in range(values.size):
        code, width = _omega_short(values[i])
        if width > 0:
            acc, nacc = _push(acc, nacc, code, width)
            if nacc >= 32:
                op, nacc = _flush(out, op, acc, nacc)
        else:
            op, acc, nacc = _put_long(out, op, acc, nacc, values[i])
    op = _finish(out, op, acc, nacc, False)
    return out[:op], total


@with_twin(elias_twin.omega_decode, count_arg=2)
@numba.njit(cache=True, nogil=True)
def _omega_decode_kernel(buf, end, out, max_value):
    """Fill ``out``; returns (status, index of the failing value, bit position reached)."""
    pos = 0
    for i in range(out.size):
        status, v, pos = _get_omega(buf, pos, end)
        if status != _OK:
            return status, i, pos
        if v > max_value:
            return _TOO_BIG, i, pos
        out[i] = v
    return _OK, out.size, pos


@numba.njit(inline="always")
def _magnitude(lv):
    return np.uint64(-lv) if lv < 0 else np.uint64(lv)


@with_twin(elias_twin.sparse_encode)
@numba.njit(cache=True, nogil=True)
def _sparse_encode_kernel(levels):
    total = 0
    last = -1
    for i in range(levels.size):
        lv = np.int64(levels[i])
        if lv != 0:
            total += _omega_len(np.uint64(i - last)) + 1 + _omega_len(_magnitude(lv))
            last = i
    out = _out_buffer(total)
    op, acc, nacc = 0, np.uint64(0), 0
    last = -1
    for i in range(levels.size):
        lv = np.int64(levels[i])
        if lv == 0:
            continue
        gap = np.uint64(i - last)
        last = i
        code, width = _omega_short(gap)
        if width > 0:
            acc, nacc = _push(acc, nacc, code, width)
            if nacc >= 32:
                op, nacc = _flush(out, op, acc, nacc)
        else:
            op, acc, nacc = _put_long(out, op, acc, nacc, gap)
        mag = _magnitude(lv)
        code, width = _omega_short(mag)
        if width > 0 and width < 32:  # sign bit and level codeword in one push
            acc, nacc = _push(acc, nacc, (np.uint64(lv < 0) << np.uint64(width)) | code, width + 1)
            if nacc >= 32:
                op, nacc = _flush(out, op, acc, nacc)
        else:
            op, acc, nacc = _put_bits(out, op, acc, nacc, np.uint64(lv < 0), 1)
            op, acc, nacc = _put_long(out, op, acc, nacc, mag)
    op = _finish(out, op, acc, nacc, True)
    return out[:op], total


@with_twin(elias_twin.sparse_decode, count_arg=3)
@numba.njit(cache=True, nogil=True)
def _sparse_decode_kernel(buf, end, self_delimiting, out, s):
    """Fill ``out`` (zeroed) from a Code_s stream; returns (status, bit position reached)."""
    n = out.size
    pos = 0
    last = -1
    while True:
        if self_delimiting:
            rest = end - pos
            if rest < 8 and (rest == 0 or _peek(buf, pos, rest) == (np.uint64(1) << np.uint64(rest)) - np.uint64(1)):
                return _OK, pos
        elif pos == end:
            return _OK, pos
        status, gap, pos = _get_omega(buf, pos, end)
        if status != _OK:
            return status, pos
        if gap > np.uint64(n - 1 - last):
            return _GAP_PAST_END, pos
        last += np.int64(gap)
        window = _peek(buf, pos, _PEEK)
        width = _SIGNED_LEN[window]
        if width != 0 and pos + width <= end:  # sign and level in one lookup
            level = _SIGNED_VAL[window]
            pos += width
        else:
            if pos >= end:
                return _TRUNCATED, pos
            negative = _peek(buf, pos, 1) == np.uint64(1)
            pos += 1
            status, mag, pos = _get_omega(buf, pos, end)
            if status != _OK:
                return status, pos
            if mag > s:
                return _TOO_BIG, pos
            level = -np.int64(mag) if negative else np.int64(mag)
        if abs(level) > np.int64(s):
            return _TOO_BIG, pos
        out[last] = level


@with_twin(elias_twin.dense_encode)
@numba.njit(cache=True, nogil=True)
def _dense_encode_kernel(levels):
    total = 0
    for i in range(levels.size):
        lv = np.int64(levels[i])
        total += _omega_len(_magnitude(lv) + np.uint64(1)) + (lv != 0)
    out = _out_buffer(total)
    op, acc, nacc = 0, np.uint64(0), 0
    for i in range(levels.size):
        lv = np.int64(levels[i])
        v = _magnitude(lv) + np.uint64(1)
        code, width = _omega_short(v)
        if width > 0 and width < 32:  # level codeword and (if nonzero) sign bit in one push
            if lv != 0:
                code = (code << np.uint64(1)) | np.uint64(lv < 0)
                width += 1
            acc, nacc = _push(acc, nacc, code, width)
            if nacc >= 32:
                op, nacc = _flush(out, op, acc, nacc)
        else:
            op, acc, nacc = _put_long(out, op, acc, nacc, v)
            op, acc, nacc = _put_bits(out, op, acc, nacc, np.uint64(lv < 0), 1)
    op = _finish(out, op, acc, nacc, False)
    return out[:op], total


@with_twin(elias_twin.dense_decode, count_arg=2)
@numba.njit(cache=True, nogil=True)
def _dense_decode_kernel(buf, end, out, s):
    """Fill ``out`` from a Code'_s stream; returns (status, index reached, bit position)."""
    pos = 0
    for i in range(out.size):
        window = _peek(buf, pos, _PEEK)
        width = _DENSE_LEN[window]
        if width != 0 and pos + width <= end:  # level and sign in one lookup, no data-dependent branch
            level = _DENSE_VAL[window]
            pos += width
        else:
            status, v, pos = _get_omega(buf, pos, end)
            if status != _OK:
                return status, i, pos
            if v > s + np.uint64(1):
                return _TOO_BIG, i, pos
            level = np.int64(0)
            if v != np.uint64(1):
                if pos >= end:
                    return _TRUNCATED, i, pos
                negative = _peek(buf, pos, 1) == np.uint64(1)
                pos += 1
                level = -np.int64(v - np.uint64(1)) if negative else np.int64(v - np.uint64(1))
        if abs(level) > np.int64(s):
            return _TOO_BIG, i, pos
        out[i] = level
    return _OK, out.size, pos


# ----------------------------------------------------------------------------------------------
# Python API.


def _as_positive_uint64(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values).reshape(-1)
    if v.dtype == np.uint64:
        if v.size and v.min() < 1:
            raise ValueError("Elias omega codes integers >= 1, got 0")
        return np.ascontiguousarray(v)
    if not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"Elias omega codes integers, got dtype {v.dtype}")
    if v.size and v.min() < 1:
        raise ValueError(f"Elias omega codes integers >= 1, got {v.min()}")
    return v.astype(np.uint64)


def _as_levels(levels: np.ndarray) -> np.ndarray:
    """int8 levels as they are; any other integer dtype as int32 (two kernel specializations)."""
    v = np.asarray(levels).reshape(-1)
    if not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"Code_s codes integer levels, got dtype {v.dtype}")
    if v.dtype == np.int8:
        return np.ascontiguousarray(v)
    if v.dtype.itemsize >= 4 and v.size and (int(v.max()) > 2**31 - 1 or int(v.min()) < -(2**31 - 1)):
        raise ValueError("Code_s levels must lie in -(2**31 - 1) .. 2**31 - 1")
    return v.astype(np.int32)


def _as_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ValueError(f"coded data must be uint8 bytes, got dtype {data.dtype}")
        return data.reshape(-1)
    return np.frombuffer(data, dtype=np.uint8)


def _padded(buf: np.ndarray) -> np.ndarray:
    """A copy with 8 zero bytes appended, so the kernels may read 64-bit words past the end."""
    out = np.zeros(buf.size + 8, np.uint8)
    out[: buf.size] = buf
    return out


def _level_dtype(s: int) -> np.dtype:
    """Output dtype of the decoders: the smallest of int8, int16, int32 that holds ``s``."""
    if s < 1:
        raise ValueError(f"the number of levels s must be >= 1, got {s}")
    for dt in (np.int8, np.int16, np.int32):
        if s <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"levels s up to 2**31 - 1 are supported, got {s}")


def _kernel_dtype(dtype: np.dtype) -> np.dtype:
    # The kernels write int8 or int32 (two specializations); int16 results are narrowed after.
    return dtype if dtype == np.int8 else np.dtype(np.int32)


def _end_bit(buf: np.ndarray, total_bits: int | None, what: str) -> int:
    """The bit position where the stream ends; checks ``total_bits`` against the byte count."""
    if total_bits is None:
        return buf.size * 8
    if total_bits < 0 or (total_bits + 7) // 8 != buf.size:
        raise PayloadError(f"{what} declares {total_bits} bits but holds {buf.size} bytes")
    return int(total_bits)


def _check_tail(buf: np.ndarray, pos: int, pad_ones: bool, what: str) -> None:
    """After decoding up to bit ``pos``: nothing but the padding of the last byte may follow."""
    used = (pos + 7) // 8
    if buf.size != used:
        raise PayloadError(f"{what} has {buf.size - used} unexpected trailing bytes")
    rest = used * 8 - pos
    if rest:
        mask = (1 << rest) - 1
        want = mask if pad_ones else 0
        if int(buf[-1]) & mask != want:
            raise PayloadError(f"{what} has {'bad' if pad_ones else 'nonzero'} padding bits in its last byte")


def _raise(status: int, what: str, where: str) -> None:
    messages = {
        _TRUNCATED: "ends in the middle of a codeword",
        _OVERLONG: "holds a malformed codeword (a value beyond 64 bits)",
        _TOO_BIG: "holds a value beyond the allowed maximum",
        _GAP_PAST_END: "holds a gap that points past the end of the vector",
    }
    raise PayloadError(f"{what} {messages.get(status, 'is malformed')} ({where})")


def elias_omega_lengths(values: np.ndarray) -> np.ndarray:
    """Codeword length in bits of each value.

    Parameters
    ----------
    values : np.ndarray
        Integers ``>= 1`` (any integer dtype, values up to ``2**64 - 1``).

    Returns
    -------
    np.ndarray
        int64 array of the same length.
    """
    return _omega_lengths_kernel(_as_positive_uint64(values))


def elias_omega_encode(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Elias omega codewords of ``values``, back to back.

    Parameters
    ----------
    values : np.ndarray
        Integers ``>= 1``.

    Returns
    -------
    (np.ndarray, int)
        uint8 bytes (MSB first, the last byte zero-padded) and the number of code bits, which
        equals ``elias_omega_lengths(values).sum()``.
    """
    out, total = _omega_encode_kernel(_as_positive_uint64(values))
    return out, int(total)


def elias_omega_decode(data, count: int, max_value: int, total_bits: int | None = None) -> np.ndarray:
    """Decode ``count`` Elias omega codewords.

    Parameters
    ----------
    data : bytes, memoryview or uint8 np.ndarray
        The stream from :func:`elias_omega_encode` (untrusted).
    count : int
        Number of values.
    max_value : int
        Largest allowed value (at most ``2**64 - 1``).
    total_bits : int, optional
        If given, the stream must hold exactly this many code bits.

    Returns
    -------
    np.ndarray
        uint64 values.

    Raises
    ------
    PayloadError
        If the stream ends early, holds a malformed codeword or a value beyond ``max_value``,
        or has trailing bytes or nonzero padding.
    """
    what = "Elias omega stream"
    buf = _as_bytes(data)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 1 <= max_value <= 2**64 - 1:
        raise ValueError(f"max_value must be in 1..2**64-1, got {max_value}")
    end = _end_bit(buf, total_bits, what)
    if count > end:  # every codeword takes at least one bit; check before allocating
        raise PayloadError(f"{what} of {buf.size} bytes cannot hold {count} values")
    out = np.empty(count, np.uint64)
    status, index, pos = _omega_decode_kernel(_padded(buf), end, out, np.uint64(max_value))
    if status != _OK:
        _raise(status, what, f"value {index} of {count}")
    if total_bits is not None and pos != total_bits:
        raise PayloadError(f"{what} declares {total_bits} bits but its {count} values take {pos}")
    _check_tail(buf, pos, False, what)
    return out


def elias_omega_decode_prefix(data, count: int, max_value: int) -> tuple[np.ndarray, int]:
    """Decode ``count`` codewords from the start of ``data``, which may go on with other sections.

    Returns
    -------
    (np.ndarray, int)
        uint64 values and the number of bits they took; the bytes after
        ``ceil(bits / 8)`` belong to the caller.

    Raises
    ------
    PayloadError
        If ``data`` ends early or holds a malformed codeword or a value beyond ``max_value``.
    """
    what = "Elias omega section"
    buf = _as_bytes(data)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 1 <= max_value <= 2**64 - 1:
        raise ValueError(f"max_value must be in 1..2**64-1, got {max_value}")
    end = buf.size * 8
    if count > end:
        raise PayloadError(f"{what} of {buf.size} bytes cannot hold {count} values")
    out = np.empty(count, np.uint64)
    status, index, pos = _omega_decode_kernel(_padded(buf), end, out, np.uint64(max_value))
    if status != _OK:
        _raise(status, what, f"value {index} of {count}")
    return out, int(pos)


def code_s_encode(levels: np.ndarray) -> tuple[np.ndarray, int]:
    """QSGD's Code_s of a signed integer level vector (sparse regime).

    Parameters
    ----------
    levels : np.ndarray
        Signed integer levels (any integer dtype).

    Returns
    -------
    (np.ndarray, int)
        uint8 bytes (last byte padded with 1 bits) and the number of code bits:
        ``sum(|omega(gap)| + 1 + |omega(|level|)|)`` over the nonzero levels.
    """
    out, total = _sparse_encode_kernel(_as_levels(levels))
    return out, int(total)


def code_s_decode(data, n: int, s: int, total_bits: int | None = None) -> np.ndarray:
    """Decode a Code_s stream into ``n`` signed levels.

    Parameters
    ----------
    data : bytes, memoryview or uint8 np.ndarray
        The stream from :func:`code_s_encode` (untrusted).
    n : int
        Vector length.
    s : int
        Largest allowed ``|level|``.
    total_bits : int, optional
        Number of code bits, if the caller stored it. The stream is self-delimiting (1-bit
        padding), so it may be omitted.

    Returns
    -------
    np.ndarray
        Levels of length ``n``: int8 if ``s <= 127``, int16 if ``s <= 32767``, else int32.

    Raises
    ------
    PayloadError
        If a gap points past ``n``, ``|level| > s``, or the stream is truncated, malformed,
        has trailing bytes or bad padding.
    """
    what = "Code_s stream"
    buf = _as_bytes(data)
    dtype = _level_dtype(s)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    end = _end_bit(buf, total_bits, what)
    out = np.zeros(n, _kernel_dtype(dtype))
    status, pos = _sparse_decode_kernel(_padded(buf), end, total_bits is None, out, np.uint64(s))
    if status != _OK:
        _raise(status, what, f"at bit {pos} of {end}")
    _check_tail(buf, pos, True, what)
    return out.astype(dtype, copy=False)


def code_s_dense_encode(levels: np.ndarray) -> tuple[np.ndarray, int]:
    """QSGD's Code'_s (dense regime): ``omega(|level| + 1)`` per coordinate, sign bit if nonzero.

    Returns
    -------
    (np.ndarray, int)
        uint8 bytes (last byte zero-padded) and the number of code bits.
    """
    out, total = _dense_encode_kernel(_as_levels(levels))
    return out, int(total)


def code_s_dense_decode(data, n: int, s: int, total_bits: int | None = None) -> np.ndarray:
    """Decode a Code'_s stream into ``n`` signed levels (dtype as in :func:`code_s_decode`).

    Raises
    ------
    PayloadError
        If ``|level| > s``, or the stream is truncated, malformed, has trailing bytes or
        nonzero padding, or does not hold exactly ``total_bits`` bits when that is given.
    """
    what = "Code'_s stream"
    buf = _as_bytes(data)
    dtype = _level_dtype(s)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    end = _end_bit(buf, total_bits, what)
    if n > end:  # every coordinate takes at least one bit
        raise PayloadError(f"{what} of {buf.size} bytes cannot hold {n} levels")
    out = np.empty(n, _kernel_dtype(dtype))
    status, index, pos = _dense_decode_kernel(_padded(buf), end, out, np.uint64(s))
    if status != _OK:
        _raise(status, what, f"level {index} of {n}")
    if total_bits is not None and pos != total_bits:
        raise PayloadError(f"{what} declares {total_bits} bits but its {n} levels take {pos}")
    _check_tail(buf, pos, False, what)
    return out.astype(dtype, copy=False)
