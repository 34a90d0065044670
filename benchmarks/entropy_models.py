"""Would an adaptive entropy model beat the static per-tensor table? (a table, exits 0)

``coding=entropy`` codes a tensor's symbols with one exact count table (rANS). An adaptive
model (frequencies per block of buckets) can only win if the symbol distribution changes
along the tensor. This script measures, for each quantizer's symbols on several inputs, the
static table's real cost in bits per element (from the payload) against two lower bounds:

* ``H global``: the empirical entropy of all symbols (what the static rANS approaches),
* ``H per block``: the mean empirical entropy within blocks of ``--block`` elements, with the
  tables of the blocks counted as free, i.e. the most any per-block adaptive model could save.

Inputs: Gaussian, Laplace, Student-t(3) and Gaussian with a log-normal scale per 4096 elements
(what layers of different magnitudes in one tensor look like), and the same after ``rht+``.

Usage::

    python -m benchmarks.entropy_models --numel 262144 --block 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.coders.symbols import fixed_width

SPECS = [
    "dqsg:levels=1",
    "dqsg:levels=2",
    "dqsg:levels=6",
    "qsgd:levels=1",
    "qsgd:levels=4",
    "terngrad",
    "orq:levels=4",
]


def entropy_bits(symbols: np.ndarray) -> float:
    """Empirical entropy (bits per symbol) of an integer array."""
    counts = np.bincount(symbols.astype(np.int64))
    p = counts[counts > 0] / symbols.size
    return float(-(p * np.log2(p)).sum())


def inputs(numel: int, seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    block_scales = np.exp(rng.normal(0.0, 1.5, -(-numel // 4096)))
    raw = {
        "gaussian": rng.standard_normal(numel),
        "laplace": rng.laplace(size=numel),
        "student-t3": rng.standard_t(3, size=numel),
        "mixed scales": rng.standard_normal(numel) * np.repeat(block_scales, 4096)[:numel],
    }
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in raw.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--block", type=int, default=1 << 15)
    args = parser.parse_args(argv)
    print(f"{'input':14s} {'codec':16s} {'H global':>9s} {'H per block':>12s} {'max gain':>9s} {'rANS bits':>10s}")
    worst_gain = 0.0
    for prefix in ("", "rht+"):
        for name, x in inputs(args.numel, 0).items():
            for spec in SPECS:
                try:
                    codec = get_codec(prefix + spec, coding="entropy")
                except ValueError as err:  # a transform not available in this installation
                    print(f"skip {prefix + spec}: {err}")
                    continue
                flat = x
                for t in codec.wire_transforms:
                    flat = t.forward(flat, 7)
                symbols = codec.quantizer.quantize(flat.contiguous(), 7, None).symbols
                n = symbols.size - symbols.size % args.block
                per_block = np.mean([entropy_bits(b) for b in symbols[:n].reshape(-1, args.block)])
                whole = entropy_bits(symbols)
                # Same side data and header at both codings: the difference is the symbol stream.
                fixed = get_codec(prefix + spec, coding="fixed")
                extra = 8 * (len(codec.encode(x, 7)) - len(fixed.encode(x, 7))) / x.numel()
                symbol_bits = extra + fixed_width(codec.quantizer.num_symbols())
                worst_gain = max(worst_gain, whole - per_block)
                print(
                    f"{name:14s} {prefix + spec:16s} {whole:9.3f} {per_block:12.3f} {whole - per_block:9.4f} "
                    f"{symbol_bits:10.3f}"
                )
    print(f"largest possible gain of a per-block adaptive model: {worst_gain:.4f} bits per element")
    return 0


if __name__ == "__main__":
    sys.exit(main())
