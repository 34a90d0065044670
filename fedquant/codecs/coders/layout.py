"""The one body layout of every quantizer: its side fields in order, then its symbol stream.

::

    side field 1   count_1 items of dtype_1 (little-endian), e.g. float32 bucket scales
    ...
    side field k
    symbols        the stream of the ``coding`` parameter (:mod:`fedquant.codecs.coders.symbols`),
                   absent for a quantizer without symbols, or the quantizer's own symbol section
                   (``Quantizer.own_stream``)

Reading checks every size before it allocates, and the side data with the quantizer's own
:meth:`~fedquant.codecs.quantizers.base.Quantizer.check_side`.
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.coders.symbols import fixed_width, read_packed, read_symbols, write_symbols
from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.quantizers.base import Quantizer
from fedquant.wire.bitpack import packed_size
from fedquant.wire.body import BodyReader, BodyWriter

#: Variable-length symbol streams never need more than this per symbol (Elias: <= 33 bits for
#: QSGD's largest alphabet; rANS: <= 24 bits at its precision) ...
VARIABLE_BYTES_PER_SYMBOL = 8
#: ... plus this per distinct symbol (the entropy coder's count table, <= 2 x 76 bits) ...
TABLE_BYTES_PER_SYMBOL = 24
#: ... plus this much (variant byte, final rANS state, padding).
VARIABLE_SLACK_BYTES = 4096


def encode_body(quantizer: Quantizer, flat: torch.Tensor, seed: int, numel: int | None = None) -> BodyWriter:
    """Quantize ``flat`` and lay out the body (``numel``: the values quantized, when a quantizer bound to
    a rotation is given the tensor before it; default ``flat.numel()``)."""
    coding = getattr(quantizer, "coding", None)
    k = quantizer.num_symbols()
    width = fixed_width(k) if coding == "fixed" and k else None
    q = quantizer.quantize(flat, seed, width)
    out = BodyWriter()
    numel = flat.numel() if numel is None else numel
    for field, array in zip(quantizer.side_fields(numel), q.side, strict=True):
        out.add_array(array, field.dtype)
    if q.stream is not None:
        for part in q.stream:
            out.add(part)
        return out
    if not k:
        return out
    if q.packed is not None:
        if width is None:
            raise RuntimeError(f"{quantizer.name} returned packed symbols for coding {coding!r}")
        out.add(q.packed)
    else:
        write_symbols(out, q.symbols, k, coding, q.counts)
    return out


def max_body_bytes(quantizer: Quantizer, numel: int) -> int:
    """The most bytes a valid body of ``numel`` elements can hold (exact for fixed-width coding).

    A payload that declares more is rejected before its checksum is computed, so a large
    CRC-valid payload for a small tensor costs no more than a small one.
    """
    fields = quantizer.side_fields(numel)
    side = sum(int(f.count) * np.dtype(f.dtype).itemsize for f in fields)
    if quantizer.own_stream:
        return side + quantizer.max_stream_bytes(numel)
    k = quantizer.num_symbols()
    if not k:
        return side
    if quantizer.coding == "fixed":
        return side + packed_size(numel, fixed_width(k))
    return side + max_entropy_bytes(numel, k)


def max_entropy_bytes(count: int, num_symbols: int, sections: int = 1) -> int:
    """The most bytes ``sections`` entropy-coded sections holding ``count`` symbols in all can take."""
    tabled = min(num_symbols * sections, count)  # a section's table names each of its symbols at most once
    return VARIABLE_BYTES_PER_SYMBOL * count + TABLE_BYTES_PER_SYMBOL * tabled + VARIABLE_SLACK_BYTES * sections


def read_side(quantizer: Quantizer, body: BodyReader, numel: int) -> list[np.ndarray]:
    """The side fields of a body, checked by the quantizer."""
    side = [body.take_array(f.dtype, f.count, f.what) for f in quantizer.side_fields(numel)]
    quantizer.check_side(side)
    return side


def decode_body(quantizer: Quantizer, body: BodyReader, numel: int, seed: int) -> torch.Tensor:
    """Values (1-D float32) of a body laid out by :func:`encode_body`."""
    side = read_side(quantizer, body, numel)
    if quantizer.own_stream:
        return quantizer.read_stream(side, body, numel, seed)
    k = quantizer.num_symbols()
    if not k:
        return quantizer.dequantize(side, np.empty(0, np.uint8), numel, seed)
    coding = quantizer.coding
    if coding == "fixed":
        packed = read_packed(body, numel, k, quantizer.name)
        return quantizer.dequantize_packed(side, packed, fixed_width(k), numel, seed)
    symbols = read_symbols(body, numel, k, coding, quantizer.name)
    return quantizer.dequantize(side, symbols, numel, seed)


def defers_body(quantizer: Quantizer) -> bool:
    """Whether :func:`defer_body` can defer this quantizer's decoded values (fixed-width symbols,
    a quantizer that defers them)."""
    return (
        not quantizer.own_stream
        and quantizer.num_symbols() > 0
        and quantizer.coding == "fixed"
        and quantizer.defers_packed()
    )


def defer_body(quantizer: Quantizer, body: BodyReader, numel: int, seed: int) -> DeferredValues:
    """What :func:`decode_body` decodes, deferred (a quantizer for which :func:`defers_body` holds)."""
    side = read_side(quantizer, body, numel)
    k = quantizer.num_symbols()
    packed = read_packed(body, numel, k, quantizer.name)
    return quantizer.defer_packed(side, packed, fixed_width(k), numel, seed)
