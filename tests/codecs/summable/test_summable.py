"""The summable integer codec: exact modular sums, error against theory, wrap-around, clipping, noise."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fedquant.codecs.summable import (
    ScaleRule,
    SumGrid,
    decode_sum,
    discrete_gaussian,
    encode_update,
    expected_mean_error,
    modulus_bound,
    to_signed,
    wrap_bound,
    wrapped,
)
from fedquant.codecs.summable.grid import block_norms
from fedquant.wire.bitpack import pack_bits, unpack_bits


def updates(n: int, d: int, seed: int, spread: float = 1.0) -> list[torch.Tensor]:
    """Correlated client updates (a common direction plus per-client parts), unequal layer scales."""
    rng = np.random.default_rng(seed)
    scale = np.where(np.arange(d) < d // 3, 3.0, 0.3)
    common = rng.standard_normal(d) * scale * 0.01
    own = [spread * 0.01 * scale * rng.standard_normal(d) for _ in range(n)]
    return [torch.tensor(common + o, dtype=torch.float32) for o in own]


def modular_sum(values: list[np.ndarray], bits: int) -> np.ndarray:
    total = np.zeros_like(values[0], dtype=np.uint64)
    for v in values:
        total += v
    return (total % (1 << bits)).astype(np.uint32)


@pytest.mark.parametrize("width", [17, 20, 23, 24, 31, 32])
def test_bit_packer_widths_above_16(width):
    v = np.random.default_rng(width).integers(0, 1 << width, size=777, dtype=np.uint64)
    packed = pack_bits(v, width)
    assert packed.size == (777 * width + 7) // 8
    assert np.array_equal(unpack_bits(packed, width, 777).astype(np.uint64), v)


@pytest.mark.parametrize("rounding", ["dither", "stochastic"])
def test_modular_sum_of_encodings_is_the_sum_of_the_integer_updates(rounding):
    n, d = 20, 3000
    xs = updates(n, d, 1)
    grid = ScaleRule(quantizer_bits=3, clip=1.0, rounding=rounding).grid(d, n, 7, torch.stack(xs).mean(0).numpy())
    encs = [encode_update(x, grid, 100 + i, rng=np.random.default_rng(i)) for i, x in enumerate(xs)]
    integer_sum = sum(e.integers for e in encs)
    total = modular_sum([e.values for e in encs], grid.bits)
    assert np.array_equal(total, (integer_sum & (grid.modulus - 1)).astype(np.uint32))
    assert wrapped(integer_sum, grid.bits) == 0
    assert np.array_equal(to_signed(total, grid.bits), integer_sum)  # no wrap: the signed read is exact
    assert all(int(e.values.max()) < grid.modulus for e in encs)


@pytest.mark.parametrize("d", [8192, 3000])
def test_decoded_mean_error_matches_dither_theory(d):
    """E||mean_hat - mean||^2 = sum_k d_k step_k^2 n / (12 W^2); 5 sigma of the chi-square-like spread."""
    n, trials = 20, 4
    ratios, weights = [], None
    for trial in range(trials):
        xs = updates(n, d, 10 + trial)
        mean = torch.stack(xs).mean(0)
        grid = ScaleRule(quantizer_bits=2, clip=5.0).grid(d, n, 50 + trial, mean.numpy())
        encs = [encode_update(x, grid, 1000 * trial + i) for i, x in enumerate(xs)]
        decoded = decode_sum(modular_sum([e.values for e in encs], grid.bits), grid,
                             [1000 * trial + i for i in range(n)], sum(e.weight_units for e in encs))
        ratios.append(float(((decoded.double() - mean.double()) ** 2).sum()) / expected_mean_error(grid, n, n))
        weights = grid.real_elements_per_block() * np.asarray(grid.steps) ** 2
    # Each rotated coordinate's error is a sum of n uniforms: its square has relative variance < 2.
    # Weighted by step^2 over d coordinates, the relative spread is sqrt(2 / n_eff) per trial.
    counts = grid.real_elements_per_block()
    n_eff = weights.sum() ** 2 / np.sum(weights**2 / counts)
    bound = 5 * math.sqrt(2.0 / (n_eff * trials)) + (0.05 if d % 512 else 0.0)  # tail block: truncation
    assert abs(np.mean(ratios) - 1.0) < bound, (ratios, bound)


def test_stochastic_rounding_is_unbiased_and_within_its_variance_bound():
    n, d, trials = 8, 2048, 16
    xs = updates(n, d, 3)
    mean = torch.stack(xs).mean(0).double()
    grid = ScaleRule(quantizer_bits=1, clip=5.0, rounding="stochastic").grid(d, n, 9, mean.numpy())
    bound_one = float(np.sum(grid.real_elements_per_block() * np.asarray(grid.steps) ** 2)) / 4 / n  # <= step^2/4 each
    decoded = []
    for t in range(trials):
        encs = [encode_update(x, grid, 0, rng=np.random.default_rng([t, i])) for i, x in enumerate(xs)]
        decoded.append(decode_sum(modular_sum([e.values for e in encs], grid.bits), grid, [], n * 65536).double())
        assert float(((decoded[-1] - mean) ** 2).sum()) < 1.5 * bound_one
    average = torch.stack(decoded).mean(0)
    assert float(((average - mean) ** 2).sum()) < 3 * bound_one / trials  # unbiased: shrinks as 1/trials


def test_wrap_frequency_stays_below_the_bound():
    """Force too few bits: the measured wrap rate per coordinate must stay under the sub-Gaussian bound."""
    n, d, q = 20, 16384, 3
    xs = updates(n, d, 4, spread=0.2)
    mean = torch.stack(xs).mean(0).numpy()
    grid = ScaleRule(quantizer_bits=q, clip=5.0, growth=1.0).grid(d, n, 11, mean)
    assert wrapped(sum(encode_update(x, grid, i).integers for i, x in enumerate(xs)), grid.bits) == 0
    for bits in range(grid.bits - 1, grid.bits - 5, -1):
        small = dataclasses.replace(grid, bits=bits)
        integer_sum = sum(encode_update(x, small, i).integers for i, x in enumerate(xs))
        rate = wrapped(integer_sum, bits) / grid.padded_numel
        per_coordinate = wrap_bound(bits, n, q, 0.0, 1)
        assert rate <= per_coordinate + 4 * math.sqrt(per_coordinate / grid.padded_numel), (bits, rate, per_coordinate)
    assert rate > 0  # the narrowest width does wrap: the measurement can see it


def test_rule_sizes_bits_from_n_and_never_from_a_client():
    rule = ScaleRule(quantizer_bits=4, clip=2.0)
    grid = rule.grid(13706, 20, 1)
    assert grid.bits == 4 + math.ceil(math.log2(20)) + 3 and grid.wrap_bound <= rule.wrap_probability
    assert max(grid.steps) == pytest.approx(2 * 2.0 / math.sqrt(min(1 << k for k in grid.blocks)) / 16)
    mean = np.concatenate([np.full(512, 1e-3), np.zeros(13706 - 512)])
    adapted = rule.grid(13706, 20, 1, mean)
    norms = block_norms(mean, 13706)
    assert adapted.steps[0] == pytest.approx(2 * 2 * norms[0] / math.sqrt(512) / 16)
    assert adapted.steps[1] == pytest.approx(2 * 2.0 * 2**-24 / math.sqrt(512) / 16)  # zero block: floor
    huge = rule.grid(13706, 20, 1, mean * 1e9)
    assert huge.steps[0] == grid.steps[0]  # capped at the clip
    assert rule.grid(13706, 1000, 1).bits == 4 + 10 + 3


def test_grid_round_trips_through_the_round_config_and_rejects_bad_entries():
    grid = ScaleRule(noise_multiplier=0.5).grid(3000, 10, 5, None)
    back = SumGrid.from_config(grid.to_config("g."), "g.")
    assert (back.bits, back.steps, back.clip, back.numel, back.rotation_seed) == (
        grid.bits, grid.steps, grid.clip, grid.numel, grid.rotation_seed)
    assert back.noise_variance == grid.noise_variance
    for key, value in (("g.bits", 40), ("g.steps", [1.0]), ("g.numel", -1), ("g.rounding", "round"),
                       ("g.clip", float("nan")), ("g.bits", True), ("g.steps", [-1.0] * len(grid.steps))):
        with pytest.raises(ValueError):
            SumGrid.from_config({**grid.to_config("g."), key: value}, "g.")


def test_a_client_that_ignores_the_clip_is_bounded_by_the_modulus():
    n, d = 10, 4096
    xs = updates(n, d, 6)
    grid = ScaleRule(quantizer_bits=3, clip=1.0).grid(d, n, 2, torch.stack(xs).mean(0).numpy())
    honest = [encode_update(x, grid, i) for i, x in enumerate(xs)]
    # The attacker skips clipping: it encodes 1e4 times its update on a grid with an infinite clip.
    cheat = encode_update(xs[0] * 1e4, dataclasses.replace(grid, clip=1e30), 0)
    values = [cheat.values] + [e.values for e in honest[1:]]
    decoded = decode_sum(modular_sum(values, grid.bits), grid, list(range(n)), n * 65536)
    clean = decode_sum(modular_sum([e.values for e in honest], grid.bits), grid, list(range(n)), n * 65536)
    moved = float(torch.linalg.vector_norm(decoded - clean))
    assert moved <= 2 * modulus_bound(grid, n)  # both decodes lie within the modulus box
    assert float(torch.linalg.vector_norm(xs[0] * 1e4)) / n > 10 * modulus_bound(grid, n)  # what it wanted
    clipped = encode_update(xs[0] * 1e4, grid, 0)  # the honest path clips to the bound
    assert clipped.clipped and clipped.norm > grid.clip


def test_discrete_gaussian_variance_and_pmf():
    for variance in (0.7, 4.0, 250.0):
        x = discrete_gaussian(np.random.default_rng(1), variance, 200_000)
        exact = np.arange(-int(12 * math.sqrt(variance)) - 5, int(12 * math.sqrt(variance)) + 6)
        pmf = np.exp(-(exact.astype(float) ** 2) / (2 * variance))
        pmf /= pmf.sum()
        true_var = float(np.sum(pmf * exact**2))
        assert true_var <= variance + 1e-9
        fourth = float(np.sum(pmf * exact.astype(float) ** 4))
        assert abs(x.var() - true_var) < 5 * math.sqrt((fourth - true_var**2) / x.size)
        assert abs(x.mean()) < 5 * math.sqrt(true_var / x.size)
        if variance < 10:  # chi-square against the exact pmf on the central support
            keep = pmf * x.size > 20
            observed = np.array([(x == k).sum() for k in exact[keep]])
            expected = pmf[keep] * x.size
            chi2 = float(np.sum((observed - expected) ** 2 / expected))
            assert chi2 < keep.sum() + 6 * math.sqrt(2 * keep.sum()), chi2
    assert discrete_gaussian(np.random.default_rng(0), 0.0, 5).tolist() == [0] * 5


def test_noise_adds_its_variance_to_the_decoded_mean():
    n, d, trials = 10, 4096, 3
    xs = updates(n, d, 8)
    mean = torch.stack(xs).mean(0)
    grid = ScaleRule(quantizer_bits=3, clip=5.0, noise_multiplier=0.05).grid(d, n, 3, mean.numpy())
    assert grid.noise_variance > 1
    errs = []
    for t in range(trials):
        encs = [encode_update(x, grid, 10 * t + i, rng=np.random.default_rng([t, i])) for i, x in enumerate(xs)]
        decoded = decode_sum(modular_sum([e.values for e in encs], grid.bits), grid, [10 * t + i for i in range(n)],
                             n * 65536)
        errs.append(float(((decoded - mean).double() ** 2).sum()))
    assert abs(np.mean(errs) / expected_mean_error(grid, n, n) - 1) < 5 * math.sqrt(2 / (d * trials))


def test_encode_rejects_bad_updates():
    grid = ScaleRule().grid(100, 2, 0)
    with pytest.raises(ValueError, match="NaN"):
        encode_update(torch.full((100,), float("nan")), grid, 0)
    with pytest.raises(ValueError, match="elements"):
        encode_update(torch.zeros(99), grid, 0)
    with pytest.raises(ValueError, match="weight"):
        encode_update(torch.zeros(100), grid, 0, weight=1.5)
