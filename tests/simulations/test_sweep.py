"""The codec sweep: table and files from histories, and one small sweep through the simulation engine."""

from __future__ import annotations

import csv
import json
import math

import pytest

from simulations.sweep import SweepRow, markdown_table, run_sweep, split_codecs, summarize


def test_split_codecs_keeps_parameters_with_their_codec():
    text = "fp32, qsgd:levels=4,bucket_size=512,ef+signsgd,orq:levels=4"
    assert split_codecs(text) == ["fp32", "qsgd:levels=4,bucket_size=512", "ef+signsgd", "orq:levels=4"]


def test_summarize_totals_and_weights():
    rounds = [
        {"round": 0, "accuracy": 0.1},
        {"round": 1, "accuracy": 0.5, "uplink-bytes": 100, "uplink-bytes-dense": 800, "bits-per-param": 4.0},
        {"round": 2, "accuracy": 0.4, "uplink-bytes": 300, "uplink-bytes-dense": 800, "bits-per-param": 12.0},
    ]
    row = summarize("x", rounds, 3.0)
    assert row.final_accuracy == 0.4 and row.best_accuracy == 0.5
    assert row.uplink_mb == 400 / 1e6 and row.compression_ratio == 1600 / 400
    assert row.bits_per_param == (4 * 100 + 12 * 300) / 400  # byte-weighted mean
    assert summarize("y", rounds[:1], 1.0).error


def test_markdown_table_shape():
    text = markdown_table([SweepRow("fp32", 0.9, 0.91, 1.5, 1.0, 32.0, 10), SweepRow("bad", error="boom")])
    lines = text.strip().splitlines()
    assert len(lines) == 4 and all(line.count("|") == 8 for line in lines)
    assert "| fp32 | 0.9000 | 0.9100 | 1.500 | 1.0 | 32.00 | 10 |" in lines and "failed: boom" in lines[3]


@pytest.mark.slow
def test_small_sweep_compares_codecs_on_identical_runs(tmp_path):
    codecs = ["fp32", "qsgd:levels=4", "nope"]
    rows = run_sweep(codecs, out=tmp_path, num_supernodes=4, rounds=2, fraction_train=0.5)
    assert [r.codec for r in rows] == codecs
    fp32, qsgd, bad = rows
    assert "unknown codec" in bad.error  # a failing codec is reported, the sweep goes on
    # fp32 sends float32 plus a small envelope per tensor (the dense baseline counts NumPy headers,
    # so the ratio can be a hair above 1); QSGD with 4 levels ~ 3-4 bits/param.
    assert 0.9 < fp32.compression_ratio < 1.05 and 31 < fp32.bits_per_param < 36
    assert qsgd.compression_ratio > 5 and qsgd.bits_per_param < 6
    assert qsgd.uplink_mb < fp32.uplink_mb / 5
    assert all(0 <= r.final_accuracy <= 1 and not math.isnan(r.seconds) for r in (fp32, qsgd))
    for name in ("sweep.csv", "sweep.md", "sweep.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| qsgd:levels=4 |" in (tmp_path / "sweep.md").read_text()
    with (tmp_path / "sweep.csv").open() as fh:
        assert [r["codec"] for r in csv.DictReader(fh)] == codecs
    # Identical runs: same initial model (round-0 accuracy), same clients sampled each round.
    runs = {p.name: json.loads((p / "history.json").read_text()) for p in (tmp_path / "runs").iterdir()}
    assert len(runs) == 2
    a, b = runs.values()
    assert a["rounds"][0]["accuracy"] == b["rounds"][0]["accuracy"]
    picks = [sorted((c["round"], c["partition-id"]) for c in h["clients"]) for h in (a, b)]
    assert picks[0] == picks[1] and len(picks[0]) == 2 * 2
