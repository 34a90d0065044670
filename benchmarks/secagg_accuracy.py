"""Accuracy of secure rounds against plain FedAvg, in process: ``python -m benchmarks.secagg_accuracy``.

The digits CNN and the app's defaults (20 clients all sampled, 20 rounds, 3 local epochs of SGD
at lr 0.05, batch 16, step clip 1.0, at least 30 steps; ``secagg-clip`` 1.0), seeds 0-2, arms:

* ``fp32``: the plain mean of the clients' updates (FedAvg on equal-sized iid parts);
* one arm per secure configuration, with 2 clients dropping every round: the survivors' updates
  encoded on the round's grid (``ScaleRule`` from the previous decoded mean, a fresh rotation
  seed per round) and the decoded mean of their modular sum applied. The protocol's sum of the
  masked inputs is exactly that modular sum (``tests/secagg``), so the masks are left out here to
  save time; the Ray sweep of ``docs/secure-aggregation.md`` runs the real thing.

Prints last-5-round test accuracy per arm and seed, mean +- std over seeds, and the paired
difference against fp32; exits 1 when a secure arm's mean falls below fp32's mean minus two of
fp32's standard deviations over seeds (outside its spread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from fedquant.codecs.summable import WEIGHT_SCALE, decode_sum, encode_update
from fedquant.rng import derive_seed
from fedquant.secagg import SecAggConfig

CLIENTS, ROUNDS, DROPOUTS = 20, 20, 2
ARMS = {
    "secagg q=2": SecAggConfig(bits=2, clip=1.0),
    "secagg q=1 keep=0.35 k=4": SecAggConfig(bits=1, clip=1.0, neighbours=4, keep=0.35),
}


def run(arm: str, seed: int, clients: int = CLIENTS, rounds: int = ROUNDS) -> list[float]:
    """Test accuracy after each round of one arm."""
    from simulations.data import load_partition, load_test_set
    from simulations.models import build_model
    from simulations.task import evaluate, train

    model = build_model("cnn", (1, 8, 8), 10, seed=seed)
    parts = [load_partition("digits", p, clients, seed=seed) for p in range(clients)]
    test = load_test_set("digits")
    config = ARMS.get(arm)
    previous, accuracy = None, []
    for rnd in range(1, rounds + 1):
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        flat_start = torch.cat([v.reshape(-1).float() for v in start.values()])
        updates = []
        for p in range(clients) if config is None else range(DROPOUTS, clients):
            model.load_state_dict(start)
            train(model, parts[p], epochs=3, batch_size=16, lr=0.05, seed=seed * 1000 + rnd * 50 + p,
                  clip_norm=1.0, min_steps=30)  # fmt: skip
            trained = torch.cat([v.detach().reshape(-1).float() for v in model.state_dict().values()])
            updates.append(trained - flat_start)
        if config is None:
            mean = torch.stack(updates).mean(0)
        else:
            grid = config.scale_rule().grid(flat_start.numel(), clients, derive_seed(seed, rnd, "rotation"), previous)
            seeds = [derive_seed(seed, rnd, p) for p in range(len(updates))]
            total = sum(encode_update(u, grid, s).values.astype(np.int64) for u, s in zip(updates, seeds))
            mean = decode_sum((total % grid.modulus).astype(np.uint32), grid, seeds, len(updates) * WEIGHT_SCALE)
            previous = mean.numpy()
        new, offset = {}, 0
        for name, value in start.items():
            n = value.numel()
            new[name] = (value.double() + mean[offset : offset + n].double().reshape(value.shape)).to(value.dtype)
            offset += n
        model.load_state_dict(new)
        accuracy.append(evaluate(model, test)[1])
    return accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--arms", nargs="*", default=list(ARMS), help="secure arms to run (fp32 always runs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()
    last5 = {arm: [] for arm in ["fp32", *args.arms]}
    for seed in args.seeds:
        for arm in last5:
            acc = run(arm, seed, args.clients, args.rounds)
            last5[arm].append(float(np.mean(acc[-5:])))
            print(f"seed {seed} {arm:26s} last-5 accuracy {last5[arm][-1]:.4f}  ({time.perf_counter() - began:.0f} s)",
                  flush=True)  # fmt: skip
    base = last5["fp32"]
    spread = statistics.stdev(base) if len(base) > 1 else 0.0
    ok = True
    for arm, values in last5.items():
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        diff = [v - b for v, b in zip(values, base)]
        dsd = statistics.stdev(diff) if len(diff) > 1 else 0.0
        print(f"{arm:26s} {np.mean(values):.4f} +- {sd:.4f}   paired difference {np.mean(diff):+.4f} +- {dsd:.4f}")
        if arm != "fp32" and np.mean(values) < np.mean(base) - 2 * spread:
            print(f"MISS: {arm} is below fp32's spread")
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
