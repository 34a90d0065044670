"""Federations that give clients too little data are flagged, with the fix, in the log and the history."""

from __future__ import annotations

import logging

import pytest

from simulations.federation_check import data_warnings
from simulations.settings import SimSettings

SYNTHETIC = SimSettings(dataset="synthetic", model="logreg")


def test_synthetic_on_flowers_default_federation_is_flagged_with_the_fix():
    # Issue 22: dataset="synthetic" on 2 supernodes ended at chance (0.116) without a hint.
    (warning,) = data_warnings(SYNTHETIC, 2)
    assert "2 supernodes" in warning and "near chance" in warning and "--num-supernodes 100" in warning


@pytest.mark.parametrize("nodes", [100, 10_000])
def test_synthetic_federations_that_hold_the_test_clients_pass(nodes):
    assert data_warnings(SYNTHETIC, nodes) == []


@pytest.mark.parametrize(("nodes", "flagged"), [(1, False), (20, False), (143, False), (144, True), (1000, True)])
def test_digits_clients_need_at_least_one_example_per_class_on_average(nodes, flagged):
    # 1,438 training digits, 10 classes: 143 clients hold 10.06 each, 144 hold 9.99.
    warnings = data_warnings(SimSettings(), nodes)
    assert bool(warnings) == flagged
    if flagged:
        assert "at most 143 supernodes" in warnings[0]


def test_the_warning_is_logged_and_kept_in_the_history(tmp_path, flwr_log, no_figures):
    from simulations.client_app import app as client_app
    from simulations.history import load_history
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    history = run_server(InProcessGrid(client_app, 2), {}, dataset="synthetic", model="logreg", rounds=1,
                         local_epochs=1, min_local_steps=1, codec="fp32", out_dir=str(tmp_path))  # fmt: skip
    assert load_history(history.folder)["warnings"] == history.warnings == data_warnings(SYNTHETIC, 2)
    logged = [r.getMessage() for r in flwr_log if r.levelno == logging.WARNING]
    assert any("near chance" in line for line in logged)
