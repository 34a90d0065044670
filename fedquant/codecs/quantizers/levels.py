"""Quantizers that send levels chosen per bucket and one level index per element (Xu, Huo, Huang 2020).

ORQ, Linear, BinGrad-b and BinGrad-pb choose ``s`` levels per bucket of ``bucket_size`` values from
the bucket's own values and round every value onto its bucket's levels. Each quantizer only says
how many levels there are, how they are chosen (a numba kernel in
:mod:`fedquant.codecs.kernels.levels` for CPU tensors, its torch twin in
:mod:`fedquant.codecs.kernels.levels_torch` for the others, giving the same levels) and how values
are rounded onto them:

* ``orq`` (ORQ-s) minimises the rounding variance: the paper's "greedy recursive Algorithm 1".
  Its equations are not in the text available to us; we implement the reconstruction of
  ``algorithms.md`` §4.3-4.4 (bisection reading): level ``(l + r) // 2`` is placed at the
  variance-optimal middle point between the already placed levels ``l`` and ``r`` (the
  first-order condition of the 3-level problem, solved exactly over the bucket's data points),
  recursively. The bisection is balanced when ``s = 2**k + 1`` (3, 5, 9, 17, ...): there it is
  within a few percent of the exact optimum. For other ``s`` one side of a split gets more
  levels than the 3-level placement assumes and the greedy levels are far from optimal (s = 8:
  about 1.4 times the optimal variance on Gaussian buckets); ``refine=n`` adds ``n`` sweeps of
  exact coordinate descent (each level moved to the optimum between its neighbours), our
  extension for that case (``refine=3`` brings s = 8 within about 4 %).
* ``linear`` (Linear-s) is the paper's naive baseline, "linearly dividing the gradient
  cumulative distribution": levels at the empirical quantiles ``F^-1(k / (s - 1))`` (§4.7).
* ``bingrad-b`` (biased, deterministic): the two levels minimising the squared error of
  nearest-level quantization, i.e. the exact 1-D 2-means of the bucket (§4.5); each value goes
  to its nearer level.
* ``bingrad-pb`` ("partially biased", our reading of the name): values inside ``[b0, b1]`` are
  rounded without bias, values outside are clipped to the nearer level; ``b0, b1`` minimise the
  resulting expected squared error (§4.6), whose optimality conditions are
  ``2 sum_{v<b0} (b0 - v) = sum_{b0<=v<=b1} (b1 - v)`` and
  ``2 sum_{v>b1} (v - b1) = sum_{b0<=v<=b1} (v - b0)``.

ORQ and Linear have the bucket's min and max as end levels and round without bias.

Wire format of the body (:mod:`fedquant.codecs.coders.layout`)::

    levels    num_buckets * s values, float32 (or float16 with level_dtype="float16"; ORQ's and
              Linear's end levels then round outward so that every value stays inside them and
              the rounding stays unbiased), bucket by bucket
    symbols   the level index of every element, 0 .. s - 1:
              coding="fixed":   bit_width(s) bits each, packed LSB first
              coding="entropy": count table + rANS over the whole tensor's indices

>>> codec = get_codec("orq:levels=9,bucket_size=512")
>>> x_hat = codec.decode(codec.encode(x, seed=7), seed=7)     # E[x_hat] = x
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import numpy as np
import torch

from fedquant.codecs.buckets import num_buckets, to_buckets
from fedquant.codecs.clipping import clip_sigma
from fedquant.codecs.kernels import levels as kernels
from fedquant.codecs.kernels import levels_torch as twin
from fedquant.codecs.kernels.common import kernel_key
from fedquant.codecs.params import Param
from fedquant.codecs.quantizers.base import (
    LevelsLadder,
    Quantized,
    Quantizer,
    SideField,
    relative_error,
    require_finite,
)
from fedquant.errors import PayloadError

FP16_MAX = 65504.0
LEVEL_DTYPES = {"float32": "<f4", "float16": "<f2"}
MAX_LEVELS = 256

COMMON_PARAMS: dict[str, Param] = {
    "bucket_size": Param(int, 512, "elements per bucket; each bucket gets its own levels", minimum=1),
    "clip": Param(
        float,
        None,
        "clip at c standard deviations of the whole tensor before quantizing (TernGrad's rule, c=2.5); off when unset",
        minimum=0.0,
    ),
    "level_dtype": Param(str, "float32", "how levels travel: float32 or float16", choices=tuple(LEVEL_DTYPES)),
}


class LevelQuantizer(Quantizer):
    """Base of the quantizers that send each bucket's levels and one level index per element.

    Subclasses set ``rounding`` (``"random"``: unbiased random rounding, values outside the end
    levels clipped; ``"nearest"``: deterministic, two levels only) and ``outward_ends`` (round
    the end levels outward when they travel as float16, so that every value stays inside them
    and random rounding stays unbiased), and implement :meth:`num_levels`,
    :meth:`_levels_torch` and :meth:`_levels_kernel`.
    """

    rounding: ClassVar[str] = "random"
    outward_ends: ClassVar[bool] = True
    #: Whether every bucket's first and last levels are its min and max (ORQ, Linear).
    ends_are_extremes: ClassVar[bool] = False
    params = COMMON_PARAMS

    @abstractmethod
    def num_levels(self) -> int:
        """Levels per bucket, ``s``."""

    @abstractmethod
    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        """``(num_buckets, s)`` float32 levels of a non-empty flat tensor, on its device."""

    @abstractmethod
    def _levels_kernel(self, flat: np.ndarray) -> np.ndarray:
        """Same as :meth:`_levels_torch` with the numba kernels (CPU)."""

    def num_symbols(self) -> int:
        return self.num_levels()

    def checks_finite(self) -> bool:
        """Without ``clip``, where the end levels are each bucket's min and max: both sorts (the
        kernels' order-preserving integer keys, ``torch.sort``) put a NaN or Inf at an end of its
        bucket, so the end levels are finite exactly when the bucket is."""
        return self.ends_are_extremes and not self.clip

    def error_bound(self, numel: int) -> float | None:
        """``omega <= d`` for unbiased rounding between the bucket's levels (ORQ, Linear).

        Each element's variance ``(v - l)(u - v)`` between its neighbouring levels is at most
        ``(max - min)^2 / 4 <= max|v|^2``. BinGrad overrides it; with ``clip`` there is no bound
        relative to the input (None).
        """
        return None if self.clip else float(min(self.bucket_size, max(numel, 1)))

    def expected_error(self, flat: torch.Tensor) -> float | None:
        """Exact for unbiased rounding: ``sum_i (v_i - l_i)(u_i - v_i)`` between the levels it would choose."""
        if self.clip or self.rounding != "random" or not self.unbiased or flat.numel() == 0:
            return self.error_bound(flat.numel())
        d = self.bucket_size
        levels = torch.from_numpy(self.wire_levels(self.select_levels(flat).cpu().numpy()).astype(np.float32))
        levels = levels.double().sort(dim=1).values
        v = to_buckets(flat.detach().cpu(), d).double()
        upper = torch.searchsorted(levels, v).clamp(1, levels.shape[1] - 1)
        lo, hi = levels.gather(1, upper - 1), levels.gather(1, upper)
        var = ((v - lo) * (hi - v)).clamp(min=0).reshape(-1)[: flat.numel()]  # padding sits on a level or beyond
        return relative_error(var.sum(), flat)

    def side_fields(self, numel: int) -> list[SideField]:
        count = num_buckets(numel, self.bucket_size) * self.num_levels()
        return [SideField("levels", LEVEL_DTYPES[self.level_dtype], count)]

    # ------------------------------------------------------------------ encode
    def select_levels(self, x: torch.Tensor) -> torch.Tensor:
        """The levels this quantizer chooses for a flat float32 tensor (after clipping), float32.

        On the CPU the numba kernels compute them (unless ``force_torch``), elsewhere the batched
        torch code; both give the same levels. The result is ``(num_buckets, s)`` on ``x``'s
        device, before any float16 rounding.
        """
        if x.numel() == 0:
            return x.new_zeros((0, self.num_levels()))
        if self.uses_kernels(x):
            return torch.from_numpy(self._levels_kernel(x.numpy()))
        return self._levels_torch(x)

    def wire_levels(self, levels: np.ndarray) -> np.ndarray:
        """Levels as they travel (float32 or float16, with outward end rounding where set).

        Raises
        ------
        ValueError
            If a level is beyond the float16 range with ``level_dtype="float16"``.
        """
        dtype = np.dtype(LEVEL_DTYPES[self.level_dtype])
        if self.level_dtype == "float32":
            return np.ascontiguousarray(levels, dtype=dtype)
        if levels.size and float(np.abs(levels).max()) > FP16_MAX:
            raise ValueError(
                f"{self.name}: a level exceeds the float16 range (+-{FP16_MAX:g}); use level_dtype='float32'"
            )
        half = levels.astype(dtype)
        if self.outward_ends and levels.size:
            low, high = half[:, 0], half[:, -1]
            down = low.astype(np.float32) > levels[:, 0]
            low[down] = np.nextafter(low[down], np.float16(-np.inf))
            up = high.astype(np.float32) < levels[:, -1]
            high[up] = np.nextafter(high[up], np.float16(np.inf))
        return half

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        x = clip_sigma(flat, self.clip).contiguous()
        selected = self.select_levels(x).cpu().numpy()
        if self.checks_finite():
            require_finite(selected[:, [0, -1]])
        wire = self.wire_levels(selected)
        levels = wire.astype(np.float32)
        d = self.bucket_size
        if self.uses_kernels(x):
            args = (x.numpy(), levels, d, kernel_key(seed), self.rounding == "nearest")
            if packed_width is not None:
                return Quantized([wire], packed=kernels.round_pack(*args, packed_width))
            if self.wants_counts():
                indices, counts = kernels.round_pack(*args, 8, count=True)  # one byte per index
                return Quantized([wire], symbols=indices, counts=counts)
            return Quantized([wire], symbols=kernels.round_pack(*args, 8))  # one byte per index
        on_device = torch.from_numpy(levels).to(x.device)
        if self.rounding == "nearest":
            indices = twin.nearest_of_two(x, on_device, d)
        else:
            indices = twin.random_round(x, on_device, d, seed)
        return Quantized([wire], symbols=indices.cpu().numpy())

    # ------------------------------------------------------------------ decode
    def _rows(self, side: list[np.ndarray], numel: int) -> np.ndarray:
        return side[0].astype(np.float32).reshape(num_buckets(numel, self.bucket_size), self.num_levels())

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        levels = self._rows(side, numel)
        if not self.uses_kernels():
            indices = torch.from_numpy(symbols.astype(np.int64))
            return twin.gather_levels(indices, torch.from_numpy(levels), self.bucket_size)
        # Symbols come checked below s <= 256: one byte each, "packed" at width 8.
        codes = np.ascontiguousarray(symbols, dtype=np.uint8)
        return self._checked(
            *kernels.unpack_gather(codes, numel, levels.reshape(-1), levels.shape[1], self.bucket_size, 8), levels
        )

    def dequantize_packed(self, side, packed, width, numel, seed) -> torch.Tensor:
        if not self.uses_kernels():
            return super().dequantize_packed(side, packed, width, numel, seed)
        levels = self._rows(side, numel)
        return self._checked(
            *kernels.unpack_gather(packed, numel, levels.reshape(-1), levels.shape[1], self.bucket_size, width),
            levels,
        )

    def _checked(self, values: np.ndarray, bad: int, levels: np.ndarray) -> torch.Tensor:
        """The kernel's values, refused where an index was beyond the levels; each value is one of
        ``levels``, so they are all finite when those are (the codec then skips its pass)."""
        if bad:
            raise PayloadError(
                f"{self.name} payload holds {int(bad)} level indices >= {self.num_levels()}, the number of levels"
            )
        self.values_finite = bool(np.isfinite(levels).all())
        return torch.from_numpy(values)


class ORQQuantizer(LevelsLadder, LevelQuantizer):
    """Optimized random quantization ORQ-s: variance-minimising levels per bucket, unbiased.

    Parameters
    ----------
    levels : int
        ``s >= 3`` levels per bucket (default 16: a full 4-bit index; the paper used 9).
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
    coding : {"fixed", "entropy"}
        How the level indices travel.
    """

    name = "orq"
    params = {
        # 16, not the paper's 9: a 4-bit index holds 16 levels, and ORQ-16 has a third of ORQ-9's
        # error for 0.44 more bits per element (0.021 vs 0.067 vNMSE on Gaussian buckets of 512).
        "levels": Param(int, 16, "levels per bucket, s (ORQ-s)", minimum=3, maximum=MAX_LEVELS),
        "refine": Param(
            int, 0, "sweeps of coordinate descent after the greedy levels (0 = paper)", minimum=0, maximum=64
        ),
        **COMMON_PARAMS,
    }
    unbiased = True
    ends_are_extremes = True
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), ORQ-s; levels per algorithms.md §4.4 [RECON]"
    wire = "per bucket s float levels + ceil(log2 s) bits per element"

    def num_levels(self) -> int:
        return self.levels

    def _tree_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, mid, hi = zip(*twin.level_schedule(self.levels, self.refine), strict=True)
        return (np.array(lo, np.int64), np.array(mid, np.int64), np.array(hi, np.int64))

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return twin.per_bucket(flat, self.bucket_size, lambda w: twin.orq_levels(w, self.levels, self.refine))

    def _levels_kernel(self, flat: np.ndarray) -> np.ndarray:
        return kernels.orq_levels(flat, self.bucket_size, self.levels, *self._tree_arrays())


class LinearQuantizer(LevelsLadder, LevelQuantizer):
    """Linear-s: levels at equally spaced quantiles of each bucket's values, unbiased rounding.

    The paper's naive baseline (Xu et al. 2020, §4: "choosing s quantization levels by linearly
    dividing the gradient cumulative distribution"), read as ``b_k = F^-1(k / (s - 1))`` of the
    bucket's empirical CDF. Parameters as :class:`ORQQuantizer` (``levels >= 2``, default 16, no
    ``refine``).
    """

    name = "linear"
    params = {
        "levels": Param(int, 16, "levels per bucket, s (Linear-s; as ORQ's default)", minimum=2, maximum=MAX_LEVELS),
        **COMMON_PARAMS,
    }
    unbiased = True
    ends_are_extremes = True
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), Linear-s baseline; quantile levels per algorithms.md §4.7"
    wire = "per bucket s float levels + ceil(log2 s) bits per element"

    def num_levels(self) -> int:
        return self.levels

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return twin.per_bucket(flat, self.bucket_size, lambda w: twin.linear_levels(w, self.levels))

    def _levels_kernel(self, flat: np.ndarray) -> np.ndarray:
        return kernels.linear_levels(flat, self.bucket_size, self.levels)


class BinGradBQuantizer(LevelQuantizer):
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
    coding : {"fixed", "entropy"}
        How the bits travel.
    """

    name = "bingrad-b"
    unbiased = False
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), BinGrad-b; exact 2-means per algorithms.md §4.5 [RECON]"
    wire = "per bucket 2 float levels + 1 bit per element"
    rounding = "nearest"
    outward_ends = False

    def num_levels(self) -> int:
        return 2

    def error_bound(self, numel: int) -> float | None:
        """``1 - 1/d``: 2-means errs at most as the centroids of the sign split.

        Those err by ``||v||^2 - ||v+||_1^2 / n+ - ||v-||_1^2 / n- <= (1 - 1/d) ||v||^2``. Levels
        sent as float16 flush values below ``6e-5`` towards 0: bound 1 (as ``fp16``). None with ``clip``.
        """
        if self.clip:
            return None
        if self.level_dtype == "float16":
            return 1.0
        return 1.0 - 1.0 / min(self.bucket_size, max(numel, 1))

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return twin.per_bucket(flat, self.bucket_size, twin.two_means_levels)

    def _levels_kernel(self, flat: np.ndarray) -> np.ndarray:
        return kernels.two_means_levels(flat, self.bucket_size)


class BinGradPBQuantizer(LevelQuantizer):
    """BinGrad-pb: unbiased rounding inside ``[b0, b1]``, clipping outside, error-optimal levels.

    The levels come from exact coordinate descent on the expected squared error, started at the
    bucket's 25 % / 75 % quantiles, for at most 20 sweeps (after 20 sweeps the error is within
    about 1e-7 of its limit on Gaussian buckets). Parameters as :class:`BinGradBQuantizer`.
    """

    name = "bingrad-pb"
    unbiased = False
    paper = "Xu, Huo, Huang 2020 (arXiv 2002.11082), BinGrad-pb; levels per algorithms.md §4.6 [RECON]"
    wire = "per bucket 2 float levels + 1 bit per element"
    rounding = "random"
    outward_ends = False

    def num_levels(self) -> int:
        return 2

    def error_bound(self, numel: int) -> float | None:
        """1 (measured, not proven): the descent only lowers the error from its quantile start.

        ``tests/codecs/test_error_bounds.py`` checks it on Gaussian, heavy-tailed, one-sided and spiked
        buckets. None with ``clip``.
        """
        return None if self.clip else 1.0

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        return twin.per_bucket(flat, self.bucket_size, twin.partially_biased_levels)

    def _levels_kernel(self, flat: np.ndarray) -> np.ndarray:
        return kernels.partially_biased_levels(flat, self.bucket_size, twin.PB_MAX_SWEEPS)
