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
from fedquant.codecs.quantizers.base import Quantizer
from fedquant.wire.body import BodyReader, BodyWriter


def encode_body(quantizer: Quantizer, flat: torch.Tensor, seed: int) -> BodyWriter:
    """Quantize ``flat`` and lay out the body."""
    coding = getattr(quantizer, "coding", None)
    k = quantizer.num_symbols()
    width = fixed_width(k) if coding == "fixed" and k else None
    q = quantizer.quantize(flat, seed, width)
    out = BodyWriter()
    for field, array in zip(quantizer.side_fields(flat.numel()), q.side, strict=True):
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
        write_symbols(out, q.symbols, k, coding)
    return out


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
