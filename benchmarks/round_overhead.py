"""Wall time per round: plain FedAvg against FedAvg wrapped in QuantizedStrategy + quantize_mod.

One ``run_simulation`` (Ray backend); its ServerApp alternates plain and wrapped runs of the
same task on the same Grid, several times, and compares the median seconds per round. The
first run of each kind is a warm-up (Ray actors start, numba compiles the QSGD kernels) and is
not counted. The task: an MLP (784-128-10, ~100K parameters, what a small FL model on edge
clients looks like) trained for one local epoch with torch SGD on synthetic data.

Target: fedquant adds at most 10% to a round. Runs of the two kinds alternate, so each wrapped
run has a plain neighbour that saw the same background load; the check uses the median over
reps of (wrapped / plain) per pair. Best-of-runs and medians are printed beside it.
Reading the numbers: the simulation Grid polls for replies every 0.1 s (flwr's InMemoryGrid
``pull_interval``), so a phase's wall time moves in 0.1 s steps, and a few milliseconds of
encoding can cost a whole step when a phase ends near a boundary. Each client trains
``--local-epochs`` epochs (default 10) over 1024 samples so that training, not polling, sets the
round time, as in real use (with one epoch a round is ~0.7 s of mostly polling and the paired
ratios scatter by +-20 %). The last line gives fedquant's own compute per round (client encode +
MSE check, server decode).
Prints a table; exits 1 when the target is missed.

    python benchmarks/round_overhead.py [--rounds 4] [--reps 8] [--clients 4] [--codec SPEC] [--no-client-mse]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedquant.clients import quantize_mod  # noqa: E402
from fedquant.strategies import QuantizedStrategy  # noqa: E402
from simulations.loopback import ray_loopback_only  # noqa: E402

TARGET_OVERHEAD = 0.10
N_SAMPLES, BATCH = 1024, 32


def make_model() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def client_data(partition: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + partition)
    x = torch.randn(N_SAMPLES, 784, generator=gen)
    y = torch.randint(0, 10, (N_SAMPLES,), generator=gen)
    return x, y


def train(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = client_data(int(context.node_config["partition-id"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(int(msg.content["config"]["local-epochs"])):
        for start in range(0, N_SAMPLES, BATCH):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[start : start + BATCH]), y[start : start + BATCH])
            loss.backward()
            optimizer.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": N_SAMPLES, "train-loss": loss.item()}),
        }
    )
    return Message(content, reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = client_data(int(context.node_config["partition-id"]))
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(x), y))
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": N_SAMPLES, "eval-loss": loss})}), reply_to=msg)


client_app = ClientApp(mods=[quantize_mod])
client_app.train()(train)
client_app.evaluate()(evaluate)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per timed run")
    parser.add_argument("--reps", type=int, default=8, help="timed runs of each kind (after one warm-up each)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--codec", default="qsgd:levels=16,bucket_size=512,coding=fixed")
    parser.add_argument("--min-numel", type=int, default=1024)
    parser.add_argument(
        "--local-epochs",
        type=int,
        default=10,
        help="epochs over 1024 samples per round (training must set the round time)",
    )
    parser.add_argument("--no-client-mse", action="store_true", help="clients skip the MSE measurement")
    args = parser.parse_args()

    times: dict[str, list[float]] = {"FedAvg": [], "QuantizedStrategy(FedAvg)": []}
    last_metrics: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        deadline = time.monotonic() + 120
        while len(list(grid.get_node_ids())) < args.clients and time.monotonic() < deadline:
            time.sleep(0.2)
        initial = ArrayRecord(make_model().state_dict())

        def plain():
            return FedAvg(min_available_nodes=args.clients)

        def wrapped():
            return QuantizedStrategy(
                plain(), args.codec, seed=0, min_numel=args.min_numel, client_mse=not args.no_client_mse
            )

        for rep in range(args.reps + 1):
            kinds = [("FedAvg", plain), ("QuantizedStrategy(FedAvg)", wrapped)]
            for name, make in kinds if rep % 2 else kinds[::-1]:  # alternate which kind goes first
                start = time.perf_counter()
                train_config = ConfigRecord({"local-epochs": args.local_epochs})
                result = make().start(grid, initial, train_config=train_config, num_rounds=args.rounds)
                per_round = (time.perf_counter() - start) / args.rounds
                if rep > 0:  # rep 0 is the warm-up
                    times[name].append(per_round)
                if name != "FedAvg":
                    last_metrics.update(dict(result.train_metrics_clientapp[args.rounds]))

    ray_loopback_only()  # Ray's servers on 127.0.0.1, not on every interface
    run_simulation(
        server_app,
        client_app,
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    if not times["FedAvg"] or not times["QuantizedStrategy(FedAvg)"]:
        print("the simulation did not finish", file=sys.stderr)
        return 2

    plain, wrapped = times["FedAvg"], times["QuantizedStrategy(FedAvg)"]
    overhead = statistics.median(w / p for w, p in zip(wrapped, plain, strict=True)) - 1
    overhead_best = min(wrapped) / min(plain) - 1
    overhead_median = statistics.median(wrapped) / statistics.median(plain) - 1
    params = sum(p.numel() for p in make_model().parameters())
    print()
    mse = "off" if args.no_client_mse else "on"
    print(f"environment: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, {os.cpu_count()} CPUs")
    print(f"round_overhead: {args.clients} clients, MLP 784-128-10 ({params} params), {args.codec}, client MSE {mse}")
    print(f"{'strategy':<28}{'best s/round':>14}{'median':>10}   runs (s/round)")
    for name, values in times.items():
        runs = "  ".join(f"{v:.3f}" for v in values)
        print(f"{name:<28}{min(values):>14.3f}{statistics.median(values):>10.3f}   {runs}")
    print(
        f"fedquant overhead per round: {100 * overhead:+.1f}% (median of paired ratios; target <= "
        f"{100 * TARGET_OVERHEAD:.0f}%), {100 * overhead_best:+.1f}% best-of-runs, "
        f"{100 * overhead_median:+.1f}% medians"
    )
    print(
        f"wrapped run: compression-ratio {last_metrics.get('compression-ratio', float('nan')):.2f}, "
        f"client encode {1000 * last_metrics.get('encode-seconds', float('nan')):.1f} ms, "
        f"server decode {1000 * last_metrics.get('decode-seconds', float('nan')):.1f} ms per round"
    )
    if overhead > TARGET_OVERHEAD:
        print("TARGET MISSED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
