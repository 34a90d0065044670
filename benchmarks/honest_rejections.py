"""Honest false rejections: how many honest replies the default admission rules drop, per setting.

Every client here is honest: each trains the app's model on its own data (local SGD, the app's
ClientApp), ``quantize_mod`` encodes the update with the run's codec, and the ServerApp's
``QuantizedStrategy`` admits or rejects the replies with the default :class:`AdmissionRules`.
The rounds run in this process on the test suite's in-process grid (the same ServerApp and
ClientApp as a simulation, without Ray), so the whole table takes minutes on two cores.

Settings: the codec table's separating task, Synthetic(alpha, beta) with LEAF's lognormal client
sizes (``alpha = beta = 0``: the same teacher distribution everywhere; ``alpha = beta = 1``:
non-IID) at 10 of 100 and 100 of 1,000 clients per round (one local epoch, as ``sim_scale.py``
measured the issue's ~15%), digits with a Dirichlet(0.5) partition (20 clients, 10 per round), the
app's CNN with float16 and with float64 weights (digits, 20 clients, 10 per round), and
Flower's default federation (digits, 2 clients, 1 per round, 20 rounds). Columns: replies that
carried content, rejections per rule (``update-norm``, ``num-examples``, every reason together),
the rate of the worst of the rules held here (``--rules``: the norm, weight and direction rules),
replies clipped per rule, and the largest max/median of a round's decoded update norms (before
any rule). Exits 1 when any setting rejects more than ``--max-rate`` (0.5%) of its honest replies
by one of ``--rules``. Usage::

    python -m benchmarks.honest_rejections            # every setting (about 10 CPU minutes)
    python -m benchmarks.honest_rejections --quick    # fewer rounds, the 1,000-client setting once
    python -m benchmarks.honest_rejections --only default
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from simulations.sweep import PRESETS

ONE_EPOCH = {"model": "mlp", "local_epochs": 1, "min_local_steps": 0}


@dataclass(frozen=True)
class Setting:
    """One federation: its name, node count and the run-config overrides (snake_case)."""

    name: str
    nodes: int
    overrides: dict = field(default_factory=dict)


def settings(quick: bool) -> list[Setting]:
    """The table's rows; ``quick`` runs fewer rounds."""
    few = 3 if quick else 6
    rows = [
        Setting("separating task (100 clients, 50/round)", 100, {**PRESETS["separating"].overrides, "rounds": few}),
    ]
    for alpha in (0, 1):
        data = f"synthetic:alpha={alpha},beta={alpha}"
        rows.append(Setting(f"Synthetic({alpha},{alpha}) LEAF sizes, 10 of 100", 100,
                            {**ONE_EPOCH, "dataset": data, "fraction_train": 0.1, "rounds": 2 * few}))  # fmt: skip
        rows.append(Setting(f"Synthetic({alpha},{alpha}) LEAF sizes, 100 of 1000", 1000,
                            {**ONE_EPOCH, "dataset": data, "fraction_train": 0.1, "rounds": few}))  # fmt: skip
    rows.append(Setting("digits Dirichlet(0.5), 10 of 20", 20,
                        {"partitioning": "dirichlet", "dirichlet_alpha": 0.5, "rounds": few}))  # fmt: skip
    for dtype in ("float16", "float64"):  # a user's half- or double-precision model (the app's CNN)
        rows.append(Setting(f"digits CNN in {dtype}, 10 of 20", 20, {"model": f"cnn:dtype={dtype}", "rounds": few}))
    rows.append(Setting("default: digits, 2 clients, 1/round", 2, {"rounds": 20}))
    return rows


class DecodedNorms:
    """Records the norm of every decoded update as the norm rule sees it (before clipping), per round."""

    def __init__(self) -> None:
        self.rounds: list[list[float]] = []

    def __enter__(self) -> DecodedNorms:
        from fedquant.strategies.admission import Admission

        self._judge, self._sums = Admission.judge, Admission.sums
        rounds, judge, sums = self.rounds, self._judge, self._sums

        def judged(admission, vote, decoded, *args, **kwargs):
            rounds[-1].append(float(decoded.update_norm))
            return judge(admission, vote, decoded, *args, **kwargs)

        def round_sums(admission, *args, **kwargs):  # one call per train round, before its decoding
            rounds.append([])
            return sums(admission, *args, **kwargs)

        Admission.judge, Admission.sums = judged, round_sums
        return self

    def __exit__(self, *exc: object) -> None:
        from fedquant.strategies.admission import Admission

        Admission.judge, Admission.sums = self._judge, self._sums

    def max_ratio(self) -> float:
        """The largest max/median of a round's decoded norms (one reply per round: 1)."""
        ratios = [max(r) / float(np.median(r)) for r in self.rounds if r and np.median(r) > 0]
        return max(ratios, default=0.0)


def measure(setting: Setting, seed: int, out: Path) -> dict:
    """Run one setting through the app's ServerApp on the in-process grid; the table's numbers."""
    from simulations.client_app import app
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    t0 = time.process_time()
    with DecodedNorms() as norms:
        history = run_server(InProcessGrid(app, setting.nodes), {}, seed=seed, out_dir=str(out),
                             run_name=f"honest-{seed}", overwrite=True, **setting.overrides)  # fmt: skip
    saved = json.loads((history.folder / "history.json").read_text())
    rows = [r for r in saved["rounds"] if r["round"] > 0]
    counts = {
        key: int(sum(r.get(key, 0) for r in rows)) for key in rows[0] if key.startswith(("rejected-", "clipped-"))
    }
    counts.pop("rejected-share", None)
    return {"replies": len(saved["clients"]), **counts, "max-ratio": norms.max_ratio(), "cpu": time.process_time() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (the default run keeps its 20)")
    parser.add_argument("--seeds", default="0", help="comma-separated run seeds")
    parser.add_argument("--only", default="", help="run the settings whose name contains this text")
    parser.add_argument("--max-rate", type=float, default=0.005, help="largest honest rejection rate per rule")
    parser.add_argument("--rules", default="update-norm,num-examples,direction",
                        help="the rules held to --max-rate (comma-separated reasons)")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    misses = []
    print("| setting | seeds | replies | rejected update-norm | rejected num-examples | rejected direction | "
          "rejected (all) | worst rule rate | clipped norm | clipped weight | max/median norm | CPU s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for setting in settings(args.quick):
        if args.only and args.only not in setting.name:
            continue
        with tempfile.TemporaryDirectory(prefix="honest_") as tmp:
            runs = [measure(setting, seed, Path(tmp)) for seed in seeds]
        sums = {k: sum(r.get(k, 0) for r in runs) for k in runs[0] if k != "max-ratio"}
        ratio = max(r["max-ratio"] for r in runs)
        per_rule = {f"rejected-{rule}": sums.get(f"rejected-{rule}", 0) for rule in args.rules.split(",")}
        worst = max(per_rule, key=per_rule.get)
        rate = per_rule[worst] / max(sums["replies"], 1)
        print(f"| {setting.name} | {args.seeds} | {sums['replies']} | {sums['rejected-update-norm']} | "
              f"{sums['rejected-num-examples']} | {sums.get('rejected-direction', 0)} | {sums['rejected-replies']} | "
              f"{100 * rate:.2f}% ({worst[len('rejected-'):]}) | {sums['clipped-update-norm']} | "
              f"{sums['clipped-num-examples']} | {ratio:.1f} | {sums['cpu']:.0f} |", flush=True)  # fmt: skip
        if rate > args.max_rate:
            misses.append(f"{setting.name}: {100 * rate:.2f}% > {100 * args.max_rate:.2f}%")
    for miss in misses:
        print(f"MISS {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
