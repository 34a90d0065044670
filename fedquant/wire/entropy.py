"""Entropy coding of small-alphabet indices (rANS via ``constriction``) with an exact count table.

Wire format of :func:`entropy_encode` (``n`` symbols; ``n`` itself is the caller's to store):

- ``n == 0``: no bytes at all.
- A table, as an Elias omega stream (:mod:`fedquant.wire.elias`, zero-padded to a byte):
  ``omega(k)`` with ``k`` the number of distinct symbols present, then for each present symbol,
  in increasing order, ``omega(gap)`` (1-based, the first gap is ``symbol + 1``) and
  ``omega(count)``. Absent symbols take no table space and get no probability mass.
- If ``k >= 2``: the compressed words of constriction's ``AnsCoder`` (rANS, 32-bit words,
  24-bit probability precision) as little-endian uint32, coding each symbol's rank among the
  present symbols with ``Categorical(counts / n, perfect=False)``. Both ends build that model
  from the same integer counts, so they agree bit for bit. With ``k == 1`` nothing follows the
  table: the data is that one symbol repeated.

Size: the rANS part is within a few dozen bits of ``n * H`` (the model is the exact empirical
distribution, quantized to 24 bits); the table costs about ``k * (|omega(gap)| + |omega(count)|)``
bits, at most a few bytes per present symbol.

Decoding checks the table (symbols below ``num_symbols``, counts summing to ``n``), rejects a
body too short for the information the table implies before decoding anything, and afterwards
checks that the coder consumed every word exactly and that the decoded symbols have exactly the
declared counts. Anything else raises :class:`~fedquant.errors.PayloadError`.
"""

from __future__ import annotations

import constriction
import numpy as np

from fedquant.errors import PayloadError
from fedquant.wire.elias import elias_omega_decode_prefix, elias_omega_encode

__all__ = ["empirical_entropy_bits", "entropy_decode", "entropy_encode"]

MAX_SYMBOLS = 1 << 16
_MAX_CODEWORD_BITS = 76  # Elias omega codeword of 2**64 - 1


def _check_num_symbols(num_symbols: int) -> None:
    if not 1 <= num_symbols <= MAX_SYMBOLS:
        raise ValueError(f"num_symbols must be in 1..{MAX_SYMBOLS}, got {num_symbols}")


def _symbol_dtype(num_symbols: int) -> np.dtype:
    return np.dtype(np.uint8 if num_symbols <= 256 else np.uint16)


def _counts(symbols: np.ndarray, num_symbols: int) -> np.ndarray:
    s = np.asarray(symbols).reshape(-1)
    if not np.issubdtype(s.dtype, np.integer):
        raise ValueError(f"symbols must be integers, got dtype {s.dtype}")
    if s.size and (int(s.min()) < 0 or int(s.max()) >= num_symbols):
        raise ValueError(f"symbols must lie in 0..{num_symbols - 1}, got {int(s.min())}..{int(s.max())}")
    if s.dtype.itemsize > 4:
        s = s.astype(np.int32)
    return np.bincount(s, minlength=num_symbols)


def _model(counts: np.ndarray, n: int):
    return constriction.stream.model.Categorical(counts.astype(np.float64) / n, perfect=False)


def empirical_entropy_bits(symbols: np.ndarray, num_symbols: int) -> float:
    """``n * H(p)`` in bits, where ``p`` is the empirical distribution of ``symbols``.

    Parameters
    ----------
    symbols : np.ndarray
        Integers in ``0 .. num_symbols - 1``.
    num_symbols : int
        Alphabet size.
    """
    _check_num_symbols(num_symbols)
    counts = _counts(symbols, num_symbols)
    c = counts[counts > 0].astype(np.float64)
    n = c.sum()
    return float(-(c * np.log2(c / n)).sum()) if n else 0.0


def entropy_encode(symbols: np.ndarray, num_symbols: int) -> np.ndarray:
    """Entropy-code ``symbols`` with their own empirical distribution.

    Parameters
    ----------
    symbols : np.ndarray
        Integers in ``0 .. num_symbols - 1`` (any integer dtype, any shape; flattened).
    num_symbols : int
        Alphabet size, 1 to 65536.

    Returns
    -------
    np.ndarray
        uint8 bytes: the count table followed by the rANS words (see the module docstring).
    """
    _check_num_symbols(num_symbols)
    symbols = np.asarray(symbols).reshape(-1)
    counts = _counts(symbols, num_symbols)
    n = int(symbols.size)
    if n == 0:
        return np.zeros(0, np.uint8)
    present = np.flatnonzero(counts)
    gaps = np.diff(present, prepend=-1)
    table = np.empty(1 + 2 * present.size, np.int64)
    table[0] = present.size
    table[1::2] = gaps
    table[2::2] = counts[present]
    header, _ = elias_omega_encode(table)
    if present.size == 1:
        return header
    rank = np.zeros(num_symbols, np.int32)
    rank[present] = np.arange(present.size, dtype=np.int32)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(rank[symbols], _model(counts[present], n))
    words = coder.get_compressed().astype("<u4", copy=False)
    return np.concatenate([header, words.view(np.uint8)])


def entropy_decode(data, count: int, num_symbols: int) -> np.ndarray:
    """Inverse of :func:`entropy_encode` for untrusted ``data``.

    Parameters
    ----------
    data : bytes, memoryview or uint8 np.ndarray
        The coded bytes.
    count : int
        Number of symbols the caller expects (it allocates at most this many).
    num_symbols : int
        Alphabet size the caller expects.

    Returns
    -------
    np.ndarray
        ``count`` symbols, uint8 if ``num_symbols <= 256`` else uint16.

    Raises
    ------
    PayloadError
        If the table is malformed or inconsistent with ``count`` and ``num_symbols``, the body
        is truncated or extended, or the decoded symbols do not match the table's counts.
    """
    _check_num_symbols(num_symbols)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    buf = data.reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if buf.dtype != np.uint8:
        raise ValueError(f"coded data must be uint8 bytes, got dtype {buf.dtype}")
    dtype = _symbol_dtype(num_symbols)
    if count == 0:
        if buf.size:
            raise PayloadError(f"entropy-coded section of 0 symbols holds {buf.size} bytes")
        return np.zeros(0, dtype)

    # The table: k, then k (gap, count) pairs. Bound k before decoding the pairs.
    max_k = min(num_symbols, count)
    limit = ((1 + 2 * max_k) * _MAX_CODEWORD_BITS + 7) // 8
    head = buf[:limit]
    (k,), _ = elias_omega_decode_prefix(head, 1, max(max_k, 1))
    k = int(k)
    pairs, nbits = elias_omega_decode_prefix(head, 1 + 2 * k, max(num_symbols, count))
    gaps, counts = pairs[1::2], pairs[2::2]
    symbols = np.cumsum(gaps) - 1  # gaps >= 1, so strictly increasing
    if int(symbols[-1]) >= num_symbols:
        raise PayloadError(f"entropy table names symbol {int(symbols[-1])}, the alphabet has {num_symbols}")
    if int(counts.sum()) != count:
        raise PayloadError(f"entropy table counts sum to {int(counts.sum())}, expected {count} symbols")
    rest = buf[(nbits + 7) // 8 :]
    if nbits % 8 and int(buf[nbits // 8]) & ((1 << (8 - nbits % 8)) - 1):
        raise PayloadError("entropy table has nonzero padding bits")
    if k == 1:
        if rest.size:
            raise PayloadError(f"entropy-coded section of one distinct symbol has {rest.size} trailing bytes")
        return np.full(count, symbols[0], dtype)

    if rest.size % 4 or rest.size == 0:
        raise PayloadError(f"rANS section holds {rest.size} bytes, not a positive multiple of 4")
    # The coded size cannot be below the information content n * H of the declared counts
    # (Gibbs: the quantized model's cross-entropy is at least H), less the coder's initial state.
    c = counts.astype(np.float64)
    info_bits = float(-(c * np.log2(c / count)).sum())
    if rest.size * 8 + 64 < info_bits * (1 - 1e-9):
        raise PayloadError(
            f"rANS section of {rest.size} bytes is too short for {count} symbols of {info_bits / count:.3f} bits each"
        )
    words = rest.view("<u4").astype(np.uint32)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        ranks = coder.decode(_model(counts, count), count)
        consumed = coder.is_empty()
    except (ValueError, RuntimeError, OverflowError) as e:
        raise PayloadError(f"rANS section is corrupt: {e}") from e
    if not consumed:
        raise PayloadError("rANS section has data left after the last symbol")
    if not np.array_equal(np.bincount(ranks, minlength=k), counts):
        raise PayloadError("decoded symbols do not match the entropy table's counts")
    return symbols.astype(dtype)[ranks]
