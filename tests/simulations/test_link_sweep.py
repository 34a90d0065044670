"""The link sweep's table, sums and files (the simulation itself runs in test_simulation_both_directions)."""

from __future__ import annotations

import math

import pytest

from simulations.link_sweep import LinkRow, cumulative, parse_variant, summarize_links, write_link_results
from simulations.link_times import link_metrics

ROUNDS = [
    {"round": 0, "accuracy": 0.1},
    {"round": 1, "accuracy": 0.8, "uplink-bytes": 100, "downlink-bytes": 400, "simulated-round-seconds": 1.5},
    {"round": 2, "accuracy": 0.95, "uplink-bytes": 50, "downlink-bytes": 100, "simulated-round-seconds": 0.5},
]


def test_parse_variant():
    assert parse_variant("codec=qsgd:levels=4,bucket_size=128 downlink-codec=none") == {
        "codec": "qsgd:levels=4,bucket_size=128",
        "downlink-codec": "none",
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_variant("codec")


def test_summary_sums_both_directions_and_time_to_target():
    assert cumulative(ROUNDS[1:], "simulated-round-seconds") == [1.5, 2.0]
    row = summarize_links("v", ROUNDS)
    assert (row.uplink_mb, row.downlink_mb) == (150 / 1e6, 500 / 1e6)
    assert row.simulated_seconds == 2.0 and row.seconds_to_target == 2.0 and row.final_accuracy == 0.95
    slow = summarize_links("w", [{**r, "accuracy": 0.5} for r in ROUNDS])
    assert math.isnan(slow.seconds_to_target) and "not reached" in slow.cells()
    assert summarize_links("x", ROUNDS[:1]).error


def test_results_files(tmp_path):
    rows = [summarize_links("a", ROUNDS), LinkRow("b", error="boom")]
    paths = write_link_results(rows, {"a": ROUNDS}, tmp_path, "title", "cmd")
    text = paths["md"].read_text()
    assert "| a | 0.9500 | 0.000 | 0.001 | 2.0 | 2.0 |" in text and "failed: boom" in text
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_link_metrics_are_the_slowest_clients():
    down = {1: 1000, 2: 1000}
    up = {1: 500, 2: 100}
    speeds = {1: 1000.0, 2: 100.0}
    metrics = link_metrics(down, up, speeds.__getitem__, speeds.__getitem__)
    assert metrics["simulated-download-seconds"] == 10.0  # node 2: 1000 B at 100 B/s
    assert metrics["simulated-round-seconds"] == 11.0  # node 2: 10 s down + 1 s up
    assert link_metrics(down, up, speeds.__getitem__, None)["simulated-round-seconds"] == 10.0


def test_a_dead_link_takes_forever_instead_of_crashing():
    metrics = link_metrics({1: 10}, {1: 10}, lambda n: 0.0, lambda n: float("nan"))
    assert metrics["simulated-download-seconds"] == math.inf and metrics["simulated-round-seconds"] == math.inf


def test_link_times_as_an_extra_stage_report_the_slowest_download():
    from flwr.serverapp.strategy import FedAvg

    from fedquant.clients import quantize_mod
    from fedquant.strategies import QuantizedStrategy
    from simulations.link_times import LinkTimes
    from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

    down = {101: 1000.0, 102: 250.0, 103: 4000.0}
    strategy = QuantizedStrategy(
        FedAvg(min_available_nodes=3), "qsgd", min_numel=MIN_NUMEL, extra_stages=[LinkTimes(down.__getitem__)]
    )
    grid = InProcessGrid(make_client_app([quantize_mod]), 3)
    metrics = strategy.start(grid, initial_arrays(), num_rounds=1).train_metrics_clientapp[1]
    per_message = metrics["downlink-bytes"] / 3  # the same model to every node
    assert metrics["simulated-download-seconds"] == pytest.approx(per_message / 250.0)
    assert metrics["simulated-round-seconds"] == pytest.approx(per_message / 250.0)  # no uplink speeds given


def test_the_app_reports_link_times_with_a_downlink_profile(tmp_path, no_figures):
    from simulations.client_app import app as client_app
    from simulations.history import load_history
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    quick = {"model": "logreg", "local_epochs": 1, "min_local_steps": 2, "codec": "qsgd"}
    run = run_server(
        InProcessGrid(client_app, 2), {}, rounds=2, out_dir=str(tmp_path), uplink="fixed:mbps=1",
        downlink="fixed:mbps=4", **quick,
    )  # fmt: skip
    trained = [r for r in load_history(run.folder)["rounds"] if r["round"] > 0]
    assert len(trained) == 2
    for row in trained:  # fixed speeds and one model for all: the slowest client is any of them
        per_message = row["simulated-download-seconds"] * 4e6 / 8  # 4 Mbit/s
        assert 0 < per_message <= row["downlink-bytes"] and row["downlink-bytes"] % round(per_message) == 0
        assert row["simulated-round-seconds"] == pytest.approx(
            row["simulated-download-seconds"] + row["simulated-upload-seconds"]
        )
