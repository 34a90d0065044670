"""Lossless coding of a stream of quantization symbols (``coding="elias" | "entropy"``).

The symbols are ``q + s`` for signed levels ``q`` in ``[-s, s]`` (what the grid kernels
produce). Layouts, appended to a codec body after its float32 scales:

* ``"entropy"``: the bytes of :func:`fedquant.wire.entropy.entropy_encode` over the alphabet of
  ``2s + 1`` symbols, to the end of the body.
* ``"elias"``: one byte naming the variant, then the stream to the end of the body. Both of
  QSGD's codes are computed and the shorter is sent: ``0`` = Code_s (sparse regime: Elias gaps
  between nonzeros, sign bit, Elias level), ``1`` = Code'_s (dense regime: Elias(|q| + 1) per
  coordinate, sign bit for nonzeros). Code_s wins when most levels are zero (small ``s`` or
  large buckets), Code'_s when they are not (``s`` near ``sqrt(d)`` and beyond).

Fixed-width packing is handled by the grid kernels themselves.
"""

from __future__ import annotations

import importlib

import numpy as np

from fedquant.errors import PayloadError
from fedquant.wire.body import BodyReader, BodyWriter

ELIAS_SPARSE = 0
ELIAS_DENSE = 1
_MODULES = {"elias": "fedquant.wire.elias", "entropy": "fedquant.wire.entropy"}


def coder_available(coding: str) -> bool:
    """Whether the module behind ``coding`` can be imported (``"fixed"`` always can)."""
    if coding == "fixed":
        return True
    try:
        importlib.import_module(_MODULES[coding])
    except ImportError:
        return False
    return True


def _signed(codes: np.ndarray, s: int) -> np.ndarray:
    dtype = np.int8 if s < 128 else (np.int16 if s < 32768 else np.int32)
    return (codes.astype(np.int32) - s).astype(dtype)


def encode_symbols(out: BodyWriter, codes: np.ndarray, s: int, coding: str) -> None:
    """Append the coded symbols ``codes`` (``q + s``, uint16) to ``out``."""
    if coding == "entropy":
        from fedquant.wire.entropy import entropy_encode

        out.add(np.asarray(entropy_encode(codes, 2 * s + 1), dtype=np.uint8))
    elif coding == "elias":
        from fedquant.wire.elias import code_s_dense_encode, code_s_encode

        levels = _signed(codes, s)
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


def decode_symbols(body: BodyReader, n: int, s: int, coding: str, codec: str) -> np.ndarray:
    """Read ``n`` symbols ``q + s`` (uint16) coded with ``coding`` from the rest of ``body``."""
    if coding == "entropy":
        from fedquant.wire.entropy import entropy_decode

        data = np.frombuffer(body.take_rest(), np.uint8)
        codes = np.asarray(entropy_decode(data, n, 2 * s + 1))
        if codes.size != n:
            raise PayloadError(f"{codec} entropy-coded indices decode to {codes.size} symbols, expected {n}")
        if codes.size and int(codes.max()) > 2 * s:
            raise PayloadError(f"{codec} payload holds indices beyond the {2 * s + 1} levels")
        return codes.astype(np.uint16, copy=False)
    if coding == "elias":
        from fedquant.wire.elias import code_s_decode, code_s_dense_decode

        variant = int(np.frombuffer(body.take(1, "Elias variant"), np.uint8)[0])
        data = np.frombuffer(body.take_rest(), np.uint8)
        if variant == ELIAS_SPARSE:
            levels = code_s_decode(data, n, s)
        elif variant == ELIAS_DENSE:
            levels = code_s_dense_decode(data, n, s)
        else:
            raise PayloadError(f"{codec} payload names unknown Elias variant {variant}")
        levels = np.asarray(levels)
        if levels.size != n:
            raise PayloadError(f"{codec} Elias-coded indices decode to {levels.size} levels, expected {n}")
        if levels.size and int(np.abs(levels.astype(np.int64)).max()) > s:
            raise PayloadError(f"{codec} payload holds levels beyond +-{s}")
        return (levels.astype(np.int32) + s).astype(np.uint16)
    raise ValueError(f"unknown coding {coding!r}")
