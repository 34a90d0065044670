"""benchmarks.sub_bit_frontier: the subsample's vNMSE formula against a Monte Carlo, and the bound."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.sub_bit_frontier import shannon_unbiased, subsample_vnmse


def test_subsample_vnmse_matches_a_monte_carlo_of_the_scaled_subsample():
    rng = np.random.default_rng(0)
    n, keep, d = 400_000, 0.65, 0.8
    x = rng.standard_normal(n)
    noisy = x + rng.standard_normal(n) * math.sqrt(d)  # an unbiased codec of vNMSE d on i.i.d. data
    kept = rng.random(n) < keep
    estimate = np.where(kept, noisy / keep, 0.0)
    measured = float(np.sum((estimate - x) ** 2) / np.sum(x**2))
    assert math.isclose(measured, subsample_vnmse(d, keep), rel_tol=0.02)
    assert subsample_vnmse(d, 1.0) == d


def test_the_unbiased_bound_is_one_at_half_a_bit():
    assert math.isclose(shannon_unbiased(0.5), 1.0)
    assert shannon_unbiased(1.0) < shannon_unbiased(0.75) < shannon_unbiased(0.5)
