"""Error feedback (EF-SGD), the ``ef+`` stateful transform: residual bookkeeping and convergence of the sent sum.

Besides the registered codecs, two tiny quantizers defined here put error feedback in front of
a biased codec (EF-SGD's scaled sign, for which the residual bound is a theorem) and of a codec
that needs decoder side information, independently of any codec family's implementation.
"""

import math

import numpy as np
import pytest
import torch

from fedquant.codecs import Codec, get_codec
from fedquant.codecs.quantizers.base import Quantized, Quantizer, SideField
from fedquant.codecs.side_info import SideInfoQuantizer
from fedquant.codecs.transforms.error_feedback import ErrorFeedback
from tests.codecs import test_codecs_common as common
from tests.helpers import cuda, ef_codec_names, sample_tensor


class ScaledSign(Quantizer):
    """EF-SGD's scaled sign (Karimireddy et al. 2019): ``mean |x|`` per bucket of 8 times ``sign(x)``; biased."""

    name = "scaled-sign"
    codings = ("fixed",)
    bucket = 8

    def num_symbols(self) -> int:
        return 2

    def error_bound(self, numel: int) -> float:
        return 1 - 1 / self.bucket  # Karimireddy et al., Lemma 8

    def side_fields(self, numel: int) -> list[SideField]:
        return [SideField("bucket means", "<f4", -(-numel // self.bucket))]

    def quantize(self, flat, seed, packed_width) -> Quantized:
        flat = flat.cpu()
        buckets = flat.abs().split(self.bucket)
        means = torch.stack([b.mean() for b in buckets]) if buckets else torch.zeros(0)
        return Quantized([means.numpy()], symbols=(flat >= 0).to(torch.uint8).numpy())

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        means = torch.from_numpy(side[0].astype(np.float32)).repeat_interleave(self.bucket)[:numel]
        return means * (2 * torch.from_numpy(symbols.astype(np.float32)) - 1)


class Coset(SideInfoQuantizer):
    """Wyner-Ziv in miniature: sends ``round(x / STEP) mod 4``; decoding picks the point of that
    class nearest to the side information (exact within ``2 STEP`` of it)."""

    name = "coset"
    codings = ("fixed",)
    step = 0.25

    def num_symbols(self) -> int:
        return 4

    def error_bound(self, numel: int) -> float:
        return 1.0  # with the exact value as side information: rounding to the nearest multiple of STEP

    def side_fields(self, numel: int) -> list[SideField]:
        return []

    def quantize(self, flat, seed, packed_width) -> Quantized:
        k = torch.round(flat.cpu().double() / self.step).to(torch.int64)
        return Quantized([], symbols=torch.remainder(k, 4).to(torch.uint8).numpy())

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        s = torch.from_numpy(symbols.astype(np.float64))
        k = s + 4 * torch.round((self.side_info.cpu().double() / self.step - s) / 4)
        return (k * self.step).to(torch.float32)


def ef(quantizer: Quantizer) -> Codec:
    return Codec(quantizer, [ErrorFeedback()])


def test_spec_name_and_flags():
    codec = get_codec("ef+fp16")
    assert codec.stateful and not codec.without_state().stateful
    assert codec.without_state() == get_codec("fp16")
    assert codec.spec == "ef+" + codec.without_state().spec
    assert codec.name == "fp16"  # the wire name: the server decodes without the state
    assert codec.unbiased is False and get_codec("fp32").unbiased is True
    assert get_codec(codec.spec) == codec and get_codec(codec) is codec
    assert ef(Coset()).needs_side_info and not ef(ScaledSign()).needs_side_info
    with pytest.raises(ValueError, match="twice"):
        get_codec("ef+ef+fp16")


def test_stateless_encode_and_decode_are_those_without_state():
    codec = get_codec("ef+fp16")
    x = sample_tensor((30, 20), seed=1)
    payload = codec.encode(x, seed=3)
    assert payload == codec.without_state().encode(x, seed=3)
    assert torch.equal(codec.decode(payload, seed=3), codec.without_state().decode(payload, seed=3))
    # Without a residual yet, the stateful encode sends exactly what the stateless one sends.
    assert codec.encode_stateful(x, 3, None)[0] == payload
    assert codec.encode_stateful(x, 3, {})[0] == payload


def test_residual_is_what_the_codec_failed_to_send():
    codec = ef(ScaledSign())
    x = sample_tensor((4, 8), seed=2)
    residual = 0.1 * sample_tensor((32,), seed=3)  # any shape with the same numel
    payload, state = codec.encode_stateful(x, 5, {"ef": residual})
    assert set(state) == {"ef"}  # one entry per stateful transform, by name
    new = state["ef"]
    p = x + residual.view(4, 8)
    assert new.shape == x.shape and new.dtype == torch.float32
    assert torch.equal(new, p - codec.decode(payload, seed=5))
    assert payload == codec.without_state().encode(p, seed=5)  # the server sees C(x + e) only
    with pytest.raises(ValueError, match="residual"):
        codec.encode_stateful(x, 5, {"ef": torch.zeros(31)})


def test_a_codec_without_stateful_transforms_keeps_no_state():
    codec = get_codec("fp16")
    x = sample_tensor((10,), seed=1)
    assert not codec.stateful
    assert codec.encode_stateful(x, 2, None) == (codec.encode(x, seed=2), {})


def test_running_mean_of_decoded_converges_to_a_constant_input():
    # Sum over t of decoded_t = T x + e_0 - e_T (telescoping), so mean_T - x = -e_T / T. Scaled sign
    # on a bucket of d = 8 has ||p - C(p)||^2 = (1 - delta) ||p||^2 with delta = ||p||_1^2 / (d ||p||^2)
    # >= 1/d per bucket (Karimireddy et al., Lemma 8), so ||e'|| <= q ||x + e|| and
    # ||e|| <= q / (1 - q) ||x||, q = sqrt(1 - 1/d) (about 14.5 ||x||).
    codec = ef(ScaledSign())
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, -1.0, 0.5, 7.0, -4.0] * 4)  # not representable by one scale per 8
    state: dict[str, torch.Tensor] = {}
    total = torch.zeros_like(x, dtype=torch.float64)
    largest = 0.0
    rounds = 400
    for t in range(rounds):
        payload, state = codec.encode_stateful(x, t, state)
        total += codec.decode(payload, seed=t).double()
        largest = max(largest, state["ef"].norm().item())
    q = math.sqrt(1 - 1 / 8)
    assert largest <= q / (1 - q) * x.norm().item()
    err = (total / rounds - x.double()).norm().item()
    assert err == pytest.approx(state["ef"].double().norm().item() / rounds, rel=1e-3, abs=1e-5)
    assert err <= 0.05 * x.norm().item()


def test_without_feedback_the_bias_stays():
    codec = ef(ScaledSign()).without_state()
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, -1.0, 0.5, 7.0, -4.0])
    mean = sum(codec.decode(codec.encode(x, seed=t), seed=t) for t in range(50)) / 50
    assert (mean - x).norm() > 0.5  # so the convergence above is error feedback's doing


def test_side_information_codecs_get_the_exact_value_on_the_client():
    # The client decodes its own payload with side information = what it encoded (it knows it), so the
    # residual is the rounding error, at most STEP / 2, although |x| is far beyond the coset's 2 STEP.
    codec = ef(Coset())
    x = 3.0 * sample_tensor((64,), seed=4)
    state = None
    for t in range(5):
        payload, state = codec.encode_stateful(x, t, state)
        assert state["ef"].abs().max().item() <= Coset.step / 2 + 1e-6
    p = x + 0.5 * sample_tensor((64,), seed=5)
    payload, new = codec.encode_stateful(x, 9, {"ef": p - x})
    assert torch.allclose(new["ef"], p - codec.decode(payload, seed=9, side_info=p), atol=1e-6)
    # Side information that is off decodes to other values: the exact value above mattered.
    assert not torch.allclose(codec.decode(payload, seed=9, side_info=torch.zeros(64)), p, atol=1.0)


@cuda
def test_residual_stays_on_the_tensors_device():
    codec = get_codec("ef+fp16")
    x = sample_tensor((1000,), seed=1).cuda()
    _, state = codec.encode_stateful(x, 1, None)
    _, state = codec.encode_stateful(x, 2, state)
    assert state["ef"].device == x.device and state["ef"].dtype == torch.float32


# Every registered quantizer with ef+ in front, but those ef+ refuses (tests.helpers.EF_REFUSED).
WRAPPED = [f"ef+{name}" for name in ef_codec_names()]


@pytest.mark.parametrize("spec", WRAPPED)
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
