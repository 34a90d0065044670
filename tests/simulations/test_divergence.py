"""Divergence detection: the monitor's rules, and a run that blows up says so in its log and history."""

from __future__ import annotations

import logging
import math

import pytest

from simulations.divergence import DIVERGED_COLUMN, DivergenceMonitor


def _feed(monitor: DivergenceMonitor, accuracies, losses=None) -> list[str | None]:
    losses = losses or [0.5] * len(accuracies)
    return [monitor.check(r, acc, loss) for r, (acc, loss) in enumerate(zip(accuracies, losses), 1)]


def test_the_collapse_of_the_issue_is_flagged_at_its_first_round():
    # The 2-supernode run of the issue (old defaults): ~0.95, then chance for the rest of the run.
    monitor = DivergenceMonitor(num_classes=10)
    flags = _feed(monitor, [0.90, 0.95, 0.89, 0.84, 0.77, 0.11, 0.10, 0.19])
    assert [f is not None for f in flags] == [False] * 5 + [True] * 3
    assert monitor.first_round == 6 and "collapsed" in monitor.reason and monitor.diverged


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_is_divergence_even_before_any_learning(bad):
    monitor = DivergenceMonitor(num_classes=10)
    flags = _feed(monitor, [0.1, 0.1], [2.3, bad])
    assert flags[0] is None and "not finite" in flags[1] and monitor.first_round == 2


def test_no_alarm_for_runs_that_learn_noisily_or_never_learned():
    # Non-iid runs swing by tens of points; a drop that keeps a quarter of the gain is not a collapse.
    noisy = DivergenceMonitor(num_classes=10)
    assert _feed(noisy, [0.5, 0.8, 0.45, 0.3, 0.85, 0.9]) == [None] * 6
    # A model that never got 0.2 above chance has nothing to lose: slow, not diverged.
    slow = DivergenceMonitor(num_classes=10)
    assert _feed(slow, [0.12, 0.25, 0.11, 0.10]) == [None] * 4 and not slow.diverged


def test_the_threshold_is_the_lost_share_of_the_gain_over_chance():
    # best 0.9 on 10 classes: gain 0.8; losing 75 % of it leaves chance + 0.2 = 0.3.
    monitor = DivergenceMonitor(num_classes=10)
    assert _feed(monitor, [0.9, 0.31]) == [None, None]
    assert monitor.check(3, 0.30, 0.5) is not None


def test_each_round_is_flagged_on_its_own_so_a_recovery_reads_as_one():
    # The per-round flag (the history's diverged column) clears when accuracy comes back; the first
    # diverged round is kept. The sweep calls a run diverged only when its last round is flagged.
    monitor = DivergenceMonitor(num_classes=10)
    flags = _feed(monitor, [0.6, 0.8, 0.12, 0.7, 0.82])
    assert [f is not None for f in flags] == [False, False, True, False, False]
    assert monitor.diverged and monitor.first_round == 3 and monitor.recovered
    # A collapse that stays is flagged in every round after it.
    stays = DivergenceMonitor(num_classes=10)
    assert [f is not None for f in _feed(stays, [0.6, 0.8, 0.12, 0.11, 0.13])] == [False, False, True, True, True]
    assert stays.diverged and not stays.recovered


@pytest.mark.slow
def test_a_run_that_blows_up_says_so_in_the_log_and_the_history(tmp_path, flwr_log):
    from simulations.client_app import app as client_app
    from simulations.history import load_history
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    # Twice the default learning rate without clipping: measured, the model reaches 0.59 after
    # round 1 and is at chance (its ReLUs dead) after round 2.
    history = run_server(
        InProcessGrid(client_app, 2), {}, rounds=3, learning_rate=0.1, clip_norm=0.0, codec="fp32",
        out_dir=str(tmp_path), run_name="blown",
    )  # fmt: skip
    saved = load_history(tmp_path / "blown")
    assert saved["divergence"] is not None and saved["divergence"]["round"] == 2
    assert [r[DIVERGED_COLUMN] for r in saved["rounds"][1:]] == [0, 1, 1]
    assert history.divergence == saved["divergence"]
    warnings = [r.getMessage() for r in flwr_log if r.levelno == logging.WARNING]
    assert any("DIVERGED" in w for w in warnings)
