"""Encode/decode throughput, bits per parameter and peak memory of every codec (a table).

For float32 tensors of each size (default 1M and 25M elements) the script measures, in the same
run: an in-place copy ``y.copy_(x)`` (the memory-bandwidth yardstick), a straightforward
whole-tensor torch QSGD (rand + floor + compare, int8 levels, no bit packing) as a reference
line, and every codec setting of :mod:`benchmarks.specs`. Everything is measured twice: **per
core** (numba kernels and torch on one thread, as ``NUMBA_NUM_THREADS=1`` and
``torch.set_num_threads(1)`` give; the process's CPU time) and **all cores** (the process's
default threads; wall time), each against the copy timed in the same thread setting. Each time
is the best over ``--rounds`` rounds through all jobs (copy included), each round timing at
least ``--repeats`` calls (more for short calls, up to ``--budget`` seconds): on a shared
machine the minimum is the least disturbed run, and rounds keep a burst of load from spoiling
a whole row. Columns: ``us/call`` and ``x copy`` (the codec's time as a multiple of the copy's
best time) per core and all cores;
``dec x lent``: the decode per core into memory a :class:`~fedquant.codecs.buffers.BufferPool`
lends again each call, as the server's decoding stage decodes (a new tensor's first touch, page
by page, is left out; the copy writes into memory it touched before too); ``peak MiB``: extra
resident memory at the peak of encode or decode.

Targets (per core, at ``--target-size`` elements, default 25M; :data:`TARGETS`, encode and
decode): fixed-width codecs (``specs.FIXED_WIDTH_PATHS``) encode and decode each within 3x of
the copy, except the level-selection codecs' encode (``specs.LEVEL_SELECTION_PATHS``: 7x); the
``rht+`` rotation and EDEN, integer and fractional bits (``specs.RHT_PATHS``), within 6x; ECDQ at
0.5, 1 and 2 bits (``specs.ECDQ_PATHS``) within 8x. ECDQ and the level-selection codecs have a
floor (:mod:`benchmarks.codec_floor`: the stages their definitions require, each at its fastest),
timed in the same rounds: above its copy target such a codec passes while it stays within
``codec_floor.MARGIN`` of its floor, and the table's last lines give each floor as a multiple of
the copy. The script exits with status 1 when a target is missed.

Usage::

    python -m benchmarks.codec_throughput                  # 1M and 25M, all codecs
    python -m benchmarks.codec_throughput --quick          # 1M only, fewer repeats
    python -m benchmarks.codec_throughput --codecs qsgd,terngrad --sizes 1M,4M
    python -m benchmarks.codec_throughput --codecs "rht+fp32;rht+dqsg" --sizes 4M,25M
    python -m benchmarks.codec_throughput --sizes 512,1000 --modes core   # per-call overhead
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import codec_floor
from benchmarks.specs import (
    ECDQ_PATHS,
    FIXED_WIDTH_PATHS,
    LEVEL_SELECTION_PATHS,
    RHT_PATHS,
    all_specs,
    build,
    parse_codec_list,
    side_info_for,
)
from fedquant.codecs.buffers import BufferPool

#: Per-core time targets (times an in-place copy: encode, decode) at the target size.
TARGETS: dict[str, tuple[float, float]] = {
    **{spec: (3.0, 3.0) for spec in FIXED_WIDTH_PATHS},
    **{spec: (7.0, 3.0) for spec in LEVEL_SELECTION_PATHS},
    **{spec: (6.0, 6.0) for spec in RHT_PATHS},
    **{spec: (8.0, 8.0) for spec in ECDQ_PATHS},
}
#: The thread settings measured: name, (torch threads, numba threads) or None for the defaults.
MODES = {"core": 1, "all": None}
#: Per core: the process's CPU time (one thread works; other processes on a shared machine then
#: slow a call only through the caches and memory they share). All cores: wall time.
CLOCKS = {"core": time.process_time, "all": time.perf_counter}


def target_factor(spec: str) -> tuple[float, float] | None:
    """The per-core throughput targets of a setting (times an in-place copy: encode, decode), None if it has none."""
    return TARGETS.get(spec)


def target_label(factor: tuple[float, float]) -> str:
    """``<=3`` for one factor, ``<=7/3`` for encode and decode factors that differ."""
    enc, dec = factor
    return f"<={enc:g}" if enc == dec else f"<={enc:g}/{dec:g}"


class Threads:
    """Run a block with torch and the numba kernels on ``n`` threads (None: as the process started)."""

    def __init__(self, n: int | None) -> None:
        from fedquant.codecs.threads import set_kernel_threads

        self.n = n
        self._set_kernels = set_kernel_threads
        self._saved: tuple[int, int] | None = None

    def __enter__(self) -> Threads:
        import numba

        self._saved = (torch.get_num_threads(), numba.get_num_threads())
        if self.n is not None:
            self._set_kernels(self.n)
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc) -> None:
        torch_threads, kernel_threads = self._saved
        self._set_kernels(kernel_threads)
        torch.set_num_threads(torch_threads)


def parse_size(text: str) -> int:
    """``"25M"`` -> 25_000_000, ``"512K"`` -> 512_000, ``"1000"`` -> 1000."""
    text = text.strip().upper()
    mult = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _release_free_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``), where available.

    Otherwise a call that reuses memory an earlier call freed (still resident) adds nothing to
    the peak, and the measurement depends on what ran before.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_mib(fn: Callable[[], object]) -> float:
    """Extra peak resident memory (MiB) while ``fn`` runs (Linux: resets VmHWM first)."""
    _release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return float("nan")
    before = _rss_kib("VmRSS:")
    result = fn()
    peak = _rss_kib("VmHWM:")
    del result
    return max(0, peak - before) / 1024


def best_time(
    fn: Callable[[], object], repeats: int, budget_s: float = 0.5, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Best time (seconds, by ``clock``: wall time by default) of at least ``repeats`` calls after a warm-up call.

    Short calls are repeated until ``budget_s`` seconds of wall time have passed (at most 300
    calls): on a shared machine a single call is easily descheduled, and the minimum of many is
    the time the code needs.
    """
    fn()
    best = float("inf")
    start = time.perf_counter()
    count = 0
    while count < repeats or (time.perf_counter() - start < budget_s and count < 300):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
        count += 1
    return best


def naive_qsgd(x: torch.Tensor, levels: int = 16, d: int = 512, seed: int = 0):
    """The straightforward whole-tensor torch QSGD: the reference line."""
    gen = torch.Generator().manual_seed(seed)

    pad = (-x.numel()) % d

    def encode():
        v = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, d)
        scale = v.abs().amax(1, keepdim=True)
        a = v.abs() / scale * levels
        lvl = torch.floor(a)
        lvl += torch.rand(v.shape, generator=gen) < a - lvl
        return (torch.sign(v) * lvl).to(torch.int8), scale

    q, scale = encode()

    def decode():
        return (q.float() * (scale / levels)).view(-1)[: x.numel()]

    return encode, decode


def _lent_decode(codec, payload: bytes, side, pool: BufferPool) -> torch.Tensor:
    """``codec.decode`` into memory ``pool`` lends (what the last call returned, once dropped)."""
    with pool.lending():
        return codec.decode(payload, seed=1, side_info=side)


def _lent_cell(times: dict[str, list[float]], key: str, pool: BufferPool) -> str:
    """The lent decode's copy multiple, or "-" for a decoder that writes into memory of its own
    (the pool lent nothing: the column would time the plain decode again)."""
    return f"{times[key][2] / times['copy'][0]:.2f}" if pool.held_bytes else "-"


def row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def measure(
    jobs: dict[str, tuple], rounds: int, repeats: int, budget: float, lent: bool = False, clock=time.perf_counter
) -> dict[str, list[float]]:
    """Best ``[encode, decode, lent decode]`` seconds of every job (``(encode, decode[, lent decode])``,
    either decode None) over ``rounds`` rounds through all of them; the lent decodes only with ``lent``."""
    # Several rounds over all jobs, keeping each job's best time: a burst of load from other
    # processes then spoils one round of a row, not the row. A job's calls run back to back.
    best: dict[str, list[float]] = {k: [float("inf")] * 3 for k in jobs}
    for _ in range(rounds):
        for key, (fe, *decoders) in jobs.items():
            best[key][0] = min(best[key][0], best_time(fe, repeats, budget, clock))
            for slot, fd in enumerate(decoders[: 2 if lent else 1], start=1):
                if fd is not None:
                    best[key][slot] = min(best[key][slot], best_time(fd, repeats, budget, clock))
    return best


def _time_cells(t: float, t_copy: float) -> list[str]:
    return [f"{t * 1e6:,.1f}" if t < 1e-4 else f"{t * 1e6:,.0f}", f"{t / t_copy:.2f}"]


def cells(best: dict[str, dict[str, list[float]]], key: str) -> list[str]:
    """Encode and decode time and copy multiple of job ``key`` in every measured thread setting."""
    out = []
    for times in best.values():
        t_copy = times["copy"][0]
        te, td = times[key][:2]
        out += _time_cells(te, t_copy) + _time_cells(td, t_copy)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", help="comma-separated codec names or specs (default: all)")
    ap.add_argument("--sizes", default="1M,25M", help="comma-separated element counts (default 1M,25M)")
    ap.add_argument("--repeats", type=int, default=3, help="calls per measurement, at least")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all codecs; each keeps the best")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per measurement for short calls")
    ap.add_argument("--quick", action="store_true", help="1M elements, 2 rounds")
    ap.add_argument("--modes", default="core,all", help="thread settings: core (1 thread), all (default threads)")
    ap.add_argument("--target-size", default="25M", help="element count the per-core targets apply at")
    args = ap.parse_args(argv)
    os.environ.setdefault("FEDQUANT_KERNELS", "numba")  # the compiled kernels, not their twins while a cache warms
    sizes = [parse_size(s) for s in ("1M" if args.quick else args.sizes).split(",")]
    target_size = parse_size(args.target_size)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes takes {', '.join(MODES)}")
    repeats, budget = args.repeats, args.budget
    rounds = 2 if args.quick else args.rounds
    specs = all_specs(parse_codec_list(args.codecs))
    settings = [build(s) for s in specs]
    with Threads(None):
        import numba

        all_threads = f"torch {torch.get_num_threads()}, numba {numba.get_num_threads()}"
    print(
        f"codec throughput: float32 input, best of {rounds} rounds x >= {repeats} calls; "
        f"per core = 1 thread, CPU time; all cores = {all_threads} threads, wall time"
    )
    headers = ["codec", "bits/param"]
    widths = [36, 10]
    for mode in modes:
        headers += [f"enc us {mode}", f"enc x {mode}", f"dec us {mode}", f"dec x {mode}"]
        widths += [11, 10, 11, 10]
    if "core" in modes:
        headers.append("dec x lent")
        widths.append(10)
    headers += ["peak MiB", "target"]
    widths += [9, 11]
    failures: list[str] = []
    floor_lines: list[str] = []
    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, generator=gen)
        y = torch.empty_like(x)
        mb = n * 4 / 1e6
        enc, dec = naive_qsgd(x)
        jobs: dict[str, tuple] = {"copy": (lambda x=x, y=y: y.copy_(x), None)}
        jobs["reference"] = (enc, dec)
        rows: dict[str, dict] = {}
        pools: dict[str, BufferPool] = {}
        for st in settings:
            if st.codec is None:
                continue
            codec = st.codec
            side = side_info_for(codec, x)
            payload = codec.encode(x, seed=1)
            pools[st.spec] = BufferPool()
            jobs[st.spec] = (
                lambda c=codec, x=x: c.encode(x, seed=1),
                lambda c=codec, p=payload, s=side: c.decode(p, seed=1, side_info=s),
                partial(_lent_decode, codec, payload, side, pools[st.spec]),
            )
            rows[st.spec] = {
                "bits": len(payload) * 8 / n,
                "peak": max(
                    peak_memory_mib(jobs[st.spec][0]),
                    peak_memory_mib(jobs[st.spec][1]),
                ),
            }
        floors: dict[str, dict] = {}
        floor_jobs: dict[str, tuple] = {}  # timed per core only: the verdicts use no other mode
        if n == target_size and "core" in modes:
            for st in settings:
                if st.codec is not None and target_factor(st.spec) is not None:
                    floors[st.spec] = codec_floor.stages_for(st.spec, x)
                    floor_jobs.update({f"{st.spec}/{name}": stage for name, stage in floors[st.spec].items()})
        best = {}
        for mode in modes:
            timed = {**jobs, **floor_jobs} if mode == "core" else jobs
            with Threads(MODES[mode]):
                best[mode] = measure(timed, rounds, repeats, budget, lent=mode == "core", clock=CLOCKS[mode])
        lent = "core" in modes
        copies = ", ".join(
            f"{mode} {best[mode]['copy'][0] * 1e3:.2f} ms = {mb / best[mode]['copy'][0]:,.0f} MB/s" for mode in modes
        )
        print(f"\n== {n:,} elements ({mb:.0f} MB float32); in-place copy: {copies}")
        print(row(headers, widths))

        print(
            row(
                [
                    "reference: naive torch qsgd s=16",
                    "8.06",
                    *cells(best, "reference"),
                    *([""] if lent else []),
                    f"{peak_memory_mib(enc):.0f}",
                    "",
                ],
                widths,
            )
        )
        for st in settings:
            factor = target_factor(st.spec)
            if st.codec is None:
                print(row([st.spec, st.reason], [widths[0], 0]))
                if factor is not None:
                    failures.append(f"{st.spec}: {st.reason}")
                continue
            verdict = ""
            if factor is not None and n == target_size and "core" in modes:
                t_copy = best["core"]["copy"][0]
                te, td = best["core"][st.spec][:2]
                floor = codec_floor.floor_seconds(best["core"], st.spec, floors.get(st.spec, {}))
                ok, why = codec_floor.verdict(st.spec, (te, td), floor, factor, t_copy)
                verdict = f"{target_label(factor)}{' floor' if any(floor) else ''} " + ("ok" if ok else "MISS")
                if any(floor):
                    floor_lines.append(
                        f"  {st.spec}: floor encode {floor[0] / t_copy:.2f}x, decode {floor[1] / t_copy:.2f}x copy; "
                        f"the codec {te / floor[0]:.2f}x / "
                        + (f"{td / floor[1]:.2f}x" if floor[1] else "-")
                        + " its floor"
                    )
                if not ok:
                    failures.append(f"{st.spec} at {n:,} per core: {why}")
            data = [
                st.spec,
                f"{rows[st.spec]['bits']:.3f}",
                *cells(best, st.spec),
                *([_lent_cell(best["core"], st.spec, pools[st.spec])] if lent else []),
                f"{rows[st.spec]['peak']:.0f}",
                verdict,
            ]
            print(row(data, widths))
    if floor_lines:
        print("\nfloors per core (benchmarks.codec_floor: the stages the definition requires, in the same rounds):")
        print("\n".join(floor_lines))
    print()
    checked = target_size in sizes and "core" in modes
    if not checked:
        print(f"(per-core targets apply at {target_size:,} elements with --modes core: not checked in this run)")
    if failures:
        print("TARGETS MISSED:")
        for f in failures:
            print("  " + f)
        return 1
    if not checked:
        return 0
    timed = {st.spec for st in settings if st.codec is not None}

    def listed(paths) -> str:
        return ", ".join(spec for spec in paths if spec in timed) or "none timed"

    print(
        f"all targets met per core at {target_size:,} elements: fixed-width codecs within 3x of an in-place copy "
        f"({listed(FIXED_WIDTH_PATHS)}; level-selection encodes within 7x: {listed(LEVEL_SELECTION_PATHS)}), "
        f"rht+ and EDEN within 6x ({listed(RHT_PATHS)}), ECDQ within 8x ({listed(ECDQ_PATHS)}); "
        "ECDQ and level selection: or within their margin of the floor"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
