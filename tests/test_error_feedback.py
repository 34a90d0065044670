"""Error feedback (EF-SGD) around any codec: residual bookkeeping and convergence of the sent sum."""

import math

import pytest
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.error_feedback import ErrorFeedback, residual_state_key
from tests import test_codecs_common as common
from tests.helpers import cuda, sample_tensor


def test_spec_name_and_flags_follow_the_inner_codec():
    ef = get_codec("ef+bingrad-b:bucket_size=64")
    assert isinstance(ef, ErrorFeedback)
    assert ef.spec == "ef+" + ef.inner.spec and ef.name == "ef+bingrad-b"
    assert ef.unbiased is False and ef.needs_side_info is ef.inner.needs_side_info
    assert ef == ErrorFeedback(get_codec("bingrad-b", bucket_size=64))
    assert get_codec(ef.spec) == ef
    with pytest.raises(ValueError, match="already"):
        ErrorFeedback(ef)


def test_stateless_encode_and_decode_are_the_inner_codecs():
    ef = get_codec("ef+orq:levels=4")
    x = sample_tensor((30, 20), seed=1)
    payload = ef.encode(x, seed=3)
    assert payload == ef.inner.encode(x, seed=3)
    assert torch.equal(ef.decode(payload, seed=3), ef.inner.decode(payload, seed=3))


def test_residual_is_what_the_codec_failed_to_send():
    ef = get_codec("ef+bingrad-b:bucket_size=16")
    x = sample_tensor((4, 8), seed=2)
    residual = 0.1 * sample_tensor((32,), seed=3)  # any shape with the same numel
    payload, new = ef.encode_with_feedback(x, 5, residual)
    p = x + residual.view(4, 8)
    assert new.shape == x.shape and new.dtype == torch.float32
    assert torch.allclose(new, p - ef.decode(payload, seed=5), atol=0, rtol=0)
    with pytest.raises(ValueError, match="residual"):
        ef.encode_with_feedback(x, 5, torch.zeros(31))


@pytest.mark.parametrize("spec", ["ef+bingrad-b:bucket_size=8", "ef+bingrad-pb:bucket_size=8", "ef+orq:levels=3"])
def test_running_mean_of_decoded_converges_to_a_constant_input(spec):
    # Sum over t of decoded_t = T x + e_0 - e_T (telescoping), so mean_T - x = -e_T / T. BinGrad-b's
    # error is at most scaled sign's, so ||p - C(p)|| <= sqrt(1 - delta) ||p|| with delta >= 1/d and
    # ||e|| <= q / (1 - q) ||x||, q = sqrt(1 - 1/d) (about 14.5 ||x|| at d = 8). For bingrad-pb and
    # ORQ (unbiased: ||e|| is one rounding error of p) the same bound is a check, not a derivation.
    ef = get_codec(spec)
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, -1.0, 0.5, 7.0, -4.0] * 4)  # not representable by 2 levels
    states: dict[str, torch.Tensor] = {}
    key = residual_state_key("layer.weight")
    total = torch.zeros_like(x, dtype=torch.float64)
    largest = 0.0
    rounds = 400
    for t in range(rounds):
        payload, states[key] = ef.encode_with_feedback(x, t, states.get(key))
        total += ef.decode(payload, seed=t).double()
        largest = max(largest, states[key].norm().item())
    q = math.sqrt(1 - 1 / 8)
    assert largest <= q / (1 - q) * x.norm().item()
    err = (total / rounds - x.double()).norm().item()
    assert err <= states[key].norm().item() / rounds + 1e-4
    assert err <= 0.05 * x.norm().item()


def test_without_feedback_the_bias_stays():
    codec = get_codec("bingrad-b:bucket_size=8")
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, -1.0, 0.5, 7.0, -4.0])
    mean = sum(codec.decode(codec.encode(x, seed=t), seed=t) for t in range(50)) / 50
    assert (mean - x).norm() > 0.5  # so the convergence above is error feedback's doing


def test_residual_keys_are_per_tensor():
    assert residual_state_key("a.weight") != residual_state_key("a.bias")
    assert residual_state_key("a.weight").endswith("a.weight")


@cuda
def test_residual_stays_on_the_tensors_device():
    ef = get_codec("ef+bingrad-b")
    x = sample_tensor((1000,), seed=1).cuda()
    _, residual = ef.encode_with_feedback(x, 1, None)
    _, residual = ef.encode_with_feedback(x, 2, residual)
    assert residual.device == x.device and residual.dtype == torch.float32


@pytest.mark.parametrize("spec", ["ef+bingrad-b", "ef+orq:levels=5", "ef+linear:coding=entropy"])
@pytest.mark.parametrize(
    "check",
    [
        common.test_rejects_empty_truncated_and_extended,
        common.test_rejects_every_single_bit_flip_in_header_and_body,
        common.test_rejects_forged_bodies_of_wrong_length,
        common.test_rejects_wrong_shape_and_dtype,
        common.test_rejects_payload_of_another_codec,
        common.test_same_seed_same_bytes,
    ],
    ids=lambda f: getattr(f, "__name__", str(f)),
)
def test_wrapped_codecs_keep_the_bad_input_contract(spec, check):
    check(get_codec(spec))
