"""Scale check: many registered clients, a sample per round, on this machine.

    python benchmarks/sim_scale.py                       # 1000 clients, 100 per round, 3 rounds
    python benchmarks/sim_scale.py --clients 5000 --per-round 200

Runs the simulation app (digits, MLP, one local epoch) through Flower's simulation engine and
prints seconds per round (rounds after the first, which pays process and JIT start-up), the
per-client cost, and the peak resident memory of this process plus every child (Ray workers).
Exits 1 when a round takes longer than --max-round-seconds or memory exceeds --max-memory-gib.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="qsgd:levels=16")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--num-cpus", type=float, default=1, help="CPUs per client actor")
    parser.add_argument("--max-round-seconds", type=float, default=120.0)
    parser.add_argument("--max-memory-gib", type=float, default=12.0)
    args = parser.parse_args()

    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.server_app import make_server_app

    out = Path(tempfile.mkdtemp(prefix="sim_scale_"))
    server_app = make_server_app(
        codec=args.codec, model=args.model, rounds=args.rounds, fraction_train=args.per_round / args.clients,
        local_epochs=1, out_dir=str(out), run_name="scale",
    )  # fmt: skip
    t0 = time.perf_counter()
    with PeakMemory() as mem:
        run_simulation(server_app, client_app, num_supernodes=args.clients,
                       backend_config={"client_resources": {"num_cpus": args.num_cpus, "num_gpus": 0.0}})  # fmt: skip
    total = time.perf_counter() - t0
    rounds = json.loads((out / "scale" / "history.json").read_text())["rounds"]
    elapsed = [r["elapsed-seconds"] for r in rounds]
    per_round = [b - a for a, b in zip(elapsed, elapsed[1:])]
    steady = per_round[1:] or per_round
    sec = statistics.mean(steady)
    sampled = len(json.loads((out / "scale" / "history.json").read_text())["clients"]) // args.rounds
    gib = mem.peak / 2**30
    print(
        "| clients | per round | model | codec | first round s | s/round (after) | ms/client | peak RSS GiB | total s |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|")
    print(f"| {args.clients} | {sampled} | {args.model} | {args.codec} | {per_round[0]:.1f} | {sec:.1f} | "
          f"{1000 * sec / max(sampled, 1):.0f} | {gib:.2f} | {total:.0f} |")  # fmt: skip
    uplink_mb = rounds[-1].get("uplink-bytes", 0) / 1e6
    print(f"final accuracy {rounds[-1]['accuracy']:.4f}; uplink per round {uplink_mb:.3f} MB")
    ok = sec <= args.max_round_seconds and gib <= args.max_memory_gib and sampled == args.per_round
    if not ok:
        print(f"TARGET MISSED: s/round <= {args.max_round_seconds}, peak <= {args.max_memory_gib} GiB, "
              f"{args.per_round} clients per round")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
