"""Entropy coding of small-alphabet indices: an exact count table and a numba rANS coder.

Wire format of :func:`entropy_encode` (``n`` symbols; ``n`` itself is the caller's to store):

- ``n == 0``: no bytes at all.
- A table, as an Elias omega stream (:mod:`fedquant.wire.elias`, zero-padded to a byte):
  ``omega(k)`` with ``k`` the number of distinct symbols present, then for each present symbol,
  in increasing order, ``omega(gap)`` (1-based, the first gap is ``symbol + 1``) and
  ``omega(count)``. Absent symbols take no table space and get no probability mass.
- If ``k >= 2``: the rANS words, little-endian uint32. Both ends turn the integer counts into
  the same frequencies ``f`` (integers >= 1 summing to ``2**24``, :func:`quantize_counts`) and
  code each symbol's rank among the present symbols. The coder is rANS with a 64-bit state in
  ``[2**31, 2**63)`` and 32-bit renormalization (Duda 2013; the layout of Giesen's ``rans64``):
  encoding runs backwards from the state ``2**31``, emits a word when the state would leave its
  range, and ends with the final state as two words (high, low) at the front. With ``k == 1``
  nothing follows the table: the data is that one symbol repeated.

Size: the rANS words stay within a few dozen bits plus ``n * KL(counts || f)`` (tiny at 24-bit
precision) of ``n * H``; the table costs about ``k * (|omega(gap)| + |omega(count)|)`` bits.

Why not ``constriction`` (the first implementation used its ``AnsCoder``): its decoder ran at
12-50 M symbols/s here, against 50-115 M/s for this kernel (encode 60-110 vs 130-190 M/s), and
its model quantization of float probabilities is library-internal, so the bytes on the wire
would depend on the installed version. Here the format is fully specified by integer arithmetic.

Decoding checks the table (symbols below ``num_symbols``, counts summing to ``n``), rejects a
body too short for the information the table implies before decoding anything, and afterwards
checks that every word was consumed, that the state returned exactly to ``2**31``, and that
the decoded symbols have exactly the declared counts. Anything else raises
:class:`~fedquant.errors.PayloadError`.
"""

from __future__ import annotations

import numba
import numpy as np

from fedquant.errors import PayloadError
from fedquant.wire.elias import elias_omega_decode_prefix, elias_omega_encode

__all__ = ["PRECISION", "empirical_entropy_bits", "entropy_decode", "entropy_encode", "quantize_counts"]

MAX_SYMBOLS = 1 << 16
MAX_COUNT = 1 << 38  # counts * 2**24 must fit in int64
PRECISION = 24  # frequencies are integers summing to 2**PRECISION
_MAX_CODEWORD_BITS = 76  # Elias omega codeword of 2**64 - 1
_TOTAL = 1 << PRECISION
_STATE_LOW = np.uint64(1) << np.uint64(31)  # the state lies in [2**31, 2**63)
_BUCKET_BITS = 16  # the decoder finds a slot's symbol from a table of up to 2**16 entries of the slot's top bits


def quantize_counts(counts: np.ndarray, n: int) -> np.ndarray:
    """Integer frequencies ``>= 1`` summing to ``2**PRECISION``, about ``counts * 2**PRECISION / n``.

    Deterministic integer arithmetic, so encoder and decoder agree bit for bit. Requires
    ``1 <= len(counts) <= 2**16``, every count ``>= 1`` and ``sum(counts) == n <= 2**38``.
    """
    freq = np.maximum(1, (counts.astype(np.int64) * _TOTAL) // n)
    excess = int(freq.sum()) - _TOTAL
    if excess > 0:  # the bumps to 1 overshot: take back from the largest frequencies first
        order = np.argsort(-freq, kind="stable")
        spare = freq[order] - 1
        before = np.cumsum(spare) - spare
        freq[order] -= np.minimum(spare, np.maximum(0, excess - before))
    elif excess < 0:  # the floors undershot: the most frequent symbol takes the rest
        freq[np.argmax(freq)] -= excess
    return freq


def _cumulative(freq: np.ndarray) -> np.ndarray:
    cum = np.zeros(freq.size + 1, np.int64)
    np.cumsum(freq, out=cum[1:])
    return cum


@numba.njit(cache=True, nogil=True)
def _rans_encode_kernel(symbols, rank, freq, cum):
    n = symbols.size
    # Each symbol adds at most PRECISION + 0.02 bits to the state; 25 bits per symbol bound the output.
    cap = (n * 25) // 32 + 16
    out = np.empty(cap, np.uint32)
    wp = cap
    x = _STATE_LOW
    for i in range(n - 1, -1, -1):
        r = rank[symbols[i]]
        f = np.uint64(freq[r])
        if x >= (f << np.uint64(63 - PRECISION)):
            wp -= 1
            out[wp] = np.uint32(x & np.uint64(0xFFFFFFFF))
            x >>= np.uint64(32)
        x = ((x // f) << np.uint64(PRECISION)) + (x % f) + np.uint64(cum[r])
    wp -= 2
    out[wp] = np.uint32(x >> np.uint64(32))
    out[wp + 1] = np.uint32(x & np.uint64(0xFFFFFFFF))
    return out[wp:]


@numba.njit(cache=True, nogil=True)
def _rans_decode_kernel(words, out, present, freq, cum, bucket, shift, hist):
    """Fill ``out`` with symbols; returns 0, or 1 bad initial state, 2 words run out,
    3 words left over, 4 final state is not the initial one.

    ``bucket[slot >> shift]`` is the first symbol whose range may hold ``slot``; the caller
    guarantees ``bucket.size == 2**(PRECISION - shift)``, ``words.size >= 2``, ``present``,
    ``freq`` and ``hist`` of ``k`` entries and ``cum`` of ``k + 1`` ending in ``2**PRECISION``.
    """
    m = words.size
    x = (np.uint64(words[0]) << np.uint64(32)) | np.uint64(words[1])
    if x < _STATE_LOW or x >= (np.uint64(1) << np.uint64(63)):
        return 1
    rp = 2
    mask = np.uint64(_TOTAL - 1)
    for i in range(out.size):
        slot = x & mask
        r = bucket[slot >> shift]
        while np.uint64(cum[r + 1]) <= slot:
            r += 1
        x = np.uint64(freq[r]) * (x >> np.uint64(PRECISION)) + slot - np.uint64(cum[r])
        if x < _STATE_LOW:
            if rp >= m:
                return 2
            x = (x << np.uint64(32)) | np.uint64(words[rp])
            rp += 1
        out[i] = present[r]
        hist[r] += 1
    if rp != m:
        return 3
    if x != _STATE_LOW:
        return 4
    return 0


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


def _canonical(symbols: np.ndarray, num_symbols: int) -> np.ndarray:
    """uint8 or uint16 symbols (two kernel specializations)."""
    return np.ascontiguousarray(symbols, dtype=_symbol_dtype(num_symbols))


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
    n = int(symbols.size)
    if n > MAX_COUNT:
        raise ValueError(f"at most {MAX_COUNT} symbols per call, got {n}")
    counts = _counts(symbols, num_symbols)
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
    freq = quantize_counts(counts[present], n)
    words = _rans_encode_kernel(_canonical(symbols, num_symbols), rank, freq, _cumulative(freq))
    return np.concatenate([header, words.astype("<u4", copy=False).view(np.uint8)])


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
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"count must be in 0..{MAX_COUNT}, got {count}")
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

    if rest.size % 4 or rest.size < 8:
        raise PayloadError(f"rANS section holds {rest.size} bytes, not a multiple of 4 of at least 8")
    # A guard against forged tables that declare many symbols over a few bytes. Each rANS step
    # grows the state by at least log2(2**24 / f) + log2(1 - 2**-7) bits (the state is at least
    # 2**7 * f when it is divided by f), so a valid section holds at least
    # n * (cross-entropy - 0.0113) - 31 >= n * H - n / 64 bits (Gibbs: cross-entropy >= H).
    c = counts.astype(np.float64)
    info_bits = float(-(c * np.log2(c / count)).sum())
    if rest.size * 8 < (info_bits - count / 64) * (1 - 1e-9):
        raise PayloadError(
            f"rANS section of {rest.size} bytes is too short for {count} symbols of {info_bits / count:.3f} bits each"
        )
    words = rest.view("<u4").astype(np.uint32)
    freq = quantize_counts(counts.astype(np.int64), count)
    cum = _cumulative(freq)
    # A table of about 2 entries per symbol to decode (2**8 to 2**16): its size follows the
    # work, so a small section does not pay for a 2**16-entry table.
    bits = min(_BUCKET_BITS, max(8, count.bit_length() + 1))
    starts = np.arange(1 << bits, dtype=np.int64) << (PRECISION - bits)
    bucket = np.searchsorted(cum[1:], starts, side="right")
    out = np.empty(count, dtype)
    hist = np.zeros(k, np.int64)
    status = _rans_decode_kernel(
        words, out, symbols.astype(dtype), freq, cum, bucket, np.uint64(PRECISION - bits), hist
    )
    problems = {
        1: "starts from an invalid coder state",
        2: "ends before the last symbol",
        3: "has data left after the last symbol",
        4: "does not return to the coder's initial state",
    }
    if status:
        raise PayloadError(f"rANS section {problems[status]}")
    if not np.array_equal(hist, counts):
        raise PayloadError("decoded symbols do not match the entropy table's counts")
    return out
