"""Where ECDQ's encode and decode time goes, per core: CPU ms of each kernel stage.

For each setting (default ``ecdq:bits=0.5``, ``ecdq:bits=1``, ``ecdq:bits=2``) a float32
Gaussian tensor of ``--size`` elements (default 25M) is encoded and decoded ``--repeats`` times
with the kernels on one thread (``NUMBA_NUM_THREADS=1``, ``torch.set_num_threads(1)``: set
before numba loads) while the kernel stages are wrapped with a CPU-time clock; each stage, and
the whole call, keeps its best. Stages: the norm, E8's fused lattice pass and table order, the
rANS coders (``one_lane``: the encoder's one-lane tables, coded four at a time; ``blocks32``:
the other rans32 tables, and all of them in the decoder; ``blocks64``: rans64), and the
decoder's context counts, first seven and eighth coordinates; ``rest`` is the call's time the
stages leave (rotation, Python, the Z lattice's passes). An in-place copy of the tensor is timed
alongside (the yardstick of
``benchmarks.codec_throughput``).

Usage::

    flock /work/bench.lock python -m benchmarks.ecdq_stages
    python -m benchmarks.ecdq_stages --specs "ecdq:bits=1" --size 4M --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ["NUMBA_NUM_THREADS"] = "1"
os.environ.setdefault("FEDQUANT_KERNELS", "numba")

import torch  # noqa: E402

from benchmarks.codec_throughput import parse_size  # noqa: E402
from benchmarks.specs import build  # noqa: E402
from fedquant.codecs.kernels import e8  # noqa: E402
from fedquant.codecs.kernels import ecdq as scalar  # noqa: E402
from fedquant.wire import rans  # noqa: E402

STAGES = {
    "norm": (scalar, "norm_and_max"),
    "lattice": (e8, "lattice_counts"),
    "order": (e8, "order_kmajor"),
    "one_lane": (rans, None),  # encode_one_lane32
    "blocks32": (rans, None),
    "blocks64": (rans, None),
    "count_first": (e8, "count_first"),
    "place_first": (e8, "place_first"),
    "finish": (e8, "finish"),
}
CODER = {
    "one_lane": ("encode_one_lane32",),
    "blocks32": ("encode_blocks32", "decode_blocks32"),
    "blocks64": ("encode_blocks", "decode_blocks"),
}


def timed(spent: dict[str, float], stage: str, fn):
    """``fn`` with its CPU time added to ``spent[stage]``."""

    def call(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[stage] = spent.get(stage, 0.0) + time.process_time() - start

    return call


def wrap_stages(spent: dict[str, float]) -> None:
    """Wrap every stage's kernel (module attribute) with the clock (those a checkout has: older ones
    code every table on its own)."""
    for stage, (module, name) in STAGES.items():
        for attr in CODER.get(stage, (name,)):
            if hasattr(module, attr):
                setattr(module, attr, timed(spent, stage, getattr(module, attr)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--specs", default="ecdq:bits=0.5;ecdq:bits=1;ecdq:bits=2", help="';'-separated settings")
    ap.add_argument("--size", default="25M", help="elements (default 25M)")
    ap.add_argument("--repeats", type=int, default=3, help="calls of each direction; the best counts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = parse_size(args.size)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    copy = torch.empty_like(x)
    spent: dict[str, float] = {}
    wrap_stages(spent)
    for spec in args.specs.split(";"):
        codec = build(spec).codec
        payload = codec.encode(x, seed=1)
        codec.decode(payload, seed=1)  # compiled and warm
        best: dict[str, dict[str, float]] = {"encode": {}, "decode": {}}
        for _ in range(args.repeats):
            for direction, call in (
                ("encode", lambda c=codec: c.encode(x, seed=1)),
                ("decode", lambda c=codec, p=payload: c.decode(p, seed=1)),
            ):
                spent.clear()
                start = time.process_time()
                call()
                total = time.process_time() - start
                times = {**spent, "rest": total - sum(spent.values()), "total": total}
                for stage, t in times.items():
                    best[direction][stage] = min(best[direction].get(stage, float("inf")), t)
        t_copy = min(_timed_copy(copy, x) for _ in range(5))
        print(f"{spec} at {n:,} (one thread, CPU ms; copy {t_copy * 1e3:.1f} ms)")
        for direction, times in best.items():
            cells = [f"{stage} {t * 1e3:.1f}" for stage, t in times.items() if stage != "total"]
            total = times["total"]
            print(f"  {direction} {total * 1e3:.1f} ms = {total / t_copy:.1f}x copy: " + ", ".join(cells))
    return 0


def _timed_copy(copy: torch.Tensor, x: torch.Tensor) -> float:
    start = time.process_time()
    copy.copy_(x)
    return time.process_time() - start


if __name__ == "__main__":
    raise SystemExit(main())
