"""The symbol coder stage: a stream of symbols ``0 .. K - 1`` as bytes, for every ``coding``.

* ``"fixed"``: each symbol at ``bit_width(K)`` bits, LSB first (:mod:`fedquant.wire.bitpack`);
  the stream is exactly ``packed_size(n, width)`` bytes and its padding bits must be zero.
* ``"entropy"``: :func:`fedquant.wire.entropy.entropy_encode` over the alphabet of ``K``
  symbols (exact count table + rANS), to the end of the body.
* ``"elias"`` (symmetric alphabets ``K = 2h + 1`` only, symbols ``q + h``): one byte naming the
  variant, then QSGD's Code_s (0: Elias gaps between nonzeros, sign, Elias level) or its dense
  variant Code'_s (1: Elias(|q| + 1) per coordinate, sign for nonzeros), whichever is shorter
  for this tensor, to the end of the body.

Decoding returns the symbols checked below ``K`` (or, for ``"fixed"``, the packed bytes for the
quantizer's fused decoder, padding checked).
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from fedquant.errors import PayloadError
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size
from fedquant.wire.body import BodyReader, BodyWriter

ELIAS_SPARSE = 0
ELIAS_DENSE = 1
#: rANS costs about this many bits per symbol beyond ``log2`` of the present symbols, at most: the
#: 64-bit coder's state grows by at most ``log2(1 + 2**-7)`` = 0.0113 bits over the ideal per step,
#: the 32-bit coder's (16-bit words, 12-bit models) by ``3e-5`` bits on average (its worst single
#: step, ``log2(1 + 2**-3)``, needs a state at the bottom of its range), and the rounded
#: frequencies lose a few ``1e-3`` bits more (checked in ``tests`` over skewed counts).
RANS_EXCESS_BITS = 0.02
#: Bits of the rANS header and final states: two header bytes and 32 lanes of 32-bit states
#: (coded streams from ``2**17`` bits; the 64-bit coder's 8 lanes take 512), else one 64-bit state.
RANS_LANE_BITS, RANS_ONE_LANE_BITS = 16 + 32 * 32, 16 + 64


def fixed_width(num_symbols: int) -> int:
    """Bits per symbol with ``coding="fixed"``."""
    return bit_width(num_symbols)


def omega_bits(value: int) -> int:
    """Length of the Elias omega codeword of ``value >= 1``."""
    bits = 1
    while value > 1:
        width = value.bit_length()
        bits += width
        value = width - 1
    return bits


def omega_bits_bound(value: np.ndarray | float) -> np.ndarray:
    """``log2 v + 3 log2(log2 v + 1) + 1``: a concave upper bound of :func:`omega_bits` for ``v >= 1``.

    Concave, so by Jensen ``k`` codewords whose values sum to ``S`` take at most
    ``k * omega_bits_bound(S / k)`` bits.
    """
    lg = np.log2(value)
    return lg + 3 * np.log2(lg + 1) + 1


@functools.lru_cache(maxsize=4096)
def _entropy_stream_bound(count: int, num_symbols: int) -> int:
    most = min(num_symbols, count)
    k = np.arange(1, most + 1, dtype=np.float64)  # symbols present; the bound is the worst of them
    # The table: omega(k), then per present symbol its gap (they sum to at most num_symbols) and its count (sum: count).
    table_bits = omega_bits(most) + k * (omega_bits_bound(num_symbols / k) + omega_bits_bound(count / k))
    coded = count * (np.log2(k) + RANS_EXCESS_BITS)
    rans_bits = np.where(k >= 2, coded + np.where(coded >= 1 << 17, RANS_LANE_BITS, RANS_ONE_LANE_BITS), 0.0)
    return int((np.ceil(table_bits / 8) + 4 * np.ceil(rans_bits / 32)).max())


def stream_bytes(count: int, num_symbols: int, coding: str) -> int:
    """Bytes of a stream of ``count`` symbols below ``num_symbols``: exact for ``"fixed"``, else an upper bound.

    * ``fixed``: ``packed_size(count, width)``, whatever the symbols.
    * ``elias``: the variant byte and the dense code with every level at ``+-h`` (the encoder
      sends the shorter of the two variants, and larger levels never code shorter).
    * ``entropy``: over the number ``k`` of symbols present, the worst of the count table (gaps
      and counts bounded by Jensen's inequality on :func:`omega_bits_bound`) plus rANS at
      ``log2 k + RANS_EXCESS_BITS`` bits per symbol, its header and final states. Symbols far from
      uniform code well below it. An estimate rather than a bound for more than ``2**24``
      symbols with some of them rarer than ``2**-24`` (the frequency quantization may then cost
      more).
    """
    if coding == "fixed":
        return packed_size(count, fixed_width(num_symbols))
    if coding == "elias":
        half = num_symbols // 2
        return 1 + -(-count * (omega_bits(half + 1) + 1) // 8)
    if coding == "entropy":
        return _entropy_stream_bound(count, num_symbols) if count else 0
    raise ValueError(f"unknown coding {coding!r}")


def _signed(symbols: np.ndarray, half: int) -> np.ndarray:
    dtype = np.int8 if half < 128 else (np.int16 if half < 32768 else np.int32)
    return (symbols.astype(np.int32) - half).astype(dtype)


@functools.cache
def coder_takes_counts() -> bool:
    """Whether :func:`fedquant.wire.entropy.entropy_encode` accepts a histogram (``counts=``) counted by the caller."""
    from fedquant.wire.entropy import entropy_encode

    return "counts" in inspect.signature(entropy_encode).parameters


def write_symbols(
    out: BodyWriter, symbols: np.ndarray, num_symbols: int, coding: str, counts: np.ndarray | None = None
) -> None:
    """Append ``symbols`` (unpacked, each below ``num_symbols``) coded with ``coding``.

    ``counts``, the symbols' histogram if the quantizer counted them, spares the entropy coder
    its own counting pass (when it takes one, :func:`coder_takes_counts`).
    """
    if coding == "fixed":
        out.add(pack_bits(symbols, fixed_width(num_symbols)))
    elif coding == "entropy":
        from fedquant.wire.entropy import entropy_encode

        extra = {"counts": counts} if counts is not None and coder_takes_counts() else {}
        out.add(np.asarray(entropy_encode(symbols, num_symbols, **extra), dtype=np.uint8))
    elif coding == "elias":
        from fedquant.wire.elias import code_s_dense_encode, code_s_encode

        levels = _signed(symbols, num_symbols // 2)
        sparse, sparse_bits = code_s_encode(levels)
        dense, dense_bits = code_s_dense_encode(levels)
        if sparse_bits <= dense_bits:
            out.add(np.array([ELIAS_SPARSE], np.uint8))
            out.add(np.asarray(sparse, np.uint8))
        else:
            out.add(np.array([ELIAS_DENSE], np.uint8))
            out.add(np.asarray(dense, np.uint8))
    else:
        raise ValueError(f"unknown coding {coding!r}")


def read_packed(body: BodyReader, count: int, num_symbols: int, codec: str) -> np.ndarray:
    """The fixed-width stream of ``count`` symbols (uint8 view), its padding bits checked zero."""
    width = fixed_width(num_symbols)
    packed = np.frombuffer(body.take(packed_size(count, width), "packed symbols"), np.uint8)
    used = (count * width) % 8
    if used and packed.size and int(packed[-1]) >> used:
        raise PayloadError(f"{codec} payload has nonzero padding bits after the last symbol")
    return packed


def read_symbols(body: BodyReader, count: int, num_symbols: int, coding: str, codec: str) -> np.ndarray:
    """``count`` symbols coded with ``"entropy"`` or ``"elias"`` (rest of ``body``), each below ``num_symbols``."""
    if coding == "entropy":
        from fedquant.wire.entropy import entropy_decode

        data = np.frombuffer(body.take_rest(), np.uint8)
        symbols = np.asarray(entropy_decode(data, count, num_symbols))
        if symbols.size != count:
            raise PayloadError(f"{codec} entropy-coded symbols decode to {symbols.size}, expected {count}")
        if symbols.size and int(symbols.max()) >= num_symbols:
            raise PayloadError(f"{codec} payload holds symbols beyond the {num_symbols} of its alphabet")
        return symbols
    if coding == "elias":
        from fedquant.wire.elias import code_s_decode, code_s_dense_decode

        half = num_symbols // 2
        variant = int(np.frombuffer(body.take(1, "Elias variant"), np.uint8)[0])
        data = np.frombuffer(body.take_rest(), np.uint8)
        if variant == ELIAS_SPARSE:
            levels = code_s_decode(data, count, half)
        elif variant == ELIAS_DENSE:
            levels = code_s_dense_decode(data, count, half)
        else:
            raise PayloadError(f"{codec} payload names unknown Elias variant {variant}")
        levels = np.asarray(levels)
        if levels.size != count:
            raise PayloadError(f"{codec} Elias-coded symbols decode to {levels.size} levels, expected {count}")
        if levels.size and int(np.abs(levels.astype(np.int64)).max()) > half:
            raise PayloadError(f"{codec} payload holds levels beyond +-{half}")
        return (levels.astype(np.int32) + half).astype(np.uint16)
    raise ValueError(f"unknown coding {coding!r}")
