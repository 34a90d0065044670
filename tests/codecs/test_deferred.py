"""Deferred decoding (fedquant/codecs/deferred.py): the values of Codec.decode, computed in each pass.

Every pass over a deferred grid update must give, bit for bit (sums: to their float64 rounding),
what the same pass over the decoded tensor gives, and an untrusted payload must be refused as
decode refuses it: before any pass when the bytes are malformed, from the first pass when a
symbol lies beyond the alphabet.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec
from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels.common import PARALLEL_MIN
from fedquant.codecs.kernels.norms import checked_accumulate, dot_terms

DEFERRED = ["qsgd", "qsgd:levels=1,bucket_size=128", "qsgd:levels=300,bucket_size=1000", "terngrad"]
#: EDEN writes its values out in its first pass (behind the rotation it undoes), bit for bit.
WRITTEN_ONCE = ["eden:bits=2", "eden:bits=1", "eden:bits=4,bucket_size=64", "rht:min_log2=3+eden:bits=2"]
NOT_DEFERRED = [
    "eden:bits=1.5",
    "eden:bits=2,coding=entropy",
    "rht+qsgd",
    "qsgd:coding=entropy",
    "qsgd:coding=elias",
    "dqsg",
    "fp32",
    "signsgd",
]


def _update(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * 0.01


@pytest.mark.parametrize("spec", DEFERRED)
@pytest.mark.parametrize("shape", [(3, 1000), (PARALLEL_MIN + 4097,)])
def test_every_pass_over_deferred_values_is_the_pass_over_the_decoded_tensor(spec, shape):
    codec = get_codec(spec)
    payload = codec.encode(_update(shape, 1), seed=7)
    decoded = codec.decode(payload, seed=7, shape=shape, dtype=torch.float32).reshape(-1).numpy()
    values = codec.decode_deferred(payload, 7, shape=shape)
    assert isinstance(values, DeferredValues) and values.numel == decoded.size
    rng = np.random.default_rng(2)
    base = rng.standard_normal(decoded.size).astype(np.float32)
    consensus, weighted = rng.standard_normal(decoded.size).astype(np.float32), rng.standard_normal(decoded.size)
    want_c, want_w = consensus.copy(), weighted.copy()
    want = checked_accumulate(base, decoded, want_c, want_w, 3.0)
    got = values.accumulate(base, consensus, weighted, 3.0)
    # the squares are summed exactly in integers, the float32 values' squares in float64: ~1e-8 apart
    assert got[1] == want[1] == 0 and got[0] == pytest.approx(want[0], rel=1e-6)
    np.testing.assert_array_equal(consensus, want_c)  # float32 sums of the same float32 values
    np.testing.assert_allclose(weighted, want_w, rtol=1e-15)
    (dot, own), want_terms = values.dot_terms(consensus), dot_terms(decoded, consensus)
    # integer symbols times float64 consensus, times the step: within float32 rounding of the float32 values' dot
    assert dot == pytest.approx(want_terms[0], rel=1e-6) and own == pytest.approx(want_terms[1], rel=1e-6)
    np.testing.assert_array_equal(values.materialize().numpy(), decoded)
    # a sum left out (empty) is not kept; a bound on |base| skips the elementwise check, same result
    for bound in (None, float(np.abs(base).max()), float("nan")):
        assert values.accumulate(base, np.zeros(0, np.float32), np.zeros(0), 1.0, bound) == pytest.approx(got)


@pytest.mark.parametrize("spec", WRITTEN_ONCE)
@pytest.mark.parametrize("shape", [(3, 1000), (PARALLEL_MIN + 4097,)])
def test_values_written_in_the_first_pass_are_the_decoded_tensor_bit_for_bit(spec, shape):
    """The first pass (sums) writes the values decode returns; the sums are those of the decoded
    tensor (squares to float64 rounding: summed by chunks), the inner products the same, and a
    second pass reads what the first wrote."""
    codec = get_codec(spec)
    payload = codec.encode(_update(shape, 1), seed=7)
    decoded = codec.decode(payload, seed=7, shape=shape, dtype=torch.float32).reshape(-1).numpy()
    rng = np.random.default_rng(2)
    base = rng.standard_normal(decoded.size).astype(np.float32)
    start_c, start_w = rng.standard_normal(decoded.size).astype(np.float32), rng.standard_normal(decoded.size)
    want_c, want_w = start_c.copy(), start_w.copy()
    want = checked_accumulate(base, decoded, want_c, want_w, 3.0)
    for bound in (None, float(np.abs(base).max())):
        values = codec.decode_deferred(payload, 7, shape=shape)
        assert isinstance(values, DeferredValues) and values.numel == decoded.size
        consensus, weighted = start_c.copy(), start_w.copy()
        got = values.accumulate(base, consensus, weighted, 3.0, bound)
        assert got[1] == want[1] == 0 and got[0] == pytest.approx(want[0], rel=1e-12)
        np.testing.assert_array_equal(consensus, want_c)
        np.testing.assert_array_equal(weighted, want_w)
        assert values.dot_terms(consensus) == dot_terms(decoded, consensus)
        np.testing.assert_array_equal(values.materialize().numpy(), decoded)
        again = values.accumulate(base, np.zeros(0, np.float32), np.zeros(0), 1.0, bound)
        assert again[1] == 0 and again[0] == pytest.approx(want[0], rel=1e-12)
    values = codec.decode_deferred(payload, 7, shape=shape)  # a lookup before any pass writes them too
    np.testing.assert_array_equal(values.materialize().numpy(), decoded)
    assert values.dot_terms(want_c) == dot_terms(decoded, want_c)


def test_eden_values_beyond_float32_are_counted_as_decode_refuses_them():
    """A forged bfloat16 scale of Inf, or one large enough that base + update overflows: the
    first pass counts every non-finite sum (the server refuses the update), whatever bound it is given."""
    codec = get_codec("eden:bits=2")
    shape = (4, 512)
    payload = codec.encode(_update(shape, 8), seed=5)
    empty = (np.zeros(0, np.float32), np.zeros(0))
    for forged in (0x7F80, 0x7F7F):  # bfloat16 Inf, the largest finite bfloat16 (~3.4e38)
        for written_first in (False, True):  # the sums' own pass, or one after a lookup wrote them
            values = codec.decode_deferred(payload, 5, shape=shape)
            values.scales = values.scales.copy()
            values.scales[1] = np.array([forged << 16], np.uint32).view(np.float32)[0]
            if written_first:
                values.materialize()
            base = np.full(values.numel, np.finfo(np.float32).max / 2, np.float32)
            squares, nonfinite = values.accumulate(base, *empty, 1.0, float(base.max()))
            assert nonfinite > 0 and not squares < np.finfo(np.float32).max


def test_a_base_bound_that_cannot_rule_out_overflow_keeps_the_elementwise_check():
    codec = get_codec("qsgd")
    values = codec.decode_deferred(codec.encode(_update((8, 512), 6) * 1e38, seed=4), 4, shape=(8, 512))
    base = np.zeros(values.numel, np.float32)
    base[::7] = np.finfo(np.float32).max  # + an update of ~1e36 overflows to Inf where it is positive
    empty = (np.zeros(0, np.float32), np.zeros(0))
    want = checked_accumulate(base, values.materialize().numpy(), *empty, 1.0)[1]
    assert want > 0
    for bound in (None, float(np.abs(base).max()), float("nan"), float("inf")):
        assert values.accumulate(base, *empty, 1.0, bound)[1] == want


@pytest.mark.parametrize("spec", NOT_DEFERRED)
def test_other_pipelines_decode_as_before(spec):
    codec = get_codec(spec)
    payload = codec.encode(_update((2, 600), 3), seed=1)
    assert codec.decode_deferred(payload, 1, shape=(2, 600)) is None


def test_the_payload_is_checked_before_any_pass():
    codec = get_codec("qsgd")
    payload = bytearray(codec.encode(_update((4, 512), 4), seed=2))
    with pytest.raises(PayloadError, match="shape"):
        codec.decode_deferred(bytes(payload), 2, shape=(2, 1024))
    with pytest.raises(PayloadError):
        codec.decode_deferred(bytes(payload[:-3]), 2, shape=(4, 512))  # truncated
    payload[-5] ^= 0x10
    with pytest.raises(PayloadError):
        codec.decode_deferred(bytes(payload), 2, shape=(4, 512))  # checksum
    with pytest.raises(PayloadError, match="codec"):
        codec.decode_deferred(get_codec("terngrad").encode(_update((4, 512), 4), seed=2), 2, shape=(4, 512))


def test_symbols_beyond_the_alphabet_are_refused_by_the_first_pass():
    """Symbols that exceed QSGD's 33 levels (6-bit symbols of 63): every first pass over the
    deferred values refuses them, as decode's dequantization does."""
    codec = get_codec("qsgd")
    shape = (4, 512)
    values = codec.decode_deferred(codec.encode(_update(shape, 5), seed=3), 3, shape=shape)
    values.packed = np.full_like(values.packed, 0xFF)  # every symbol 63 > 2s = 32
    base = np.zeros(values.numel, np.float32)
    with pytest.raises(PayloadError, match="beyond"):
        values.accumulate(base, np.zeros(values.numel, np.float32), np.zeros(values.numel), 1.0)
    fresh = codec.decode_deferred(codec.encode(_update(shape, 5), seed=3), 3, shape=shape)
    fresh.packed = np.full_like(fresh.packed, 0xFF)
    with pytest.raises(PayloadError, match="beyond"):  # a dot before any check writes the values out first
        fresh.dot_terms(np.zeros(values.numel, np.float32))
    with pytest.raises(PayloadError, match="beyond"):
        fresh.materialize()
