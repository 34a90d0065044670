"""ORQ-s and Linear-s: unbiased random rounding onto levels chosen per bucket (Xu, Huo, Huang 2020).

Both codecs pick ``s`` levels per bucket of ``bucket_size`` values at encode time, with the
bucket's min and max as end levels, and round every value without bias onto the two levels
around it. They differ in where the interior levels go:

* ``orq`` minimises the rounding variance: the paper's "greedy recursive Algorithm 1". Its
  equations are not in the text available to us; we implement the reconstruction of
  ``algorithms.md`` §4.3-4.4 (bisection reading): level ``(l + r) // 2`` is placed at the
  variance-optimal middle point between the already placed levels ``l`` and ``r`` (the first-order
  condition of the 3-level problem, solved exactly over the bucket's data points), recursively.
  The bisection is balanced when ``s = 2**k + 1`` (3, 5, 9, 17, ...): there it is within a few
  percent of the exact optimum. For other ``s`` one side of a split gets more levels than the
  3-level placement assumes and the greedy levels are far from optimal (s = 8: about 1.4 times
  the optimal variance on Gaussian buckets); ``refine=n`` adds ``n`` sweeps of exact coordinate
  descent (each level moved to the optimum between its neighbours), our extension for that case
  (``refine=3`` brings s = 8 within about 4 %). Default: ``levels=9`` (4 bits), ``refine=0``.
* ``linear`` is the paper's naive baseline, "linearly dividing the gradient cumulative
  distribution": levels at the empirical quantiles ``F^-1(k / (s - 1))`` (§4.7).

Wire per bucket: ``s`` levels (float32, or float16 with ``level_dtype="float16"``; the end levels
then round outward so the rounding stays unbiased) and ``bit_width(s)`` bits per element.

>>> codec = get_codec("orq:levels=9,bucket_size=512")
>>> x_hat = codec.decode(codec.encode(x, seed=7), seed=7)     # E[x_hat] = x
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.kernels import levels as cpu_kernels
from fedquant.codecs.level_codec import COMMON_PARAMS, LevelCodec
from fedquant.codecs.levels import level_schedule, linear_levels, orq_levels, per_bucket
from fedquant.codecs.params import Param

MAX_LEVELS = 256


class ORQCodec(LevelCodec):
    """Optimized random quantization ORQ-s: variance-minimising levels per bucket, unbiased.

    Parameters
    ----------
    levels : int
        ``s >= 3`` levels per bucket (default 9: balanced bisection, 4 bits per element).
    refine : int
        Sweeps of coordinate descent after the greedy algorithm (default 0, the paper's greedy);
        useful when ``levels`` is not ``2**k + 1``.
    bucket_size : int
        Elements per bucket (default 512).
    clip : float, optional
        Clip at ``clip`` standard deviations of the whole tensor first (TernGrad's layer-wise
        rule; the paper uses 2.5 with ORQ on ImageNet). Off by default. Unbiased with respect to
        the clipped tensor.
    level_dtype : {"float32", "float16"}
        How levels travel.
    """

    name = "orq"
    params = {
        "levels": Param(int, 9, "levels per bucket, s (ORQ-s)", minimum=3, maximum=MAX_LEVELS),
        "refine": Param(
            int, 0, "sweeps of coordinate descent after the greedy levels (0 = paper)", minimum=0, maximum=64
        ),
        **COMMON_PARAMS,
    }
    unbiased = True
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), ORQ-s; levels per algorithms.md §4.4 [RECON]"
    wire = "per bucket s float levels + ceil(log2 s) bits per element"

    def num_levels(self) -> int:
        return self.levels

    def _tree_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, mid, hi = zip(*level_schedule(self.levels, self.refine), strict=True)
        return (np.array(lo, np.int64), np.array(mid, np.int64), np.array(hi, np.int64))

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return per_bucket(flat, self.bucket_size, lambda w: orq_levels(w, self.levels, self.refine))

    def _levels_cpu(self, flat: np.ndarray) -> np.ndarray:
        return cpu_kernels.orq_levels(flat, self.bucket_size, self.levels, *self._tree_arrays())


class LinearCodec(LevelCodec):
    """Linear-s: levels at equally spaced quantiles of each bucket's values, unbiased rounding.

    The paper's naive baseline (Xu et al. 2020, §4: "choosing s quantization levels by linearly
    dividing the gradient cumulative distribution"), read as ``b_k = F^-1(k / (s - 1))`` of the
    bucket's empirical CDF. Parameters as :class:`ORQCodec` (``levels >= 2``, default 9, no
    ``refine``).
    """

    name = "linear"
    params = {
        "levels": Param(int, 9, "levels per bucket, s (Linear-s)", minimum=2, maximum=MAX_LEVELS),
        **COMMON_PARAMS,
    }
    unbiased = True
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), Linear-s baseline; quantile levels per algorithms.md §4.7"
    wire = "per bucket s float levels + ceil(log2 s) bits per element"

    def num_levels(self) -> int:
        return self.levels

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return per_bucket(flat, self.bucket_size, lambda w: linear_levels(w, self.levels))

    def _levels_cpu(self, flat: np.ndarray) -> np.ndarray:
        return cpu_kernels.linear_levels(flat, self.bucket_size, self.levels)
