"""Distributed DP: the noise the grid asks for, and the (epsilon, delta) the ledger reports."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event  # the "dp" extra (in "dev" too)
from dp_accounting.rdp import RdpAccountant

from fedquant.codecs.summable import ScaleRule
from fedquant.secagg.accounting import PrivacyLedger, ddg_rho


def test_rho_tends_to_the_gaussian_one_and_grows_for_tiny_noise():
    # sigma^2 = 100: tau ~ 10 n e^{-pi^2 100} = 0, the bound is the Gaussian Delta^2 / (2 n sigma^2)
    assert ddg_rho(50.0, 100.0, 20, 10_000) == pytest.approx(50.0**2 / (2 * 20 * 100.0), rel=1e-12)
    # sigma^2 = 0.05: the discrete correction tau * d dominates and rho is larger
    assert ddg_rho(1.0, 0.05, 20, 10_000) > 1.0**2 / (2 * 20 * 0.05)
    assert ddg_rho(1.0, 1.0, 0, 10) == math.inf


def test_grid_noise_makes_the_sum_carry_multiplier_times_sensitivity():
    grid = ScaleRule(quantizer_bits=2, clip=1.0, noise_multiplier=0.8).grid(13706, 20, 1)
    total_std = math.sqrt(20 * grid.noise_variance)
    assert total_std == pytest.approx(0.8 * grid.l2_sensitivity())
    assert grid.wrap_bound <= 1e-6  # the headroom grew to hold the noise


def test_ledger_composes_rounds_like_the_equivalent_gaussian():
    rule = ScaleRule(quantizer_bits=2, clip=1.0, noise_multiplier=1.2)
    grid = rule.grid(13706, 20, 1)
    ledger = PrivacyLedger(delta=1e-5)
    rhos = [ledger.record(grid, survivors=18) for _ in range(10)]
    rho = grid.l2_sensitivity() ** 2 / (2 * 17 * grid.noise_variance)  # other survivors' noise only
    assert rhos[0] == pytest.approx(rho, rel=1e-9)
    reference = RdpAccountant()
    reference.compose(dp_event.GaussianDpEvent(1 / math.sqrt(2 * rho)), 10)  # same RDP curve alpha * rho
    assert ledger.epsilon() == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    assert ledger.round_epsilon(rho) < ledger.epsilon()
    noiseless = PrivacyLedger(delta=1e-5)
    noiseless.record(ScaleRule().grid(100, 5, 1), 5)
    assert noiseless.epsilon() == math.inf
