"""What error feedback buys under partial participation, on the separating task (a table).

A client keeps its error-feedback residual between the rounds it is sampled in; with a share
``f`` of the clients per round it comes back about every ``1/f`` rounds, so the residual it adds
was computed against a model ``1/f`` rounds old. This runs ``signsgd`` / ``ef+signsgd`` (biased:
error feedback corrects the bias) and ``eden:bits=0.5`` / ``ef+eden:bits=0.5`` (unbiased with
``omega`` about 2: ``ef+`` scales by ``1/(1+omega)``) on the ``separating`` preset (100 clients,
40 rounds) at several shares per round, three seeds each, through the app's ServerApp and
ClientApp on the test suite's in-process grid (runs are stored under ``--out``; rerunning resumes).

Columns: last-5 accuracy per codec (mean ± 95 % interval over the seeds) and the gain of
``ef+`` over the same codec without it, paired by seed. Exits 1 when a run ends diverged.
Usage::

    python -m benchmarks.ef_participation                      # about 25 CPU minutes
    python -m benchmarks.ef_participation --fractions 0.1 --seeds 0,1
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulations.sweep import PRESETS, SweepPlan, parse_seeds, run_plan
from simulations.sweep_stats import Interval

PAIRS = (("signsgd", "ef+signsgd"), ("eden:bits=0.5", "ef+eden:bits=0.5"))
NODES = 100


def _grid(nodes: int):
    from simulations.client_app import app
    from tests.flower_fakes import InProcessGrid

    return InProcessGrid(app, nodes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fractions", default="0.1,0.2,0.5", help="shares of the clients per round")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=Path("results/ef-participation"))
    args = parser.parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    seeds = tuple(parse_seeds(args.seeds))
    codecs = tuple(c for pair in PAIRS for c in pair)
    head = ["clients per round", "rounds between a client's turns"]
    for plain, ef in PAIRS:
        head += [plain, ef, f"gain of ef+ ({plain})"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---:"] * len(head)) + "|")
    ok = True
    for fraction in (float(f) for f in args.fractions.split(",")):
        overrides = {**PRESETS["separating"].overrides, "fraction_train": fraction}
        plan = SweepPlan(codecs, seeds, args.out / f"fraction-{fraction:g}", last_k=5, overrides=overrides,
                         federation={"num-supernodes": NODES, "engine": "in-process"})  # fmt: skip
        result = run_plan(_grid(NODES), {}, plan)
        ok &= not result.errors and not any(r.diverged for r in result.runs)
        last = {(r.codec, r.seed): r.last_k_accuracy for r in result.runs}
        per_round = max(int(NODES * fraction), 1)
        cells = [str(per_round), f"{NODES / per_round:g}"]
        for plain, ef in PAIRS:
            cells += [Interval.of([last[plain, s] for s in seeds if (plain, s) in last]).text(4)]
            cells += [Interval.of([last[ef, s] for s in seeds if (ef, s) in last]).text(4)]
            gain = [last[ef, s] - last[plain, s] for s in seeds if (ef, s) in last and (plain, s) in last]
            cells += [Interval.of(gain).text(4)]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
