"""Fuzz every codec's decoder with mutated payloads; a table of outcomes per family.

Each case mutates a valid payload of one family (codec and coding; see
:mod:`fedquant.testing.fuzzing`) and decodes it in a worker subprocess with the expected shape and
dtype, as the server does (a quarter of the cases without the shape, half without the dtype).
The table counts, per family, the outcomes ``ok-finite`` and ``payload-error`` (both fine) and
the failures: ``other-exception``, ``crash`` (the worker died), ``hang`` (no result within
``--case-timeout`` seconds), ``memory`` (peak allocation above 4 x (payload bytes + expected
float32 tensor bytes) plus a small constant), ``nonfinite`` (a NaN/Inf came back) and
``bad-output`` (wrong shape or dtype).

Exit status 1 on any failure; the first failing cases are listed with the command that replays
one of them in-process.

Usage::

    python -m benchmarks.fuzz                      # 100,000 cases, 2 workers
    python -m benchmarks.fuzz --cases 5000 --families qsgd:coding=elias,terngrad:coding=entropy
    python -m benchmarks.fuzz --replay "qsgd:coding=elias" 1234
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.specs import parse_codec_list
from fedquant.testing.fuzz_mutations import families
from fedquant.testing.fuzzing import FAILURES, Report, replay, run_fuzz


def _parse_families(text: str | None) -> list[str] | None:
    """``--families`` split as ``--codecs`` (:func:`benchmarks.specs.parse_codec_list`), checked against the known."""
    out = parse_codec_list(text)
    if out is None:
        return None
    known = families()
    unknown = [s for s in out if s not in known]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {'; '.join(known)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="number of cases (default 100,000)")
    ap.add_argument("--seed", type=int, default=0, help="master seed (default 0)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes at once (default 2)")
    ap.add_argument("--case-timeout", type=float, default=20.0, help="seconds before a case counts as a hang")
    ap.add_argument("--families", help="';'-separated family specs (default: all)")
    ap.add_argument("--replay", nargs=2, metavar=("FAMILY", "CASE"), help="run one case in this process")
    args = ap.parse_args(argv)

    if args.replay:
        outcome, detail = replay(args.replay[0], int(args.replay[1]), args.seed)
        print(outcome, detail)
        return int(outcome in FAILURES)

    specs = _parse_families(args.families) or families()
    start = time.perf_counter()

    def progress(total: int, report: Report) -> None:
        bad = len(report.failures)
        elapsed = time.perf_counter() - start
        print(f"\r  {report.total:>9,} / {total:,} cases, {bad} failures, {elapsed:.0f} s", end="", flush=True)

    print(f"fuzzing {len(specs)} families with {args.cases:,} cases, seed {args.seed}, {args.workers} workers")
    report = run_fuzz(
        args.cases,
        seed=args.seed,
        workers=args.workers,
        specs=specs,
        case_timeout=args.case_timeout,
        progress=progress,
    )
    elapsed = time.perf_counter() - start
    rate = report.total / max(elapsed, 1e-9)
    print(f"\r  {report.total:,} cases in {elapsed:.0f} s ({rate:,.0f} cases/s)" + " " * 20)
    print()
    print(report.table())
    problems = list(report.worker_errors)
    if report.total != args.cases:
        problems.append(f"{report.total:,} cases reported, {args.cases:,} planned")
    if report.failures:
        print(f"\n{len(report.failures)} FAILING CASES (first 20):")
        for spec, i, outcome, detail in report.failures[:20]:
            print(f"  {outcome:<16} {spec} case {i}: {detail}")
        spec, i = report.failures[0][:2]
        print(f'replay one: python -m benchmarks.fuzz --seed {args.seed} --replay "{spec}" {i}')
    for line in problems:
        print(f"HARNESS PROBLEM: {line}")
    if report.failures or problems:
        return 1
    print(
        "\nno crash, hang, memory blow-up, non-finite output, exception other than PayloadError, or deferred pass"
        " that disagrees with decode"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
