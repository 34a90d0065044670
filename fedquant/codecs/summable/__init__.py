"""Summable integer codecs: updates that secure aggregation can add up while they stay compressed.

Every client of a round encodes on the same :class:`SumGrid` (shared clip, rotation signs and
steps, chosen by :class:`ScaleRule` from the previous round's aggregate), rounds without bias and
reduces modulo ``2**bits``; the modular sum of the encodings is the encoding of the sum, and the
server decodes only that (:func:`decode_sum`). See ``docs/secure-aggregation.md``.
"""

from fedquant.codecs.summable.grid import ROUNDINGS, ScaleRule, SumGrid, block_norms, wrap_bound
from fedquant.codecs.summable.integer import (
    WEIGHT_BITS,
    WEIGHT_SCALE,
    EncodedUpdate,
    decode_sum,
    dither,
    encode_update,
    expected_mean_error,
    modulus_bound,
    to_signed,
    weight_units,
    wrapped,
)
from fedquant.codecs.summable.noise import discrete_gaussian

__all__ = [
    "ROUNDINGS",
    "WEIGHT_BITS",
    "WEIGHT_SCALE",
    "EncodedUpdate",
    "ScaleRule",
    "SumGrid",
    "block_norms",
    "decode_sum",
    "discrete_gaussian",
    "dither",
    "encode_update",
    "expected_mean_error",
    "modulus_bound",
    "to_signed",
    "weight_units",
    "wrap_bound",
    "wrapped",
]
