"""Distribution-aware codecs (Xu, Huo, Huang 2020): variance tables and a throughput check.

Part 1, multi-level (unbiased) quantizers: the normalized rounding variance
``sum Var[Q(v)] / ||v||^2`` of ORQ-s, Linear-s and QSGD-s at equal numbers of levels ``s`` on
buckets of ``d = 512`` values drawn from Gaussian, Laplace and Student-t(3) distributions. The
variance is computed exactly from the levels the codecs choose (``sum (hi - v)(v - lo)``), so the
table has no Monte Carlo noise. QSGD-s here is the reference quantizer with ``s`` levels in
total, symmetric around and including 0 (``s = 2m + 1``, ``m`` levels per sign), scaled by the
bucket's max norm as in QSGD's experiments: levels ``max|v| * k / m``, ``k = -m..m``. Also shown:
the greedy levels' variance divided by the exact optimum (dynamic programming over data points),
and ORQ with ``refine=3`` for ``s = 8``, where the bisection is unbalanced.

Part 2, two-level quantizers: relative squared error ``||Q(v) - v||^2 / ||v||^2`` of BinGrad-b
(exact), BinGrad-pb (expected, exact from its levels) and scaled sign ``(||v||_1 / d) sign(v)``.

Part 3, throughput on a 25M-element float32 tensor: each codec's encode and decode time
against an in-place copy of the tensor, best of ``--repeats``. Targets: encode within 100x the
copy time (1/100 of the copy rate) for ``orq`` and ``bingrad-*``; decode within the decode time
of the fixed-width ``qsgd`` codec (times 1.5 for noise) when that codec is installed.

Exit status 1 when ORQ's variance exceeds Linear's or QSGD's in any row, or a throughput target
is missed.

Usage::

    python -m benchmarks.orq_variance                 # everything
    python -m benchmarks.orq_variance --no-throughput # tables only (a few seconds)
    python -m benchmarks.orq_variance --numel 5M      # smaller throughput tensor
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

from fedquant.codecs import get_codec

D = 512
BUCKETS = 64
DP_BUCKETS = 4
LEVELS = (3, 5, 9, 17)
ENCODE_FACTOR = 100.0
DECODE_NOISE = 1.5
THROUGHPUT_SPECS = ("orq", "orq:levels=5", "linear", "bingrad-b", "bingrad-pb", "orq:coding=entropy")
TARGET_SPECS = ("orq", "orq:levels=5", "bingrad-b", "bingrad-pb")


def draw(dist: str, count: int, d: int, seed: int) -> np.ndarray:
    """``count`` buckets of ``d`` float32 values, each row sorted."""
    rng = np.random.default_rng(seed)
    if dist == "gauss":
        w = rng.standard_normal((count, d))
    elif dist == "laplace":
        w = rng.laplace(size=(count, d))
    else:
        w = rng.standard_t(3, size=(count, d))
    return np.sort(w.astype(np.float32), axis=1)


def rounding_variance(w: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Per-row ``sum (hi - v)(v - lo)`` of unbiased rounding of rows ``w`` onto rows ``levels``."""
    v = w.astype(np.float64)
    lv = np.sort(levels.astype(np.float64), axis=1)
    out = np.empty(v.shape[0])
    for r in range(v.shape[0]):  # a benchmark, not a hot path
        k = np.clip(np.searchsorted(lv[r], v[r], side="right") - 1, 0, lv.shape[1] - 2)
        out[r] = np.sum((lv[r, k + 1] - v[r]) * (v[r] - lv[r, k]))
    return out


def qsgd_levels(w: np.ndarray, s: int) -> np.ndarray:
    """QSGD-s with max-norm scaling: ``s = 2m + 1`` levels ``max|v| * k / m``, ``k = -m..m``."""
    m = (s - 1) // 2
    scale = np.abs(w).max(axis=1, keepdims=True).astype(np.float64)
    return scale * (np.arange(-m, m + 1) / m)[None, :]


def optimal_variance(w: np.ndarray, s: int) -> float:
    """Exact minimum variance with ``s`` levels, ends at min and max (DP over data points)."""
    w = np.sort(w.astype(np.float64))
    n = w.size
    p1 = np.concatenate([[0.0], np.cumsum(w)])
    p2 = np.concatenate([[0.0], np.cumsum(w * w)])
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    inner = j > i + 1
    cnt = np.where(inner, j - i - 1, 0)
    s1 = np.where(inner, p1[j] - p1[np.minimum(i + 1, n)], 0.0)
    s2 = np.where(inner, p2[j] - p2[np.minimum(i + 1, n)], 0.0)
    cost = -s2 + s1 * (w[:, None] + w[None, :]) - cnt * w[:, None] * w[None, :]
    cost = np.where(j >= i, cost, np.inf)
    best = cost[0].copy()
    for _ in range(s - 2):
        best = np.min(best[:, None] + cost, axis=0)
    return float(best[n - 1])


def codec_levels(spec: str, w: np.ndarray) -> np.ndarray:
    """The levels a codec selects for each row of ``w`` (rows are its buckets)."""
    codec = get_codec(spec, bucket_size=w.shape[1])
    return codec.quantizer.select_levels(torch.from_numpy(np.ascontiguousarray(w).reshape(-1))).numpy()


def variance_table() -> bool:
    """Print part 1; return whether ORQ is never worse than Linear and QSGD."""
    print(f"Normalized rounding variance sum Var / ||v||^2, mean over {BUCKETS} buckets of d = {D}")
    print(f"greedy/DP: ORQ's variance over the exact optimum, mean of {DP_BUCKETS} buckets")
    head = (
        f"{'dist':<9}{'s':>4}{'ORQ':>10}{'Linear':>10}{'QSGD-max':>10}{'ORQ/Lin':>9}{'ORQ/QSGD':>10}{'greedy/DP':>11}"
    )
    print(head)
    print("-" * len(head))
    ok = True
    for dist in ("gauss", "laplace", "student"):
        w = draw(dist, BUCKETS, D, seed=1)
        norm = (w.astype(np.float64) ** 2).sum(axis=1)
        for s in LEVELS:
            orq = rounding_variance(w, codec_levels(f"orq:levels={s}", w)) / norm
            lin = rounding_variance(w, codec_levels(f"linear:levels={s}", w)) / norm
            qsgd = rounding_variance(w, qsgd_levels(w, s)) / norm
            sub = w[:DP_BUCKETS]
            greedy = rounding_variance(sub, codec_levels(f"orq:levels={s}", sub))
            ratio = np.mean([g / optimal_variance(row, s) for g, row in zip(greedy, sub, strict=True)])
            worse = orq.mean() > lin.mean() or orq.mean() > qsgd.mean()
            ok &= not worse
            print(
                f"{dist:<9}{s:>4}{orq.mean():>10.4f}{lin.mean():>10.4f}{qsgd.mean():>10.4f}"
                f"{orq.mean() / lin.mean():>9.3f}{orq.mean() / qsgd.mean():>10.3f}{ratio:>11.4f}"
                + ("   <-- ORQ WORSE" if worse else "")
            )
        for spec in ("orq:levels=8", "orq:levels=8,refine=3"):
            sub = w[:DP_BUCKETS]
            v = rounding_variance(sub, codec_levels(spec, sub))
            ratio = np.mean([g / optimal_variance(row, 8) for g, row in zip(v, sub, strict=True)])
            print(f"{dist:<9}{'':>4}  {spec}: greedy/DP = {ratio:.4f}")
    return ok


def two_level_table() -> None:
    """Print part 2."""
    print(f"\nTwo-level quantizers: relative squared error ||Q(v) - v||^2 / ||v||^2 (d = {D})")
    head = f"{'dist':<9}{'BinGrad-b':>11}{'BinGrad-pb':>12}{'scaled sign':>13}"
    print(head)
    print("-" * len(head))
    for dist in ("gauss", "laplace", "student"):
        w = draw(dist, BUCKETS, D, seed=2).astype(np.float64)
        norm = (w**2).sum()
        b = codec_levels("bingrad-b", w.astype(np.float32)).astype(np.float64)
        nearest = np.where(w >= b.mean(axis=1, keepdims=True), b[:, 1:], b[:, :1])
        pb = codec_levels("bingrad-pb", w.astype(np.float32)).astype(np.float64)
        lo, hi = pb[:, :1], pb[:, 1:]
        j_pb = np.where(w < lo, (lo - w) ** 2, np.where(w > hi, (w - hi) ** 2, (hi - w) * (w - lo))).sum()
        sign = np.abs(w).mean(axis=1, keepdims=True) * np.sign(w)
        b_err = ((nearest - w) ** 2).sum() / norm
        sign_err = ((sign - w) ** 2).sum() / norm
        print(f"{dist:<9}{b_err:>11.4f}{j_pb / norm:>12.4f}{sign_err:>13.4f}")


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def throughput(numel: int, repeats: int) -> bool:
    """Print part 3; return whether every target is met."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    copy = best_time(lambda: y.copy_(x), max(repeats, 10))
    print(f"\nThroughput on {numel / 1e6:g}M float32 elements ({torch.get_num_threads()} torch threads)")
    print(
        f"in-place copy: {copy * 1e3:.1f} ms; encode target: <= {ENCODE_FACTOR:g} x copy for {', '.join(TARGET_SPECS)}"
    )
    reference = None
    try:
        qsgd = get_codec("qsgd:levels=4")  # 9 levels, 4-bit fixed width: the size class of orq's default
        data = qsgd.encode(x, seed=1)
        reference = best_time(lambda: qsgd.decode(data, seed=1), repeats)
        print(f"fixed-width reference: qsgd:levels=4 decode {reference * 1e3:.1f} ms")
    except (ValueError, ImportError) as err:
        print(f"fixed-width reference: not available ({err})")
    head = f"{'codec':<24}{'bits/param':>11}{'encode ms':>11}{'x copy':>8}{'decode ms':>11}{'x copy':>8}  target"
    print(head)
    print("-" * len(head))
    ok = True
    for spec in THROUGHPUT_SPECS:
        codec = get_codec(spec)
        data = codec.encode(x, seed=1)
        enc = best_time(lambda codec=codec: codec.encode(x, seed=1), repeats)
        dec = best_time(lambda codec=codec, data=data: codec.decode(data, seed=1), repeats)
        verdict = ""
        if spec in TARGET_SPECS:
            met = enc <= ENCODE_FACTOR * copy and (reference is None or dec <= DECODE_NOISE * reference)
            ok &= met
            verdict = "ok" if met else "MISSED"
        print(
            f"{spec:<24}{len(data) * 8 / numel:>11.3f}{enc * 1e3:>11.1f}{enc / copy:>8.1f}"
            f"{dec * 1e3:>11.1f}{dec / copy:>8.1f}  {verdict}"
        )
    return ok


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1_000, "M": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-throughput", action="store_true", help="only the variance tables")
    parser.add_argument("--numel", default="25M", help="throughput tensor size (default 25M)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("FEDQUANT_KERNELS", "numba")  # the compiled kernels, not their twins while a cache warms
    ok = variance_table()
    two_level_table()
    if not args.no_throughput:
        ok &= throughput(parse_size(args.numel), args.repeats)
    print("\nall targets met" if ok else "\nTARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
