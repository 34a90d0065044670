"""Expected run time of the sweep presets, from the measured cost of one local SGD step (a table, exits 0).

The Hub datasets (FEMNIST, CIFAR-10) cannot be downloaded here, so a run cannot be timed whole:
this times the preset's model on random inputs of the dataset's shape (one thread, the preset's
batch size, best of 3 repeats of 20 steps) and multiplies by the steps a run takes::

    steps per client = max(min-local-steps, local-epochs * ceil(examples per client / batch size))
    seconds per run  = rounds * clients per round * steps per client * seconds per step / cores

(clients train side by side, one per core; server evaluation, codec and Flower overheads are
not counted, so it is a lower bound). Usage::

    flock /work/bench.lock python -m benchmarks.preset_cost --cores 2
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn import functional as F

from simulations.models import build_model
from simulations.settings import SimSettings
from simulations.sweep import PRESETS

# Training examples and input shape of each dataset (FEMNIST: 10 % of its train split is held out).
DATASETS = {
    "digits": (1438, (1, 8, 8), 10),
    "synthetic": (14274, (60,), 10),  # synthetic:alpha=0.5,beta=0.5 on 100 clients (measured)
    "femnist": (int(0.9 * 814_277), (1, 28, 28), 62),
    "cifar10": (50_000, (3, 32, 32), 10),
}


def seconds_per_step(model_name: str, shape: tuple[int, ...], classes: int, batch: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` time of one SGD step (forward, backward, update) on one thread."""
    torch.set_num_threads(1)
    model = build_model(model_name, shape, classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(1))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(20):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        best = min(best, (time.perf_counter() - t0) / 20)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", type=int, default=2, help="clients trained side by side (default 2)")
    args = parser.parse_args(argv)
    head = "| preset | dataset, model | clients/round | steps/client | ms/step | rounds |"
    print(head + f" est. minutes ({args.cores} cores) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, preset in PRESETS.items():
        s = SimSettings.from_run_config({}, **preset.overrides)
        key = "synthetic" if s.dataset.startswith("synthetic") else s.dataset
        examples, shape, classes = DATASETS[key]
        per_client = examples / preset.num_supernodes
        steps = max(s.min_local_steps, s.local_epochs * math.ceil(per_client / s.batch_size))
        clients = max(int(preset.num_supernodes * s.fraction_train), 1)
        step = seconds_per_step(s.model, shape, classes, s.batch_size)
        minutes = s.rounds * clients * steps * step / args.cores / 60
        print(
            f"| {name} | {s.dataset}, {s.model} | {clients} | {steps} | {1e3 * step:.2f} | {s.rounds} | {minutes:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
