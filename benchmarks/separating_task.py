"""The search for a task that separates codecs: fp32 and signsgd over three seeds per candidate (a table).

A benchmark task for codec tables must (1) converge within its rounds, (2) repeat: fp32's
mean accuracy of the last 5 rounds varies by at most a point between seeds, and (3) separate:
a 1-bit codec ends clearly below fp32. Each candidate runs fp32 and ``signsgd`` for every seed
through the app's ServerApp and ClientApp on the test suite's in-process grid (the same code as
a simulation, without Ray's start-up), storing every run under ``--out`` (rerunning resumes).

Columns: fp32's last-5 accuracy (mean, standard deviation and range over the seeds), its
plateau (last-5 mean minus the mean of the 5 rounds before), signsgd's last-5 mean and the gap,
and the CPU seconds of one run. Exits 1 when the chosen candidate (the sweep's ``separating``
preset) misses a criterion: std <= 0.01, plateau <= 0.01, gap >= 0.05. Usage::

    python -m benchmarks.separating_task                        # every candidate (about 40 CPU minutes)
    python -m benchmarks.separating_task --only separating
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulations.sweep import PRESETS, RunStore, SweepPlan, run_plan

SYNTHETIC = {"dataset": "synthetic:alpha=0.5,beta=0.5", "rounds": 40}
LIGHT = {"local_epochs": 1, "min_local_steps": 10}
CANDIDATES: dict[str, dict] = {
    "logreg, 20/round, app defaults": {**SYNTHETIC, "model": "logreg", "fraction_train": 0.2},
    "logreg, 20/round, 1 epoch": {**SYNTHETIC, **LIGHT, "model": "logreg", "fraction_train": 0.2},
    "logreg, 20/round, 1 epoch, lr 0.2": {
        **SYNTHETIC,
        **LIGHT,
        "model": "logreg",
        "fraction_train": 0.2,
        "learning_rate": 0.2,
    },  # fmt: skip
    "logreg, 30/round, 1 epoch": {**SYNTHETIC, **LIGHT, "model": "logreg", "fraction_train": 0.3},
    "logreg, 50/round, 1 epoch": {**SYNTHETIC, **LIGHT, "model": "logreg", "fraction_train": 0.5},
    "mlp, 30/round, 1 epoch": {**SYNTHETIC, **LIGHT, "model": "mlp", "fraction_train": 0.3},
    "separating": PRESETS["separating"].overrides,
}
SEEDS = (0, 1, 2)


def _grid(nodes: int):
    from simulations.client_app import app
    from tests.flower_fakes import InProcessGrid

    return InProcessGrid(app, nodes)


def measure(name: str, overrides: dict, out: Path, nodes: int = 100) -> dict:
    """Run (or load) fp32 and signsgd over the seeds; the table's numbers."""
    plan = SweepPlan(("fp32", "signsgd"), SEEDS, out, last_k=5, overrides=overrides,
                     federation={"num-supernodes": nodes, "engine": "in-process"})  # fmt: skip
    t0 = time.process_time()
    result = run_plan(_grid(nodes), {}, plan)
    cpu = time.process_time() - t0
    store = RunStore(out)
    last = {c: [r.last_k_accuracy for r in result.runs if r.codec == c] for c in plan.codecs}
    before = []
    for seed in SEEDS:
        acc = [r["accuracy"] for r in json.loads(store.path("fp32", seed).read_text())["rounds"] if r["round"] > 0]
        before.append(statistics.fmean(acc[-5:]) - statistics.fmean(acc[-10:-5]))
    fp32 = last["fp32"]
    return {
        "name": name,
        "fp32": statistics.fmean(fp32),
        "std": statistics.stdev(fp32),
        "range": max(fp32) - min(fp32),
        "plateau": statistics.fmean(before),
        "signsgd": statistics.fmean(last["signsgd"]),
        "cpu": cpu / max(len(result.runs), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", default=None, help="candidate name (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("results/separating-search"))
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    names = args.only or list(CANDIDATES)
    print("| candidate | fp32 last-5 | std | range | plateau | signsgd last-5 | gap | CPU s/run |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name in names:
        slug = name.replace(", ", "_").replace(" ", "-").replace("/", "-per-")
        m = measure(name, CANDIDATES[name], args.out / slug)
        gap = m["fp32"] - m["signsgd"]
        print(f"| {name} | {m['fp32']:.4f} | {m['std']:.4f} | {m['range']:.4f} | {m['plateau']:+.4f} | "
              f"{m['signsgd']:.4f} | {gap:.3f} | {m['cpu']:.0f} |", flush=True)  # fmt: skip
        if name == "separating":
            ok = m["std"] <= 0.01 and abs(m["plateau"]) <= 0.01 and gap >= 0.05
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
