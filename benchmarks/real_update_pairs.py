"""Real client updates and their NDQSG side information, from a small federated training run.

A self-contained FedAvg run (no Flower, no Ray): an MLP 64-128-64-10 on scikit-learn's
``load_digits`` (1797 8x8 images), partitioned over ``clients`` clients (IID, or label-skewed
with a Dirichlet ``beta``), every client trains every round (``local_epochs`` of minibatch SGD)
from the global model. Each round follows NDQSG's Algorithm 2 at the server:

* a random half of the clients is P1: their updates are encoded and decoded with the real
  ``dqsg`` codec (``levels = M``) and folded into a running mean, per tensor;
* every other client (P2), in turn, gives a pair ``(its update, the running mean so far)`` for
  each encoded tensor (at least ``min_numel`` elements: the two hidden weight matrices), then
  its DQSG-decoded update joins the mean (an NDQSG decode without wrap-around has exactly that
  error, see ``fedquant.codecs.quantizers.dither``).

The global model moves by the mean of the raw updates (the trajectory does not depend on the
codec). Per round the script also records the spread the server would have estimated from the
P1 updates (``spread_in_steps``, as ``NestedDecodePlan`` does) next to the spread the P2 pairs
really had.

Run: ``python -m benchmarks.real_update_pairs [--save pairs.pt]``, or
``python -m benchmarks.nested_rate_distortion --real`` for the DQSG/NDQSG table on these pairs.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch import nn

from fedquant.codecs import get_codec
from fedquant.codecs.nested_params import spread_in_steps
from fedquant.rng import derive_seed

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RoundSpread:
    """Per round: accuracy of the global model, estimated and measured spread (in fine steps)."""

    server_round: int
    accuracy: float
    estimated: float  # spread_in_steps of the round's decoded P1 updates (max over tensors)
    measured: float  # RMS of (update - side info) / Delta1 over the round's P2 pairs


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def _data(clients: int, beta: float | None, seed: int):
    from sklearn.datasets import load_digits  # noqa: PLC0415 (benchmark-only dependency)

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, train = order[:300], order[300:]
    if beta is None:
        parts = np.array_split(rng.permutation(train), clients)
    else:  # label skew: each class spread over clients with Dirichlet(beta) proportions
        parts = [[] for _ in range(clients)]
        for label in range(10):
            idx = rng.permutation(train[y[train] == label])
            cuts = (np.cumsum(rng.dirichlet([beta] * clients))[:-1] * len(idx)).astype(int)
            for p, chunk in enumerate(np.split(idx, cuts)):
                parts[p].extend(chunk.tolist())
        parts = [np.array(p, dtype=np.int64) for p in parts]
    as_t = lambda i: (torch.from_numpy(x[i]), torch.from_numpy(y[i]).long())  # noqa: E731
    return [as_t(p) for p in parts], as_t(test)


def _train(model: nn.Module, data, epochs: int, lr: float, batch: int, seed: int) -> None:
    xs, ys = data
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        perm = torch.randperm(len(ys), generator=gen)
        for start in range(0, len(ys), batch):
            i = perm[start : start + batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs[i]), ys[i]).backward()
            opt.step()


def collect_pairs(
    rounds: int = 8,
    clients: int = 10,
    levels: int = 3,
    bucket_size: int = 512,
    min_numel: int = 1024,
    local_epochs: int = 5,
    lr: float = 0.3,
    beta: float | None = None,
    seed: int = 0,
) -> tuple[list[list[Pair]], list[RoundSpread], list[dict[str, list[torch.Tensor]]]]:
    """Run the federated training.

    Returns, per round: the P2 ``(update, side_info)`` pairs, the spreads, and the decoded P1
    updates per tensor (what ``NestedDecodePlan.learn`` gets from the round).

    Parameters
    ----------
    rounds, clients : int
        Rounds of FedAvg; clients (all train every round; half are P1).
    levels, bucket_size : int
        DQSG ``M`` and bucket size of the P1 codec (and of the spread estimate).
    min_numel : int
        Tensors with fewer elements are not encoded and give no pairs.
    local_epochs, lr : int, float
        Local training per round (minibatches of 32).
    beta : float, optional
        Dirichlet concentration of a label-skewed partition; None (default) for IID.
    seed : int
        Seeds the partition, the groups, the local minibatches and the dithers.
    """
    parts, (x_test, y_test) = _data(clients, beta, seed)
    model = _model()
    dqsg = get_codec("dqsg", levels=levels, bucket_size=bucket_size)
    pairs: list[list[Pair]] = []
    spreads: list[RoundSpread] = []
    p1_decoded: list[dict[str, list[torch.Tensor]]] = []
    rng = np.random.default_rng(seed)
    for server_round in range(1, rounds + 1):
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        updates = []
        for p in range(clients):
            model.load_state_dict(start)
            _train(model, parts[p], local_epochs, lr, 32, derive_seed(seed, server_round, p) % (1 << 31))
            updates.append({k: (v.detach() - start[k]) for k, v in model.state_dict().items()})
        encoded = [k for k, v in start.items() if v.numel() >= min_numel]
        order = rng.permutation(clients)
        p1, p2 = order[: clients // 2], order[clients // 2 :]
        decoded: dict[str, list[torch.Tensor]] = {k: [] for k in encoded}
        for p in p1:
            for k in encoded:
                tensor_seed = derive_seed(seed, server_round, int(p), k)
                payload = dqsg.encode(updates[p][k], tensor_seed)
                decoded[k].append(dqsg.decode(payload, tensor_seed, shape=updates[p][k].shape).reshape(-1))
        p1_decoded.append({k: list(v) for k, v in decoded.items()})
        estimated = max(spread_in_steps(decoded[k], levels, bucket_size, dqsg_levels=levels) for k in encoded)
        sq = count = 0.0
        pairs.append([])
        for p in p2:
            for k in encoded:
                x = updates[p][k].reshape(-1).float()
                y = torch.stack(decoded[k]).mean(0)
                pairs[-1].append((x, y))
                step = _steps(x, levels, bucket_size)
                keep = step > 0
                sq += float(((x - y)[keep] / step[keep]).double().pow(2).sum())
                count += int(keep.sum())
                tensor_seed = derive_seed(seed, server_round, int(p), k)
                decoded[k].append(dqsg.decode(dqsg.encode(x, tensor_seed), tensor_seed))
        model.load_state_dict({k: start[k] + torch.stack([u[k] for u in updates]).mean(0) for k in start})
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        spreads.append(RoundSpread(server_round, accuracy, estimated, math.sqrt(sq / max(count, 1))))
    return pairs, spreads, p1_decoded


def _steps(x: torch.Tensor, levels: int, bucket_size: int) -> torch.Tensor:
    n = x.numel()
    v = torch.nn.functional.pad(x, (0, (-n) % bucket_size)).view(-1, bucket_size)
    return (v.abs().amax(1, keepdim=True) / levels).expand_as(v).reshape(-1)[:n]


def format_spreads(spreads: list[RoundSpread]) -> str:
    """Per round: accuracy, the P1 estimate, and the P2 pairs' real spread next to the previous round's estimate
    x 1.1 (what ``NestedDecodePlan`` chooses this round's ``rho`` from)."""
    lines = [f"{'round':>5} {'test acc':>8} {'est. s/D1 (P1)':>15} {'real s/D1 (P2)':>15} {'prev. est x1.1':>15}"]
    for i, s in enumerate(spreads):
        prev = f"{1.1 * spreads[i - 1].estimated:>15.3f}" if i else f"{'-':>15}"
        lines.append(f"{s.server_round:>5} {s.accuracy:>8.3f} {s.estimated:>15.3f} {s.measured:>15.3f} {prev}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--beta", type=float, default=None, help="Dirichlet label skew (default IID)")
    parser.add_argument("--save", help="torch.save the pairs here (for nested_rate_distortion --pairs)")
    args = parser.parse_args(argv)
    by_round, spreads, _ = collect_pairs(args.rounds, args.clients, args.levels, beta=args.beta)
    pairs = [pair for round_pairs in by_round for pair in round_pairs]
    print(format_spreads(spreads))
    print(f"{len(pairs)} pairs of {sum(x.numel() for x, _ in pairs)} coordinates in all")
    if args.save:
        torch.save(pairs, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
