"""NDQSG against DQSG on real client updates: bits per parameter at equal MSE, per tensor and overall.

A self-contained FedAvg run (no Flower, no Ray) of the simulation's own models (``mlp``: 64-128-128-10,
``cnn``: the LeNet-style CNN of :mod:`simulations.models` on 8x8 images) on scikit-learn's
``load_digits`` (1797 8x8 images), partitioned over ``clients`` clients (IID, or label-skewed with
a Dirichlet ``beta``); every client trains every round (``local_epochs`` of minibatch SGD) from
the global model. Each round follows NDQSG's Algorithm 2 at the server:

* a random half of the clients is P1: their updates are encoded and decoded with the real
  ``dqsg`` codec (``levels = M``) and folded into a running mean, per tensor;
* every other client (P2), in turn, gives a pair ``(its update, the running mean so far)`` for
  each tensor (every float tensor is encoded, as in the simulation's ``min-numel = 1``), then
  its DQSG-decoded update joins the mean (an NDQSG decode without wrap-around has exactly that
  error).

The global model moves by the mean of the raw updates (the trajectory does not depend on the
codec). :func:`compare` then replays the rounds through the real server plan
(:class:`~fedquant.strategies.nested.NestedDecodePlan`: ``rho`` per tensor from the previous
round's decoded P1 updates, tensors under 1024 elements and tensors whose ``rho`` reaches
``2M + 1`` sent as DQSG) and encodes every P2 pair with

* ``dqsg`` at ``levels = M`` (the baseline: P2 sending DQSG like P1);
* ``plan``: the codec the plan assigned to that tensor (``ndqsg`` at its ``rho`` or ``dqsg``),
  decoded against the side information, wrap-arounds included;
* ``authors``: ``ndqsg`` at the authors' fixed ``(M, rho) = (3, 3)`` on every tensor;

with the same ``coding`` (``fixed`` or ``entropy``), counting bits from the real payload bytes
(envelope included). Equal MSE: nesting changes the MSE only through wrap-arounds (same fine step),
so besides the ratio of MSEs each row gives the bits DQSG needs for the *same* MSE as the nested
codec, interpolated (bits linear in log MSE) on DQSG's own curve over ``levels`` 1..16, and the
saving against it. A negative saving means NDQSG costs more than DQSG at its error.

Run: ``python -m benchmarks.real_update_pairs`` (both models, IID and label skew ``beta = 0.5``,
``M = 3``, both codings; about 2 minutes on 2 cores); ``--models mlp --beta 0.5`` etc. Exits 1
when the plan's NDQSG MSE (at the first ``--max-excess``, default 1 %) exceeds DQSG's by more than
5 % overall in any case. ``python -m benchmarks.nested_rate_distortion --real`` reads the same
pairs for its DQSG/NDQSG rule table.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from torch import nn

from fedquant.codecs import get_codec
from fedquant.protocol import KEY_ROLE
from fedquant.rng import derive_seed
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient
from fedquant.strategies.nested import ROLE_P1, ROLE_P2, NestedDecodePlan
from fedquant.strategies.nested_rules import AUTHORS_LEVELS, AUTHORS_RHO, cheapest_bits_at, spread_in_steps
from simulations.models import build_model

Pair = tuple[torch.Tensor, torch.Tensor]
DQSG_LADDER = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)  # levels of DQSG's rate/MSE curve
MAX_MSE_EXCESS = 0.05  # the plan's NDQSG may exceed DQSG's MSE by this much overall (design: 1 %)


@dataclass
class RoundUpdates:
    """One round: accuracy of the global model, P1's decoded updates and P2's pairs, per tensor."""

    server_round: int
    accuracy: float
    p1_decoded: dict[str, list[torch.Tensor]]  # flat float32, what the server decoded from P1
    p2: list[dict[str, Pair]]  # per P2 client in decode order: tensor -> (update, side info), flat
    measured: float = 0.0  # RMS of (update - side info) / Delta1 over the round's P2 pairs


@dataclass
class RoundSpread:
    """Per round: accuracy of the global model, estimated and measured spread (in fine steps)."""

    server_round: int
    accuracy: float
    estimated: float  # spread_in_steps of the round's decoded P1 updates (max over tensors)
    measured: float  # RMS of (update - side info) / Delta1 over the round's P2 pairs


def _input_shape(model: str) -> tuple[int, ...]:
    return (1, 8, 8) if model == "cnn" else (64,)


def _data(clients: int, beta: float | None, seed: int, model: str):
    from sklearn.datasets import load_digits  # noqa: PLC0415 (benchmark-only dependency)

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, *_input_shape(model))
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


def collect_rounds(
    model: str = "mlp",
    rounds: int = 8,
    clients: int = 10,
    levels: int = 3,
    bucket_size: int = 512,
    min_numel: int = 1,
    local_epochs: int = 5,
    lr: float = 0.1,
    beta: float | None = None,
    seed: int = 0,
) -> list[RoundUpdates]:
    """Run the federated training and record what the server of Algorithm 2 sees each round.

    Parameters
    ----------
    model : {"mlp", "cnn"}
        The simulation's model (:func:`simulations.models.build_model`).
    rounds, clients : int
        Rounds of FedAvg; clients (all train every round; half are P1).
    levels, bucket_size : int
        DQSG ``M`` and bucket size of the P1 codec.
    min_numel : int
        Tensors with fewer elements are not encoded and give no pairs (default 1: all, as the simulation).
    local_epochs, lr : int, float
        Local training per round (minibatches of 32).
    beta : float, optional
        Dirichlet concentration of a label-skewed partition; None (default) for IID.
    seed : int
        Seeds the partition, the groups, the local minibatches and the dithers.
    """
    parts, (x_test, y_test) = _data(clients, beta, seed, model)
    net = build_model(model, _input_shape(model), 10, seed=seed)
    dqsg = get_codec("dqsg", levels=levels, bucket_size=bucket_size)
    out: list[RoundUpdates] = []
    rng = np.random.default_rng(seed)
    for server_round in range(1, rounds + 1):
        start = {k: v.detach().clone() for k, v in net.state_dict().items()}
        updates = []
        for p in range(clients):
            net.load_state_dict(start)
            _train(net, parts[p], local_epochs, lr, 32, derive_seed(seed, server_round, p) % (1 << 31))
            updates.append({k: (v.detach() - start[k]).reshape(-1).float() for k, v in net.state_dict().items()})
        encoded = [k for k, v in start.items() if v.is_floating_point() and v.numel() >= min_numel]
        order = rng.permutation(clients)
        p1, p2 = order[: clients // 2], order[clients // 2 :]
        decoded: dict[str, list[torch.Tensor]] = {k: [] for k in encoded}
        for p in p1:
            for k in encoded:
                tensor_seed = derive_seed(seed, server_round, int(p), k)
                decoded[k].append(dqsg.decode(dqsg.encode(updates[p][k], tensor_seed), tensor_seed))
        record = RoundUpdates(server_round, 0.0, {k: list(v) for k, v in decoded.items()}, [])
        sq = count = 0.0
        for p in p2:
            pairs = {}
            for k in encoded:
                x = updates[p][k]
                y = torch.stack(decoded[k]).mean(0)
                pairs[k] = (x, y)
                pair_sq, pair_count = spread_sums(x, y, levels, bucket_size)
                sq += pair_sq
                count += pair_count
                tensor_seed = derive_seed(seed, server_round, int(p), k)
                decoded[k].append(dqsg.decode(dqsg.encode(x, tensor_seed), tensor_seed))
            record.p2.append(pairs)
        net.load_state_dict(
            {k: start[k] + torch.stack([u[k] for u in updates]).mean(0).view_as(start[k]) for k in start}
        )
        with torch.no_grad():
            record.accuracy = float((net(x_test).argmax(1) == y_test).float().mean())
        record.measured = math.sqrt(sq / max(count, 1))
        out.append(record)
    return out


def collect_pairs(
    rounds: int = 8,
    clients: int = 10,
    levels: int = 3,
    bucket_size: int = 512,
    min_numel: int = 1024,
    beta: float | None = None,
    seed: int = 0,
    model: str = "mlp",
) -> tuple[list[list[Pair]], list[RoundSpread], list[dict[str, list[torch.Tensor]]]]:
    """:func:`collect_rounds` as flat lists: per round the P2 pairs, the spreads and P1's decoded updates.

    ``min_numel`` defaults to 1024 here (the weight matrices only), as
    ``benchmarks.nested_rate_distortion --real`` pools the pairs of all tensors.
    """
    rounds_ = collect_rounds(
        model, rounds, clients, levels, bucket_size, min_numel=min_numel, beta=beta, seed=seed
    )  # fmt: skip
    pairs = [[pair for client in r.p2 for pair in client.values()] for r in rounds_]
    return pairs, spreads_of(rounds_, levels, bucket_size), [r.p1_decoded for r in rounds_]


def spreads_of(rounds: list[RoundUpdates], levels: int, bucket_size: int) -> list[RoundSpread]:
    """Per round the P1 spread estimate (largest over tensors of 1024+ elements) and the measured one."""
    out = []
    for r in rounds:
        big = [u for u in r.p1_decoded.values() if len(u) >= 2 and u[0].numel() >= 1024]
        estimated = max((spread_in_steps(u, levels, bucket_size, dqsg_levels=levels) for u in big), default=0.0)
        out.append(RoundSpread(r.server_round, r.accuracy, estimated, r.measured))
    return out


def spread_sums(x: torch.Tensor, y: torch.Tensor, levels: int, bucket_size: int) -> tuple[float, int]:
    """Sum of ``((x - y) / Delta1)**2`` over the coordinates whose fine step ``Delta1`` (NDQSG's, of
    ``x``) is not 0, and their count: the RMS spread in fine steps is ``sqrt(sum / count)``."""
    step = _steps(x, levels, bucket_size)
    keep = step > 0
    return float(((x - y)[keep] / step[keep]).double().pow(2).sum()), int(keep.sum())


def _steps(x: torch.Tensor, levels: int, bucket_size: int) -> torch.Tensor:
    n = x.numel()
    v = torch.nn.functional.pad(x, (0, (-n) % bucket_size)).view(-1, bucket_size)
    return (v.abs().amax(1, keepdim=True) / levels).expand_as(v).reshape(-1)[:n]


def format_spreads(spreads: list[RoundSpread]) -> str:
    """Per round: accuracy, the P1 estimate, and the P2 pairs' real spread next to the previous round's estimate
    x 1.1 (the margin ``NestedDecodePlan`` chooses this round's ``rho`` with)."""
    lines = [f"{'round':>5} {'test acc':>8} {'est. s/D1 (P1)':>15} {'real s/D1 (P2)':>15} {'prev. est x1.1':>15}"]
    for i, s in enumerate(spreads):
        prev = f"{1.1 * spreads[i - 1].estimated:>15.3f}" if i else f"{'-':>15}"
        lines.append(f"{s.server_round:>5} {s.accuracy:>8.3f} {s.estimated:>15.3f} {s.measured:>15.3f} {prev}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the comparison
@dataclass
class Tally:
    """Bits (from payload bytes) and squared error summed over a tensor's P2 pairs."""

    bits: float = 0.0
    sq: float = 0.0

    def add(self, payload: bytes, err: torch.Tensor) -> None:
        self.bits += 8 * len(payload)
        self.sq += float(err.double().pow(2).sum())

    def merge(self, other: Tally) -> None:
        self.bits += other.bits
        self.sq += other.sq


@dataclass
class TensorResult:
    """One tensor (or ``all``) of one case: DQSG's curve and each nested variant."""

    name: str
    size: int = 0  # elements of the tensor
    numel: int = 0  # coordinates encoded over all P2 pairs
    ladder: dict[int, Tally] = field(default_factory=lambda: defaultdict(Tally))
    variants: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    rhos: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per round, 0: sent as DQSG

    def merge(self, other: TensorResult) -> None:
        self.numel += other.numel
        for m, t in other.ladder.items():
            self.ladder[m].merge(t)
        for v, t in other.variants.items():
            self.variants[v].merge(t)

    def curve(self) -> tuple[np.ndarray, np.ndarray]:
        """DQSG's bits per parameter and MSE over the ladder."""
        levels = sorted(self.ladder)
        bits = np.array([self.ladder[m].bits / self.numel for m in levels])
        mse = np.array([self.ladder[m].sq / self.numel for m in levels])
        return bits, mse


def _variants(levels: int, max_excess: list[float], seed: int) -> dict[str, NestedDecodePlan]:
    """The nested settings compared with DQSG: the plan's rules at each ``max_excess``, and the authors' (3, 3)."""
    out = {
        f"{rule} {e:g}": NestedDecodePlan(seed=seed, max_excess=e, rule=rule)
        for rule in ("variance", "rate")
        for e in max_excess
    }
    out[f"authors ({AUTHORS_LEVELS},{AUTHORS_RHO})"] = NestedDecodePlan.authors(seed=seed)
    return out


def compare(
    rounds: list[RoundUpdates],
    levels: int,
    bucket_size: int,
    coding: str,
    max_excess: list[float] = (0.01,),
    seed: int = 0,
) -> tuple[list[TensorResult], TensorResult]:
    """Replay the rounds through each :class:`NestedDecodePlan` variant and encode every P2 pair with it.

    Each variant's plan sees the same decoded P1 updates the server would (and learns each
    tensor's ``rho`` for the next round from them); its P2 codec per tensor is what
    ``assign`` gives a P2 client. The authors' variant runs at their ``M = 3`` whatever ``levels``.

    Returns
    -------
    tuple of (list of TensorResult, TensorResult)
        Per tensor (in model order) and ``all`` (every encoded tensor together).
    """
    shared = {"bucket_size": bucket_size, "coding": coding}
    ladder = {m: get_codec("dqsg", levels=m, **shared) for m in sorted({*DQSG_LADDER, levels})}
    plans = _variants(levels, list(max_excess), seed)
    nodes = list(range(2 * max(len(r.p2) for r in rounds)))
    results: dict[str, TensorResult] = {}
    for r in rounds:
        assigned = {}
        for label, plan in plans.items():
            m = AUTHORS_LEVELS if plan.rho is not None else levels
            assignments = plan.assign(r.server_round, nodes, get_codec("ndqsg", levels=m, **shared))
            assigned[label] = next(a for a in assignments.values() if a.config[KEY_ROLE] == ROLE_P2)
        for i, client in enumerate(r.p2):
            for name, (x, y) in client.items():
                res = results.setdefault(name, TensorResult(name, size=x.numel()))
                res.numel += x.numel()
                s = derive_seed(seed, r.server_round, i, name)
                for m, dq in ladder.items():
                    payload = dq.encode(x, s)
                    res.ladder[m].add(payload, dq.decode(payload, s) - x)
                for label, assignment in assigned.items():
                    c = assignment.codec_for(name)
                    payload = c.encode(x, s)
                    side = {"side_info": y} if c.needs_side_info else {}
                    res.variants[label].add(payload, c.decode(payload, s, **side) - x)
                    if i == 0:
                        res.rhos[label].append(c.rho if c.needs_side_info else 0)
        p1 = ClientAssignment(ladder[levels], {KEY_ROLE: ROLE_P1})
        for plan in plans.values():
            for j in range(len(next(iter(r.p1_decoded.values())))):
                updates = {name: decoded[j] for name, decoded in r.p1_decoded.items()}
                plan.accepted(r.server_round, DecodedClient(j, p1, updates, 0, 0))
            plan.round_metrics(r.server_round)  # learns the next round's rho per tensor
    total = TensorResult("all", size=sum(res.size for res in results.values()))
    for res in results.values():
        total.merge(res)
    return list(results.values()), total


def _rho_text(rhos: list[int]) -> str:
    nested = [r for r in rhos if r]
    if not nested:
        return "dqsg"
    low, high = min(nested), max(nested)
    span = str(low) if low == high else f"{low}-{high}"
    return f"{span}({len(nested)}/{len(rhos)})"


def format_comparison(label: str, levels: int, coding: str, per_tensor: list[TensorResult], total: TensorResult) -> str:
    """The table of one case: one row per tensor, then ``all``; per variant rho, bits, MSE ratio and saving.

    ``saving`` is ``1 - bits / (DQSG's bits at the variant's MSE)``: positive when the variant
    sends fewer bits than DQSG would at the same error. ``rho`` gives the range over the rounds
    where the tensor was nested and in how many rounds (``dqsg``: never nested).
    """
    names = list(total.variants)
    block = 36
    lead = f"{label + ' ' + coding:<28} {'tensor':<13} {'size':>6} {'DQSG b/p':>8}"
    top = " " * len(lead) + "".join(f" | {v:^{block}}" for v in names)
    head = lead + "".join(f" | {'rho':>12} {'b/p':>6} {'MSE/D':>6} {'saving':>7}" for _ in names)
    lines = [top, head, "-" * len(head)]
    for res in [*per_tensor, total]:
        bits, mse = res.curve()
        base = res.ladder[levels]
        line = f"{'':<28} {res.name[:13]:<13} {res.size:>6} {base.bits / res.numel:>8.3f}"
        for v in names:
            b, m = res.variants[v].bits / res.numel, res.variants[v].sq / res.numel
            rho = _rho_text(res.rhos[v]) if res.rhos.get(v) else "-"
            at = cheapest_bits_at(list(zip(bits, mse, strict=True)), m)
            line += f" | {rho:>12} {b:>6.3f} {m * res.numel / base.sq:>6.3f} {1 - b / at:>+7.1%}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--beta", type=float, nargs="+", default=[0.0, 0.5], help="label skew; 0 for IID")
    parser.add_argument("--codings", nargs="+", default=["fixed", "entropy"], choices=["fixed", "entropy"])
    parser.add_argument(
        "--max-excess", type=float, nargs="+", default=[0.01, 0.1], help="the plan's wrap bounds to compare"
    )
    parser.add_argument("--save", help="torch.save the P2 (update, side info) pairs of all cases here")
    args = parser.parse_args(argv)
    failures, saved = [], []
    for model in args.models:
        for beta in args.beta:
            label = f"{model} {'IID' if not beta else f'beta={beta:g}'} M={args.levels}"
            rounds = collect_rounds(
                model, args.rounds, args.clients, args.levels, args.bucket_size, lr=args.lr, beta=beta or None
            )  # fmt: skip
            saved += [pair for r in rounds for client in r.p2 for pair in client.values()]
            print(f"\n== {label} ==")
            print(format_spreads(spreads_of(rounds, args.levels, args.bucket_size)))
            for coding in args.codings:
                per_tensor, total = compare(rounds, args.levels, args.bucket_size, coding, args.max_excess)
                print(format_comparison(label, args.levels, coding, per_tensor, total))
                ratio = total.variants[f"variance {args.max_excess[0]:g}"].sq / total.ladder[args.levels].sq
                if ratio > 1 + MAX_MSE_EXCESS:
                    failures.append(f"{label} {coding}: the plan's NDQSG MSE is {ratio:.3f} x DQSG's")
    if args.save:
        torch.save(saved, args.save)
    print()
    for line in failures:
        print("FAIL:", line)
    if not failures:
        print(f"PASS: the plan's NDQSG stays within {MAX_MSE_EXCESS:.0%} of DQSG's MSE in every case")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
