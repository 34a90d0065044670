"""Scaled sign: exact output, error formula, sign(0), short buckets, sizes, bad bodies."""

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec
from fedquant.wire import read_payload, write_payload
from fedquant.wire.bitpack import packed_size
from fedquant.wire.payload import header_size
from tests.helpers import cuda, sample_tensor


def _reference(x: torch.Tensor, d: int) -> torch.Tensor:
    """(||v||_1 / count) * sign(v) per bucket, sign(0) = +1, in float64."""
    out = torch.empty(x.numel(), dtype=torch.float64)
    flat = x.reshape(-1).double()
    for lo in range(0, flat.numel(), d):
        v = flat[lo : lo + d]
        out[lo : lo + d] = v.abs().mean() * torch.where(v < 0, -1.0, 1.0)
    return out


@pytest.mark.parametrize(("n", "d"), [(1, 512), (1000, 512), (1000, 0), (999, 7)])
def test_decodes_to_mean_abs_times_sign(n, d):
    x = sample_tensor((n,), seed=n)
    x[::9] = 0.0
    codec = get_codec("signsgd", bucket_size=d)
    y = codec.decode(codec.encode(x, seed=0), seed=0)
    want = _reference(x, d if d else n)
    assert torch.allclose(y.double(), want, rtol=1e-6, atol=0)
    assert torch.all(y[x == 0] >= 0)  # sign(0) = +1 (0 only when the whole bucket is 0)


def test_error_is_l2_squared_minus_l1_squared_over_d():
    x = sample_tensor((4096,), seed=2)
    y = get_codec("signsgd", bucket_size=0).decode(get_codec("signsgd", bucket_size=0).encode(x))
    err = (y.double() - x.double()).square().sum().item()
    x64 = x.double()
    assert err == pytest.approx(x64.square().sum().item() - x64.abs().sum().item() ** 2 / 4096, rel=1e-5)


def test_short_last_bucket_uses_its_true_count():
    x = torch.cat([torch.ones(8), torch.full((2,), 3.0)])
    y = get_codec("signsgd", bucket_size=8).decode(get_codec("signsgd", bucket_size=8).encode(x))
    assert y.tolist() == [1.0] * 8 + [3.0, 3.0]


def test_size_is_header_scales_and_one_bit_per_element():
    for n, d in [(1, 512), (1000, 512), (4096, 0), (12345, 100)]:
        codec = get_codec("signsgd", bucket_size=d)
        nb = 1 if d == 0 else -(-n // d)
        data = codec.encode(sample_tensor((n,), seed=1))
        assert len(data) == header_size(1, codec.spec) + 4 * nb + packed_size(n, 1)


def test_deterministic_and_seed_independent():
    codec = get_codec("signsgd")
    x = sample_tensor((3000,), seed=3)
    assert codec.encode(x, seed=1) == codec.encode(x.clone(), seed=2)


def test_torch_path_gives_the_same_bytes_and_values():
    x = sample_tensor((3, 1001), seed=4)
    x[0, :5] = 0.0
    for d in (512, 0, 33):
        for coding in ("fixed", "entropy"):
            fast, slow = (get_codec("signsgd", bucket_size=d, coding=coding) for _ in "ab")
            slow.quantizer.force_torch = True
            data = fast.encode(x)
            assert slow.encode(x) == data
            assert torch.equal(slow.decode(data), fast.decode(data))


@cuda
def test_cuda_encode_equals_cpu_encode():
    codec = get_codec("signsgd")
    x = sample_tensor((10_000,), seed=8)
    assert codec.encode(x.cuda()) == codec.encode(x)


def _forge(codec, x, edit):
    p = read_payload(codec.encode(x))
    body = bytearray(p.body)
    edit(body)
    return write_payload(p.spec, p.dtype, p.shape, [bytes(body)])


@pytest.mark.parametrize("bad_scale", [float("nan"), float("-inf"), -2.0])
def test_rejects_bad_scale(bad_scale):
    codec = get_codec("signsgd", bucket_size=100)
    forged = _forge(
        codec, sample_tensor((500,), seed=1), lambda b: b.__setitem__(slice(4, 8), np.float32(bad_scale).tobytes())
    )
    with pytest.raises(PayloadError, match="scale"):
        codec.decode(forged)


def test_rejects_nonzero_padding_bits():
    codec = get_codec("signsgd")
    forged = _forge(codec, sample_tensor((1001,), seed=1), lambda b: b.__setitem__(-1, b[-1] | 0x80))
    with pytest.raises(PayloadError, match="padding"):
        codec.decode(forged)


@pytest.mark.parametrize(("n", "d"), [(1, 512), (1000, 512), (999, 7), (5000, 0)])
def test_entropy_coding_decodes_like_sign_bits(n, d):
    x = sample_tensor((n,), seed=n)
    x[::9] = 0.0
    coded, fixed = get_codec("signsgd", bucket_size=d, coding="entropy"), get_codec("signsgd", bucket_size=d)
    assert coded.quantizer.codings == ("fixed", "entropy") and coded.quantizer.num_symbols() == 2
    assert torch.equal(coded.decode(coded.encode(x)), fixed.decode(fixed.encode(x)))


def test_entropy_coding_shrinks_a_skewed_update_to_its_entropy():
    from fedquant.wire.entropy import empirical_entropy_bits

    x = sample_tensor((40_000,), seed=11).abs()
    x[::10] *= -1.0  # 10% negative: about 0.47 bits of entropy per sign
    codec = get_codec("signsgd", coding="entropy")
    data = codec.encode(x)
    entropy_bytes = empirical_entropy_bits((x < 0).numpy().astype(np.uint8), 2) / 8
    coded = len(read_payload(data).body) - 4 * -(-40_000 // 512)
    assert 0.99 * entropy_bytes <= coded <= 1.05 * entropy_bytes + 16
    assert coded < 0.6 * packed_size(40_000, 1)


def test_entropy_coding_rejects_a_forged_stream():
    codec = get_codec("signsgd", bucket_size=100, coding="entropy")
    x = sample_tensor((500,), seed=1)
    forged = _forge(codec, x, lambda b: b.__setitem__(20, b[20] ^ 0xFF))  # first byte after the scales
    with pytest.raises(PayloadError):
        codec.decode(forged)
