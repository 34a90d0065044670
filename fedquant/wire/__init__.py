"""The wire layer: payload envelope, body sections, bit packing and entropy codes."""

import fedquant.jit  # noqa: F401  (first: the kernel cache locator, before the coders' kernels)
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader, BodyWriter
from fedquant.wire.elias import (
    code_s_decode,
    code_s_dense_decode,
    code_s_dense_encode,
    code_s_encode,
    elias_omega_decode,
    elias_omega_encode,
    elias_omega_lengths,
)
from fedquant.wire.entropy import empirical_entropy_bits, entropy_decode, entropy_encode
from fedquant.wire.payload import Payload, read_payload, write_payload

__all__ = [
    "BodyReader",
    "BodyWriter",
    "Payload",
    "bit_width",
    "code_s_decode",
    "code_s_dense_decode",
    "code_s_dense_encode",
    "code_s_encode",
    "elias_omega_decode",
    "elias_omega_encode",
    "elias_omega_lengths",
    "empirical_entropy_bits",
    "entropy_decode",
    "entropy_encode",
    "pack_bits",
    "packed_size",
    "read_payload",
    "unpack_bits",
    "write_payload",
]
