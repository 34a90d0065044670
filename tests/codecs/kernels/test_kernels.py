"""The fused numba kernels against fedquant.rng, the bit packer and their torch twins."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedquant.codecs.buckets import bucket_stat
from fedquant.codecs.kernels import common
from fedquant.codecs.kernels import grid as kernels
from fedquant.codecs.kernels.hadamard import NO_ROTATION
from fedquant.codecs.quantizers.grid import grid_steps
from fedquant.rng import stream_key, uniform
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from tests.helpers import sample_tensor


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**62 + 7, 2**63 - 1])
@pytest.mark.parametrize("offset", [0, 1, 999_999])
def test_inline_uniform_equals_rng_stream_bit_for_bit(seed, offset):
    got = common.uniform_stream(np.uint64(stream_key(seed)), 4097, offset)
    want = uniform(seed, 4097, offset=offset).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)


def _float32_pairs(count, seed):
    """Random finite float32 pairs over the whole exponent range, and every mantissa of ``a`` for a few ``b``."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 0x7F800000, size=(2, count), dtype=np.int64).astype(np.uint32)
    a, b = bits.view(np.float32)
    mantissas = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    fixed = np.float32([3, 5, 7, 11, 0.1, 1 / 3, 2**-20 * 13, 12345.678]).repeat(1 << 23)
    return np.concatenate([a, np.tile(mantissas, 8)]), np.concatenate([b, fixed])


def test_exact_quotient_is_the_float32_division_wherever_the_quotient_is_normal():
    a, b = _float32_pairs(4_000_000, seed=0)
    a, b = a[b > 0], b[b > 0]
    with np.errstate(over="ignore", under="ignore"):
        want = a / b
        got = (a.astype(np.float64) * (1.0 / b.astype(np.float64))).astype(np.float32)
    normal = (want == 0) & (a == 0) | (np.abs(want) >= np.float32(2.0**-126))
    assert normal.sum() > 60_000_000
    assert np.array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))
    # the kernels' own helper computes the same (and the subnormal range is where it may not)
    pick = np.flatnonzero(normal)[:1000]
    inv = 1.0 / b[pick].astype(np.float64)
    assert [common.exact_quotient(x, y) for x, y in zip(a[pick], inv)] == list(want[pick])


def tiny_quotient_input(d: int) -> torch.Tensor:
    """Three chunks: tiny (subnormal) values beside normal ones in every bucket, normal values, then
    buckets of 98 beside 147 * 2**-149 (a quotient exactly halfway between two subnormal float32s)."""
    rng = np.random.default_rng(d)
    c = common.CHUNK
    x = rng.standard_normal(3 * c).astype(np.float32)
    tiny = rng.integers(1, 1 << 20, size=c, dtype=np.int64).astype(np.uint32).view(np.float32)
    x[1:c:3] = np.where(x[1:c:3] < 0, -tiny[1::3], tiny[1::3])
    x[2 * c :: d] = 98.0
    x[2 * c + 1 :: d] = np.uint32(147).view(np.float32)
    return torch.from_numpy(x)


@pytest.mark.parametrize("d", [3, 512])
def test_subnormal_quotients_take_the_division(d):
    # |v| / step a subnormal float32: the float64 product may round otherwise (exact halfway cases)
    a, b = np.uint32(147).view(np.float32), np.float32(98.0)
    assert np.float32(np.float64(a) * (1 / np.float64(b))) != a / b
    x = tiny_quotient_input(d)
    key = common.kernel_key(3)
    for s in (1, 16):
        steps = grid_steps(bucket_stat(x, d, "max", use_kernels=True), s)
        ts = np.empty(common.CHUNK, np.float32)
        one, c = np.float32(1), common.CHUNK
        xs = x.numpy()  # each chunk's values from 0, as the kernels pass them
        flags = [
            common.chunk_quotients(xs[i : i + c], d, steps, one, False, False, i, i + c, ts) for i in (0, c, 2 * c)
        ]
        assert flags == [True, False, True]
        codes = kernels.round_codes(x.numpy(), d, steps, s, key)
        assert np.array_equal(codes, kernels.torch_round_codes(x, d, steps, s, 3).numpy())
        width = bit_width(2 * s + 1)
        assert np.array_equal(kernels.round_pack(x.numpy(), d, steps, s, key, width), pack_bits(codes, width))


CASES = [
    # n, bucket, s
    (1, 512, 16),
    (7, 512, 1),
    (1000, 7, 1),
    (4099, 100, 7),
    (10_007, 512, 16),
    (5000, 64, 127),
    (3001, 3001, 3),
    (20_000, 33, 300),  # width 10: symbols straddle bytes
    (40_000, 512, 2),  # several kernel chunks
]


@pytest.mark.parametrize(("n", "d", "s"), CASES)
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_kernel_and_torch_paths_give_identical_bytes_and_values(n, d, s, norm):
    x = sample_tensor((n,), seed=n + s)
    x[::5] = 0.0
    width = bit_width(2 * s + 1)
    scales = bucket_stat(x, d, norm, use_kernels=True)
    assert np.array_equal(scales, bucket_stat(x, d, norm, use_kernels=False))
    steps = grid_steps(scales, s)
    key = common.kernel_key(11)
    codes = kernels.round_codes(x.numpy(), d, steps, s, key)
    torch_codes = kernels.torch_round_codes(x, d, steps, s, 11)
    assert torch_codes.dtype == torch.int32 and np.array_equal(codes, torch_codes.numpy())
    # the fused packer writes exactly what the reference bit packer writes
    packed = kernels.round_pack(x.numpy(), d, steps, s, key, width)
    assert np.array_equal(packed, pack_bits(codes, width))
    y, bad = kernels.unpack_dequant(packed, n, d, steps, s, width)
    y_codes, bad_codes = kernels.codes_dequant(codes, d, steps, s)
    y_torch, bad_torch = kernels.torch_dequantize(torch_codes, d, steps, s)
    assert bad == bad_torch == bad_codes == 0
    assert np.array_equal(y, y_torch.numpy()) and np.array_equal(y, y_codes)
    # every decoded value is a neighbouring grid point of its input
    step = torch.from_numpy(steps).repeat_interleave(d)[:n]
    assert torch.all((torch.from_numpy(y) - x).abs() <= step * (1 + 1e-6))


@pytest.mark.parametrize("norm", ["max", "l2", "l1mean"])
@pytest.mark.parametrize("n", [0, 1, 999])
def test_bucket_stat_paths_agree_including_empty_and_single_bucket(norm, n):
    x = sample_tensor((n,), seed=n) if n else torch.zeros(0)
    for d in (1, 7, max(n, 1)):
        got = bucket_stat(x, d, norm, use_kernels=True)
        assert got.dtype == np.float32 and got.shape == (-(-n // d),)
        assert np.array_equal(got, bucket_stat(x, d, norm, use_kernels=False))
    with pytest.raises(ValueError, match="statistic"):
        bucket_stat(x, 4, "l1", use_kernels=True)


def test_scale_kernels_match_definitions():
    x = sample_tensor((1030,), seed=3)
    d = 100
    xb = torch.nn.functional.pad(x, (0, 70)).view(-1, d).double()
    counts = torch.tensor([100.0] * 10 + [30.0], dtype=torch.float64)
    np.testing.assert_array_equal(common.bucket_max_abs(x.numpy(), d), xb.abs().amax(1).float().numpy())
    np.testing.assert_allclose(common.bucket_l2(x.numpy(), d), xb.norm(dim=1).float().numpy(), rtol=1e-7)
    np.testing.assert_allclose(
        common.bucket_l1_mean(x.numpy(), d), (xb.abs().sum(1) / counts).float().numpy(), rtol=1e-7
    )


def test_unpack_counts_symbols_beyond_the_alphabet():
    s, width, n = 2, 3, 11  # 5 symbols in 3 bits: 5, 6, 7 are invalid
    codes = np.array([0, 4, 5, 7, 2, 6, 1, 1, 1, 4, 3], np.uint16)
    steps = np.ones(1, np.float32)
    _, bad = kernels.unpack_dequant(pack_bits(codes, width), n, 512, steps, s, width)
    assert bad == 3
    _, bad = kernels.codes_dequant(codes, 512, steps, s)
    assert bad == 3
    _, bad = kernels.torch_dequantize(torch.from_numpy(codes.astype(np.int32)), 512, steps, s)
    assert bad == 3


def test_sign_kernels_match_reference_and_torch_twin():
    x = sample_tensor((1001,), seed=5)
    x[::7] = 0.0
    bits = kernels.sign_pack(x.numpy())
    assert np.array_equal(bits, pack_bits((x < 0).numpy().astype(np.uint8), 1))
    scales = np.arange(1, 12, dtype=np.float32)
    y = kernels.sign_unpack(bits, 1001, 100, scales)
    want = np.where(unpack_bits(bits, 1, 1001) == 1, -1.0, 1.0) * np.repeat(scales, 100)[:1001]
    assert np.array_equal(y, want.astype(np.float32))
    assert np.array_equal(kernels.torch_sign_values(x < 0, 100, scales).numpy(), y)


@pytest.mark.parametrize("d", [1, 8, 512, 16384])
@pytest.mark.parametrize("n", [1, 13, 16384, 50_003])
def test_fused_means_and_signs_equal_the_two_passes(d, n):
    x = sample_tensor((n,), seed=n + d).numpy()
    x[::3] = 0.0
    x[1::5] *= -1
    scales, packed = kernels.l1_sign_pack(x, d)
    assert np.array_equal(scales, common.bucket_l1_mean(x, d))
    assert np.array_equal(packed, kernels.sign_pack(x))


def test_zero_step_buckets_give_zero_levels():
    x = torch.zeros(1500)
    x[1000:] = 1.0
    scales = bucket_stat(x, 500, "max", use_kernels=True)
    assert scales.tolist() == [0.0, 0.0, 1.0]
    steps = grid_steps(scales, 4)
    codes = kernels.round_codes(x.numpy(), 500, steps, 4, common.kernel_key(0))
    assert codes[:1000].tolist() == [4] * 1000 and codes[1000:].tolist() == [8] * 500
    assert np.array_equal(kernels.torch_round_codes(x, 500, steps, 4, 0).numpy(), codes)


@pytest.mark.parametrize("d", [1, 128, 512, 16384])
@pytest.mark.parametrize("l2", [False, True])
def test_fused_scale_and_round_equals_the_two_passes(d, l2):
    x = sample_tensor((50_003,), seed=d).numpy()
    x[:1024] = 0.0
    key = np.uint64(stream_key(4))
    scales = common.bucket_l2(x, d) if l2 else common.bucket_max_abs(x, d)
    packed = kernels.round_pack(x, d, grid_steps(scales, 16), 16, key, 6)
    fused_scales, fused_packed = kernels.scale_round_pack(x, d, 16, key, 6, l2)
    assert np.array_equal(fused_scales, scales) and np.array_equal(fused_packed, packed)


# ---------------------------------------------------------------- the parallel/serial switch
SWITCH_SIZES = [1, 1000, common.PARALLEL_MIN - 1, common.PARALLEL_MIN + 1001]


@pytest.mark.parametrize("n", SWITCH_SIZES)
def test_serial_and_parallel_versions_of_a_kernel_agree(n):
    x = sample_tensor((n,), seed=n).numpy()
    key = np.uint64(stream_key(9))
    for stat in (common.bucket_max_abs, common.bucket_l2, common.bucket_l1_mean):
        assert np.array_equal(stat.serial(x, 100), stat.parallel(x, 100))
    nb = -(-n // 128)
    outputs = {}
    for version in ("serial", "parallel"):
        scales, packed = np.empty(nb, np.float32), np.empty(packed_size(n, 4), np.uint8)
        getattr(kernels.scale_round_pack_into, version)(x, n, 128, 7, key, 4, False, scales, packed, *NO_ROTATION)
        y = np.empty(n, np.float32)
        bad, _ = getattr(kernels.unpack_dequant_into, version)(
            packed, n, 128, scales / np.float32(7), 7, 4, y, *NO_ROTATION
        )
        bits = np.empty(packed_size(n, 1), np.uint8)
        getattr(kernels.sign_pack_into, version)(x, bits)
        codes, counts = np.empty(n, np.uint16), np.zeros((3, 15), np.int64)
        getattr(kernels.round_codes_into, version)(x, 128, scales / np.float32(7), 7, key, codes, counts)
        assert bad == 0 and np.array_equal(counts.sum(axis=0), np.bincount(codes, minlength=15))
        outputs[version] = (scales, packed, y, bits, codes)
    for serial, parallel in zip(outputs["serial"], outputs["parallel"], strict=True):
        assert np.array_equal(serial, parallel)


_SWITCH_PROBE = """
import numpy as np
from fedquant.codecs.kernels import common
kernel = common.bucket_max_abs
kernel(np.ones(10, np.float32), 4)
assert kernel.serial.signatures and not kernel.parallel.signatures, "a small call must run the serial version"
big = np.ones(common.PARALLEL_MIN, np.float32)
kernel(big, 4)
assert kernel.parallel.signatures, "a large call must run the parallel version"
print(sum(kernel.serial.stats.cache_hits.values()), sum(kernel.parallel.stats.cache_hits.values()))
"""


def test_switch_picks_by_size_and_both_versions_load_from_their_own_cache():
    # Jitting one function twice with cache=True shares one cache entry and crashes the next
    # process; the switch's two versions must each load from cache in a fresh process.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    probe = [sys.executable, "-c", _SWITCH_PROBE]
    for _ in "ab":  # a second process only when the first did not load both from the cache (a cold one)
        run = subprocess.run(probe, env=env, capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr
        if run.stdout.split() == ["1", "1"]:
            break
    assert run.stdout.split() == ["1", "1"]


# ---------------------------------------------------------------- splitting and merging by flags
@pytest.mark.parametrize("density", [0.0, 0.037, 0.5, 1.0])
@pytest.mark.parametrize("m", [0, 5, 32, 100, 512])
def test_split_and_merge_by_flags_are_the_element_loops(density, m):
    rng = np.random.default_rng(m)
    flags = (rng.random(512) < density).astype(np.uint8) * rng.integers(1, 255, 512).astype(np.uint8)
    a, b = rng.integers(0, 255, 512).astype(np.uint8), rng.integers(0, 255, 512).astype(np.uint8)
    out_a, out_b = np.zeros(600, np.uint8), np.zeros(600, np.uint8)
    pos = common.split_by_flags(flags, m, a, b, out_a, 3, out_b, 7)
    chosen = flags[:m] != 0
    assert pos == (3 + chosen.sum(), 7 + m - chosen.sum())
    assert np.array_equal(out_a[3 : pos[0]], a[:m][chosen]) and np.array_equal(out_b[7 : pos[1]], b[:m][~chosen])
    # Nothing before, nor past the next byte (the branch-free tail writes each element to both sides
    # and advances one; the 32-element groups write exactly what they take).
    assert not out_a[:3].any() and not out_a[pos[0] + 1 :].any()
    assert not out_b[:7].any() and not out_b[pos[1] + 1 :].any()
    if m % 32 == 0:
        assert not out_a[pos[0] :].any() and not out_b[pos[1] :].any()
    merged = np.zeros(512, np.uint8)
    assert common.merge_by_flags(flags, m, out_a, 3, out_b, 7, merged) == pos
    assert np.array_equal(merged[:m], np.where(chosen, a[:m], b[:m]))


_SPLIT_PROBE = """
import hashlib, numpy as np
from fedquant.codecs.kernels import common
from fedquant.jit import target
rng = np.random.default_rng(7)
flags = (rng.random(4099) < 0.3).astype(np.uint8)
a, b = rng.integers(0, 255, 4099).astype(np.uint8), rng.integers(0, 255, 4099).astype(np.uint8)
out_a, out_b = np.zeros(4200, np.uint8), np.zeros(4200, np.uint8)
pos = common.split_by_flags(flags, 4099, a, b, out_a, 5, out_b, 9)
print(int(target.has_avx512_vbmi2()), pos, hashlib.sha256(out_a.tobytes() + out_b.tobytes()).hexdigest())
"""


def test_the_split_writes_the_same_bytes_with_and_without_avx512_vbmi2():
    """The register compress (AVX-512 VBMI2) and the portable compress store: the same bytes."""
    from numba.core.codegen import get_host_cpu_features

    host = get_host_cpu_features()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    runs = []
    for features in (host, host.replace("+avx512vbmi2", "-avx512vbmi2")):
        run = subprocess.run(
            [sys.executable, "-c", _SPLIT_PROBE],
            env={**env, "NUMBA_CPU_FEATURES": features},
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        runs.append(run.stdout.split(maxsplit=1))
    assert runs[1][0] == "0"
    assert runs[0][1] == runs[1][1]
