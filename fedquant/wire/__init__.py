"""The wire layer: payload envelope, body sections, bit packing and entropy codes."""

from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader, BodyWriter
from fedquant.wire.payload import Payload, read_payload, write_payload

__all__ = [
    "BodyReader",
    "BodyWriter",
    "Payload",
    "bit_width",
    "pack_bits",
    "packed_size",
    "read_payload",
    "unpack_bits",
    "write_payload",
]
