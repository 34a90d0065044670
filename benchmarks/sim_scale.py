"""Scale check: many registered clients, a sample per round, on this machine.

    python benchmarks/sim_scale.py                                  # 10,000 clients, 100 per round
    python benchmarks/sim_scale.py --clients 1000 --dataset digits  # the digits dataset (<= 1438 clients)
    python benchmarks/sim_scale.py --flower-dispatch                # Flower's own message dispatch (slow)

Runs the simulation app (Synthetic(1, 1) by default, MLP, one local epoch) through Flower's
simulation engine (``run_simulation``, Ray backend bound to 127.0.0.1) and prints a table: the
time until all nodes are registered, the first round (which also pays Ray's start, the actors'
imports and the numba cache load), seconds per round after it, the per-sampled-client cost, and
the peak resident memory of this process plus every child (Ray workers), sampled every 0.5 s.
Then it checks, in a fresh Ray worker, that fedquant's ``cache=True`` numba kernels are loaded
from the on-disk cache rather than compiled.

Exits 1 when a round after the first takes longer than ``--max-round-seconds`` (5), memory
exceeds ``--max-memory-gib`` (6), a round sampled another number of clients than
``--per-round``, or a kernel was compiled in the fresh worker.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ray.init turns a loopback _node_ip_address into the routed one: ray_loopback_only() binds 127.0.0.1.
RAY_INIT_ARGS = {"include_dashboard": False}
REGISTRATION_TIMEOUT_S = 600


class PeakMemory:
    """Samples the summed RSS of this process tree every ``interval`` seconds."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def waiting_server_app(num_nodes: int, marks: dict[str, float], **overrides: Any) -> Any:
    """The simulation's ServerApp, started only once all ``num_nodes`` nodes are registered.

    ``run_simulation`` starts the ServerApp while the engine is still registering nodes (10,000
    take seconds), so the first rounds would otherwise sample from a part of the federation.
    """
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from simulations.server_app import run_server
    from simulations.task import limit_threads

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        limit_threads()
        deadline = time.monotonic() + REGISTRATION_TIMEOUT_S
        while len(list(grid.get_node_ids())) < num_nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {num_nodes} nodes registered after {REGISTRATION_TIMEOUT_S} s")
            time.sleep(0.2)
        marks["registered"] = time.perf_counter()
        run_server(grid, dict(context.run_config), **overrides)

    return app


def numba_cache_in_fresh_worker(codec: str, numel: int) -> dict[str, int]:
    """Encode and decode once in a new Ray worker; count the kernels loaded from cache and compiled."""
    import ray

    @ray.remote(num_cpus=1)
    def probe(spec: str, n: int) -> dict[str, int]:
        import torch

        from fedquant import jit
        from fedquant.codecs import get_codec
        from fedquant.codecs.kernels import common, dither, eden, grid, hadamard, levels

        codec_obj = get_codec(spec)
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        codec_obj.decode(codec_obj.encode(x, seed=1), seed=1)
        counts = {"loaded": 0, "compiled": 0}
        for module in (common, grid, levels, dither, hadamard, eden):
            for fn in jit.module_dispatchers(module):
                counts["loaded"] += sum(fn.stats.cache_hits.values())
                counts["compiled"] += sum(fn.stats.cache_misses.values())
        return counts

    from simulations.loopback import ray_loopback_only

    ray_loopback_only()
    ray.init(**RAY_INIT_ARGS)
    try:
        return ray.get(probe.remote(codec, numel))
    finally:
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4, help="the first is reported apart")
    parser.add_argument("--codec", default="qsgd:levels=16")
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--num-cpus", type=float, default=1, help="CPUs per client actor")
    parser.add_argument("--flower-dispatch", action="store_true", help="keep Flower's per-node message dispatch")
    parser.add_argument("--max-round-seconds", type=float, default=5.0)
    parser.add_argument("--max-memory-gib", type=float, default=6.0)
    args = parser.parse_args()

    from flwr.simulation import run_simulation

    from simulations import vce_dispatch
    from simulations.client_app import app as client_app

    if args.flower_dispatch:
        vce_dispatch.uninstall()  # importing the ClientApp module installed fedquant's
    else:
        vce_dispatch.install(force_import=True)
    out = Path(tempfile.mkdtemp(prefix="sim_scale_"))
    marks: dict[str, float] = {}
    server_app = waiting_server_app(
        args.clients,
        marks,
        codec=args.codec,
        dataset=args.dataset,
        model=args.model,
        rounds=args.rounds,
        fraction_train=args.per_round / args.clients,
        local_epochs=1,
        min_local_steps=0,
        out_dir=str(out),
        run_name="scale",
    )  # fmt: skip  (one local epoch as measured: the app's min-local-steps would make it 30 steps)
    backend = {"client_resources": {"num_cpus": args.num_cpus, "num_gpus": 0.0}, "init_args": RAY_INIT_ARGS}
    t0 = time.perf_counter()
    from flwr.server.superlink.fleet.vce import vce_api

    dispatch = "fedquant" if getattr(vce_api.add_messages_to_queue, "fedquant_dispatch", False) else "flower"
    from simulations.loopback import ray_loopback_only

    ray_loopback_only()
    with PeakMemory() as mem:
        run_simulation(server_app, client_app, num_supernodes=args.clients, backend_config=backend)
    total = time.perf_counter() - t0
    history = json.loads((out / "scale" / "history.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    rounds = history["rounds"]  # row 0 is the initial evaluation
    elapsed = [r["elapsed-seconds"] for r in rounds]
    per_round = [b - a for a, b in zip(elapsed, elapsed[1:])]
    steady = per_round[1:] or per_round
    sec = statistics.mean(steady)
    per_round_clients = [sum(1 for c in history["clients"] if c["round"] == r) for r in range(1, args.rounds + 1)]
    startup = marks.get("registered", t0) - t0
    gib = mem.peak / 2**30
    numel = rounds[-1].get("uplink-bytes-dense", 0) // 4 // max(args.per_round, 1)
    cache = numba_cache_in_fresh_worker(args.codec, max(int(numel), 1024))

    print("| clients | per round | dataset | model | codec | dispatch | registration s | first round s | "
          "s/round (after) | ms/client | peak RSS GiB | total s |")  # fmt: skip
    print("|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.clients} | {args.per_round} | {args.dataset} | {args.model} | {args.codec} | "
          f"{dispatch} | {startup:.1f} | {per_round[0]:.1f} | {sec:.2f} | "
          f"{1000 * sec / max(args.per_round, 1):.0f} | {gib:.2f} | {total:.0f} |")  # fmt: skip
    uplink_mb = rounds[-1].get("uplink-bytes", 0) / 1e6
    print(f"accuracy {rounds[0]['accuracy']:.4f} -> {rounds[-1]['accuracy']:.4f}; uplink per round {uplink_mb:.3f} MB; "
          f"clients per round {per_round_clients}; seconds per round {[round(s, 2) for s in per_round]}")  # fmt: skip
    print(f"numba kernels in a fresh Ray worker: {cache['loaded']} loaded from cache, {cache['compiled']} compiled")
    misses = []
    if sec > args.max_round_seconds:
        misses.append(f"s/round {sec:.2f} > {args.max_round_seconds}")
    if gib > args.max_memory_gib:
        misses.append(f"peak {gib:.2f} GiB > {args.max_memory_gib} GiB")
    if any(n != args.per_round for n in per_round_clients):
        misses.append(f"clients per round {per_round_clients} != {args.per_round}")
    if cache["compiled"] or not cache["loaded"]:
        misses.append("numba kernels compiled in a fresh worker instead of loaded from the cache")
    for miss in misses:
        print(f"TARGET MISSED: {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
