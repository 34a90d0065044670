"""Elias omega lookup tables, built once in Python from the recursive definition.

Shared by the compiled coder (:mod:`fedquant.wire.elias`, where numba freezes them into the kernels)
and its NumPy twin (:mod:`fedquant.wire.elias_twin`), which import this module and not each other.
"""

from __future__ import annotations

import numpy as np


def _omega_bits_reference(k: int) -> str:
    code = "0"
    while k > 1:
        b = bin(k)[2:]
        code = b + code
        k = len(b) - 1
    return code


def _prefix_tables() -> tuple[np.ndarray, np.ndarray]:
    """For bit length L >= 2: the codeword starts with omega(L - 1) minus its final 0."""
    plen = np.zeros(65, np.int64)
    pcode = np.zeros(65, np.uint64)
    for length in range(2, 65):
        bits = _omega_bits_reference(length - 1)[:-1]
        plen[length] = len(bits)
        pcode[length] = int(bits, 2) if bits else 0
    return plen, pcode


_SHORT = 4096  # values below this are encoded from a table
_PEEK = 12  # the decoder resolves codewords of up to this many bits with one table lookup


def _short_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    enc_code = np.zeros(_SHORT, np.uint64)
    enc_len = np.zeros(_SHORT, np.int64)
    dec_val = np.zeros(1 << _PEEK, np.uint64)
    dec_len = np.zeros(1 << _PEEK, np.int64)  # 0: the codeword is longer than _PEEK bits
    for k in range(1, _SHORT):
        bits = _omega_bits_reference(k)
        enc_code[k], enc_len[k] = int(bits, 2), len(bits)
        if len(bits) <= _PEEK:
            lo = int(bits, 2) << (_PEEK - len(bits))
            hi = lo + (1 << (_PEEK - len(bits)))
            dec_val[lo:hi], dec_len[lo:hi] = k, len(bits)
    return enc_code, enc_len, dec_val, dec_len


def _fill(values: np.ndarray, widths: np.ndarray, bits: str, value: int) -> None:
    """Enter a code of at most _PEEK bits into a lookup table indexed by the next _PEEK bits."""
    if len(bits) <= _PEEK:
        lo = int(bits, 2) << (_PEEK - len(bits))
        hi = lo + (1 << (_PEEK - len(bits)))
        values[lo:hi], widths[lo:hi] = value, len(bits)


def _signed_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lookup tables for a whole signed level (width 0: not in the table).

    Code'_s: omega(|l| + 1) then the sign bit if l != 0.  Code_s: sign bit then omega(|l|).
    """
    dense_val, dense_len = np.zeros(1 << _PEEK, np.int64), np.zeros(1 << _PEEK, np.int64)
    sparse_val, sparse_len = np.zeros(1 << _PEEK, np.int64), np.zeros(1 << _PEEK, np.int64)
    _fill(dense_val, dense_len, "0", 0)
    for mag in range(1, 1 << _PEEK):
        code = _omega_bits_reference(mag)
        if len(code) >= _PEEK:
            break  # codeword lengths never decrease
        _fill(dense_val, dense_len, _omega_bits_reference(mag + 1) + "0", mag)
        _fill(dense_val, dense_len, _omega_bits_reference(mag + 1) + "1", -mag)
        _fill(sparse_val, sparse_len, "0" + code, mag)
        _fill(sparse_val, sparse_len, "1" + code, -mag)
    return dense_val, dense_len, sparse_val, sparse_len


_PLEN, _PCODE = _prefix_tables()
_ENC_CODE, _ENC_LEN, _DEC_VAL, _DEC_LEN = _short_tables()
_DENSE_VAL, _DENSE_LEN, _SIGNED_VAL, _SIGNED_LEN = _signed_tables()
