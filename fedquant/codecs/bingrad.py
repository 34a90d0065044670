"""BinGrad-b and BinGrad-pb: two levels per bucket chosen from the bucket's values (Xu, Huo, Huang 2020).

The paper proposes "biased BinGrad" for 1-bit gradients with the optimal 2-level condition; its
equations are not in the text available to us. We implement the reconstruction of
``algorithms.md`` §4.5-4.6:

* ``bingrad-b`` (biased, deterministic): the two levels minimising the squared error of
  nearest-level quantization, i.e. the exact 1-D 2-means of the bucket (best of all splits of the
  sorted bucket); each value goes to its nearer level.
* ``bingrad-pb`` ("partially biased", our reading of the name): values inside ``[b0, b1]`` are
  rounded without bias, values outside are clipped to the nearer level; ``b0, b1`` minimise the
  resulting expected squared error, whose optimality conditions are
  ``2 sum_{v<b0} (b0 - v) = sum_{b0<=v<=b1} (b1 - v)`` and
  ``2 sum_{v>b1} (v - b1) = sum_{b0<=v<=b1} (v - b0)``.

Wire per bucket: 2 levels (float32 or float16) and 1 bit per element.

>>> codec = get_codec("bingrad-b:bucket_size=512")
>>> x_hat = codec.decode(codec.encode(x))
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.kernels import levels as cpu_kernels
from fedquant.codecs.level_codec import COMMON_PARAMS, LevelCodec
from fedquant.codecs.levels import PB_MAX_SWEEPS, partially_biased_levels, per_bucket, two_means_levels


class BinGradBCodec(LevelCodec):
    """BinGrad-b: exact per-bucket 2-means levels, deterministic nearest-level bit (biased).

    Parameters
    ----------
    bucket_size : int
        Elements per bucket (default 512).
    clip : float, optional
        Clip at ``clip`` standard deviations of the whole tensor first (TernGrad's rule, 2.5 in
        the paper). Off by default (the paper finds BinGrad effective without clipping).
    level_dtype : {"float32", "float16"}
        How the two levels travel.
    """

    name = "bingrad-b"
    params = dict(COMMON_PARAMS)
    unbiased = False
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), BinGrad-b; exact 2-means per algorithms.md §4.5 [RECON]"
    wire = "per bucket 2 float levels + 1 bit per element"
    rounding = "nearest"
    outward_ends = False

    def num_levels(self) -> int:
        return 2

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return per_bucket(flat, self.bucket_size, two_means_levels)

    def _levels_cpu(self, flat: np.ndarray) -> np.ndarray:
        return cpu_kernels.two_means_levels(flat, self.bucket_size)


class BinGradPBCodec(LevelCodec):
    """BinGrad-pb: unbiased rounding inside ``[b0, b1]``, clipping outside, error-optimal levels.

    The levels come from exact coordinate descent on the expected squared error, started at the
    bucket's 25 % / 75 % quantiles, for at most 20 sweeps (after 20 sweeps the error is within
    about 1e-7 of its limit on Gaussian buckets). Parameters as :class:`BinGradBCodec`.
    """

    name = "bingrad-pb"
    params = dict(COMMON_PARAMS)
    unbiased = False
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), BinGrad-pb; levels per algorithms.md §4.6 [RECON]"
    wire = "per bucket 2 float levels + 1 bit per element"
    rounding = "random"
    outward_ends = False

    def num_levels(self) -> int:
        return 2

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return per_bucket(flat, self.bucket_size, partially_biased_levels)

    def _levels_cpu(self, flat: np.ndarray) -> np.ndarray:
        return cpu_kernels.partially_biased_levels(flat, self.bucket_size, PB_MAX_SWEEPS)
