"""The per-core floor of the codecs whose throughput targets may lie below it (a table).

Some work is part of a codec's definition, whatever the kernels. Each such stage is timed here
alone, at the fastest this project (or numpy) does it, on the same tensor and in the same run as
the in-place copy the targets divide by; the floor is the stages' sum:

* **ECDQ** (issue 45). Encode: rotate (the codec's own randomized Hadamard transform), find each
  coordinate's dithered lattice point (E8: both ``D8`` cosets per block, the dither hashed in the
  same pass; Z: a rounding), and entropy-code one symbol per coordinate: the coder alone on the
  codec's own symbols as **one** table with the counts given, so on 32 interleaved lanes, its
  fastest layout (ECDQ's contexts split them into about a hundred tables, most too short for
  32 lanes). Decode: entropy-decode them, rebuild each value from its point and hashed dither,
  and rotate back. Left out, so the floor stays low: the norm, the context counts and histogram,
  the table order, the coset stage.
* **Level selection** (ORQ, Linear, BinGrad-b/pb; issue 20's decision: levels from each
  bucket's sorted values). Encode: sort every bucket (numpy's ``np.sort`` of the rows, the
  AVX-512 ``x86-simd-sort`` where the CPU has it) and round each value at random onto levels at
  the index width (QSGD's whole fixed-width encode at that width, norms included). Left out: the
  levels themselves (prefix sums, ORQ's tree, BinGrad's sweeps).

:mod:`benchmarks.codec_throughput` times these stages beside the codecs (one thread, CPU time) and
accepts a codec above its copy target while it stays within :data:`MARGIN` of the floor measured
in the same run (a guard against regressions: the distance left is what ECDQ's contexts and table
order, or the levels' own arithmetic, cost: docs/ECDQ.md#speed, docs/benchmarks.md). Where a
floor lies above its target, that target is out of reach on the machine measured.

Usage::

    python -m benchmarks.codec_floor                       # 25M, ECDQ 0.5/1/2 bits, level selection
    python -m benchmarks.codec_floor --size 4M --codecs "ecdq:bits=1;orq"
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from numba import njit

from fedquant.codecs import get_codec
from fedquant.codecs.kernels import e8
from fedquant.codecs.kernels import ecdq as scalar
from fedquant.codecs.kernels.common import CHUNK, hash24_run, kernel_key
from fedquant.wire.entropy import entropy_decode, entropy_encode

#: A codec above its copy target passes when the target lies below its floor and the codec within
#: this many times the floor (encode, decode), measured in the same run.
MARGIN = {"ecdq": (3.0, 4.0), "level-selection": (2.5, 2.5)}
#: QSGD at the index width of the level-selection codecs: the random-rounding floor's setting.
ROUNDING = {4: "qsgd:levels=7", 2: "qsgd:levels=1"}
_SEED = 1

Stage = tuple[Callable[[], object], Callable[[], object] | None]


@njit(cache=True)
def _e8_points(y, inv, key, m, coset):
    """Dither and nearest E8 point of every block, chunk by chunk (``e8.lattice_counts`` without its counts)."""
    n = y.size
    t = np.empty((8, CHUNK // 8), np.float64)
    top = 0
    for c0 in range(0, n, CHUNK):
        blocks = (min(c0 + CHUNK, n) - c0) // 8
        mk = m[c0 : c0 + 8 * blocks].reshape(8, blocks)
        e8._dither_kmajor(y, inv, key, c0, blocks, t)
        top = max(top, e8._nearest_kmajor(t, blocks, mk, coset[c0 // 8 : c0 // 8 + blocks]))
    return top


@njit(cache=True)
def _z_points(y, inv, key, q):
    """Dithered scalar indices of every element, chunk by chunk (``scan`` without its counts)."""
    n = y.size
    hs = np.empty(CHUNK, np.uint32)
    top = 0
    for c0 in range(0, n, CHUNK):
        count = min(c0 + CHUNK, n) - c0
        top = max(top, scalar._chunk_indices(y, inv, key, c0, count, hs, q[c0 : c0 + count]))
    return top


@njit(cache=True)
def _values(m, key, step, out):
    """``float32(step (m - 2 v))`` with the hashed dither ``v`` of every element (the decoders' last pass)."""
    n = out.size
    hs = np.empty(CHUNK, np.uint32)
    half = np.zeros(CHUNK, np.float64)
    for c0 in range(0, n, CHUNK):
        count = min(c0 + CHUNK, n) - c0
        hash24_run(key, c0, count, hs)
        e8._values(m[c0 : c0 + count], half[:count], hs[:count], step, out[c0 : c0 + count])


def _coded(symbols: np.ndarray, alphabet: int) -> tuple[Stage, int]:
    """The coder's stage on ``symbols`` as one table (counts given, as ECDQ's encoder gives them)."""
    counts = np.bincount(symbols, minlength=alphabet)
    data = entropy_encode(symbols, alphabet, counts=counts)
    n = symbols.size
    return (
        lambda: entropy_encode(symbols, alphabet, counts=counts),
        lambda: entropy_decode(data, n, alphabet),
    ), data.size


def ecdq_stages(spec: str, x: torch.Tensor) -> dict[str, Stage]:
    """The floor's stages of ECDQ setting ``spec`` on ``x`` (encode, decode callables each)."""
    codec = get_codec(spec)
    rotation = codec.wire_transforms[0]
    n = x.numel()
    rotated = rotation.forward(x, _SEED)
    y = np.ascontiguousarray(rotated.numpy())
    sumsq, maxabs = scalar.norm_and_max(y)
    step, inv = codec.quantizer.step_for(float(sumsq), float(maxabs), y.size)
    key = kernel_key(_SEED)
    if codec.quantizer.lattice_for(y.size) == "e8":
        y = y[: y.size // 8 * 8]
        m, coset = np.empty(y.size, np.int16), np.empty(y.size // 8, np.uint8)
        h = (int(_e8_points(y, inv, key, m, coset)) + 1) // 2
        points: Callable[[], object] = lambda: _e8_points(y, inv, key, m, coset)  # noqa: E731
        symbols = (m + (h - 1)).astype(np.uint8 if 2 * h < 256 else np.uint16)
    else:
        m = np.empty(y.size, np.int32)
        h = int(_z_points(y, inv, key, m))
        points = lambda: _z_points(y, inv, key, m)  # noqa: E731
        symbols = (m + h).astype(np.uint8 if 2 * h < 256 else np.uint16)
    coder, size = _coded(symbols, 2 * h + 1)
    out = np.empty(y.size, np.float32)
    return {
        "rotate": (lambda: rotation.forward(x, _SEED), lambda: rotation.inverse(rotated, n, _SEED)),
        "lattice / values": (points, lambda: _values(m, key, step, out)),
        f"entropy code, one table ({8 * size / n:.3f} b/p)": coder,
    }


def level_selection_stages(spec: str, x: torch.Tensor) -> dict[str, Stage]:
    """The floor's stages of a level-selection setting: the buckets' sort and a random rounding."""
    quantizer = get_codec(spec).quantizer
    d = quantizer.bucket_size
    rows = x.numpy()[: x.numel() // d * d].reshape(-1, d)
    width = 4 if getattr(quantizer, "levels", 2) > 2 else 2
    rounding = get_codec(ROUNDING[width])
    return {
        "sort buckets": (lambda: np.sort(rows, axis=1), None),
        f"round ({ROUNDING[width]})": (lambda: rounding.encode(x, seed=_SEED), None),
    }


def family(spec: str) -> str | None:
    """``"ecdq"``, ``"level-selection"`` or None (no floor)."""
    from benchmarks.specs import ECDQ_PATHS, LEVEL_SELECTION_PATHS

    if spec in ECDQ_PATHS or spec.split(":")[0] == "ecdq":
        return "ecdq"
    if spec in LEVEL_SELECTION_PATHS:
        return "level-selection"
    return None


def stages_for(spec: str, x: torch.Tensor) -> dict[str, Stage]:
    """The floor's stages of ``spec`` (empty for a codec without a floor)."""
    kind = family(spec)
    if kind is None:
        return {}
    return (ecdq_stages if kind == "ecdq" else level_selection_stages)(spec, x)


def floor_seconds(best: dict[str, list[float]], spec: str, stages: dict[str, Stage]) -> tuple[float, float]:
    """(encode, decode) floor of ``spec``: the sum of its stages' best times (``best`` keyed ``spec/stage``)."""
    enc = sum(best[f"{spec}/{name}"][0] for name in stages)
    dec = sum(best[f"{spec}/{name}"][1] for name, (_, fd) in stages.items() if fd is not None)
    return enc, dec


def verdict(
    spec: str, times: tuple[float, float], floor: tuple[float, float], target: tuple[float, float], copy: float
):
    """``(ok, reason)`` of one codec: per direction, its copy target met or the codec within
    :data:`MARGIN` of its floor (a direction without floor stages is held to the copy target)."""
    margin = MARGIN.get(family(spec), (0.0, 0.0))
    reasons = []
    for what, t, f, goal, slack in zip(("encode", "decode"), times, floor, target, margin):
        if t <= goal * copy or t <= slack * f:
            continue
        where = "above" if f > goal * copy else "within"
        why = f"{t / f:.2f}x its floor {f / copy:.1f}x, {where} the target" if f else "no floor"
        reasons.append(f"{what} {t / copy:.2f}x copy > {goal:g}x ({why})")
    return not reasons, "; ".join(reasons)


def _line(name: str, enc: float, dec: float, copy: float) -> str:
    return f"{name:44s} {enc * 1e3:9.1f} {enc / copy:7.2f} {dec * 1e3:9.1f} {dec / copy:7.2f}"


def report(spec: str, x: torch.Tensor, copy: float, best: Callable) -> tuple[float, float, float, float]:
    """Print the floor's stages of ``spec`` and the codec beside them; returns (encode, decode, floors)."""
    codec = get_codec(spec)
    payload = codec.encode(x, seed=_SEED)
    enc = best(lambda: codec.encode(x, seed=_SEED))
    dec = best(lambda: codec.decode(payload, seed=_SEED))
    floor_enc = floor_dec = 0.0
    for name, (fe, fd) in stages_for(spec, x).items():
        te, td = best(fe), (best(fd) if fd else 0.0)
        floor_enc, floor_dec = floor_enc + te, floor_dec + td
        print(_line(f"  {name}", te, td, copy))
    print(_line("  floor (sum)", floor_enc, floor_dec, copy))
    ratio = f"{dec / floor_dec:.2f}" if floor_dec else "-"
    bits = 8 * len(payload) / x.numel()
    print(_line(f"{spec} ({bits:.3f} b/p)", enc, dec, copy) + f"   x floor {enc / floor_enc:.2f} / {ratio}")
    return enc, dec, floor_enc, floor_dec


def main(argv: list[str] | None = None) -> int:
    from benchmarks.codec_throughput import TARGETS, Threads, best_time, parse_size
    from benchmarks.specs import ECDQ_PATHS, LEVEL_SELECTION_PATHS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="25M", help="float32 elements (default 25M)")
    ap.add_argument("--codecs", default=";".join((*ECDQ_PATHS, *LEVEL_SELECTION_PATHS)), help="';'-separated specs")
    ap.add_argument("--repeats", type=int, default=3, help="calls per time (the best is kept)")
    args = ap.parse_args(argv)
    os.environ.setdefault("FEDQUANT_KERNELS", "numba")
    n = parse_size(args.size)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    y = torch.empty_like(x)
    failures = []
    with Threads(1):
        copy = best_time(lambda: y.copy_(x), 3 * args.repeats, 0.5, time.process_time)
        print(f"per core (1 thread, CPU time), {n:,} float32; in-place copy {copy * 1e3:.2f} ms")
        print(f"{'codec / stage':44s} {'enc ms':>9s} {'enc x':>7s} {'dec ms':>9s} {'dec x':>7s}")
        for spec in [s.strip() for s in args.codecs.split(";") if s.strip()]:
            enc, dec, *floor = report(spec, x, copy, lambda fn: best_time(fn, args.repeats, 0.5, time.process_time))
            if spec in TARGETS:
                ok, why = verdict(spec, (enc, dec), tuple(floor), TARGETS[spec], copy)
                failures += [] if ok else [f"{spec}: {why}"]
    if failures:
        print("MISSED:\n  " + "\n  ".join(failures))
        return 1
    print("every codec meets its copy target or lies within its margin of its floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
