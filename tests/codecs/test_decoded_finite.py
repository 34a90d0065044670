"""Kernel decoders that vouch for their values being finite, so the codec skips its NaN/Inf pass."""

import numpy as np
import pytest
import torch

from fedquant.codecs import get_codec
from fedquant.errors import PayloadError
from tests.helpers import decode_kwargs, reseal, sample_tensor

VOUCHING = ["qsgd", "qsgd:levels=7", "terngrad", "signsgd", "orq", "linear", "bingrad-b", "bingrad-pb", "dqsg", "ndqsg"]
F32_MAX = float(np.finfo(np.float32).max)


def _first_side_value(codec, x):
    """The bytes of the first side value (a bucket's scale, step or level) as encoded."""
    quantizer = codec.quantizer
    width = None if quantizer.coding != "fixed" else 8
    side = quantizer.quantize(x.reshape(-1).contiguous(), 3, width).side[0]
    return np.asarray(side[:1], dtype=side.dtype).tobytes()


def _tampered(codec, x, value):
    """``codec.encode(x)`` with its first side value replaced by ``value`` (same dtype), resealed."""
    payload = codec.encode(x, seed=3)
    old = _first_side_value(codec, x)
    at = payload.find(old)
    assert at > 0 and payload.find(old, at + 1) < 0  # found once: the field, not some other bytes
    new = np.asarray([value], dtype=np.frombuffer(old, np.uint8).view(np.float32).dtype).tobytes()
    return reseal(payload[:at] + new + payload[at + len(new) :])


@pytest.mark.parametrize("spec", VOUCHING)
def test_decoding_never_marks_the_shared_quantizer(spec):
    # what a decode checked is recorded on its own copy: a shared codec serves every thread
    codec = get_codec(spec)
    x = sample_tensor((3, 700), seed=1)
    out = codec.decode(codec.encode(x, seed=2), seed=2, **decode_kwargs(codec, x))
    assert torch.isfinite(out).all()
    assert codec.quantizer.values_finite is False
    assert codec.quantizer.for_decode().values_finite is False


@pytest.mark.parametrize("force_torch", [False, True])
@pytest.mark.parametrize("spec", ["orq", "linear", "bingrad-b", "bingrad-pb"])
def test_a_level_that_is_not_finite_is_refused_on_both_paths(spec, force_torch):
    codec = get_codec(spec)
    codec.quantizer.force_torch = force_torch
    x = sample_tensor((2, 600), seed=5)
    for bad in (np.inf, -np.inf, np.nan):
        with pytest.raises(PayloadError, match="NaN or Inf"):
            codec.decode(_tampered(codec, x, bad), seed=3)


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=7", "terngrad", "signsgd"])
def test_scales_at_the_float32_limit_decode_alike_on_both_paths(spec):
    # the kernels vouch only where s x step cannot overflow; at the limit the codec checks
    kernel, reference = get_codec(spec), get_codec(spec)
    reference.quantizer.force_torch = True
    x = sample_tensor((2, 600), seed=6)
    payload = _tampered(kernel, x, F32_MAX)
    got = kernel.decode(payload, seed=3)
    assert torch.equal(got, reference.decode(payload, seed=3))
    assert torch.isfinite(got).all() and got.abs().max() > 1e38
