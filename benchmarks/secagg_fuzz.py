"""Fuzzing the secure-aggregation server with mutated client replies: ``python -m benchmarks.secagg_fuzz``.

The cases and their outcomes are :mod:`fedquant.testing.secagg_fuzz`'s. Prints a table; exits 1
on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time

from fedquant.testing.secagg_fuzz import FAILURES, run_fuzz


def main(argv: list[str] | None = None) -> int:
    from tests.flower_fakes import set_task_identity

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    set_task_identity()
    start = time.perf_counter()
    outcomes, _, failures = run_fuzz(args.cases, args.seed)
    print(f"secagg reply fuzz: {args.cases} cases, seed {args.seed}, {time.perf_counter() - start:.0f} s")
    for outcome in ("completed", "completed-rejected", "completed-tampered", "failed-clean", *FAILURES):
        print(f"  {outcome:20s} {outcomes.get(outcome, 0)}")
    for i, outcome, detail in failures[:20]:
        print(f"  FAIL case {i}: {outcome} {detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
