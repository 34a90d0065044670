"""The fuzz harness shared by ``tests/testing/test_fuzz.py`` and ``python -m benchmarks.fuzz``.

The cases come from :mod:`fedquant.testing.fuzz_mutations`; case ``i`` of a family is a pure
function of ``(seed, family, i)``, so a failing case can be replayed alone (:func:`replay`).

Cases run in worker subprocesses (``python -m fedquant.testing.fuzzing``, jobs as JSON on stdin, one
result line per case on stdout), so a crash of the decoder kills a worker, not the caller: the
parent reports the case in flight as ``crash``, or as ``hang`` when no result comes within the
timeout, and starts a new worker after it. A worker measures each decode's peak allocation
(tracemalloc, which sees NumPy buffers) and peak resident memory (Linux ``VmHWM``, which sees
torch's too) against ``MEMORY_FACTOR * (payload bytes + expected float32 tensor bytes)`` plus a
small constant.

Outcomes: ``ok-finite`` (a finite tensor of the expected shape and dtype), ``payload-error``
(:class:`fedquant.PayloadError`), and the failures ``other-exception``, ``crash``, ``hang``,
``memory``, ``nonfinite``, ``bad-output`` (a tensor of the wrong shape or dtype) and
``deferred-mismatch``: where the case decodes as the server does (shape and float32 given) and the
pipeline defers its values (:meth:`fedquant.codecs.Codec.decode_deferred`), the server's first pass
over them (the running sums') must refuse what decode refuses and give decode's values otherwise.
"""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedquant.testing.fuzz_mutations import Base, bases, families, mutate

OUTCOMES = (
    "ok-finite",
    "payload-error",
    "other-exception",
    "crash",
    "hang",
    "memory",
    "nonfinite",
    "bad-output",
    "deferred-mismatch",
)
FAILURES = OUTCOMES[2:]
MEMORY_FACTOR = 4
TRACED_SLACK = 1 << 20  # bytes of Python/NumPy bookkeeping any decode may allocate
RSS_SLACK = 32 << 20  # resident-memory noise: allocator arenas, numba code loaded on first use
STARTUP_TIMEOUT = 300.0  # seconds for a worker's imports and kernel loading, before its first result
#: The directory that holds this ``fedquant`` package: workers import the same code from it.
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- one case
class _Proc:
    """Peak resident memory of this process (Linux): reset ``VmHWM``, read it back; files kept open."""

    def __init__(self) -> None:
        try:
            self.clear = open("/proc/self/clear_refs", "wb", buffering=0)  # noqa: SIM115 - reused per case
            self.status = open("/proc/self/status", "rb", buffering=0)  # noqa: SIM115
            self.reset()
        except OSError:
            self.clear = self.status = None

    @property
    def available(self) -> bool:
        return self.clear is not None

    def reset(self) -> None:
        self.clear.write(b"5")

    def kib(self, key: bytes) -> int:
        self.status.seek(0)
        text = self.status.read()
        start = text.index(key) + len(key)
        return int(text[start : text.index(b"kB", start)])


@dataclass
class Family:
    """A worker's state for one family: codec, valid payloads, the other families' specs."""

    spec: str
    codec: object
    bases: list[Base]
    all_specs: list[str]  # canonical specs of every family, for header rewrites
    proc: _Proc | None = None


def run_case(fam: Family, seed: int, family_index: int, i: int, inject: dict | None = None) -> tuple[str, str]:
    """Mutate, decode and classify case ``i`` of a family: ``(outcome, detail)``."""
    import torch

    from fedquant.codecs.codec import numel_limit
    from fedquant.errors import PayloadError
    from fedquant.wire.payload import read_payload

    rng = np.random.default_rng([seed, family_index, i])
    base = fam.bases[int(rng.integers(len(fam.bases)))]
    other = fam.bases[int(rng.integers(len(fam.bases)))]
    kind, payload = mutate(rng, fam.spec, base, other, fam.all_specs)
    shape = base.shape if rng.random() < 0.75 else None
    dtype = base.dtype if rng.random() < 0.5 else None
    injected = next((k for k, v in (inject or {}).items() if v == [fam.spec, i]), None)
    if injected == "crash":
        import ctypes

        ctypes.string_at(0)  # a deliberate segfault: the harness must report it
    elif injected == "hang":
        time.sleep(3600)
    elif injected == "nonfinite":  # a valid payload whose decoded tensor is then replaced by Inf
        kind, payload, shape, dtype = "valid", base.payload, base.shape, base.dtype

    expected_numel = math.prod(shape) if shape is not None else numel_limit(len(payload))
    bound = MEMORY_FACTOR * (len(payload) + 4 * expected_numel)
    proc = fam.proc if fam.proc is not None and fam.proc.available else None
    if proc is not None:
        proc.reset()
    rss_before = proc.kib(b"VmRSS:") if proc is not None else 0
    tracemalloc.reset_peak()
    traced_before = tracemalloc.get_traced_memory()[0]
    try:
        out = fam.codec.decode(payload, base.seed, base.side_info, shape=shape, dtype=dtype)
        error = None
    except PayloadError as err:
        out, error = None, err
    except Exception as err:  # noqa: BLE001 - classifying every escape is the point
        return "other-exception", f"{kind}: {type(err).__name__}: {err}"[:300]
    traced = tracemalloc.get_traced_memory()[1] - traced_before
    grown = (proc.kib(b"VmHWM:") - rss_before) * 1024 if proc is not None else 0
    if traced > bound + TRACED_SLACK or grown > bound + RSS_SLACK:
        return "memory", f"{kind}: allocated {traced} B (traced), {grown} B resident; bound {bound} B"
    if shape is not None and dtype == torch.float32:
        mismatch = _deferred_disagrees(fam.codec, payload, base.seed, shape, out)
        if mismatch is not None:
            return "deferred-mismatch", f"{kind}: {mismatch}"[:300]
    if error is not None:
        return "payload-error", ""
    if injected == "nonfinite":
        out = torch.full_like(out, math.inf)
    declared = read_payload(payload)
    want_shape = shape if shape is not None else declared.shape
    want_dtype = dtype if dtype is not None else declared.dtype
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want_shape) or out.dtype != want_dtype:
        got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
        return "bad-output", f"{kind}: got {got}, expected {(tuple(want_shape), want_dtype)}"
    if not bool(torch.isfinite(out).all()):
        return "nonfinite", f"{kind}: decoded tensor holds NaN or Inf"
    return "ok-finite", ""


def _deferred_disagrees(codec, payload: bytes, seed: int, shape, decoded) -> str | None:
    """Where the server's deferred decode of ``payload`` disagrees with ``decoded`` (decode's tensor,
    None when decode refused it), in a sentence; None when they agree or nothing is deferred.

    The first pass is the running sums' (:meth:`~fedquant.codecs.deferred.DeferredValues.accumulate`
    onto a zero model): it must raise :class:`fedquant.PayloadError` or count a non-finite sum
    exactly when decode refused, and the values it wrote must be decode's.
    """
    from fedquant.errors import PayloadError

    try:
        values = codec.decode_deferred(payload, seed, shape=shape)
        if values is None:
            return None
        zeros = np.zeros(values.numel, np.float32)
        _, nonfinite = values.accumulate(zeros, np.zeros(values.numel, np.float32), np.zeros(0), 1.0, 0.0)
    except PayloadError:
        return None if decoded is None else "the deferred pass refused a payload decode accepts"
    except Exception as err:  # noqa: BLE001 - any other escape is the finding
        return f"the deferred pass raised {type(err).__name__}: {err}"
    if decoded is None:
        return None if nonfinite else "the deferred pass accepted a payload decode refuses"
    if nonfinite:
        return "the deferred pass found non-finite values where decode found none"
    if not np.array_equal(values.materialize().numpy(), decoded.reshape(-1).numpy()):
        return "the deferred values differ from decode's"
    return None


def canonical_specs(specs: list[str]) -> list[str]:
    """The spec each family's payloads carry (``"qsgd:bucket_size=512,coding=elias,..."``)."""
    from fedquant.codecs import get_codec

    return [get_codec(s).spec for s in specs]


def load_family(spec: str, all_specs: list[str], proc: _Proc | None = None) -> Family:
    """Build a family and warm up its decoder (kernels load on first use)."""
    codec, valid = bases(spec)
    for b in valid:
        codec.decode(b.payload, b.seed, b.side_info, shape=b.shape, dtype=b.dtype)
    return Family(spec, codec, valid, all_specs, proc)


def _load_wire_coders() -> None:
    """Load every argument-type variant of the wire coders before any case is measured.

    A family's valid payloads load only the variants they reach; a mutated payload may reach
    another (uint16 symbols, another lane count), and loading it on first use grows the resident
    memory of that case by the compiled code, which the harness would report as a blow-up.
    """
    from fedquant.codecs.kernels.common import PARALLEL_MIN
    from fedquant.codecs.kernels.warmup import exercise_wire

    exercise_wire((3000, PARALLEL_MIN + 1001))


def worker_main() -> None:
    """Worker process: read ``{"seed", "jobs": [[spec, start, stop], ...], "inject"}`` from stdin."""
    job = json.load(sys.stdin)
    names = families()
    canonical = canonical_specs(names)
    proc = _Proc()
    _load_wire_coders()
    tracemalloc.start()
    out = sys.stdout
    for spec, start, stop in job["jobs"]:
        try:
            fam = load_family(spec, canonical, proc)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which skips the family
            out.write(f"LOADFAIL\t{spec}\t{type(err).__name__}: {err}\n".replace("\n", " ").rstrip() + "\n")
            out.flush()
            continue
        out.write(f"LOADED\t{spec}\n")  # the parent allows STARTUP_TIMEOUT until this line
        out.flush()
        index = names.index(spec)
        for i in range(start, stop):
            outcome, detail = run_case(fam, job["seed"], index, i, job.get("inject"))
            out.write(f"{spec}\t{i}\t{outcome}\t{detail.replace(chr(10), ' ')}\n")
            out.flush()
    out.write("DONE\n")
    out.flush()


# ---------------------------------------------------------------------------------------------- parent
@dataclass
class Report:
    """Counts per family and outcome, and the failing cases (family, case, outcome, detail)."""

    counts: dict[str, Counter] = field(default_factory=dict)
    failures: list[tuple[str, int, str, str]] = field(default_factory=list)
    worker_errors: list[str] = field(default_factory=list)

    def add(self, spec: str, i: int, outcome: str, detail: str) -> None:
        self.counts.setdefault(spec, Counter())[outcome] += 1
        if outcome in FAILURES:
            self.failures.append((spec, i, outcome, detail))

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def table(self) -> str:
        """Counts per family x outcome, with a total row."""
        width = max([len(s) for s in self.counts] + [12])
        head = f"{'family':<{width}}" + "".join(f"{o:>19}" for o in OUTCOMES)
        lines = [head, "-" * len(head)]
        total: Counter = Counter()
        for spec, c in self.counts.items():
            total.update(c)
            lines.append(f"{spec:<{width}}" + "".join(f"{c[o]:>19,}" for o in OUTCOMES))
        lines.append("-" * len(head))
        lines.append(f"{'total':<{width}}" + "".join(f"{total[o]:>19,}" for o in OUTCOMES))
        return "\n".join(lines)


def _plan(specs: list[str], cases: int, workers: int) -> list[list[list]]:
    """Split ``cases`` over families (as evenly as possible) and the jobs over workers."""
    per, extra = divmod(cases, len(specs))
    jobs = [[s, 0, per + (k < extra)] for k, s in enumerate(specs)]
    jobs = [j for j in jobs if j[2] > 0]
    lanes: list[list[list]] = [[] for _ in range(max(1, workers))]
    for k, j in enumerate(jobs):
        lanes[k % len(lanes)].append(j)
    return lanes


def _start_worker(jobs: list[list], seed: int, inject: dict | None, env: dict) -> tuple:
    """A worker process, a queue of its stdout lines (``None`` at EOF) and a list that gets its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedquant.testing.fuzzing"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    proc.stdin.write(json.dumps({"seed": seed, "jobs": jobs, "inject": inject}))
    proc.stdin.close()
    lines: queue.Queue = queue.Queue()
    err_chunks: list[str] = []

    def pump_stdout() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def pump_stderr() -> None:
        err_chunks.append(proc.stderr.read())

    threading.Thread(target=pump_stdout, daemon=True).start()
    threading.Thread(target=pump_stderr, daemon=True).start()
    return proc, lines, err_chunks


def _lane(
    jobs: list[list],
    seed: int,
    inject: dict | None,
    case_timeout: float,
    report: Report,
    lock: threading.Lock,
) -> None:
    """Run a list of jobs in worker processes, restarting after each crash or hang."""
    # One thread per worker: workers run side by side, and a parallel kernel's thread start costs
    # more than a small tensor's decode.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        NUMBA_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
    )
    remaining = [list(j) for j in jobs]
    while remaining:
        proc, lines, err_chunks = _start_worker(remaining, seed, inject, env)
        loading = True  # imports, kernels and the family's valid payloads: slow on a cold cache
        outcome = None
        while True:
            try:
                line = lines.get(timeout=STARTUP_TIMEOUT if loading else case_timeout)
            except queue.Empty:
                outcome = "hang"
                proc.kill()
                break
            if line is None:
                outcome = "crash"
                break
            if line == "DONE\n":
                remaining = []
                break
            if line.startswith("LOADED\t"):
                loading = False
                continue
            if line.startswith("LOADFAIL\t"):  # a harness problem: the family has no valid payloads
                with lock:
                    report.worker_errors.append(f"family {remaining[0][0]} failed to load: {line.split(chr(9), 2)[2]}")
                remaining.pop(0)
                continue
            spec, i, result, detail = line.rstrip("\n").split("\t", 3)
            with lock:
                report.add(spec, int(i), result, detail)
            remaining[0][1] = int(i) + 1
            if remaining[0][1] >= remaining[0][2]:
                remaining.pop(0)
                loading = True
        rc = proc.wait()
        if outcome is None:
            continue
        if not remaining:  # the worker died after its last case: a harness problem, not a case
            with lock:
                report.worker_errors.append(f"worker exited with {rc} after its last case")
            break
        spec, i = remaining[0][0], remaining[0][1]
        detail = f"worker exit status {rc}" if outcome == "crash" else f"no result within {case_timeout:.0f} s"
        tail = "".join(err_chunks)[-300:].replace("\n", " ") if outcome == "crash" else ""
        with lock:
            report.add(spec, i, outcome, f"{detail} {tail}".strip())
        remaining[0][1] = i + 1
        if remaining[0][1] >= remaining[0][2]:
            remaining.pop(0)


def run_fuzz(
    cases: int,
    *,
    seed: int = 0,
    workers: int = 2,
    specs: list[str] | None = None,
    case_timeout: float = 20.0,
    inject: dict | None = None,
    progress: Callable[[int, Report], None] | None = None,
) -> Report:
    """Fuzz ``cases`` mutated payloads spread over ``specs`` (default: every family) in workers.

    Parameters
    ----------
    cases : int
        Total number of cases.
    seed : int
        Master seed; the same seed gives the same cases.
    workers : int
        Worker processes running at once.
    specs : list of str, optional
        Families to fuzz (default :func:`families`).
    case_timeout : float
        Seconds without a result after which the case in flight counts as a hang.
    inject : dict, optional
        Self-test of the harness: ``{"crash": [spec, i], "hang": [spec, i], "nonfinite": [spec, i]}``
        makes those cases segfault, hang or return Inf.
    progress : callable, optional
        Called about every 2 seconds with ``(cases, report)``.
    """
    report = Report()
    lock = threading.Lock()
    specs = specs or families()
    threads = [
        threading.Thread(target=_lane, args=(lane, seed, inject, case_timeout, report, lock), daemon=True)
        for lane in _plan(specs, cases, workers)
        if lane
    ]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(timeout=2.0)
        if progress is not None:
            with lock:
                progress(cases, report)
    return report


def replay(spec: str, i: int, seed: int = 0) -> tuple[str, str]:
    """Run one case in this process (to debug a failure the table reports)."""
    names = families()
    tracemalloc.start()
    try:
        return run_case(load_family(spec, canonical_specs(names), _Proc()), seed, names.index(spec), i)
    finally:
        tracemalloc.stop()


if __name__ == "__main__":
    worker_main()
