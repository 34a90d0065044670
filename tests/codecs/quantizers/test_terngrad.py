"""TernGrad: ternary output, unbiasedness and exact variance, clipping, scalers, sizes, bad bodies."""

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec
from fedquant.wire import read_payload, write_payload
from fedquant.wire.bitpack import packed_size
from fedquant.wire.payload import header_size
from tests.grid_stats import assert_unbiased_with_exact_variance, quantize_copies
from tests.helpers import cuda, sample_tensor


def test_output_is_ternary_times_the_bucket_max():
    codec = get_codec("terngrad", bucket_size=100)
    x = sample_tensor((1050,), seed=1)
    y = codec.decode(codec.encode(x, seed=2), seed=2)
    m = torch.nn.functional.pad(x.abs(), (0, 50)).view(-1, 100).amax(1).repeat_interleave(100)[:1050]
    assert torch.all((y == 0) | (y == m) | (y == -m))
    assert torch.all((y == 0) | (y.sign() == x.sign()))


def test_unbiased_and_error_is_max_times_l1_minus_l2_squared():
    d = 64
    v = sample_tensor((d,), seed=3)
    q = quantize_copies(get_codec("terngrad", bucket_size=d), v, copies=4000)
    m = v.abs().max().item()
    err = assert_unbiased_with_exact_variance(q, v, m)
    # TernGrad's variance in closed form: sum |v_i| (m - |v_i|) = m ||v||_1 - ||v||_2^2
    closed = m * v.double().abs().sum().item() - v.double().square().sum().item()
    assert err == pytest.approx(closed, rel=0.05)


def test_equals_qsgd_with_one_level_and_max_norm():
    x = sample_tensor((3000,), seed=4)
    tern = read_payload(get_codec("terngrad", bucket_size=256).encode(x, seed=9)).body
    qsgd = read_payload(get_codec("qsgd", levels=1, bucket_size=256, norm="max").encode(x, seed=9)).body
    assert bytes(tern) == bytes(qsgd)


def test_per_tensor_scaler_and_two_bit_size():
    codec = get_codec("terngrad", bucket_size=0)
    x = sample_tensor((40, 25), seed=5)
    data = codec.encode(x, seed=1)
    assert len(data) == header_size(2, codec.spec) + 4 + packed_size(1000, 2)
    y = codec.decode(data, seed=1)
    assert set(y.abs().unique().tolist()) <= {0.0, x.abs().max().item()}


def test_clipping_bounds_the_scaler_by_c_sigma_and_marks_the_codec_biased():
    codec = get_codec("terngrad", bucket_size=0, clip=2.5)
    assert not codec.unbiased and get_codec("terngrad").unbiased
    x = sample_tensor((5000,), seed=6)
    x[0] = 100.0  # an outlier that clipping must remove
    y = codec.decode(codec.encode(x, seed=1), seed=1)
    bound = 2.5 * x.std(correction=0).item()
    assert y.abs().max().item() == pytest.approx(bound, rel=1e-6)
    assert y[0].item() == pytest.approx(bound, rel=1e-6)  # the clipped outlier is at the top level


def test_inputs_on_the_grid_and_constants_come_back_exactly():
    codec = get_codec("terngrad", bucket_size=10)
    x = torch.tensor([0.5, -0.5, 0.0, 0.5] * 5 + [-3.0])
    assert torch.equal(codec.decode(codec.encode(x, seed=1), seed=1), x)
    c = torch.full((33,), 0.7)
    assert torch.equal(codec.decode(codec.encode(c, seed=1), seed=1), c)


def test_determinism_and_seed_dependence():
    codec = get_codec("terngrad")
    x = sample_tensor((4000,), seed=7)
    assert codec.encode(x, seed=1) == codec.encode(x.clone(), seed=1)
    assert codec.encode(x, seed=1) != codec.encode(x, seed=2)


@pytest.mark.parametrize(
    "spec",
    [
        "terngrad",
        "terngrad:bucket_size=0,clip=2.5",
        "terngrad:bucket_size=77",
        "terngrad:coding=entropy,clip=2.5",
        "terngrad:coding=elias,bucket_size=77",
    ],
)
def test_torch_path_gives_the_same_bytes_as_the_kernels(spec):
    x = sample_tensor((2, 2222), seed=8)
    fast, slow = get_codec(spec), get_codec(spec)
    slow.quantizer.force_torch = True
    data = fast.encode(x, seed=5)
    assert slow.encode(x, seed=5) == data
    assert torch.equal(slow.decode(data, seed=5), fast.decode(data, seed=5))


@cuda
def test_cuda_encode_equals_cpu_encode():
    codec = get_codec("terngrad:clip=2.5")
    x = sample_tensor((10_000,), seed=8)
    assert codec.encode(x.cuda(), seed=3) == codec.encode(x, seed=3)


def _forge(codec, x, edit):
    p = read_payload(codec.encode(x, seed=2))
    body = bytearray(p.body)
    edit(body)
    return write_payload(p.spec, p.dtype, p.shape, [bytes(body)])


@pytest.mark.parametrize("bad_scale", [float("nan"), -0.5])
def test_rejects_bad_scaler(bad_scale):
    codec = get_codec("terngrad", bucket_size=100)
    forged = _forge(
        codec, sample_tensor((500,), seed=1), lambda b: b.__setitem__(slice(0, 4), np.float32(bad_scale).tobytes())
    )
    with pytest.raises(PayloadError, match="scale"):
        codec.decode(forged, seed=2)


def test_rejects_the_fourth_two_bit_symbol():
    codec = get_codec("terngrad", bucket_size=100)

    def edit(body):
        body[4 * 5] |= 0b11  # symbol 3 does not exist: ternary symbols are 0, 1, 2

    with pytest.raises(PayloadError, match="beyond"):
        codec.decode(_forge(codec, sample_tensor((500,), seed=1), edit), seed=2)


def test_entropy_coding_decodes_like_two_bit_packing_in_at_most_log2_3_bits():
    from fedquant.wire.entropy import empirical_entropy_bits

    x = sample_tensor((40_000,), seed=9)
    coded, fixed = get_codec("terngrad", coding="entropy"), get_codec("terngrad")
    data = coded.encode(x, seed=4)
    assert torch.equal(coded.decode(data, seed=4), fixed.decode(fixed.encode(x, seed=4), seed=4))
    body = len(read_payload(data).body) - 4 * 79
    q = fixed.decode(fixed.encode(x, seed=4), seed=4)
    symbols = (q.sign() + 1).to(torch.int64).numpy()
    entropy_bytes = empirical_entropy_bits(symbols, 3) / 8
    assert body <= 1.05 * entropy_bytes + 32
    assert body * 8 <= np.log2(3) * 40_000


@pytest.mark.parametrize("coding", ["elias", "entropy"])
@pytest.mark.parametrize("clip", [None, 2.5])
def test_every_coding_decodes_like_two_bit_packing(coding, clip):
    x = sample_tensor((7000,), seed=10)
    x[:1024] = 0.0
    coded, fixed = get_codec("terngrad", coding=coding, clip=clip), get_codec("terngrad", clip=clip)
    assert coded.unbiased == fixed.unbiased == (clip is None)
    data = coded.encode(x, seed=3)
    assert data == coded.encode(x.clone(), seed=3) != coded.encode(x, seed=4)
    assert torch.equal(coded.decode(data, seed=3), fixed.decode(fixed.encode(x, seed=3), seed=3))
    assert len(read_payload(data).body) < len(read_payload(fixed.encode(x, seed=3)).body)


def test_elias_rejects_levels_beyond_one():
    from fedquant.wire.elias import code_s_encode

    codec = get_codec("terngrad", bucket_size=100, coding="elias")
    p = read_payload(codec.encode(sample_tensor((500,), seed=1), seed=2))
    stream, _ = code_s_encode(np.array([0, 2, 0, -1] * 125, np.int8))  # |level| 2 > s = 1
    body = bytes(p.body)[:20] + b"\x00" + stream.tobytes()
    with pytest.raises(PayloadError, match="beyond"):
        codec.decode(write_payload(p.spec, p.dtype, p.shape, [body]), seed=2)
