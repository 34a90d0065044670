"""BinGrad-b (exact 2-means) and BinGrad-pb (clip outside, unbiased inside) codecs."""

import itertools

import numpy as np
import pytest
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.kernels import levels as kernels
from fedquant.codecs.kernels import levels_torch as L
from fedquant.codecs.kernels.common import PARALLEL_MIN, kernel_key
from fedquant.codecs.kernels.levels_torch import nearest_of_two
from fedquant.wire import read_payload
from fedquant.wire.bitpack import packed_size
from tests.helpers import cuda, sample_tensor


def _small_buckets(seed: int, count: int = 12, n: int = 12) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal(n), rng.laplace(size=n), rng.standard_t(2, size=n), rng.integers(-2, 3, n)]
    out += [rng.standard_normal(n) * rng.uniform(0.1, 5) for _ in range(count - len(out))]
    return [np.sort(w.astype(np.float32)) for w in out]


def _levels(fn, w: np.ndarray) -> np.ndarray:
    return fn(torch.from_numpy(w)[None, :])[0].numpy().astype(np.float64)


def brute_force_two_means(w: np.ndarray) -> tuple[float, np.ndarray]:
    """Minimum within-cluster squared error over all 2^(n-1) two-cluster assignments of ``w``."""
    v = w.astype(np.float64)
    best = (np.inf, None)
    for bits in itertools.product([0, 1], repeat=v.size - 1):
        mask = np.array((0, *bits), bool)
        if mask.all() or not mask.any():
            continue
        a, b = v[~mask], v[mask]
        sse = ((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()
        if sse < best[0] - 1e-12:
            best = (sse, np.sort([a.mean(), b.mean()]))
    return best


def pb_error(w: np.ndarray, b0: float, b1: float) -> float:
    """Expected squared error J(b0, b1) of BinGrad-pb (algorithms.md §4.6)."""
    v = w.astype(np.float64)
    return float(np.where(v < b0, (b0 - v) ** 2, np.where(v > b1, (v - b1) ** 2, (b1 - v) * (v - b0))).sum())


# ---------------------------------------------------------------- BinGrad-b
def test_two_means_equals_brute_force():
    for w in _small_buckets(seed=0):
        sse, centres = brute_force_two_means(w)
        got = _levels(L.two_means_levels, w)
        assigned = np.where(w >= got.mean(), got[1], got[0])
        assert ((w - assigned) ** 2).sum() == pytest.approx(sse, rel=1e-6, abs=1e-9)
        assert got == pytest.approx(centres, rel=1e-6, abs=1e-6)


def test_two_means_of_one_or_equal_values():
    assert _levels(L.two_means_levels, np.array([3.5], np.float32)).tolist() == [3.5, 3.5]
    assert _levels(L.two_means_levels, np.full(7, -2.0, np.float32)).tolist() == [-2.0, -2.0]


def test_bingrad_b_decodes_to_the_nearer_level():
    codec = get_codec("bingrad-b:bucket_size=64")
    x = sample_tensor((300,), seed=3)
    levels = codec.quantizer.select_levels(x)
    y = codec.decode(codec.encode(x))
    rows = torch.nn.functional.pad(x, (0, 20)).view(5, 64)
    expect = torch.where(rows >= levels[:, :1].add(levels[:, 1:]) / 2, levels[:, 1:], levels[:, :1])
    assert torch.equal(y, expect.reshape(-1)[:300])


@pytest.mark.parametrize("dist", ["gauss", "laplace"])
def test_bingrad_b_error_never_exceeds_scaled_sign(dist):
    # Scaled sign is one particular 2-level nearest quantizer; the 2-means is the best one.
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal(64 * 512) if dist == "gauss" else rng.laplace(size=64 * 512))
    x = x.float()
    y = get_codec("bingrad-b").decode(get_codec("bingrad-b").encode(x)).view(64, 512)
    rows = x.view(64, 512)
    sign = rows.abs().mean(1, keepdim=True) * torch.sign(rows)
    assert torch.all(((y - rows) ** 2).sum(1) <= ((sign - rows) ** 2).sum(1) * (1 + 1e-6))


# ---------------------------------------------------------------- BinGrad-pb
def _pb_subgradient_gaps(w: np.ndarray, b0: float, b1: float) -> tuple[float, float, float, float]:
    """One-sided derivatives of J at (b0, b1) in each coordinate (algorithms.md §4.6 conditions)."""
    v = w.astype(np.float64)
    d0_left = 2 * (b0 - v[v < b0]).sum() - (b1 - v[(v >= b0) & (v <= b1)]).sum()
    d0_right = 2 * (b0 - v[v <= b0]).sum() - (b1 - v[(v > b0) & (v <= b1)]).sum()
    d1_right = -2 * (v[v > b1] - b1).sum() + (v[(v >= b0) & (v <= b1)] - b0).sum()
    d1_left = -2 * (v[v >= b1] - b1).sum() + (v[(v >= b0) & (v < b1)] - b0).sum()
    return d0_left, d0_right, d1_left, d1_right


@pytest.mark.parametrize("dist", ["gauss", "laplace", "student"])
def test_pb_levels_satisfy_the_optimality_conditions(dist):
    rng = np.random.default_rng(5)
    draw = {"gauss": rng.standard_normal, "laplace": rng.laplace, "student": lambda size: rng.standard_t(3, size)}
    w = np.sort(draw[dist](size=(20, 256)).astype(np.float32), axis=1)
    levels = L.partially_biased_levels(torch.from_numpy(w), max_sweeps=2000).numpy().astype(np.float64)
    for row, (b0, b1) in zip(w, levels, strict=True):
        scale = np.abs(row - row.mean()).sum()
        d0l, d0r, d1l, d1r = _pb_subgradient_gaps(row, b0, b1)
        # Zero lies in each coordinate's subdifferential, up to float32 rounding of the levels.
        tol = 1e-5 * scale
        assert d0l <= tol and d0r >= -tol and d1l <= tol and d1r >= -tol
        assert b0 <= b1


def test_pb_levels_match_a_grid_search():
    for w in _small_buckets(seed=6, n=16):
        b0, b1 = _levels(L.partially_biased_levels, w)
        grid = np.linspace(w[0], w[-1], 401).astype(np.float64)
        a, c, v = grid[:, None, None], grid[None, :, None], w.astype(np.float64)[None, None, :]
        j = np.where(v < a, (a - v) ** 2, np.where(v > c, (v - c) ** 2, (c - v) * (v - a))).sum(-1)
        best = j[np.triu_indices(grid.size)].min()  # pairs with b0 <= b1
        assert pb_error(w, b0, b1) <= best * (1 + 1e-6) + 1e-9


def test_pb_default_sweeps_are_close_to_convergence():
    w = np.sort(np.random.default_rng(7).standard_normal((100, 512)).astype(np.float32), axis=1)
    t = torch.from_numpy(w)
    default = L.partially_biased_levels(t).numpy()
    converged = L.partially_biased_levels(t, max_sweeps=2000).numpy()
    j_default = sum(pb_error(r, *lv) for r, lv in zip(w, default, strict=True))
    j_converged = sum(pb_error(r, *lv) for r, lv in zip(w, converged, strict=True))
    assert j_converged <= j_default <= j_converged * (1 + 1e-6)


def test_pb_is_unbiased_inside_and_clips_outside():
    codec = get_codec("bingrad-pb:bucket_size=64")
    x = sample_tensor((64,), seed=8)
    b0, b1 = codec.quantizer.select_levels(x)[0].tolist()
    inside = (x >= b0) & (x <= b1)
    trials = 2000
    total = torch.zeros(64, dtype=torch.float64)
    for seed in range(trials):
        y = codec.decode(codec.encode(x, seed=seed), seed=seed)
        assert torch.all(y[x < b0] == b0) and torch.all(y[x > b1] == b1)
        total += y.double()
    mean = total / trials
    sd = torch.sqrt((b1 - x.double()) * (x.double() - b0) / trials)
    # 6 standard deviations of the mean of `trials` Bernoulli roundings, per element.
    assert torch.all((mean - x.double())[inside].abs() <= 6 * sd[inside] + 1e-6)


# ---------------------------------------------------------------- parity, CUDA, wire
@pytest.mark.parametrize("n", [1000, PARALLEL_MIN + 77])
def test_numba_and_torch_give_the_same_levels_and_bits(n):
    x = sample_tensor((n,), seed=9) * torch.rand(n, generator=torch.Generator().manual_seed(9))
    x[:40] = 0.0
    for name in ("bingrad-b", "bingrad-pb"):
        codec = get_codec(name, bucket_size=256)
        levels = codec.quantizer.select_levels(x)
        assert torch.equal(levels, codec.quantizer._levels_torch(x)), name
    levels = get_codec("bingrad-b", bucket_size=256).quantizer.select_levels(x)
    bits = kernels.round_pack(x.numpy(), levels.numpy(), 256, kernel_key(1), True, 8)
    assert np.array_equal(bits, nearest_of_two(x, levels, 256).numpy())


@cuda
@pytest.mark.parametrize("spec", ["bingrad-b", "bingrad-pb", "bingrad-pb:clip=2.5,level_dtype=float16"])
def test_cuda_encode_gives_the_cpu_bytes(spec):
    codec = get_codec(spec)
    x = sample_tensor((3, 1000), seed=8)
    assert codec.encode(x.cuda(), seed=4) == codec.encode(x, seed=4)


@pytest.mark.parametrize("spec", ["bingrad-b", "bingrad-pb:level_dtype=float16"])
def test_one_bit_per_element_plus_two_levels_per_bucket(spec):
    codec = get_codec(spec)
    x = sample_tensor((5000,), seed=1)
    body = read_payload(codec.encode(x, seed=2)).body
    assert body.nbytes == 10 * 2 * (2 if codec.level_dtype == "float16" else 4) + packed_size(5000, 1)


def test_clip_is_applied_before_choosing_levels():
    x = sample_tensor((2048,), seed=2)
    x[0] = 50.0
    bound = 2.5 * x.std(correction=0).item()
    for spec in ("bingrad-b:clip=2.5", "bingrad-pb:clip=2.5"):
        codec = get_codec(spec)
        assert codec.decode(codec.encode(x, seed=1), seed=1).abs().max().item() <= bound * (1 + 1e-6)


@pytest.mark.parametrize("spec", ["bingrad-b", "bingrad-pb", "orq", "orq:levels=4", "linear"])
@pytest.mark.parametrize("seed", [0, 1, 98765])
def test_numba_and_torch_levels_agree_to_the_sign_of_zero(spec, seed):
    """Mostly zeros of both signs with ties (payload_identity's sparse input): the levels go on the
    wire as float32 bits, so a -0.0 against a 0.0 is a different payload. torch.maximum/minimum
    return either zero on such a tie; the twin takes the first argument, as the kernels do."""
    gen = torch.Generator().manual_seed(4097 + seed)
    x = torch.zeros(4097)
    x[::7] = torch.randint(-3, 4, (len(range(0, 4097, 7)),), generator=gen).float() * 0.25
    x[3::11] = -0.0
    quantizer = get_codec(spec).quantizer
    kernel, twin = quantizer.select_levels(x), quantizer._levels_torch(x)
    assert torch.equal(kernel.view(torch.int32), twin.view(torch.int32)), (spec, kernel[kernel != twin])
