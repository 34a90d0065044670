"""Speed and size of the entropy coder, alone and inside the entropy-coded codecs (two tables).

**The coder alone** (:mod:`fedquant.wire.entropy`) on streams of ``--size`` symbols (default
25M): the symbols that ``qsgd:coding=entropy``, ``rht+dqsg:levels=2,coding=entropy``,
``terngrad:coding=entropy``, ``dqsg:coding=entropy`` and ``eden:bits=2,coding=entropy`` produce
on a Gaussian tensor, and synthetic streams (binary, 256 uniform symbols, a Gaussian over 4096
bins, skewed binaries with p = 0.002 and 1e-4, one symbol only). ``vs H``: coded bytes
(count table included) over the empirical entropy ``n H``; ``layout``: precision/lanes/blocks
the encoder chose; throughputs in M symbols/s at 1 thread (``1t``, CPU time of the calling
thread) and at every thread (``all``, wall time): ``hist`` the one-pass histogram, ``enc`` the
encoder given the counts (what a quantizer kernel that counts in its own pass pays), ``enc+h``
with its own histogram, ``dec`` the decoder. With ``--zstd-src DIR`` (a checkout of
github:facebook/zstd; compiled once into /tmp, never part of fedquant) zstd's huff0
(``HUF_compress4X_repeat`` / ``HUF_decompress4X_hufOnly_wksp``, 128 KiB blocks with a table
each, as zstd codes literals) runs on the same byte streams in the same process: its size over
``n H`` and its 1-thread speeds.

**The codecs**: whole ``encode`` and ``decode`` of a float32 tensor of ``--size`` elements as a
multiple of an in-place copy of the same tensor (``y.copy_(x)``) measured in the same run, per
core (1 thread, CPU time) and on all cores (wall time), and where the per-core time goes
(rotation, quantizer pass, histogram, coder, dequantize, inverse rotation; a rotation the
quantizer's kernels apply themselves is timed with the pass it is fused into).

Every time is the best of ``--rounds`` rounds. Targets (exit status 1 on a miss): the decoder
at least 500 M symbols/s per core on every codec stream, every stream's size within 0.5% of
``n H`` (count table included; the one-symbol stream: a few bytes), and each codec's encode and
decode at most 5x a copy per core (``--coder-only`` leaves the codec table out).

Usage::

    python -m benchmarks.entropy_coder                      # 25M, both tables
    python -m benchmarks.entropy_coder --coder-only --size 4M
    python -m benchmarks.entropy_coder --zstd-src /tmp/zstd  # with the huff0 anchor
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numba
import numpy as np
import torch

from benchmarks.codec_throughput import parse_size, row
from fedquant.codecs import get_codec
from fedquant.codecs.coders.layout import read_side
from fedquant.codecs.threads import set_kernel_threads
from fedquant.wire.body import BodyReader
from fedquant.wire.entropy import (
    choose_layout,
    empirical_entropy_bits,
    entropy_decode,
    entropy_encode,
    symbol_counts,
)
from fedquant.wire.payload import read_payload

DECODE_TARGET = 500e6  # symbols/s per core
SIZE_TARGET = 0.005  # coded bits over n H
CODEC_TARGET = 5.0  # x an in-place copy, per core
CODEC_STREAMS = (
    "qsgd:coding=entropy",
    "rht+dqsg:levels=2,coding=entropy",
    "terngrad:coding=entropy",
    "dqsg:coding=entropy",
    "eden:bits=2,coding=entropy",
)
CODECS = CODEC_STREAMS[:4]


# ---------------------------------------------------------------------------------------------- timing
def best(fn: Callable[[], object], rounds: int, clock: Callable[[], float]) -> float:
    """Least time of ``rounds`` calls after a warm-up call."""
    fn()
    least = math.inf
    for _ in range(rounds):
        t0 = clock()
        fn()
        least = min(least, clock() - t0)
    return least


class Threads:
    """Per-core (1 thread, CPU time of this thread) and all-core (wall time) measurements."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.all = numba.config.NUMBA_NUM_THREADS
        self.torch_threads = torch.get_num_threads()

    def time(self, fn: Callable[[], object], per_core: bool) -> float:
        if per_core:
            set_kernel_threads(1)
            torch.set_num_threads(1)
            try:
                return best(fn, self.rounds, time.thread_time)
            finally:
                set_kernel_threads(self.all)
                torch.set_num_threads(self.torch_threads)
        return best(fn, self.rounds, time.perf_counter)


# ---------------------------------------------------------------------------------------------- streams
def codec_symbols(spec: str, x: torch.Tensor, seed: int = 1) -> tuple[np.ndarray, int]:
    """The symbol stream a codec entropy-codes for ``x`` (after its rotation), and its alphabet."""
    codec = get_codec(spec)
    flat = x.reshape(-1).contiguous()
    for t in codec.wire_transforms:
        flat = t.forward(flat, seed).contiguous()
    q = codec.quantizer.quantize(flat, seed, None)
    return np.asarray(q.symbols), codec.quantizer.num_symbols()


def synthetic_streams(n: int) -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(7)
    gauss = np.clip(np.floor((rng.standard_normal(n) / 6 + 0.5) * 4096), 0, 4095).astype(np.uint16)
    return {
        "binary p=0.3": ((rng.random(n) < 0.3).astype(np.uint8), 2),
        "uniform 256": (rng.integers(0, 256, n, dtype=np.uint8), 256),
        "gaussian 4096 bins": (gauss, 4096),
        "binary p=0.002": ((rng.random(n) < 0.002).astype(np.uint8), 2),
        "binary p=1e-4": ((rng.random(n) < 1e-4).astype(np.uint8), 2),
        "one symbol": (np.full(n, 3, np.uint8), 9),
    }


# ---------------------------------------------------------------------------------------------- huff0
_HUF_HARNESS = r"""
#define HUF_STATIC_LINKING_ONLY
#include <stddef.h>
#include <string.h>
#include "common/huf.h"
#include "common/mem.h"
/* Blocks of at most 128 KiB, each with its own table (as zstd codes literals); a block that
   huff0 leaves raw (0) or finds one symbol (1) is stored raw or as that byte. */
size_t huf_compress(const unsigned char* src, size_t n, unsigned char* dst, size_t cap, unsigned* sizes, int flags) {
    static unsigned wksp[HUF_WORKSPACE_SIZE_U64 * 2];
    HUF_CElt table[HUF_CTABLE_SIZE_ST(255)];
    size_t out = 0, b = 0;
    for (size_t pos = 0; pos < n; pos += HUF_BLOCKSIZE_MAX, b++) {
        size_t len = n - pos < HUF_BLOCKSIZE_MAX ? n - pos : HUF_BLOCKSIZE_MAX;
        HUF_repeat repeat = HUF_repeat_none;
        size_t c = HUF_compress4X_repeat(dst + out, cap - out, src + pos, len, 255, 11, wksp, sizeof(wksp),
                                         table, &repeat, flags);
        if (HUF_isError(c)) return (size_t)-1;
        if (c == 0) { memcpy(dst + out, src + pos, len); c = len; }
        else if (c == 1) { dst[out] = src[pos]; }
        sizes[b] = (unsigned)c;
        out += c;
    }
    return out;
}
int huf_decompress(const unsigned char* src, const unsigned* sizes, size_t n, unsigned char* dst, int flags) {
    static HUF_DTable dtable[HUF_DTABLE_SIZE(HUF_TABLELOG_MAX)];
    static unsigned wksp[HUF_DECOMPRESS_WORKSPACE_SIZE_U32];
    size_t in = 0, b = 0;
    for (size_t pos = 0; pos < n; pos += HUF_BLOCKSIZE_MAX, b++) {
        size_t len = n - pos < HUF_BLOCKSIZE_MAX ? n - pos : HUF_BLOCKSIZE_MAX;
        if (sizes[b] == len) memcpy(dst + pos, src + in, len);
        else if (sizes[b] == 1) memset(dst + pos, src[in], len);
        else {
            dtable[0] = (unsigned)(HUF_TABLELOG_MAX) * 0x01000001;
            size_t r = HUF_decompress4X_hufOnly_wksp(dtable, dst + pos, len, src + in, sizes[b],
                                                     wksp, sizeof(wksp), flags);
            if (HUF_isError(r) || r != len) return -1;
        }
        in += sizes[b];
    }
    return 0;
}
"""


def load_huff0(zstd_src: Path) -> ctypes.CDLL:
    """Build (once per source and harness) and load a small library of zstd's huff0 with the harness above."""
    lib = zstd_src / "lib" if (zstd_src / "lib").is_dir() else zstd_src
    sources = [
        *sorted((lib / "common").glob("*.c")),
        lib / "compress" / "huf_compress.c",
        lib / "compress" / "hist.c",
        lib / "compress" / "fse_compress.c",
        lib / "decompress" / "huf_decompress.c",
        lib / "decompress" / "huf_decompress_amd64.S",
    ]
    key = hashlib.sha1((_HUF_HARNESS + str(lib.resolve())).encode()).hexdigest()[:12]
    out = Path("/tmp") / f"fedquant-huff0-{key}.so"
    if not out.exists():
        harness = out.with_suffix(".c")
        harness.write_text(_HUF_HARNESS)
        cmd = ["gcc", "-O3", "-march=native", "-shared", "-fPIC", f"-I{lib}", str(harness), *map(str, sources)]
        subprocess.run([*cmd, "-o", str(out)], check=True, capture_output=True)
    huf = ctypes.CDLL(str(out))
    huf.huf_compress.restype = ctypes.c_size_t
    huf.huf_compress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    huf.huf_compress.argtypes += [ctypes.c_void_p, ctypes.c_int]
    huf.huf_decompress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int]
    return huf


def huff0_row(huf: ctypes.CDLL, symbols: np.ndarray, threads: Threads) -> tuple[int, float, float]:
    """``(bytes, encode s, decode s)`` of huff0 on ``symbols`` (bytes), 1 thread."""
    src = np.ascontiguousarray(symbols, np.uint8)
    n = src.size
    dst = np.empty(n + n // 64 + (n // (128 << 10) + 1) * 1024, np.uint8)
    sizes = np.empty(n // (128 << 10) + 1, np.uint32)
    flags = 1  # HUF_flags_bmi2

    def enc():
        return huf.huf_compress(src.ctypes.data, n, dst.ctypes.data, dst.size, sizes.ctypes.data, flags)

    size = enc()
    back = np.empty_like(src)

    def dec():
        return huf.huf_decompress(dst.ctypes.data, sizes.ctypes.data, n, back.ctypes.data, flags)

    if dec() != 0 or not np.array_equal(back, src):
        raise RuntimeError("huff0 round trip failed")
    return int(size + 4 * sizes.size), threads.time(enc, True), threads.time(dec, True)


# ---------------------------------------------------------------------------------------------- tables
def mps(n: int, seconds: float) -> str:
    return f"{n / seconds / 1e6:,.0f}"


def coder_table(
    streams: dict[str, tuple[np.ndarray, int]], threads: Threads, huf: ctypes.CDLL | None, failures: list[str]
) -> None:
    headers = ["stream", "H bits", "layout", "vs H", "hist 1t", "enc 1t", "enc+h 1t", "dec 1t"]
    headers += ["hist all", "enc all", "dec all"]
    widths = [36, 7, 10, 8, 8, 8, 8, 8, 8, 8, 8]
    if huf is not None:
        headers += ["huff0 vs H", "h0 enc 1t", "h0 dec 1t"]
        widths += [10, 9, 9]
    print(row(headers, widths))
    for name, (symbols, k) in streams.items():
        n = symbols.size
        counts = symbol_counts(symbols, k)
        info = empirical_entropy_bits(symbols, k)
        data = entropy_encode(symbols, k, counts=counts)
        if not np.array_equal(entropy_decode(data, n, k), symbols):
            raise RuntimeError(f"{name}: round trip failed")
        present = np.flatnonzero(counts)
        if present.size > 1:
            lay, _ = choose_layout(counts[present], n)
            blocks = 1 if lay.block_log2 is None else -(-n // (1 << lay.block_log2))
            layout = f"{lay.precision}/{lay.lanes}/{blocks}"
            excess = 8 * data.size / info - 1
            size_ok = excess <= SIZE_TARGET
            vs_h = f"{excess:+.3%}"
        else:
            layout, size_ok, vs_h = "-", data.size <= 16, f"{data.size} B"
        if not size_ok:
            failures.append(f"{name}: {vs_h} over n H (target {SIZE_TARGET:.1%})")
        t = {}
        for per_core in (True, False):
            tag = "1t" if per_core else "all"
            t[f"hist {tag}"] = threads.time(lambda s=symbols, k=k: symbol_counts(s, k), per_core)
            t[f"enc {tag}"] = threads.time(lambda s=symbols, k=k, c=counts: entropy_encode(s, k, counts=c), per_core)
            t[f"dec {tag}"] = threads.time(lambda d=data, n=n, k=k: entropy_decode(d, n, k), per_core)
        t["enc+h 1t"] = threads.time(lambda s=symbols, k=k: entropy_encode(s, k), True)
        cells = [name, f"{info / n:.3f}", layout, vs_h] + [mps(n, t[h]) for h in headers[4:11]]
        if huf is not None:
            if k <= 256:
                size, te, td = huff0_row(huf, symbols, threads)
                cells += [f"{8 * size / max(info, 1) - 1:+.2%}", mps(n, te), mps(n, td)]
            else:
                cells += ["(bytes only)", "", ""]
        print(row(cells, widths))
        if name in CODEC_STREAMS and n / t["dec 1t"] < DECODE_TARGET:
            failures.append(f"{name}: decode {n / t['dec 1t'] / 1e6:.0f} M symbols/s per core (target >= 500)")


def codec_table(x: torch.Tensor, threads: Threads, failures: list[str], seed: int = 1) -> None:
    y = torch.empty_like(x)
    n = x.numel()
    headers = ["codec", "bits/param", "enc 1t", "dec 1t", "enc all", "dec all", "target"]
    widths = [34, 10, 8, 8, 8, 8, 6]
    copy = {pc: threads.time(lambda: y.copy_(x), pc) for pc in (True, False)}
    print(
        f"in-place copy of {n:,} float32: {copy[True] * 1e3:.2f} ms per core (CPU), {copy[False] * 1e3:.2f} ms "
        f"on {threads.all} threads (wall); codec times as multiples of it"
    )
    print(row(headers, widths))
    splits = []
    for spec in CODECS:
        codec = get_codec(spec)
        payload = codec.encode(x, seed=seed)
        t = {}
        for pc in (True, False):
            t[("enc", pc)] = threads.time(lambda c=codec: c.encode(x, seed=seed), pc) / copy[pc]
            t[("dec", pc)] = threads.time(lambda c=codec, p=payload: c.decode(p, seed=seed), pc) / copy[pc]
        ok = t[("enc", True)] <= CODEC_TARGET and t[("dec", True)] <= CODEC_TARGET
        if not ok:
            failures.append(
                f"{spec}: encode {t[('enc', True)]:.1f}x, decode {t[('dec', True)]:.1f}x copy per core "
                f"(target <= {CODEC_TARGET:.0f}x)"
            )
        cells = [spec, f"{8 * len(payload) / n:.3f}"]
        cells += [f"{t[(w, pc)]:.1f}" for pc in (True, False) for w in ("enc", "dec")]
        print(row([*cells, "ok" if ok else "MISS"], widths))
        splits.append((spec, time_split(codec, x, payload, threads, seed, copy[True])))
    print("\nwhere the per-core time goes (x copy):")
    for spec, parts in splits:
        print(f"  {spec:<34} " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))


def time_split(codec, x: torch.Tensor, payload: bytes, threads: Threads, seed: int, copy: float) -> dict[str, float]:
    """Per-core time of each stage of encode and decode, as multiples of ``copy``."""
    quantizer = codec.quantizer
    k = quantizer.num_symbols()
    flat = x.reshape(-1).contiguous()
    parts: dict[str, float] = {}
    sizes = [flat.numel()]
    wire = codec.wire_transforms
    rotation = wire[-1].fused(flat.numel(), seed, flat) if len(wire) == 1 else None
    if rotation is not None and quantizer.fuses(rotation):  # as encode runs it: one kernel, counts included
        bound = quantizer.with_rotation(rotation)
        parts[f"{wire[0].name} fwd+quantize+histogram"] = threads.time(lambda: bound.quantize(flat, seed, None), True)
        symbols = np.asarray(bound.quantize(flat, seed, None).symbols)
        sizes.append(rotation.padded)
    else:
        bound = None
        for t in wire:
            parts[f"{t.name} fwd"] = threads.time(lambda t=t, f=flat: t.forward(f, seed), True)
            flat = t.forward(flat, seed).contiguous()
            sizes.append(flat.numel())
        parts["quantize"] = threads.time(lambda: quantizer.quantize(flat, seed, None), True)
        symbols = np.asarray(quantizer.quantize(flat, seed, None).symbols)
    counts = symbol_counts(symbols, k)
    if bound is None:
        parts["histogram"] = threads.time(lambda: symbol_counts(symbols, k), True)
    parts["coder enc"] = threads.time(lambda: entropy_encode(symbols, k, counts=counts), True)
    body = BodyReader(read_payload(payload).body, quantizer.name)
    m = sizes[-1]
    side = read_side(quantizer, body, m)
    section = np.frombuffer(body.take_rest(), np.uint8)
    parts["coder dec"] = threads.time(lambda: entropy_decode(section, m, k), True)
    decoded = entropy_decode(section, m, k)
    if bound is not None:
        parts[f"dequantize+{wire[0].name} inv"] = threads.time(lambda: bound.dequantize(side, decoded, m, seed), True)
        return {name: seconds / copy for name, seconds in parts.items()}
    parts["dequantize"] = threads.time(lambda: quantizer.dequantize(side, decoded, m, seed), True)
    values = quantizer.dequantize(side, decoded, m, seed)
    for t, size in zip(reversed(codec.wire_transforms), reversed(sizes[:-1]), strict=True):
        parts[f"{t.name} inv"] = threads.time(lambda t=t, v=values, s=size: t.inverse(v, s, seed), True)
    return {name: seconds / copy for name, seconds in parts.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="25M", help="symbols per stream and elements per tensor (default 25M)")
    ap.add_argument("--rounds", type=int, default=5, help="timed calls per measurement; the best counts")
    ap.add_argument("--zstd-src", type=Path, help="a zstd checkout: add huff0 on the same streams")
    ap.add_argument("--coder-only", action="store_true", help="only the coder table and its targets")
    args = ap.parse_args(argv)
    os.environ.setdefault("FEDQUANT_KERNELS", "numba")  # the compiled kernels, not their twins while a cache warms
    n = parse_size(args.size)
    threads = Threads(args.rounds)
    huf = load_huff0(args.zstd_src) if args.zstd_src else None
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    streams = {spec: codec_symbols(spec, x) for spec in CODEC_STREAMS}
    streams.update(synthetic_streams(n))
    print(f"entropy coder: {n:,} symbols per stream, best of {args.rounds}, {threads.all} threads for 'all'")
    failures: list[str] = []
    coder_table(streams, threads, huf, failures)
    if not args.coder_only:
        print()
        codec_table(x, threads, failures)
    print()
    if failures:
        print("TARGETS MISSED:")
        for f in failures:
            print("  " + f)
        return 1
    print("all targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
