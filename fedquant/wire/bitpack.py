"""Packing unsigned integers at an exact bit width (LSB first), and the inverse.

``pack_bits(values, width)`` writes value ``i`` into bits ``[i*width, (i+1)*width)`` of the
output, counting bits from the least significant bit of byte 0. The output has exactly
``ceil(n * width / 8)`` bytes; padding bits in the last byte are zero.
"""

from __future__ import annotations

import numpy as np

from fedquant.errors import PayloadError

MAX_WIDTH = 32  # the summable integer codec of secure aggregation packs Z_{2^b} values up to b = 32


def packed_size(count: int, width: int) -> int:
    """Bytes that ``count`` values of ``width`` bits take."""
    return (count * width + 7) // 8


def bit_width(num_symbols: int) -> int:
    """Bits needed for indices ``0 .. num_symbols - 1`` (at least 1)."""
    if num_symbols < 1:
        raise ValueError(f"need at least one symbol, got {num_symbols}")
    return max(1, (num_symbols - 1).bit_length())


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"bit width must be in 1..{MAX_WIDTH}, got {width}")


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers below ``2**width`` into a uint8 array.

    Parameters
    ----------
    values : np.ndarray
        1-D array of unsigned (or non-negative) integers, each ``< 2**width``.
    width : int
        Bits per value, 1 to 32.

    Returns
    -------
    np.ndarray
        uint8 array of ``packed_size(len(values), width)`` bytes.
    """
    _check_width(width)
    v = np.asarray(values).reshape(-1)
    n = v.size
    if width == 8:
        return v.astype(np.uint8)
    if width == 16:
        return v.astype("<u2").view(np.uint8)
    if width == 32:
        return v.astype("<u4").view(np.uint8)
    if 8 % width == 0:
        per = 8 // width
        pad = (-n) % per
        u = v.astype(np.uint8)
        if pad:
            u = np.concatenate([u, np.zeros(pad, np.uint8)])
        u = u.reshape(-1, per)
        out = u[:, 0].copy()
        for j in range(1, per):
            out |= u[:, j] << np.uint8(j * width)
        return out
    shifts = np.arange(width, dtype=np.uint32)
    bits = ((v.astype(np.uint32)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(data: np.ndarray | memoryview | bytes, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` values of ``width`` bits.

    Raises
    ------
    PayloadError
        If ``data`` does not hold exactly ``packed_size(count, width)`` bytes.
    """
    _check_width(width)
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    need = packed_size(count, width)
    if buf.size != need:
        raise PayloadError(f"packed indices hold {buf.size} bytes, {count} values of {width} bits need {need}")
    if width == 8:
        return buf.copy()
    if width == 16:
        return buf.view("<u2").astype(np.uint16)
    if width == 32:
        return buf.view("<u4").astype(np.uint32)
    if 8 % width == 0:
        per = 8 // width
        mask = np.uint8((1 << width) - 1)
        out = np.empty((buf.size, per), np.uint8)
        for j in range(per):
            out[:, j] = (buf >> np.uint8(j * width)) & mask
        return out.reshape(-1)[:count]
    bits = np.unpackbits(buf, count=count * width, bitorder="little").reshape(count, width)
    weights = (1 << np.arange(width, dtype=np.uint32)).astype(np.uint32)
    out_dtype = np.uint8 if width <= 8 else np.uint16 if width <= 16 else np.uint32
    return (bits.astype(np.uint32) @ weights).astype(out_dtype)
