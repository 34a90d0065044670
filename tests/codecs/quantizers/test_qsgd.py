"""QSGD: grid exactness, unbiasedness and variance (Lemma 3.1), sizes, determinism, bad bodies."""

import math

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec
from fedquant.codecs.buckets import bucket_stat
from fedquant.codecs.coders.symbols import fixed_width
from fedquant.wire import read_payload, write_payload
from fedquant.wire.bitpack import packed_size
from fedquant.wire.payload import header_size
from tests.grid_stats import assert_unbiased_with_exact_variance, quantize_copies
from tests.helpers import cuda, sample_tensor


def test_defaults_and_spec():
    codec = get_codec("qsgd")
    assert (codec.levels, codec.bucket_size, codec.norm, codec.coding) == (16, 512, "max", "fixed")
    assert codec.quantizer.num_symbols() == 33 and fixed_width(33) == 6
    assert [fixed_width(get_codec("qsgd", levels=s).quantizer.num_symbols()) for s in (1, 7, 127)] == [2, 4, 8]
    assert codec.quantizer.codings == ("fixed", "elias", "entropy") and codec.quantizer.symmetric
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
    scale = float(bucket_stat(v, d, norm, use_kernels=True)[0])
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
    slow.quantizer.force_torch = True
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


# ---------------------------------------------------------------- Elias and entropy coding
def _levels(codec, x, seed):
    """The signed levels the codec draws for ``x`` (its quantizer's unpacked symbols, minus s)."""
    q = codec.quantizer.quantize(x.reshape(-1).float().contiguous(), seed, None)
    return q.symbols.astype(np.int64) - codec.levels


@pytest.mark.parametrize(("levels", "bucket_size"), [(1, 4096), (2, 512), (16, 512), (64, 4096), (300, 0)])
def test_elias_payload_is_header_plus_the_shorter_code_s_and_decodes_like_fixed(levels, bucket_size):
    from fedquant.wire.elias import elias_omega_lengths

    x = sample_tensor((3, 4096), seed=levels)
    elias = get_codec("qsgd", levels=levels, bucket_size=bucket_size, coding="elias")
    fixed = get_codec("qsgd", levels=levels, bucket_size=bucket_size)
    data = elias.encode(x, seed=5)
    assert torch.equal(elias.decode(data, seed=5), fixed.decode(fixed.encode(x, seed=5), seed=5))
    q = _levels(elias, x, 5)
    nz = np.flatnonzero(q)
    gaps = np.diff(nz, prepend=-1)  # 1-based position of the first nonzero, then distances
    sparse_bits = int(elias_omega_lengths(gaps).sum() + nz.size + elias_omega_lengths(np.abs(q[nz])).sum())
    dense_bits = int(elias_omega_lengths(np.abs(q) + 1).sum() + nz.size)
    nb = 1 if bucket_size == 0 else -(-q.size // bucket_size)
    body = 4 * nb + 1 + math.ceil(min(sparse_bits, dense_bits) / 8)
    assert len(data) == header_size(2, elias.spec) + body
    variant = read_payload(data).body[4 * nb]
    assert variant == (0 if sparse_bits <= dense_bits else 1)


@pytest.mark.parametrize("levels", [1, 4, 16, 127])
def test_entropy_coded_size_is_within_5_percent_of_the_empirical_entropy(levels):
    from fedquant.wire.entropy import empirical_entropy_bits

    x = sample_tensor((50_000,), seed=levels)
    codec = get_codec("qsgd", levels=levels, coding="entropy")
    data = codec.encode(x, seed=1)
    fixed = get_codec("qsgd", levels=levels)
    assert torch.equal(codec.decode(data, seed=1), fixed.decode(fixed.encode(x, seed=1), seed=1))
    symbols = _levels(codec, x, 1) + levels
    entropy_bytes = empirical_entropy_bits(symbols, 2 * levels + 1) / 8
    coded = len(read_payload(data).body) - 4 * math.ceil(50_000 / 512)
    # constant: the count table (a few bytes per present symbol) and the coder's final words
    assert coded <= 1.05 * entropy_bytes + 16 + 4 * (2 * levels + 1)
    assert coded >= 0.99 * entropy_bytes


@pytest.mark.parametrize("coding", ["fixed", "elias", "entropy"])
@pytest.mark.parametrize(("levels", "bucket_size", "norm"), [(1, 128, "max"), (7, 100, "l2"), (300, 0, "max")])
def test_every_coding_decodes_alike_deterministic_and_equal_on_the_torch_path(coding, levels, bucket_size, norm):
    x = sample_tensor((4000,), seed=3)
    x[:700] = 0.0  # whole zero buckets (step 0)
    spec = f"qsgd:levels={levels},bucket_size={bucket_size},norm={norm},coding={coding}"
    fast, slow = get_codec(spec), get_codec(spec)
    slow.quantizer.force_torch = True
    data = fast.encode(x, seed=1)
    assert slow.encode(x, seed=1) == data == fast.encode(x.clone(), seed=1)
    assert fast.encode(x, seed=1) != fast.encode(x, seed=2)
    y = fast.decode(data, seed=1)
    assert torch.equal(slow.decode(data, seed=1), y)
    reference = get_codec(f"qsgd:levels={levels},bucket_size={bucket_size},norm={norm}")
    assert torch.equal(y, reference.decode(reference.encode(x, seed=1), seed=1))


def test_elias_rejects_unknown_variant_and_levels_beyond_s():
    from fedquant.wire.elias import code_s_encode

    codec = get_codec("qsgd", levels=2, bucket_size=100, coding="elias")
    x = sample_tensor((1000,), seed=1)
    with pytest.raises(PayloadError, match="variant"):
        codec.decode(_forge(codec, x, lambda b: b.__setitem__(40, 7)), seed=2)
    stream, _ = code_s_encode(np.array([0, 5, 0, -1] * 250, np.int8))  # |level| 5 > s = 2
    p = read_payload(codec.encode(x, seed=2))
    body = bytes(p.body)[:40] + b"\x00" + stream.tobytes()
    with pytest.raises(PayloadError):
        codec.decode(write_payload(p.spec, p.dtype, p.shape, [body]), seed=2)


def test_entropy_rejects_a_forged_table():
    codec = get_codec("qsgd", levels=2, bucket_size=100, coding="entropy")
    x = sample_tensor((1000,), seed=1)
    with pytest.raises(PayloadError):
        codec.decode(_forge(codec, x, lambda b: b.__setitem__(40, b[40] ^ 0xFF)), seed=2)
