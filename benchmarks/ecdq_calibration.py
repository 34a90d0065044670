"""The rate of ECDQ's E8 context model on Gaussian data: the table ``E8_RATES`` of ``fedquant.codecs.quantizers.ecdq``.

For each step constant ``c`` (step ``c`` on ``N(0, 1)`` coordinates) the script quantizes
``--size`` Gaussian coordinates on the dithered E8 lattice and measures what the entropy-coded
section takes: the empirical entropy of the cosets plus the tables' bits as the encoder counts
them (:func:`~fedquant.codecs.quantizers.ecdq.coded_bits`: information, count tables, lengths),
for the number of dither contexts the encoder would pick. It prints the table as Python, and
beside it the scalar lattice's exact rate ``gaussian_rate(c)`` and the vNMSE of both at equal
rate (E8 / Z: below 1, E8 has the smaller error).

Usage::

    python -m benchmarks.ecdq_calibration              # 2^21 coordinates per point (~1 min on 2 cores)
    python -m benchmarks.ecdq_calibration --size 262144
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from fedquant.codecs.kernels import e8
from fedquant.codecs.kernels.common import kernel_key
from fedquant.codecs.kernels.ecdq import FINE_BITS
from fedquant.codecs.quantizers.ecdq import SECOND_MOMENT, coded_bits, gaussian_rate, step_constant

#: Step constants of the table (geometric, from about 8.6 bits down to 0.4).
GRID = tuple(float(c) for c in np.geomspace(0.01, 8.0, 30))


def entropy_bits(counts: np.ndarray) -> float:
    """``n H`` of the rows of ``counts`` (each row one table), summed."""
    total = 0.0
    for row in np.atleast_2d(counts):
        c = row[row > 0].astype(np.float64)
        if c.size:
            total += float(c.sum() * math.log2(c.sum()) - (c * np.log2(c)).sum())
    return total


def e8_model_rate(c: float, n: int, seed: int = 11) -> float:
    """Bits per coordinate of the E8 context model at step ``c`` on ``n`` Gaussian coordinates."""
    y = torch.randn(n, generator=torch.Generator().manual_seed(seed)).numpy()
    key = kernel_key(seed)
    m = np.empty(n, np.int16)
    coset = np.empty(n // 8, np.uint8)
    off = int(np.abs(y).max() / c) + 4
    top, counts, hist = e8.lattice_counts(y, 1.0 / c, key, off, 2 * off + 1, 4, m, coset)
    _, hist = e8.symbol_parity(counts, hist, (int(top) + 1) // 2, off)
    tables = min(coded_bits(e8.E8.folded(hist, k)) for k in range(FINE_BITS + 1))
    return (entropy_bits(np.bincount(coset, minlength=2)) + tables) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=1 << 21, help="Gaussian coordinates per point (multiple of 8)")
    args = ap.parse_args(argv)
    rows = [(c, e8_model_rate(c, args.size)) for c in GRID]
    print("E8_RATES: tuple[tuple[float, float], ...] = (")
    for c, r in rows:
        print(f"    ({c:.6g}, {r:.5f}),")
    print(")")
    print(f"\n{'c':>9} {'E8 bits':>8} {'Z bits':>8} {'E8 vNMSE':>9} {'Z vNMSE at E8 bits':>19} {'ratio':>6}")
    for c, r in rows:
        cz = step_constant(r, "z") if r > 0.02 else float("nan")
        vz = SECOND_MOMENT["z"] * cz * cz
        ve = SECOND_MOMENT["e8"] * c * c
        print(f"{c:9.4g} {r:8.4f} {gaussian_rate(c):8.4f} {ve:9.4g} {vz:19.4g} {ve / vz:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
