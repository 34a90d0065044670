"""Accuracy and wire bits of compressed secure aggregation over Ray: ``python -m benchmarks.secagg_sweep``.

The issue's accuracy gate, through the real Flower simulation (``simulations.sweep``: one Ray
start, the app's ServerApp and ClientApp, ``flwr run``'s code underneath): 20 clients, all
sampled every round, 2 of them dropping after key sharing in every secure round
(``secagg-dropouts = 2``: partitions 0 and 1 answer collect with an error reply), 3 seeds, the
app's defaults otherwise (digits CNN of 13,706 parameters, 3 local epochs, ``secagg-clip`` 1.0).
Arms: ``fp32``, plain FedAvg without secure aggregation (all 20 clients, float32 updates), and
each secure arm (default: the <= 4 bits setting of ``benchmarks.secagg_bits``, 1 quantizer bit,
a SecAgg+ neighbourhood of 4, a shared random 35 % of the rotated coordinates).

Prints per arm the last-k test accuracy (mean ± 95 % Student-t interval over the seeds), the
difference to fp32 paired by seed, the verdict, and the uplink bits per parameter on the wire
with every protocol stage counted (Flower's serialized records), two ways: ``over sampled`` is
the history's ``bits-per-param`` (all bytes over the 20 sampled clients), ``per sender`` divides
advertise and share-keys by the clients sampled and collect, consistency and unmask by the
clients whose masked input arrived (the dropped clients send no masked vector, so this is the
larger, what one client that stays sends). Writes the same as markdown to ``--doc`` with the
command, the run time and the machine's load. Exits 1 when a secure arm's mean accuracy lies
below fp32's 95 % interval, sends more than ``--max-bits`` per sender, or a run failed; 2 on a
bad setting (before Ray starts). Runs already stored in ``--out`` are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simulations.sweep_stats import REFERENCE, Interval

CLIENTS, DROPOUTS, SEEDS = 20, 2, "0-2"
COMPRESSED = f"secagg:bits=1,neighbours=4,keep=0.35,dropouts={DROPOUTS}"
MAX_BITS = 4.0
BEFORE_COLLECT = ("advertise", "share-keys")
STAGE_PREFIX = "secagg-uplink-bytes-"


def sender_bits(row: Mapping[str, Any]) -> float:
    """Uplink bits per parameter of one secure round per client that sent each stage (see the module doc)."""
    sampled, uplink, over_sampled = row["secagg-sampled"], row["uplink-bytes"], row["bits-per-param"]
    if not (sampled and uplink and over_sampled):
        return float("nan")
    numel = 8.0 * uplink / (sampled * over_sampled)  # the history's bits-per-param is 8 uplink / (sampled numel)
    arrived = row["secagg-survivors"] + row["secagg-refused-inputs"]  # masked inputs that reached the server
    total = 0.0
    for key, value in row.items():
        if key.startswith(STAGE_PREFIX) and value:
            stage = key[len(STAGE_PREFIX) :]
            total += value / (sampled if stage in BEFORE_COLLECT else max(arrived, 1))
    return 8.0 * total / numel


def arm_bits(records: Sequence[Mapping[str, Any]]) -> tuple[Interval, Interval]:
    """(bits over the sampled clients, bits per sender) of an arm: each run's mean over its rounds, over seeds."""
    sampled, senders = [], []
    for record in records:
        rows = [r for r in record["rounds"] if r.get("round", 0) > 0 and r.get("bits-per-param")]
        sampled.append(statistics.fmean(r["bits-per-param"] for r in rows))
        secure = [sender_bits(r) for r in rows if "secagg-sampled" in r]
        senders.append(statistics.fmean(secure) if secure else sampled[-1])
    return Interval.of(sampled), Interval.of(senders)


def summary(result, store, seeds: Sequence[int], last_k: int, max_bits: float) -> tuple[str, list[str]]:
    """The markdown table of the arms and the reasons the gate fails (empty: it passes)."""
    lines = [f"| arm | last-{last_k} accuracy | Δ vs fp32 (paired) | verdict | bits/param over sampled | "
             "bits/param per sender | seeds |", "|---|---:|---:|---|---:|---:|---|"]  # fmt: skip
    misses = []
    for row in result.rows:
        records = [json.loads(store.path(row.codec, s).read_text()) for s in row.seeds]
        over, per = arm_bits(records)
        delta = "–" if row.delta is None else row.delta.text(4)
        lines.append(f"| {row.codec} | {row.last_k.text(4)} | {delta} | {row.verdict} | {over.text(2)} | "
                     f"{per.text(2)} | {','.join(map(str, row.seeds))} |")  # fmt: skip
        if row.codec == REFERENCE:
            continue
        if row.verdict not in ("within fp32's spread", "above fp32's spread"):
            where = row.verdict or "not compared"
            misses.append(f"{row.codec}: last-{last_k} accuracy {row.last_k.text(4)} is {where}")
        if not per.mean <= max_bits:
            misses.append(f"{row.codec}: {per.mean:.2f} uplink bits/param per sender, more than {max_bits:g}")
        if len(row.seeds) < len(seeds):
            misses.append(f"{row.codec}: {len(seeds) - len(row.seeds)} of {len(seeds)} seeds did not finish")
    for codec, errors in result.errors.items():
        misses += [f"{codec}: {e}" for e in errors]
    return "\n".join(lines) + "\n", misses


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.secagg_sweep", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--arms",
        default=COMPRESSED,
        help=f"secure arms: secagg:key=value,... specs, comma-separated (default {COMPRESSED})",
    )
    parser.add_argument("--seeds", default=SEEDS, help=f"seeds (default {SEEDS})")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per run (default 20, the app's)")
    parser.add_argument("--last-k", type=int, default=5, help="rounds averaged for the accuracy (default 5)")
    parser.add_argument("--max-bits", type=float, default=MAX_BITS,
                        help=f"gate on the bits per sender (default {MAX_BITS:g})")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other run-config key")
    parser.add_argument("--out", type=Path, default=Path("results/secagg-compressed-sweep"),
                        help="the sweep's folder (default results/secagg-compressed-sweep)")  # fmt: skip
    parser.add_argument("--doc", type=Path, default=None, help="also write the result as markdown to this file")
    parser.add_argument("--restart", action="store_true", help="discard the runs stored in --out")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from simulations.run import stop_at_ctrl_c
    from simulations.settings import RunConfigError
    from simulations.sweep import RunStore, describe, parse_seeds, run_sweep, split_codecs

    args = _parse_args(argv)
    arms = split_codecs(args.arms)
    if not arms or any(not a.startswith("secagg") for a in arms):
        print(f"secagg_sweep: --arms takes secagg:... specs, got {args.arms!r}", file=sys.stderr)
        return 2
    overrides: dict[str, Any] = {"fraction_train": 1.0, "rounds": args.rounds}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"secagg_sweep: --set expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key.strip().replace("-", "_")] = value.strip().strip('"')
    seeds = parse_seeds(args.seeds)
    command = "python -m benchmarks.secagg_sweep " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    stop_at_ctrl_c("secagg_sweep")
    load_before, t0 = os.getloadavg(), time.perf_counter()
    try:
        result = run_sweep([REFERENCE, *arms], out=args.out, seeds=seeds, num_supernodes=CLIENTS, last_k=args.last_k,
                           command=command.strip(), restart=args.restart, **overrides)  # fmt: skip
    except RunConfigError as err:
        for problem in err.problems:
            print(f"secagg_sweep: invalid: {problem}", file=sys.stderr)
        return 2
    wall, load_after = time.perf_counter() - t0, os.getloadavg()
    from simulations.settings import SimSettings

    base = SimSettings.from_run_config({}, **overrides)
    table, misses = summary(result, RunStore(args.out.resolve()), seeds, min(args.last_k, args.rounds), args.max_bits)
    title = describe(base, CLIENTS, seeds) + f"; {DROPOUTS} of the secure arm's clients drop after key sharing"
    stored = sum(json.loads(RunStore(args.out.resolve()).path(r.codec, s).read_text())["wall-seconds"]
                 for r in result.rows for s in r.seeds)  # fmt: skip
    timing = (f"This invocation: {wall / 60:.1f} min of wall time, load average {load_before[0]:.1f} before and "
              f"{load_after[0]:.1f} after ({os.cpu_count()} CPUs); the runs themselves took {stored / 60:.1f} min "
              "(runs stored in the --out folder are reused, not rerun).")  # fmt: skip
    verdict = "PASS" if not misses else "MISS: " + "; ".join(misses)
    text = (f"{title}\n\n{table}\n{verdict}\n\n{timing}\n\nCommand: `{command.strip()}`\n\n"
            f"The sweep's own table (every column, {args.out}/sweep.md):\n\n"
            + (args.out / "sweep.md").read_text().split("\n", 2)[2])  # fmt: skip
    print("\n" + text, flush=True)
    if args.doc is not None:
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        args.doc.write_text("<!-- written by python -m benchmarks.secagg_sweep; do not edit by hand -->\n" + text)
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
