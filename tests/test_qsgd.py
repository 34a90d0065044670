"""QSGD: grid exactness, unbiasedness and variance (Lemma 3.1), sizes, determinism, bad bodies."""

import math

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec, grid
from fedquant.wire import read_payload, write_payload
from fedquant.wire.bitpack import packed_size
from fedquant.wire.payload import header_size
from tests.grid_stats import assert_unbiased_with_exact_variance, quantize_copies
from tests.helpers import cuda, sample_tensor


def test_defaults_and_spec():
    codec = get_codec("qsgd")
    assert (codec.levels, codec.bucket_size, codec.norm, codec.coding) == (16, 512, "max", "fixed")
    assert codec.symbol_width == 6
    assert get_codec("qsgd", levels=1).symbol_width == 2
    assert get_codec("qsgd", levels=7).symbol_width == 4
    with pytest.raises(ValueError, match="norm"):
        get_codec("qsgd", norm="l1")
    with pytest.raises(ValueError, match="levels"):
        get_codec("qsgd", levels=0)


@pytest.mark.parametrize("levels", [1, 3, 16, 100])
@pytest.mark.parametrize("bucket_size", [8, 512])
def test_inputs_on_the_grid_come_back_exactly(levels, bucket_size):
    # step = 1/8 is exact, so q * step is exact and |x| / step recovers q with p = 0
    gen = torch.Generator().manual_seed(levels)
    n = 3 * bucket_size + 5
    q = torch.randint(-levels, levels + 1, (n,), generator=gen)
    q[::bucket_size] = levels  # every bucket reaches the top level, so its max scale is levels * step
    x = q.float() * 0.125
    codec = get_codec("qsgd", levels=levels, bucket_size=bucket_size)
    for seed in (0, 1, 2):
        assert torch.equal(codec.decode(codec.encode(x, seed=seed), seed=seed), x)


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_constant_size_one_and_zero_inputs(norm):
    codec = get_codec("qsgd", levels=4, norm=norm)
    for x in (torch.full((700,), -0.3), torch.tensor([2.5]), torch.zeros(513)):
        y = codec.decode(codec.encode(x, seed=1), seed=1)
        if norm == "max" or x.numel() == 1 or not x.any():
            assert torch.equal(y, x)  # |x_i| = scale: the top level, no randomness
        else:
            assert torch.all((y == 0) | (y.sign() == x.sign()))


@pytest.mark.parametrize(("levels", "norm"), [(1, "l2"), (3, "l2"), (4, "max"), (16, "max"), (16, "l2")])
def test_unbiased_and_error_matches_exact_variance_and_lemma_3_1(levels, norm):
    d = 64
    v = sample_tensor((d,), seed=levels)
    codec = get_codec("qsgd", levels=levels, bucket_size=d, norm=norm)
    scale = float(grid.bucket_scales(v, d, norm)[0])
    step = float(np.float32(scale) / np.float32(levels))
    q = quantize_copies(codec, v, copies=4000)
    err = assert_unbiased_with_exact_variance(q, v, step)
    sq = v.double().square().sum().item()
    if norm == "l2":
        bound = min(d / levels**2, math.sqrt(d) / levels) * sq  # Lemma 3.1 (ii)
    else:
        bound = d * scale**2 / (4 * levels**2)  # p(1 - p) <= 1/4
    assert err <= bound


def test_fixed_width_payload_is_header_plus_scales_plus_exact_packed_body():
    for levels, bucket_size, n in [(1, 512, 1000), (16, 512, 10_000), (7, 100, 333), (300, 0, 999)]:
        codec = get_codec("qsgd", levels=levels, bucket_size=bucket_size)
        x = sample_tensor((n,), seed=n)
        data = codec.encode(x, seed=3)
        nb = 1 if bucket_size == 0 else -(-n // bucket_size)
        width = math.ceil(math.log2(2 * levels + 1))
        assert len(data) == header_size(1, codec.spec) + 4 * nb + packed_size(n, width)


def test_same_seed_same_bytes_different_seed_different_bytes():
    codec = get_codec("qsgd", levels=4)
    x = sample_tensor((5000,), seed=1)
    assert codec.encode(x, seed=10) == codec.encode(x.clone(), seed=10)
    assert codec.encode(x, seed=10) != codec.encode(x, seed=11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_input_is_encoded_as_its_float32_value(dtype):
    codec = get_codec("qsgd")
    x = sample_tensor((2000,), seed=2).to(dtype)
    a = read_payload(codec.encode(x, seed=4)).body
    b = read_payload(codec.encode(x.float(), seed=4)).body
    assert bytes(a) == bytes(b)
    assert codec.decode(codec.encode(x, seed=4), seed=4).dtype == dtype


@pytest.mark.parametrize(
    "spec",
    ["qsgd", "qsgd:levels=1,bucket_size=100", "qsgd:norm=l2,levels=5", "qsgd:levels=300,bucket_size=0"],
)
def test_torch_path_gives_the_same_bytes_as_the_kernels(spec):
    x = sample_tensor((3, 1111), seed=8)
    fast = get_codec(spec)
    slow = get_codec(spec)
    slow.force_torch = True
    data = fast.encode(x, seed=21)
    assert slow.encode(x, seed=21) == data
    assert torch.equal(slow.decode(data, seed=21), fast.decode(data, seed=21))


@cuda
def test_cuda_encode_equals_cpu_encode():
    codec = get_codec("qsgd:levels=5,bucket_size=100")
    x = sample_tensor((10_000,), seed=8)
    data = codec.encode(x.cuda(), seed=3)
    assert data == codec.encode(x, seed=3)
    assert torch.equal(codec.decode(data, seed=3, device="cuda").cpu(), codec.decode(data, seed=3))


# ---------------------------------------------------------------- forged bodies
def _forge(codec, x, edit):
    data = codec.encode(x, seed=2)
    p = read_payload(data)
    body = bytearray(p.body)
    edit(body)
    return write_payload(p.spec, p.dtype, p.shape, [bytes(body)])


@pytest.mark.parametrize("bad_scale", [float("nan"), float("inf"), -1.0])
def test_rejects_non_finite_or_negative_scale(bad_scale):
    codec = get_codec("qsgd", levels=2, bucket_size=100)
    x = sample_tensor((1000,), seed=1)
    forged = _forge(codec, x, lambda b: b.__setitem__(slice(8, 12), np.float32(bad_scale).tobytes()))
    with pytest.raises(PayloadError, match="scale"):
        codec.decode(forged, seed=2)


def test_rejects_index_beyond_the_alphabet():
    codec = get_codec("qsgd", levels=2, bucket_size=100)  # 5 symbols in 3 bits
    x = sample_tensor((1000,), seed=1)
    offset = 4 * 10  # after the scales: symbol 0 sits in the low 3 bits of this byte

    def edit(body):
        body[offset] |= 0b111

    with pytest.raises(PayloadError, match="beyond"):
        codec.decode(_forge(codec, x, edit), seed=2)


def test_rejects_nonzero_padding_bits():
    codec = get_codec("qsgd", levels=2, bucket_size=100)
    x = sample_tensor((1001,), seed=1)  # 3003 bits: the last byte has 5 unused bits

    def edit(body):
        body[-1] |= 0x80

    with pytest.raises(PayloadError, match="padding"):
        codec.decode(_forge(codec, x, edit), seed=2)
