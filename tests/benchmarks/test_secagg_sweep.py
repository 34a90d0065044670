"""benchmarks.secagg_sweep: bits per sender from the history's stage bytes, and the gate's misses.

The sweep's ServerApp loop runs on the in-process grid (no Ray); the benchmark itself runs on Ray.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.secagg_sweep import arm_bits, sender_bits, summary
from simulations.sweep import RunStore, SweepPlan, run_plan
from tests.flower_fakes import InProcessGrid


def test_sender_bits_divide_collect_and_later_by_the_inputs_that_arrived():
    numel, sampled = 1000, 20
    stages = {"advertise": 200, "share-keys": 500, "collect": 1800, "unmask": 300}
    row = {f"secagg-uplink-bytes-{s}": b * (sampled if s in ("advertise", "share-keys") else 18)
           for s, b in stages.items()}  # fmt: skip
    uplink = sum(row.values())
    row.update({"uplink-bytes": uplink, "bits-per-param": 8 * uplink / (sampled * numel), "secagg-sampled": sampled,
                "secagg-survivors": 17, "secagg-refused-inputs": 1})  # fmt: skip
    assert sender_bits(row) == pytest.approx(8 * sum(stages.values()) / numel)
    assert sender_bits(row) > row["bits-per-param"]  # two clients sent no masked vector


def test_the_gate_names_an_arm_over_the_bits_or_below_fp32s_spread(tmp_path, no_figures):
    from simulations.client_app import app as client_app

    small = {"rounds": 2, "local_epochs": 1, "min_local_steps": 2, "model": "logreg", "fraction_train": 1.0}
    arm = "secagg:bits=1,neighbours=4,keep=0.35,dropouts=1"
    plan = SweepPlan(("fp32", arm), (0, 1), tmp_path, last_k=1, overrides=small)
    result = run_plan(InProcessGrid(client_app, 6), {}, plan)
    store = RunStore(tmp_path)
    records = [json.loads(store.path(arm, s).read_text()) for s in (0, 1)]
    over, per = arm_bits(records)
    assert 0 < over.mean < per.mean < 32  # compressed, and more per sender than over the sampled
    table, misses = summary(result, store, (0, 1), 1, max_bits=64.0)
    assert f"| {arm} |" in table and "| fp32 |" in table
    assert not [m for m in misses if "bits/param" in m]
    _, misses = summary(result, store, (0, 1), 1, max_bits=per.mean / 2)
    assert any(m.startswith(f"{arm}: {per.mean:.2f} uplink bits/param per sender") for m in misses)
    result.rows[1] = dataclasses.replace(result.rows[1], verdict="below fp32's spread")
    _, misses = summary(result, store, (0, 1), 1, max_bits=64.0)
    assert misses == [f"{arm}: last-1 accuracy {result.rows[1].last_k.text(4)} is below fp32's spread"]
