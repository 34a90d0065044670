"""The numba CPU path of DQSG/NDQSG against the torch path (the CUDA path): same bytes, same values."""

import numpy as np
import pytest
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.kernels.common import PARALLEL_MIN
from fedquant.errors import PayloadError
from fedquant.rng import uniform
from tests.helpers import sample_tensor


def _pair(spec):
    kernel = get_codec(spec)
    reference = get_codec(spec)
    reference.quantizer.force_torch = True
    assert kernel.quantizer.uses_kernels() and not reference.quantizer.uses_kernels()
    return kernel, reference


def _input(n, seed, dtype=torch.float32):
    x = sample_tensor((n,), seed=seed) * 3.0
    if n > 1200:
        x[100:700] = 0.0  # whole zero buckets for bucket sizes up to 512, a zero run otherwise
    x[::11] = 0.0
    return x.to(dtype)


SIZES = [1, 7, 1000, 4099, 20_011, PARALLEL_MIN + 1234]  # short last buckets; serial and parallel loops
DQSG_SPECS = [
    "dqsg",
    "dqsg:levels=1",
    "dqsg:levels=7,bucket_size=100",
    "dqsg:levels=200,bucket_size=33",  # 9-bit symbols straddle bytes
    "dqsg:levels=32767,bucket_size=0",  # 16-bit symbols, one step per tensor
    "dqsg:bucket_size=0",
    "dqsg:levels=5,bucket_size=1",
]
NDQSG_SPECS = [
    "ndqsg",
    "ndqsg:rho=5,alpha=0.7",
    "ndqsg:levels=8,rho=7,alpha=0.3,bucket_size=100",
    "ndqsg:levels=100,rho=301,alpha=0.9,bucket_size=33",  # 9-bit symbols
    "ndqsg:levels=1000,rho=65535,bucket_size=0",  # 16-bit symbols, one step per tensor
    "ndqsg:levels=2,rho=3,alpha=0.123456789,bucket_size=0",
]


def _check_same(spec, x, seed, side_info=None):
    kernel, reference = _pair(spec)
    payload = kernel.encode(x, seed=seed)
    assert payload == reference.encode(x, seed=seed)
    kw = {} if side_info is None else {"side_info": side_info}
    got = kernel.decode(payload, seed=seed, **kw)
    want = reference.decode(payload, seed=seed, **kw)
    assert got.dtype == want.dtype == x.dtype
    # bit-for-bit equal values (the sign of zeros may differ between 0 * negative and a plain 0)
    assert torch.equal(got, want)
    return payload, got


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", DQSG_SPECS)
def test_dqsg_kernel_path_writes_the_torch_bytes_and_decodes_to_its_values(spec, n):
    x = _input(n, seed=n)
    _, got = _check_same(spec, x, seed=n + 17)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", NDQSG_SPECS)
def test_ndqsg_kernel_path_writes_the_torch_bytes_and_decodes_to_its_values(spec, n):
    x = _input(n, seed=2 * n)
    # side information near x (mostly no wrap-around) and far from it (wrap-arounds) both decode alike
    near = x + 0.05 * sample_tensor((n,), seed=n + 1)
    far = 4.0 * sample_tensor((n,), seed=n + 2)
    _check_same(spec, x, seed=n, side_info=near)
    _check_same(spec, x, seed=n, side_info=far)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["dqsg:levels=7", "ndqsg:rho=5,alpha=0.8"])
def test_half_precision_inputs_give_the_same_bytes(spec, dtype):
    x = _input(5003, seed=9, dtype=dtype)
    side = (x.float() + 0.01).to(dtype) if spec.startswith("ndqsg") else None
    _check_same(spec, x, seed=3, side_info=side)


@pytest.mark.parametrize("coding", ["entropy", "elias"])
@pytest.mark.parametrize("spec", ["dqsg:levels=3", "ndqsg:rho=5,alpha=0.6", "dqsg:levels=300,bucket_size=0"])
@pytest.mark.parametrize("n", [999, PARALLEL_MIN + 5])
def test_coded_paths_agree(spec, coding, n):
    x = _input(n, seed=4)
    side = x + 0.02 if spec.startswith("ndqsg") else None
    payload, got = _check_same(f"{spec},coding={coding}", x, seed=8, side_info=side)
    kw = {} if side is None else {"side_info": side}
    # the coder carries the same symbols as the fixed-width stream: same values
    fixed = get_codec(spec)
    assert torch.equal(got, fixed.decode(fixed.encode(x, seed=8), seed=8, **kw))


def test_all_zero_tensor_and_empty_tensor():
    for spec in ["dqsg", "ndqsg:rho=3"]:
        side = torch.ones(2000) if spec.startswith("ndqsg") else None
        _, got = _check_same(spec, torch.zeros(2000), seed=1, side_info=side)
        assert torch.equal(got, torch.zeros(2000))
    _check_same("dqsg", torch.zeros(0), seed=1)


def test_kernel_decode_rejects_indices_outside_the_alphabet_like_torch():
    # dqsg levels=2: 5 symbols in 3 bits; overwrite the packed byte stream with all ones (symbol 7)
    from fedquant.errors import PayloadError
    from tests.helpers import reseal

    kernel, reference = _pair("dqsg:levels=2")
    payload = bytearray(kernel.encode(torch.ones(16), seed=0))
    # body: one float32 step then 6 bytes of 3-bit symbols, followed by the 4-byte CRC
    payload[-10:-4] = b"\xff" * 6
    bad = reseal(bytes(payload))
    for codec in (kernel, reference):
        with pytest.raises(PayloadError, match="symbol 7 outside 0..4"):
            codec.decode(bad, seed=0)


@pytest.mark.parametrize("spec", ["dqsg", "ndqsg:rho=5,alpha=0.7"])
def test_kernel_path_allocates_no_full_size_temporaries(spec):
    # 4M elements: the torch path's int64 random bits alone take 32 MB (and it holds several
    # float32/int64 temporaries). The kernel path needs the steps, the packed stream (1.5-2 MB)
    # and, to decode, the 16 MB float32 output. Peak resident memory above the start, via VmHWM.
    from benchmarks.codec_throughput import peak_memory_mib

    x = _input(4_000_000, seed=1)
    side = {"side_info": x} if spec.startswith("ndqsg") else {}
    kernel, reference = _pair(spec)
    payload = kernel.encode(x, seed=0)
    kernel.decode(payload, seed=0, **side)  # warm up (compilation, thread pool)
    encode_mib = peak_memory_mib(lambda: kernel.encode(x, seed=0))
    if encode_mib != encode_mib:  # NaN: no /proc/self/clear_refs here
        pytest.skip("peak memory needs Linux /proc/self/clear_refs")
    decode_mib = peak_memory_mib(lambda: kernel.decode(payload, seed=0, **side))
    torch_mib = peak_memory_mib(lambda: reference.encode(x, seed=0))
    assert encode_mib < 8, encode_mib
    assert decode_mib < 16 + 8, decode_mib
    assert torch_mib > 32, torch_mib  # the measurement sees the torch path's temporaries


def _near_ties(n, seed, levels, alpha, top):
    """Inputs whose ``alpha * x / step + u`` lands within float32 rounding of a half-integer.

    Element 0 is the bucket maximum ``top`` (step ``top / levels``); every other element is the
    float32 value near a tie for which the float32 pipeline of the torch code and the same
    formula in float64 round differently, so a kernel that computed in another precision or
    order would write other symbols (or 0 where none is near). Returns the tensor and how many such elements it holds.
    """
    u = (uniform(seed, n).numpy() - np.float32(0.5)).astype(np.float32)
    a32 = np.float32(alpha)
    step = np.float32(top) / np.float32(levels)
    k = (np.arange(n) % (2 * levels - 1)) - (levels - 1)
    centre = ((k + 0.5 - u.astype(np.float64)) * np.float64(step) / np.float64(alpha)).astype(np.float32)
    x = np.zeros(n, np.float32)
    found = np.zeros(n, bool)
    for off in range(-40, 41):
        cand = (centre.view(np.int32) + off).view(np.float32)
        t32 = np.rint((a32 * cand) / step + u)
        t64 = np.rint(np.float64(alpha) * cand.astype(np.float64) / np.float64(step) + u)
        hit = (t32 != t64) & ~found & (np.abs(cand) < np.float32(top))
        x[hit] = cand[hit]
        found |= hit
    x[0] = np.float32(top)
    return torch.from_numpy(x), int(found[1:].sum())


@pytest.mark.parametrize(
    ("spec", "levels", "alpha", "top"),
    [("dqsg:bucket_size=0", 3, 1.0, 3.3), ("ndqsg:rho=5,alpha=0.7,bucket_size=0", 3, 0.7, 2.9)],
)
def test_paths_agree_on_inputs_at_rounding_ties(spec, levels, alpha, top):
    x, ties = _near_ties(4001, 5, levels, alpha, top)
    assert ties > 1000  # the input does probe the float32 rounding
    side = x + 0.01 if spec.startswith("ndqsg") else None
    _check_same(spec, x, seed=5, side_info=side)


@pytest.mark.parametrize("n", [5, PARALLEL_MIN + 3])
def test_side_info_finiteness_check(n):
    from fedquant.codecs.kernels import dither as dither_kernels

    y = np.full(n, np.finfo(np.float32).max, np.float32)
    y[0] = -np.finfo(np.float32).max
    y[1] = np.float32(1e-45)  # subnormal
    assert dither_kernels.all_finite(y)
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, n // 2, n - 1):
            z = y.copy()
            z[pos] = bad
            assert not dither_kernels.all_finite(z)
    # the decoding kernels check the side information in their own pass: in buckets whose step
    # is 0 too, with either coding, and before a payload error found ahead of them
    for coding in ("fixed", "entropy"):
        codec = get_codec(f"ndqsg:coding={coding}")
        x = torch.ones(n)
        x[: n // 2] = 0.0
        payload = codec.encode(x, seed=0)
        for pos in (0, n - 1):
            side = torch.zeros(n)
            side[pos] = float("nan")
            with pytest.raises(ValueError, match="NaN or Inf"):
                codec.decode(payload, seed=0, side_info=side)
        side = torch.zeros(n, dtype=torch.float64)
        side[n - 1] = 1e39  # finite in float64, Inf as the float32 the kernels read
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.decode(payload, seed=0, side_info=side)
        # a payload that fails its own checks before the kernels run (too few bytes)
        short = ([np.ones(1, np.float32)], np.zeros(1, np.uint8), 2, n, 0)
        with pytest.raises(PayloadError):
            codec.quantizer.with_side_info(torch.zeros(n)).dequantize_packed(*short)
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.quantizer.with_side_info(side.float()).dequantize_packed(*short)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["dqsg:levels=3", "dqsg:levels=7,bucket_size=0", "ndqsg:levels=5,rho=7,alpha=0.7"])
def test_cuda_torch_path_writes_the_cpu_kernel_bytes(spec):
    # levels that are not powers of two: the step is a true division on both devices
    x = _input(PARALLEL_MIN + 77, seed=6)
    codec = get_codec(spec)
    assert codec.encode(x.cuda(), seed=3) == codec.encode(x, seed=3)


@pytest.mark.parametrize(
    "spec", ["dqsg:bucket_size=3", "dqsg:levels=1,bucket_size=512", "ndqsg:rho=5,alpha=0.7,bucket_size=3"]
)
def test_paths_agree_where_quotients_are_subnormal(spec):
    # the kernels' float64-product quotients hand such buckets to the division
    from tests.codecs.kernels.test_kernels import tiny_quotient_input

    x = tiny_quotient_input(3 if spec.endswith("=3") else 512)
    side = x + 0.01 if spec.startswith("ndqsg") else None
    _check_same(spec, x, seed=2, side_info=side)


def test_ndqsg_decode_takes_the_division_near_half_cells():
    # round(r / step2) from r * (1 / step2) is flagged wherever the two could round apart
    from fedquant.codecs.kernels.dither import _may_round_apart, _ndqsg_value

    st1 = 0.1
    st2 = 3 * st1
    for cells in (0.5, 1.5, -2.5, 7.5):
        r = cells * st2
        shifted = r / st1  # symbol minus half minus dither, against y = 0
        _, z, k = _ndqsg_value(shifted, 0.0, st1, st2, 1 / st2, 1.0, False)
        assert _may_round_apart(z, k)
        exact, _, _ = _ndqsg_value(shifted, 0.0, st1, st2, st2, 1.0, True)
        rr = shifted * st1
        assert exact == np.float32(rr - st2 * np.rint(rr / st2))
    _, z, k = _ndqsg_value(0.7 / st1, 0.0, st1, st2, 1 / st2, 1.0, False)
    assert not _may_round_apart(z, k)


@pytest.mark.parametrize("n", [4099, PARALLEL_MIN + 1234])
@pytest.mark.parametrize("spec", ["ndqsg", "ndqsg:rho=5,alpha=0.7,bucket_size=100"])
def test_ndqsg_buckets_with_far_side_information_take_the_exact_pass(spec, n):
    # side values at or beyond (2**20 - 1) step2 send their bucket through the division pass,
    # which must start from the bucket's own dither again: the values are still the torch path's
    x = _input(n, seed=8)
    side = x + 0.25
    side[3] = 1e9  # far from a step of about 3 / 3
    side[n // 2 : n // 2 + 700] *= 1e7
    side[-5:] = -3e38
    _check_same(spec, x, seed=8, side_info=side)


@pytest.mark.parametrize("force_torch", [False, True])
def test_values_beyond_float32_are_refused_on_both_paths(force_torch):
    # the kernels check the values they write (the codec then skips its own pass); the torch
    # path is checked by the codec: both refuse the same payloads
    big = float(np.finfo(np.float32).max)
    x = torch.full((PARALLEL_MIN + 3,), big)
    cases = [("dqsg:levels=1", None), ("ndqsg", torch.full_like(x, big)), ("ndqsg:bucket_size=0", -x)]
    for spec, side in cases:
        codec = get_codec(spec)
        codec.quantizer.force_torch = force_torch
        payload = codec.encode(x, seed=4)
        kw = {} if side is None else {"side_info": side}
        with pytest.raises(PayloadError, match="NaN or Inf"):
            codec.decode(payload, seed=4, **kw)
        fine = codec.decode(payload, seed=4, check_finite=False, **kw)
        assert not torch.isfinite(fine).all()  # the values did overflow
