"""Scaled uniform grids per bucket: QSGD (``s`` levels per sign) and TernGrad (``s = 1``).

Each bucket ``b`` of ``d`` elements has a float32 ``scale[b]`` and grid step ``scale[b] / s``;
every element is rounded without bias to a signed level ``q`` in ``[-s, s]`` (see
:mod:`fedquant.codecs.kernels.grid` for the rule) and sent as the symbol ``q + s``. Body::

    scales    num_buckets float32, little-endian (max |v| or ||v||_2 of each bucket)
    symbols   numel symbols q + s of the 2s + 1 of the alphabet, coded by ``coding``:
              "fixed"   at bit_width(2s + 1) bits (s=1: 2 bits, s=7: 4, s=16: 6, s=127: 8)
              "elias"   QSGD's Code_s or its dense variant Code'_s, whichever is shorter
              "entropy" rANS under the symbols' exact empirical distribution

``bucket_size=0`` makes the whole tensor one bucket. CPU tensors run the fused numba kernels
(scales, rounding and bit packing in one pass when the coder asks for a fixed width), other
devices their torch twins, with identical bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedquant.codecs.buckets import bucket_stat, effective_bucket_size, to_buckets
from fedquant.codecs.clipping import clip_sigma
from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels import grid as kernels
from fedquant.codecs.kernels import grid_sums
from fedquant.codecs.kernels.common import kernel_key
from fedquant.codecs.kernels.norms import dot_terms
from fedquant.codecs.params import Param
from fedquant.codecs.quantizers.base import (
    BucketScaledQuantizer,
    LevelsLadder,
    Quantized,
    relative_error,
    require_finite,
)
from fedquant.errors import PayloadError
from fedquant.wire.bitpack import packed_size
from fedquant.wire.body import require_items


def grid_steps(scales: np.ndarray, levels: int) -> np.ndarray:
    """Grid step ``scale / s`` per bucket, in float32 (encoder and decoder compute the same)."""
    return (scales.astype(np.float32, copy=False) / np.float32(levels)).astype(np.float32, copy=False)


def value_bound(steps: np.ndarray, s: int) -> float:
    """A bound on ``|(code - s) step|`` for every valid code (``|code - s| <= s``): ``s`` times the
    largest step, and the float32 product rounds up by at most one part in ``2**24``."""
    return float(s) * float(steps.max()) * (1 + 2.0**-22) if steps.size else 0.0


class ScaledGridQuantizer(BucketScaledQuantizer):
    """Base of the quantizers that round each bucket onto ``scale * {-s..s} / s`` (QSGD, TernGrad).

    Subclasses give ``(s, norm)`` through :meth:`grid` and may transform the input in
    :meth:`prepare` (TernGrad's clipping).
    """

    codings = ("fixed", "elias", "entropy")
    symmetric = True

    def grid(self) -> tuple[int, str]:
        """``(s, norm)``: levels per sign and the bucket statistic that scales the grid."""
        raise NotImplementedError

    def prepare(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensor actually quantized (default: ``flat`` itself)."""
        return flat

    def checks_finite(self) -> bool:
        """With max scaling and no clipping: a bucket's max is finite exactly when the bucket is."""
        return self.grid()[1] == "max" and not getattr(self, "clip", None)

    def num_symbols(self) -> int:
        return 2 * self.grid()[0] + 1

    def error_bound(self, numel: int) -> float:
        """``omega``: ``min(d / 4s^2, sqrt(d) / s)`` per bucket of ``d`` (QSGD's Lemma 3.1 argument).

        Each element's rounding variance is at most ``step^2 / 4`` and at most ``step |v_i|``, with
        ``step = m / s <= ||v||_2 / s``. With ``s = 1`` and the max scale (TernGrad) the error
        ``m ||v||_1 - ||v||^2`` is largest at ``v = (1, t, .., t)``: ``(sqrt(d) - 1) / 2``.
        With TernGrad's clipping the codec is biased and the bound is ``max(omega, 1)``.
        """
        s, norm = self.grid()
        d = effective_bucket_size(self.bucket_size, numel)
        omega = (math.sqrt(d) - 1) / 2 if s == 1 and norm == "max" else min(d / (4 * s * s), math.sqrt(d) / s)
        return omega if self.unbiased else max(omega, 1.0)

    def expected_error(self, flat: torch.Tensor) -> float:
        """Exact: ``sum_i step^2 f_i (1 - f_i)``, ``f_i`` the fractional part of ``|v_i| / step``."""
        if not self.unbiased:
            return self.error_bound(flat.numel())
        s, norm = self.grid()
        d = effective_bucket_size(self.bucket_size, flat.numel())
        steps = grid_steps(bucket_stat(flat, d, norm, self.uses_kernels(flat)), s)
        step = torch.from_numpy(steps).to(flat.device, torch.float64)[:, None]
        t = to_buckets(flat, d).double().abs() / torch.where(step > 0, step, torch.ones_like(step))
        frac = t - torch.floor(t)
        return relative_error((step * step * frac * (1 - frac)).sum(), flat)

    def fuses(self, rotation) -> bool:
        """Fixed-width coding on the CPU kernels with buckets that tile the chunks rotates as it goes."""
        d = effective_bucket_size(self.bucket_size, rotation.padded)
        clipped = getattr(self, "clip", None)
        return self.coding == "fixed" and self.uses_kernels() and kernels.CHUNK % d == 0 and not clipped

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        s, norm = self.grid()
        if self.rotation is not None:  # the kernels rotate each chunk first (see fuses)
            d = effective_bucket_size(self.bucket_size, self.rotation.padded)
            scales, packed = kernels.scale_round_pack(
                flat.numpy(), d, s, kernel_key(seed), packed_width, norm == "l2", self.rotation
            )
            return Quantized([scales], packed=packed)
        flat = self.prepare(flat)
        d = effective_bucket_size(self.bucket_size, flat.numel())
        check = self.checks_finite()
        if not self.uses_kernels(flat):
            scales = bucket_stat(flat, d, norm, use_kernels=False)
            if check:
                require_finite(scales)
            codes = kernels.torch_round_codes(flat, d, grid_steps(scales, s), s, seed)
            return Quantized([scales], symbols=codes.cpu().numpy().astype(np.uint16))
        x = flat.numpy()
        key = kernel_key(seed)
        if packed_width is not None and kernels.CHUNK % d == 0:
            scales, packed = kernels.scale_round_pack(x, d, s, key, packed_width, norm == "l2")
            if check:
                require_finite(scales)
            return Quantized([scales], packed=packed)
        scales = bucket_stat(flat, d, norm, use_kernels=True)
        if check:
            require_finite(scales)
        steps = grid_steps(scales, s)
        if packed_width is not None:
            return Quantized([scales], packed=kernels.round_pack(x, d, steps, s, key, packed_width))
        if self.wants_counts():
            codes, counts = kernels.round_codes(x, d, steps, s, key, count=True)
            return Quantized([scales], symbols=codes, counts=counts)
        return Quantized([scales], symbols=kernels.round_codes(x, d, steps, s, key))

    def _steps(self, side: list[np.ndarray], numel: int) -> tuple[int, np.ndarray]:
        d, scales = self.bucket_scales(side, numel)
        return d, grid_steps(scales, self.grid()[0])

    def _checked(self, values: torch.Tensor, bad: int) -> torch.Tensor:
        if bad:
            raise PayloadError(f"{self.name} payload holds {bad} symbols beyond the {self.num_symbols()} levels")
        return values

    def _kernel_checked(self, values: np.ndarray, bad: int, steps: np.ndarray) -> torch.Tensor:
        """:meth:`_checked` of a kernel's values, which are all finite when no step can overflow
        float32 (steps are checked finite): then the codec skips its pass over them."""
        self.values_finite = value_bound(steps, self.grid()[0]) <= _F32_MAX
        return self._checked(torch.from_numpy(values), int(bad))

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        if self.rotation is not None:
            raise RuntimeError(f"{self.name}: a quantizer bound to a rotation decodes packed symbols only")
        s = self.grid()[0]
        d, steps = self._steps(side, numel)
        if self.uses_kernels():
            codes = np.ascontiguousarray(
                symbols, dtype=symbols.dtype if symbols.dtype in (np.uint8, np.uint16) else np.uint16
            )
            return self._kernel_checked(*kernels.codes_dequant(codes, d, steps, s), steps)
        codes = torch.from_numpy(np.asarray(symbols).astype(np.int32))
        return self._checked(*kernels.torch_dequantize(codes, d, steps, s))

    def dequantize_packed(self, side, packed, width, numel, seed) -> torch.Tensor:
        if self.rotation is None and not self.uses_kernels():
            return super().dequantize_packed(side, packed, width, numel, seed)
        d, steps = self._steps(side, numel)
        require_items(packed, packed_size(numel, width), "packed symbols")
        values, bad = kernels.unpack_dequant(packed, numel, d, steps, self.grid()[0], width, self.rotation)
        if self.rotation is not None:  # (rotation.finite says what the kernel found)
            return self._checked(torch.from_numpy(values), int(bad))
        return self._kernel_checked(values, bad, steps)

    def defers_packed(self) -> bool:
        """Decoded values can be deferred (:class:`GridValues`) where the kernels run."""
        return self.uses_kernels()

    def defer_packed(self, side, packed, width, numel, seed) -> GridValues:
        d, steps = self._steps(side, numel)
        require_items(packed, packed_size(numel, width), "packed symbols")
        return GridValues(self, packed, numel, d, steps, width)


_F32_MAX = float(np.finfo(np.float32).max)


class GridValues(DeferredValues):
    """A scaled grid's decoded values, computed from its packed symbols in every pass
    (:mod:`fedquant.codecs.kernels.grid_sums`)."""

    def __init__(
        self, quantizer: ScaledGridQuantizer, packed: np.ndarray, numel: int, d: int, steps: np.ndarray, width: int
    ) -> None:
        self.quantizer = quantizer
        self.packed = packed
        self.numel = numel
        self.d = d
        self.steps = steps
        self.width = width
        self.s = quantizer.grid()[0]
        self._squares: float | None = None  # sum(u**2), once accumulate has checked the symbols
        self.bound = value_bound(steps, self.s)

    def accumulate(self, base, consensus, weighted, weight, base_bound=None) -> tuple[float, int]:
        check = base_bound is None or not base_bound + self.bound <= _F32_MAX
        squares, top, nonfinite = grid_sums.packed_accumulate(
            self.packed, self.numel, self.d, self.steps, self.s, self.width, base, consensus, weighted, weight, check
        )
        if top > 2 * self.s:
            q = self.quantizer
            raise PayloadError(f"{q.name} payload holds symbols beyond the {q.num_symbols()} levels (up to {top})")
        self._squares = float(squares)
        return self._squares, int(nonfinite)

    def dot_terms(self, consensus) -> tuple[float, float]:
        if self._squares is None:  # not checked yet: the values written out check them
            return dot_terms(self.materialize().numpy(), consensus)
        dot = grid_sums.packed_dot(self.packed, self.numel, self.d, self.steps, self.s, self.width, consensus)
        return float(dot), self._squares

    def materialize(self) -> torch.Tensor:
        values, bad = kernels.unpack_dequant(self.packed, self.numel, self.d, self.steps, self.s, self.width)
        return self.quantizer._checked(torch.from_numpy(values), int(bad))


class QSGDQuantizer(LevelsLadder, ScaledGridQuantizer):
    """QSGD (Alistarh et al., NeurIPS 2017): unbiased stochastic rounding to ``s`` levels per sign.

    Each bucket ``v`` of ``bucket_size`` elements is sent as one float32 scale ``m`` (``max |v_i|``
    with ``norm="max"``, the paper's practical variant, or ``||v||_2`` with ``norm="l2"``, the
    quantizer ``Q_s`` of the theory) and one signed level ``q_i`` in ``{-s..s}`` per element, drawn
    so that ``E[q_i m / s] = v_i``: with ``a = |v_i| s / m``, ``|q_i|`` is ``floor(a) + 1`` with
    probability ``a - floor(a)`` and ``floor(a)`` otherwise.

    Error: ``E||Q(v) - v||^2 = (m / s)^2 sum_i p_i (1 - p_i)``, which for ``norm="l2"`` is at most
    ``min(d / s^2, sqrt(d) / s) ||v||^2`` (Lemma 3.1).

    Defaults: ``levels=16`` (what the paper's arithmetic calls "4-bit": ``sqrt(512) / 2**4``),
    ``bucket_size=512``, ``norm="max"`` (the setting of the paper's experiments) and
    ``coding="fixed"``; ``coding="elias"`` is the paper's Code_s.
    """

    name = "qsgd"
    params = {
        "levels": Param(int, 16, "s: nonzero magnitude levels per sign", minimum=1, maximum=32767),
        "bucket_size": Param(int, 512, "elements per bucket with its own scale; 0 = whole tensor", minimum=0),
        "norm": Param(str, "max", "bucket scale: max |v| (practice) or the L2 norm (theory)", choices=("max", "l2")),
    }
    unbiased = True
    paper = "Alistarh et al. 2017, QSGD"
    wire = "float32 scale per bucket + signed level per element (fixed width, Elias Code_s or entropy coded)"

    def grid(self) -> tuple[int, str]:
        return self.levels, self.norm


class TernGradQuantizer(ScaledGridQuantizer):
    """TernGrad (Wen et al., NeurIPS 2017): stochastic ternarization with a max-norm scaler.

    Each bucket ``v`` (after optional clipping) is sent as one float32 scaler ``m = max |v_i|`` and
    one ternary ``t_i`` in ``{-1, 0, 1}`` per element with ``P(t_i = sign(v_i)) = |v_i| / m``, so
    ``E[m t_i] = v_i`` and the error is ``E||Q(v) - v||^2 = m ||v||_1 - ||v||_2^2``: QSGD with
    ``s = 1`` and max scaling, on the same kernels.

    * ``bucket_size``: elements per scaler (default 512, the per-bucket scalers of Xu et al.);
      ``0`` gives TernGrad's layer-wise scaler (one per tensor).
    * ``clip``: clip to ``[-c sigma, c sigma]`` before ternarizing, sigma the standard deviation
      of the whole tensor (TernGrad uses ``c = 2.5``); off by default. The scaler is then the max
      of the clipped bucket (as GRACE does; TernGrad's code uses ``c sigma`` itself), and the
      quantizer is unbiased only with respect to the clipped tensor.
    * ``coding``: ``"fixed"`` packs ``t + 1`` at 2 bits (TernGrad's practice), ``"entropy"``
      codes the three symbols with rANS (at most about ``log2(3)`` bits, much less when most
      entries ternarize to 0), ``"elias"`` with Code_s.
    """

    name = "terngrad"
    params = {
        "bucket_size": Param(int, 512, "elements per scaler; 0 = one scaler per tensor (layer-wise)", minimum=0),
        "clip": Param(
            float, None, "clip at clip x sigma before ternarizing (TernGrad uses 2.5); none = off", minimum=0.0
        ),
    }
    unbiased = True
    paper = "Wen et al. 2017, TernGrad"
    wire = "float32 scaler per bucket + ternary per element (2 bits, Elias or entropy coded)"

    def _validate(self) -> None:
        self.unbiased = not self.clip

    def grid(self) -> tuple[int, str]:
        return 1, "max"

    def prepare(self, flat: torch.Tensor) -> torch.Tensor:
        return clip_sigma(flat, self.clip).contiguous() if self.clip else flat
