"""Server cost of a round: ``QuantizedStrategy.aggregate_train`` against ``FedAvg.aggregate_train``.

Replies are built with the real client path (``quantize_mod`` on the train messages that
``QuantizedStrategy.configure_train`` writes, so every payload is what a client sends), then the
wrapped strategy's ``aggregate_train`` (check, decode, admission, rebuild, FedAvg) is timed
against plain ``FedAvg.aggregate_train`` of the same dense arrays, in one process, best of
``--repeats``, one wrapped strategy for every round (as a ServerApp keeps it: the first,
untimed round warms its caches and the memory it lends again). Each setting runs twice in a
fresh subprocess: per core (``NUMBA_NUM_THREADS=1``, one torch thread) and on every core.
Honest clients only: every reply is admitted.

Targets (issue 23): at most 1.5x FedAvg's time for 100 replies x 1M parameters and 2x for
10 x 25M, for ``qsgd:levels=16`` and ``eden:bits=2``; ``rht+dqsg:levels=6,coding=entropy`` is
reported without a target. Exits 1 on a miss. ``--profile`` adds, per setting, the functions
that take the wrapped strategy's time (cProfile, own time, per core). ``--drift on|off`` times the
wrapped strategy with the cross-round rule on or off (default: the library's ``AdmissionRules()``);
``--cpu-time`` times CPU seconds instead of wall seconds (per core only), for a machine other jobs load.

    python -m benchmarks.server_decode [--quick] [--repeats 3] [--profile] [--codec SPEC ...] [--source DIR]
        [--drift on|off] [--cpu-time]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TARGETED = ("qsgd:levels=16", "eden:bits=2")
REPORTED = ("rht+dqsg:levels=6,coding=entropy",)
SETTINGS = {"full": ((100, 1_000_000, 1.5), (10, 25_000_000, 2.0)), "quick": ((20, 200_000, 1.5), (4, 2_000_000, 2.0))}
BIAS_NUMEL = 512  # a small tensor that travels as it is (below min_numel), as a model's biases do
UPDATE_SCALE = 1e-2
CLOCK_ENV = "FEDQUANT_BENCH_CLOCK"  # "cpu": the process's CPU time instead of wall time (a loaded machine)


@dataclass
class Setting:
    replies: int
    numel: int
    target: float


def _worker(spec: str, replies: int, numel: int, repeats: int, profile: bool, drift: str = "default") -> dict:
    """Build the replies, time both aggregations; runs in a subprocess with its thread settings."""
    import numpy as np
    import torch
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from fedquant.clients import quantize_mod
    from fedquant.strategies import QuantizedStrategy

    threads = int(os.environ.get("FEDQUANT_BENCH_THREADS", "0"))
    clock = time.process_time if os.environ.get(CLOCK_ENV) == "cpu" else time.perf_counter
    if threads:
        torch.set_num_threads(threads)
    for attr, value in (("run_id", 1), ("node_id", 1), ("task_id", 1)):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:
            setattr(TaskIdentity, attr, value)

    class _Grid:  # just enough of a Grid for configure_train
        def get_node_ids(self) -> list[int]:
            return list(range(1001, 1001 + replies))

    rng = np.random.default_rng(0)
    model = {
        "weight": rng.standard_normal(numel - BIAS_NUMEL, dtype=np.float32) * 0.05,
        "bias": np.zeros(BIAS_NUMEL, dtype=np.float32),
    }
    model_record = ArrayRecord({k: Array(v) for k, v in model.items()})

    def strategy() -> QuantizedStrategy:
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
        setting = drift
        try:
            from fedquant.strategies.drift import DriftRule
        except ImportError:  # a checkout from before the rule: off is its only setting
            if setting == "on":
                raise
            setting = "default"
        if setting == "default":  # what the checkout's AdmissionRules() does
            return QuantizedStrategy(inner, codec=spec, seed=0, client_mse=False)
        from fedquant.strategies import AdmissionRules

        admission = AdmissionRules(cross_round=DriftRule() if setting == "on" else None)
        return QuantizedStrategy(inner, codec=spec, seed=0, client_mse=False, admission=admission)

    wrapped = strategy()
    messages = list(wrapped.configure_train(1, model_record, ConfigRecord({"lr": 0.1}), _Grid()))
    wire: dict[int, dict] = {}  # node -> the reply's records as the client sent them
    dense: dict[int, ArrayRecord] = {}
    for msg in messages:
        node = msg.metadata.dst_node_id
        node_rng = np.random.default_rng(node)
        scale = UPDATE_SCALE * (1.0 + 0.2 * node_rng.random())
        trained = {k: v + node_rng.standard_normal(v.shape, dtype=np.float32) * scale for k, v in model.items()}
        dense[node] = ArrayRecord({k: Array(v) for k, v in trained.items()})
        content = RecordDict({"arrays": dense[node], "metrics": MetricRecord({"num-examples": 100})})
        context = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
        reply = quantize_mod(msg, context, lambda m, _c, c=content: Message(c, reply_to=m))
        if reply.has_error():
            raise RuntimeError(f"the client path failed: {reply.error.reason}")
        wire[node] = dict(reply.content.items())
    wire_bytes = sum(
        len(a.data)
        for records in wire.values()
        for r in records.values()
        if isinstance(r, ArrayRecord)
        for a in r.values()
    )

    def wrapped_round() -> tuple[float, cProfile.Profile | None]:
        # One strategy for every round, as a ServerApp keeps it: its memory from the round before
        # is reused. Each round is configured as round 1, which the replies were built for.
        msgs = list(wrapped.configure_train(1, model_record, ConfigRecord({"lr": 0.1}), _Grid()))
        # Fresh reply objects over the same bytes: aggregate_train replaces their records.
        round_replies = [Message(RecordDict(dict(wire[m.metadata.dst_node_id])), reply_to=m) for m in msgs]
        prof = cProfile.Profile() if profile else None
        start = clock()
        if prof is not None:
            prof.enable()
        arrays, metrics = wrapped.aggregate_train(1, round_replies)
        if prof is not None:
            prof.disable()
        seconds = clock() - start
        if arrays is None or metrics["rejected-replies"]:
            raise RuntimeError(f"{spec}: the wrapped round rejected honest replies: {dict(metrics)}")
        return seconds, prof

    def fedavg_round() -> float:
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1)
        msgs = list(inner.configure_train(1, model_record, ConfigRecord({"lr": 0.1}), _Grid()))
        round_replies = [
            Message(
                RecordDict({"arrays": dense[m.metadata.dst_node_id], "metrics": MetricRecord({"num-examples": 100})}),
                reply_to=m,
            )
            for m in msgs
        ]
        start = clock()
        arrays, _ = inner.aggregate_train(1, round_replies)
        seconds = clock() - start
        assert arrays is not None
        return seconds

    wrapped_round()  # warm-up: numba compiles, caches fill
    fedavg_round()
    ours, theirs, profiles = [], [], []
    for _ in range(repeats):  # interleaved, so both see the same background load
        seconds, prof = wrapped_round()
        ours.append(seconds)
        profiles.append((seconds, prof))
        theirs.append(fedavg_round())
    result = {"wrapped": min(ours), "fedavg": min(theirs), "wire_bytes": wire_bytes}
    if profile:
        best = min(profiles, key=lambda p: p[0])[1]
        stats = pstats.Stats(best)
        total = sum(row[2] for row in stats.stats.values())
        rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:12]
        result["profile"] = [
            (f"{Path(file).name}:{line}({func})", own / total, cum / total)
            for (file, line, func), (_, _, own, cum, _) in rows
        ]
    return result


def run_setting(
    spec: str,
    setting: Setting,
    threads: int,
    repeats: int,
    profile: bool,
    source: Path,
    drift: str = "default",
    cpu_time: bool = False,
) -> dict:
    """One setting in a fresh process: ``threads`` 1 (per core) or 0 (every core), timing ``source``'s fedquant."""
    env = {**os.environ, "PYTHONPATH": str(source), "FEDQUANT_BENCH_THREADS": str(threads)}
    env[CLOCK_ENV] = "cpu" if cpu_time else "wall"
    env.setdefault("FEDQUANT_KERNELS", "numba")  # the compiled kernels, not their twins while a cache warms
    if source != ROOT:  # numba caches beside the sources: keep another checkout's folder untouched
        env.setdefault("NUMBA_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"fedquant-bench-numba-{os.getuid()}"))
    if threads:
        env.update(NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    args = [spec, str(setting.replies), str(setting.numel), str(repeats), "1" if profile else "0", drift]
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(args)],
        env=env, cwd=source, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{spec} {setting}: worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller settings (20 x 200k, 4 x 2M)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per setting (best is kept)")
    parser.add_argument("--profile", action="store_true", help="print where the wrapped round's time goes (per core)")
    parser.add_argument("--codec", action="append", help="codec specs to run (default: the targeted and reported ones)")
    parser.add_argument("--all-core", dest="all_core", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure with every core (default on)")  # fmt: skip
    parser.add_argument(
        "--source",
        type=Path,
        default=ROOT,
        help="the checkout whose fedquant is timed (default: this one; e.g. /work/main for a baseline)",
    )
    parser.add_argument("--cpu-time", action="store_true",
                        help="CPU seconds, not wall seconds (per core only; for a loaded machine)")  # fmt: skip
    parser.add_argument("--drift", choices=("on", "off"), default=None,
                        help="the cross-round rule on or off (default: the library's AdmissionRules())")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec, replies, numel, repeats, profile, drift = json.loads(args.worker)
        print(json.dumps(_worker(spec, int(replies), int(numel), int(repeats), profile == "1", drift)))
        return 0
    specs = args.codec or [*TARGETED, *REPORTED]
    settings = [Setting(*s) for s in SETTINGS["quick" if args.quick else "full"]]
    header = (
        f"{'codec':34} {'replies x numel':>16} {'cores':>5} {'fedavg s':>9} {'wrapped s':>9} {'ratio':>6} "
        f"{'target':>6}  verdict"
    )
    clock = "CPU seconds, per core only" if args.cpu_time else "wall seconds"
    print(f"cross-round rule: {args.drift or 'the library default'}; {clock}")
    print(header)
    print("-" * len(header))
    missed = []
    profiles = []
    for setting in settings:
        for spec in specs:
            for threads in (1, 0) if args.all_core and not args.cpu_time else (1,):
                result = run_setting(
                    spec, setting, threads, args.repeats, args.profile and threads == 1, args.source.resolve(),
                    args.drift or "default", args.cpu_time,
                )  # fmt: skip
                ratio = result["wrapped"] / result["fedavg"]
                targeted = spec in TARGETED
                ok = ratio <= setting.target or not targeted
                if not ok:
                    missed.append((spec, setting, threads))
                verdict = ("ok" if ok else "MISS") if targeted else "(reported)"
                size = f"{setting.replies} x {setting.numel / 1e6:g}M"
                print(
                    f"{spec:34} {size:>16} {'1' if threads else 'all':>5} {result['fedavg']:9.3f} "
                    f"{result['wrapped']:9.3f} {ratio:6.2f} {setting.target if targeted else '-':>6}  {verdict}",
                    flush=True,
                )
                if "profile" in result:
                    profiles.append((spec, setting, result["profile"]))
    for spec, setting, rows in profiles:
        print(f"\nprofile, {spec}, {setting.replies} x {setting.numel / 1e6:g}M, per core (share of the wrapped round)")
        print(f"  {'own':>6} {'cum':>6}  function")
        for name, own, cum in rows:
            print(f"  {own:6.1%} {cum:6.1%}  {name}")
    if missed:
        print(f"\nMISSED {len(missed)} target(s)")
        return 1
    print("\nall targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
