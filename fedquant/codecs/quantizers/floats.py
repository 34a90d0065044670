"""Float baselines: ``fp32`` (lossless for float32 input) and ``fp16`` (a cast). No symbol stream."""

from __future__ import annotations

import sys

import numpy as np
import torch

from fedquant.codecs.kernels.hadamard import fwht_numba, rotate_into_bytes
from fedquant.codecs.quantizers.base import Quantized, Quantizer, SideField
from fedquant.wire.body import Deferred

FP16_MAX = 65504.0


class FloatQuantizer(Quantizer):
    """Sends every element as an IEEE-754 float of the subclass's wire dtype (one side field)."""

    codings = ()
    dtype: str

    def num_symbols(self) -> int:
        return 0

    def side_fields(self, numel: int) -> list[SideField]:
        return [SideField(f"{self.name} values", self.dtype, numel)]

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        return torch.from_numpy(side[0].astype(np.float32))


class Float32Quantizer(FloatQuantizer):
    """IEEE-754 float32: the uncompressed reference (32 bits/param)."""

    name = "fp32"
    dtype = "<f4"
    unbiased = True
    paper = "baseline"
    wire = "32-bit floats"
    rate = 32.0

    def rate_ladder(self) -> tuple[Quantizer, ...]:
        return (self, Float16Quantizer())

    def error_bound(self, numel: int) -> float:
        return 0.0

    def fuses(self, rotation) -> bool:
        """On the CPU kernels, decoding rotates the payload's floats back where they lie (no copy first)."""
        return self.uses_kernels()

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        if self.rotation is not None:  # the rotated floats are written straight into the payload
            rotation, x = self.rotation, flat.numpy()

            def fill(dst: np.ndarray) -> None:
                rotation.check(rotate_into_bytes(x, dst, rotation.layout, rotation.scales, rotation.key))

            if sys.byteorder == "little":
                return Quantized([Deferred(4 * rotation.padded, fill)])
            rotated, nonfinite = fwht_numba(x, rotation.runs, rotation.key, False)
            rotation.check(nonfinite)
            return Quantized([rotated])
        return Quantized([flat.cpu().numpy()])

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        if self.rotation is None:
            return super().dequantize(side, symbols, numel, seed)
        values = np.ascontiguousarray(side[0], dtype=np.float32)  # the payload's bytes, read only
        out, nonfinite = fwht_numba(values, self.rotation.runs, self.rotation.key, True)
        self.rotation.finite = nonfinite == 0
        return torch.from_numpy(out)[: self.rotation.numel]


class Float16Quantizer(FloatQuantizer):
    """A cast to IEEE-754 half precision (16 bits/param); values beyond +-65504 saturate."""

    name = "fp16"
    dtype = "<f2"
    paper = "baseline"
    wire = "16-bit floats"
    rate = 16.0

    def error_bound(self, numel: int) -> float:
        """1: rounding to the nearest half (0 included) and saturation never move a value beyond 0.

        In the normal range the relative error is at most ``2^-22``; values below ``6e-5`` flush
        towards 0 and lose up to all of themselves.
        """
        return 1.0

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        return Quantized([flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).cpu().numpy()])
