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

import math

import numpy as np

from fedquant.errors import PayloadError
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size
from fedquant.wire.body import BodyReader, BodyWriter

ELIAS_SPARSE = 0
ELIAS_DENSE = 1
#: rANS costs at most this many bits per symbol beyond ``log2`` of the present symbols: the
#: state grows by at most ``log2(1 + 2**-7)`` = 0.0113 bits over the ideal per step, and the
#: 24-bit frequencies lose a few ``1e-3`` bits more (bounded in ``tests`` over skewed counts).
RANS_EXCESS_BITS = 0.02


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


def stream_bytes(count: int, num_symbols: int, coding: str) -> int:
    """Bytes of a stream of ``count`` symbols below ``num_symbols``: exact for ``"fixed"``, else an upper bound.

    * ``fixed``: ``packed_size(count, width)``, whatever the symbols.
    * ``elias``: the variant byte and the dense code with every level at ``+-h`` (the encoder
      sends the shorter of the two variants, and longer levels never code shorter).
    * ``entropy``: the count table with every symbol present at its widest gap and count, and
      rANS at ``log2(present symbols) + RANS_EXCESS_BITS`` bits per symbol plus its 64-bit final
      state. Symbols far from uniform code well below it. An estimate rather than a bound for
      more than ``2**24`` symbols with some of them rarer than ``2**-24`` (the frequency
      quantization may then cost more).
    """
    if coding == "fixed":
        return packed_size(count, fixed_width(num_symbols))
    if coding == "elias":
        half = num_symbols // 2
        return 1 + -(-count * (omega_bits(half + 1) + 1) // 8)
    if coding == "entropy":
        if count == 0:
            return 0
        present = min(num_symbols, count)
        table_bits = omega_bits(present) + present * (omega_bits(num_symbols) + omega_bits(count))
        if present == 1:
            return -(-table_bits // 8)
        rans_bits = count * (math.log2(present) + RANS_EXCESS_BITS) + 64
        return -(-table_bits // 8) + 4 * math.ceil(rans_bits / 32)
    raise ValueError(f"unknown coding {coding!r}")


def _signed(symbols: np.ndarray, half: int) -> np.ndarray:
    dtype = np.int8 if half < 128 else (np.int16 if half < 32768 else np.int32)
    return (symbols.astype(np.int32) - half).astype(dtype)


def write_symbols(out: BodyWriter, symbols: np.ndarray, num_symbols: int, coding: str) -> None:
    """Append ``symbols`` (unpacked, each below ``num_symbols``) coded with ``coding``."""
    if coding == "fixed":
        out.add(pack_bits(symbols, fixed_width(num_symbols)))
    elif coding == "entropy":
        from fedquant.wire.entropy import entropy_encode

        out.add(np.asarray(entropy_encode(symbols, num_symbols), dtype=np.uint8))
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
