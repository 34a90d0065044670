"""EDEN (``eden:bits=B``): Lloyd–Max centroids, rates from payload bytes, unbiasedness, vNMSE, bad payloads.

The quantizer is tested on its own (``Codec(EdenQuantizer(...))``, no rotation) on Gaussian input,
which is what rotated coordinates look like, and with an explicit random rotation where the
theory needs one (unbiasedness is over the rotation).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import Codec, get_codec
from fedquant.codecs.kernels import common, eden
from fedquant.codecs.kernels.common import PARALLEL_MIN
from fedquant.codecs.quantizers.eden import EdenQuantizer, eden_vnmse, lloyd_max, lloyd_max_distortion
from fedquant.wire.bitpack import packed_size
from fedquant.wire.payload import header_size
from tests.helpers import reseal

# Max (1960), Table I: the positive half of the optimal quantizer of N(0, 1) (a cross-check
# to the printed 4 decimals; the centroid test below derives them independently).
MAX_1960 = {2: [0.7980], 4: [0.4528, 1.510], 8: [0.2451, 0.7560, 1.344, 2.152]}
# EDEN's published unbiased vNMSE at large d (Vargaftik et al. 2022) for b = 1..4.
PUBLISHED = {1: 0.571, 2: 0.133, 3: 0.0358, 4: 0.0096}


def bare(**params) -> Codec:
    """The EDEN quantizer without the rotation in front."""
    return Codec(EdenQuantizer(**params))


def gaussian(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- centroids
@pytest.mark.parametrize("levels", [2, 4, 8, 16, 32, 64, 128, 256])
def test_centroids_are_symmetric_sorted_and_midpoint_bounded(levels):
    c, t = lloyd_max(levels)
    assert c.shape == (levels,) and t.shape == (levels - 1,)
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-12)
    np.testing.assert_allclose(t, 0.5 * (c[:-1] + c[1:]), atol=1e-15)


@pytest.mark.parametrize("levels", [2, 4, 8, 16])
def test_centroids_are_the_conditional_means_of_their_cells(levels):
    """Brute-force check of the centroid condition: numerical integration of N(0, 1) over each cell."""
    c, t = lloyd_max(levels)
    z = np.linspace(-12.0, 12.0, 2_400_001)
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    cell = np.searchsorted(t, z)
    for i in range(levels):
        inside = cell == i
        mean = np.trapezoid(z[inside] * pdf[inside], z[inside]) / np.trapezoid(pdf[inside], z[inside])
        assert abs(mean - c[i]) < 1e-4, (levels, i, mean, c[i])
    if levels in MAX_1960:
        np.testing.assert_allclose(c[levels // 2 :], MAX_1960[levels], atol=5e-4)


def test_two_levels_and_known_distortions():
    c, _ = lloyd_max(2)
    assert c[1] == pytest.approx(math.sqrt(2 / math.pi), abs=1e-12)
    assert lloyd_max_distortion(2) == pytest.approx(1 - 2 / math.pi, abs=1e-12)
    # Max (1960): 0.1175, 0.03455, 0.009497 for 4, 8, 16 levels
    for levels, mse in [(4, 0.1175), (8, 0.03455), (16, 0.009497)]:
        assert lloyd_max_distortion(levels) == pytest.approx(mse, rel=1e-3)
    for b, published in PUBLISHED.items():
        assert eden_vnmse(b) == pytest.approx(published, rel=1e-2)


# ---------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    "spec", [{"bits": 0}, {"bits": -1}, {"bits": 8.5}, {"bits": 1.5, "coding": "entropy"}, {"bucket_size": 500}]
)
def test_bad_parameters_are_refused(spec):
    with pytest.raises(ValueError, match="eden"):
        EdenQuantizer(**spec)


# ---------------------------------------------------------------- rates
def body_size(q: EdenQuantizer, n: int) -> int:
    """Scales and index streams, computed from the rates alone."""
    lo, hi = math.floor(q.bits + 1e-9), q.hi_count(n)
    scales = -(-n // q.bucket_size)
    return 2 * scales + (packed_size(n - hi, lo) if lo else 0) + (packed_size(hi, lo + 1) if hi else 0)


@pytest.mark.parametrize("bits", [0.25, 0.5, 1.0, 1.07, 1.5, 2.0, 2.3, 3.0, 4.0, 5.5, 8.0])
@pytest.mark.parametrize("bucket_size", [128, 512])
def test_bits_counted_from_payload_bytes(bits, bucket_size):
    n = 1 << 16
    codec = bare(bits=bits, bucket_size=bucket_size)
    payload = codec.encode(gaussian(n, 1), seed=3)
    assert len(payload) == header_size(1, codec.wire_spec) + body_size(codec.quantizer, n)
    index_bits = 8 * (len(payload) - header_size(1, codec.wire_spec)) / n - 16 / bucket_size
    assert bits - 1e-3 < index_bits <= bits + 1e-3


def test_split_is_seeded_exact_and_regenerated():
    q = EdenQuantizer(bits=1.3)
    m1, m2, m3 = q.hi_mask(1000, 7), q.hi_mask(1000, 7), q.hi_mask(1000, 8)
    assert int(m1.sum()) == 300 and torch.equal(m1, m2) and not torch.equal(m1, m3)
    assert int(EdenQuantizer(bits=0.001).hi_mask(10, 1).sum()) == 1  # something is always sent


def test_entropy_coding_sends_the_same_values_in_fewer_bytes():
    x = gaussian(1 << 16, 2)
    fixed, entropy = bare(bits=2), bare(bits=2, coding="entropy")
    pf, pe = fixed.encode(x, seed=4), entropy.encode(x, seed=4)
    assert torch.equal(fixed.decode(pf, seed=4), entropy.decode(pe, seed=4))
    # 4 Lloyd–Max cells of N(0, 1) hold 0.163, 0.337, 0.337, 0.163: entropy 1.911 bits, + 16/512 for scales
    bits = 8 * len(pe) / x.numel()
    assert 1.93 < bits < 1.96


# ---------------------------------------------------------------- error and bias
@pytest.mark.parametrize("b", [1, 2, 3, 4])
def test_vnmse_on_gaussian_matches_eden(b):
    n = 1 << 16
    errs = []
    for seed in (1, 2):
        x = gaussian(n, seed)
        y = bare(bits=b).decode(bare(bits=b).encode(x, seed=seed), seed=seed)
        errs.append(float((y.double() - x.double()).square().sum() / x.double().square().sum()))
    assert np.mean(errs) == pytest.approx(PUBLISHED[b], rel=0.03)


@pytest.mark.parametrize("bits", [0.5, 1.5, 2.5])
def test_fractional_rates_follow_the_mixture_formula(bits):
    x = gaussian(1 << 16, 5)
    codec = bare(bits=bits)
    y = codec.decode(codec.encode(x, seed=9), seed=9)
    vnmse = float((y.double() - x.double()).square().sum() / x.double().square().sum())
    assert vnmse == pytest.approx(eden_vnmse(bits), rel=0.05)


@pytest.mark.parametrize("bits", [1.0, 1.5, 0.5, 3.0])
def test_unbiased_over_random_rotations(bits):
    """The mean of T decodes of a spiky vector, each behind its own Haar rotation.

    If the estimate is unbiased, ``E||mean - x||^2 = E||x_hat - x||^2 / T``; a bias would add
    ``||bias||^2`` (without the unbiasing scale, 1 bit gives ``(2/pi)`` times ``x``: 0.13 ||x||^2,
    a hundred times the variance term here). The bound allows three times the variance term.
    """
    d, trials = 64, 400
    gen = torch.Generator().manual_seed(11)
    x = torch.zeros(d, dtype=torch.float64)
    x[:5] = torch.tensor([3.0, -1.0, 0.5, 0.0, 2.0])
    x[5:] = 0.1 * torch.randn(d - 5, generator=gen, dtype=torch.float64)
    # Uniformly random orthogonal matrices: QR of Gaussian matrices, signs fixed.
    q, r = torch.linalg.qr(torch.randn(trials, d, d, generator=gen, dtype=torch.float64))
    rots = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    ys = (rots @ x).float()
    codec = bare(bits=bits)
    decoded = torch.stack([codec.decode(codec.encode(ys[t], seed=t), seed=t) for t in range(trials)]).double()
    x_hat = (rots.transpose(-1, -2) @ decoded.unsqueeze(-1)).squeeze(-1)
    variance_term = float((x_hat - x).square().sum()) / trials**2
    mean_err = float((x_hat.mean(0) - x).square().sum())
    assert mean_err <= 3 * variance_term, (mean_err, variance_term)


def test_zero_vector_and_scale_side_data():
    codec = bare(bits=2, bucket_size=128)
    x = gaussian(300, 3)
    x[128:256] = 0  # a zero bucket
    payload = codec.encode(x, seed=1)
    scales = struct.unpack_from("<3H", payload, len(payload) - 4 - body_size(codec.quantizer, 300))
    assert scales[0] > 0 and scales[1] == 0 and scales[2] > 0
    # In each bucket the estimate has <x_hat, x> = ||x||^2 (the unbiasing scale), up to its bfloat16 step.
    y = codec.decode(payload, seed=1).double()
    for b in (slice(0, 128), slice(128, 256), slice(256, 300)):
        assert float(y[b] @ x[b].double()) == pytest.approx(float(x[b].double().square().sum()), rel=2**-7)
    assert torch.equal(y[128:256], torch.zeros(128, dtype=torch.float64))


# ---------------------------------------------------------------- bad payloads
def bfloat16(value: float) -> int:
    """The bfloat16 bit pattern (truncated) of a float."""
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


@pytest.mark.parametrize("bits", [2.0, 1.5, 0.5])
def test_bad_payloads_raise_payload_error(bits):
    n = 999  # not a multiple of 8: the streams end in padding bits
    codec = bare(bits=bits)
    x = gaussian(n, 4)
    payload = codec.encode(x, seed=2)
    start = len(payload) - 4 - body_size(codec.quantizer, n)
    codec.decode(payload, seed=2)  # the original decodes
    with pytest.raises(PayloadError):
        codec.decode(payload[:-5] + payload[-4:], seed=2)  # truncated body
    for scale in (-1.0, float("nan"), float("inf")):
        bad = bytearray(payload)
        struct.pack_into("<H", bad, start + 2, bfloat16(scale))  # the second bucket's
        with pytest.raises(PayloadError, match="scale"):
            codec.decode(reseal(bad), seed=2)
    if bits >= 1.5:  # an outer centroid above 1: a finite scale can overflow float32
        bad = bytearray(payload)
        struct.pack_into("<H", bad, start, bfloat16(3e38))
        with pytest.raises(PayloadError, match="NaN or Inf"):
            codec.decode(reseal(bad), seed=2)
    bad = bytearray(payload)
    bad[-5] |= 0x80  # a padding bit of the last stream
    with pytest.raises(PayloadError, match="padding"):
        codec.decode(reseal(bad), seed=2)
    with pytest.raises(PayloadError):
        codec.decode(payload, seed=2, shape=(n + 1,))
    with pytest.raises(PayloadError):
        bare(bits=bits + 1).decode(payload, seed=2)


# ---------------------------------------------------------------- behind the rotation
def test_eden_implies_the_rotation():
    assert get_codec("eden:bits=2") == get_codec("rht+eden:bits=2")
    assert get_codec("eden:bits=2").name == "rht+eden"
    assert get_codec("ef+eden").spec == get_codec("ef+rht+eden").spec == "ef+rht+" + EdenQuantizer().spec


def test_unbiased_over_seeds_behind_rht():
    """Averaging decodes over seeds (new rotation signs and split each time) of a layered vector.

    The Hadamard rotation is not uniform: a block dominated by one spike keeps a bias (see the
    module docstring), so this vector has none.
    """
    d, trials = 1024, 200
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(d, generator=gen) * torch.linspace(0.01, 1.0, d)
    for spec in ("eden:bits=1", "eden:bits=1.5", "eden:bits=0.5"):
        codec = get_codec(spec)
        x_hat = torch.stack([codec.decode(codec.encode(x, seed=s), seed=s) for s in range(trials)]).double()
        variance_term = float((x_hat - x.double()).square().sum()) / trials**2
        mean_err = float((x_hat.mean(0) - x.double()).square().sum())
        assert mean_err <= 3 * variance_term, (spec, mean_err, variance_term)


def test_vnmse_behind_rht_on_laplace_input():
    n = 1 << 16
    u = torch.rand(n, generator=torch.Generator().manual_seed(8), dtype=torch.float64) - 0.5
    x = (-torch.sign(u) * torch.log1p(-2 * u.abs())).float()
    for b in (1, 2, 3):
        codec = get_codec(f"eden:bits={b}")
        y = codec.decode(codec.encode(x, seed=1), seed=1)
        vnmse = float((y.double() - x.double()).square().sum() / x.double().square().sum())
        assert vnmse == pytest.approx(PUBLISHED[b], rel=0.04)


def test_bfloat16_scales_are_rounded_without_bias():
    """The stochastic rounding of a scale to bfloat16 averages to the scale (bound: 4 standard errors)."""
    from fedquant.codecs.quantizers.eden import _from_bfloat16, _scales

    target = 1 / 3  # between two bfloat16 values
    sq, dot = np.array([target]), np.ones(1)
    values = np.array([_from_bfloat16(_scales(sq, dot, seed))[0] for seed in range(2000)], np.float64)
    lo, hi = values.min(), values.max()
    assert lo < target < hi and hi - lo == pytest.approx(2.0**-9, rel=1e-6)  # one bfloat16 step at 1/3
    assert abs(values.mean() - target) < 4 * (hi - lo) / 2 / math.sqrt(values.size)


@pytest.mark.parametrize("bits", [1.0, 1.5, 3.3])
def test_values_near_the_float32_range_are_refused_or_decode_finite(bits):
    codec = get_codec(f"eden:bits={bits}")
    x = torch.tensor([3.3e38, -3.0e38, 1.0e38, 2.0])
    try:
        payload = codec.encode(x, seed=3)
    except ValueError:
        return
    assert torch.isfinite(codec.decode(payload, seed=3)).all()


# ---------------------------------------------------------------- numba kernels and their torch twin
def torch_twin(codec: Codec) -> Codec:
    """The same codec running the torch path on CPU."""
    twin = get_codec(codec.spec)
    twin.quantizer.force_torch = True
    return twin


SIZES = [0, 1, 7, 300, 1000, PARALLEL_MIN - 3, PARALLEL_MIN + 777]


@pytest.mark.parametrize(
    "spec",
    [
        "eden:bits=1",
        # packed 1- and 2-bit indices read straight into the inverse's first sweep, beside blocks
        # of fewer than 32 and a last block kept in part (the general path), buckets smaller than
        # a block and blocks smaller than a bucket
        "eden:bits=2",
        "rht:min_log2=3+eden:bits=2",
        "rht:max_log2=9,min_log2=5+eden:bits=1,bucket_size=64",
        "rht:max_log2=6,min_log2=2+eden:bits=2,bucket_size=128",
        "eden:bits=3,bucket_size=64",
        "eden:bits=8",
        "eden:bits=2,coding=entropy,bucket_size=128",
        "eden:bits=1.037",
        "eden:bits=2.5,bucket_size=64",
        "eden:bits=0.5",
        "eden:bits=0.001",
        "eden:bits=7.9",
    ],
)
def test_kernels_give_the_torch_bytes_and_values(spec):
    """Same payload bytes and decoded values on both paths (sizes across the serial/parallel switch,
    short last buckets, empty and one element); the float64 sums may differ in their last bit,
    which changes an index or a bfloat16 scale only with negligible probability."""
    codec = get_codec(spec)
    twin = torch_twin(codec)
    assert codec.quantizer.uses_kernels() and not twin.quantizer.uses_kernels()
    for n in SIZES:
        for seed in (0, 5):
            x = 3 * gaussian(n, seed)
            payload = codec.encode(x, seed=seed)
            assert payload == twin.encode(x, seed=seed), (n, seed)
            decoded = codec.decode(payload, seed=seed, shape=(n,))
            assert torch.equal(decoded, twin.decode(payload, seed=seed, shape=(n,))), (n, seed)
            if n:
                assert 0 < float(decoded @ x) / float(x @ x) < 2  # an estimate of x, not noise


@pytest.mark.parametrize("bits", [1.3, 0.2])
def test_split_plan_fallback_gives_the_same_bytes(bits, monkeypatch):
    """A threshold outside the counting window (forced by a window of 0.01 standard deviations)
    takes the exact path over all uniforms: same plan, same bytes."""
    codec = get_codec(f"eden:bits={bits}")
    x = gaussian(3 * PARALLEL_MIN + 5, 4)
    payload = codec.encode(x, seed=6)
    decoded = codec.decode(payload, seed=6)
    calls = []
    exact = eden._plan_exact
    monkeypatch.setattr(eden, "_plan_exact", lambda *a: calls.append(a) or exact(*a))
    monkeypatch.setattr(eden, "WINDOW_SIGMAS", 0.01)
    assert codec.encode(x, seed=6) == payload
    assert torch.equal(codec.decode(payload, seed=6), decoded)
    assert len(calls) == 2  # encode and decode both fell back


@pytest.mark.parametrize("n", [1, 100, 2 * common.CHUNK + 3, 5 * common.CHUNK])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.5, 0.999, 1.0])
def test_split_plan_chooses_the_smallest_uniforms_chunk_by_chunk(n, fraction):
    key = np.uint64(12345)
    k = min(n, int(fraction * n))
    threshold, r, hi_before, ties_before = eden.split_plan(key, n, k)
    u24 = (common.uniform_stream(key, n, 0) * np.float32(1 << 24)).astype(np.int64)
    order = np.lexsort((np.arange(n), u24))
    chosen = np.zeros(n, bool)
    chosen[order[:k]] = True
    assert np.array_equal(chosen, (u24 < threshold) | ((u24 == threshold) & (np.cumsum(u24 == threshold) <= r)))
    starts = np.arange(0, n + common.CHUNK, common.CHUNK).clip(max=n)
    assert np.array_equal(hi_before, np.concatenate([[0], np.cumsum(chosen)])[starts])


@pytest.mark.parametrize("bits", [1, 2, 5])
def test_kernel_decode_refuses_symbols_beyond_the_centroids(bits):
    q = EdenQuantizer(bits=bits)
    n = 1000
    side = [np.full(2, bfloat16(1.0), np.uint16)]
    good = np.arange(n, dtype=np.uint8) % (1 << bits)
    centroids = lloyd_max(1 << bits)[0].astype(np.float32)
    np.testing.assert_array_equal(q.dequantize(side, good, n, 0).numpy(), centroids[good])
    for dtype in (np.uint8, np.uint16):
        bad = good.astype(dtype)
        bad[n - 1] = 1 << bits
        with pytest.raises(PayloadError, match="beyond|outside"):
            q.dequantize(side, bad, n, 0)
    with pytest.raises(PayloadError):
        q.dequantize(side, good[:-1], n, 0)  # too few symbols for the kernel
    with pytest.raises(PayloadError):
        q.dequantize_packed(side, np.zeros(packed_size(n, bits) - 1, np.uint8), bits, n, 0)


_CACHE_PROBE = """
import torch
from fedquant.codecs import get_codec
from fedquant import jit
from fedquant.codecs.kernels import common, eden
for spec in ("eden:bits=2", "eden:bits=2,coding=entropy"):
    codec = get_codec(spec)
    for n in (100, common.PARALLEL_MIN):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        codec.decode(codec.encode(x, seed=1), seed=1)
used = [fn for fn in jit.module_dispatchers(eden) if fn.signatures]
print(len(used), sum(sum(fn.stats.cache_misses.values()) for fn in used))
"""


def test_kernels_load_from_cache_in_a_fresh_process():
    """Both versions of each switched kernel run, and a fresh process loads all of them from numba's cache
    (a second one, when the first had to compile them)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    for _ in "ab":  # a second process only when the first had to compile (a cold cache)
        run = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr
        used, compiled = map(int, run.stdout.split())
        if not compiled:
            break
    assert used == 4 and compiled == 0  # quantize and dequantize, serial and parallel


def test_a_scale_too_large_for_float32_saturates_without_a_warning():
    # Fuzzed inputs met ||y||^2 / <c, y> above float32's range: the scale saturates at bfloat16's
    # largest finite value (0x7F7F), silently, like any other clamp, instead of warning on overflow.
    import warnings

    from fedquant.codecs.quantizers.eden import _scales

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raw = _scales(np.array([1e300, 1.0, 0.0]), np.array([1e-300, 0.5, 0.0]), seed=1)
    assert raw[0] == 0x7F7F and raw[2] == 0
    assert 0x3FFF <= raw[1] <= 0x4000  # 2.0 in bfloat16, stochastically rounded from 2.0 exactly
