"""A shared-seed subsample of a rotated tensor (ECDQ's ``keep``): which coordinates are sent.

Coordinate ``i`` is kept iff the ``i``-th uniform of the stream of ``derive_seed(seed, "ecdq-keep")``
(:mod:`fedquant.rng`, 24 bits; independent of the dither, which is the stream of ``seed``) is
below ``p = round(keep * 2**24) / 2**24``. Both ends regenerate the mask, so no index is sent and
the count of kept coordinates follows from the seed and ``n``. The decoder scales the kept values
by ``1 / p`` and puts zeros elsewhere: unbiased, and for kept values of vNMSE ``D`` the whole
tensor's is ``(1 + D) / p - 1`` (in expectation over the mask, for every input).
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.kernels.common import kernel_key, uniform_stream
from fedquant.rng import UNIFORM_BITS, derive_seed, uniform

#: The least ``keep``: one in ``2**24``, the uniforms' resolution.
MIN_KEEP = 2.0**-UNIFORM_BITS


def probability(keep: float) -> float:
    """The exact probability that a coordinate is kept: ``keep`` rounded to the uniforms' 24 bits."""
    return max(1, round(keep * (1 << UNIFORM_BITS))) / (1 << UNIFORM_BITS)


def mask_seed(seed: int) -> int:
    """The seed of the mask's stream, derived from the tensor's seed (the dither's stream is the seed's own)."""
    return derive_seed(seed, "ecdq-keep")


def kept_mask(seed: int, n: int, keep: float, *, kernel: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean mask of the kept coordinates of ``n`` (``kernel``: numba stream on CPU, else torch on ``device``).

    Both give the same mask: the uniforms are bit-identical and ``p`` is exact in float32.
    """
    p = probability(keep)
    if kernel:
        return torch.from_numpy(uniform_stream(kernel_key(mask_seed(seed)), n, 0) < np.float32(p))
    return uniform(mask_seed(seed), n, device=device) < p


def expand(values: torch.Tensor, mask: torch.Tensor, keep: float) -> torch.Tensor:
    """The decoded tensor: ``values / p`` at the kept coordinates (in order), zeros elsewhere (float32)."""
    out = torch.zeros(mask.numel(), dtype=torch.float32, device=values.device)
    out[mask] = values * float(np.float32(1.0 / probability(keep)))  # float32 arithmetic on both paths
    return out
