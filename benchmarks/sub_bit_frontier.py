"""Below one bit: ECDQ, EDEN and ECDQ's shared-seed subsample (``keep``) against the unbiased Shannon bound.

    python -m benchmarks.sub_bit_frontier

On 2^20 Gaussian coordinates (3 seeds: data draw and codec seed), per setting: the bits per
coordinate its payload really sends, vNMSE (mean ± sample std), the unbiased bound
``4^-R / (1 - 4^-R)`` at that rate ``R`` and the ratio. The ``keep`` rows are the codec option
itself (``ecdq:bits=b,keep=p``: a seeded fraction ``p`` of the rotated coordinates, coded at
``b / p`` bits and scaled by ``1 / p``), measured on the whole vector; the declared vNMSE
``(1 + D) / p - 1`` is printed beside. Exits 1 when no setting reaches ``TARGET`` x the bound at
0.5 bits (issue 45).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from benchmarks.rate_distortion import shannon_unbiased
from fedquant.codecs import get_codec

N = 1 << 20
SEEDS = (0, 1, 2)
TARGET = 1.6
RATES = (0.25, 0.5, 0.75)
DIRECT = [f"{family}:bits={b}" for family in ("ecdq", "eden") for b in RATES]
#: Subsample fractions per rate, around the best by the declared vNMSE (0.3, 0.65, 0.95).
KEEP = {0.25: (0.25, 0.3, 0.4), 0.5: (0.5, 0.65, 0.75), 0.75: (0.8, 0.9, 0.95)}
SUBSAMPLE = [f"ecdq:bits={b},keep={p}" for b, keeps in KEEP.items() for p in keeps]


def measure(spec: str) -> tuple[float, list[float]]:
    """Bits per coordinate of the payload, and vNMSE per seed."""
    codec = get_codec(spec)
    bits, errors = [], []
    for seed in SEEDS:
        x = torch.randn(N, generator=torch.Generator().manual_seed(100 + seed))
        payload = codec.encode(x, seed=seed)
        y = codec.decode(payload, seed=seed)
        errors.append(float(((y.double() - x.double()) ** 2).sum() / (x.double() ** 2).sum()))
        bits.append(8 * len(payload) / N)
    return float(np.mean(bits)), errors


def main() -> int:
    print("| setting | bits sent | vNMSE | declared | bound at bits sent | x bound |\n|---|---|---|---|---|---|")
    best = np.inf
    for spec in DIRECT + SUBSAMPLE:
        bits, errors = measure(spec)
        ratio = float(np.mean(errors)) / shannon_unbiased(bits)
        if abs(bits - 0.5) < 0.04:
            best = min(best, ratio)
        declared = f"{get_codec(spec).quantizer.vnmse(N):.4f}" if spec.startswith("ecdq") else "-"
        print(
            f"| `{spec}` | {bits:.3f} | {np.mean(errors):.4f} ± {np.std(errors, ddof=1):.4f} | {declared} | "
            f"{shannon_unbiased(bits):.4f} | {ratio:.2f} |"
        )
    print(f"\nbest at 0.5 bits: {best:.2f} x the bound (target {TARGET})")
    return 0 if best <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
