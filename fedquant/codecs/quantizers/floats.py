"""Float baselines: ``fp32`` (lossless for float32 input) and ``fp16`` (a cast). No symbol stream."""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.quantizers.base import Quantized, Quantizer, SideField

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

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        return Quantized([flat.cpu().numpy()])


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
