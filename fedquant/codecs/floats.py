"""Float baselines: ``fp32`` (lossless for float32 input) and ``fp16`` (a cast)."""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.base import Codec
from fedquant.wire.body import BodyReader, BodyWriter

FP16_MAX = 65504.0


class Float32Codec(Codec):
    """Sends every element as an IEEE-754 float32: the uncompressed reference (32 bits/param)."""

    name = "fp32"
    unbiased = True
    paper = "baseline"
    wire = "32-bit floats"

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        out = BodyWriter()
        out.add_array(flat.cpu().numpy(), "<f4")
        return out

    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        return torch.from_numpy(body.take_array("<f4", numel, "float32 values").astype(np.float32))


class Float16Codec(Codec):
    """Casts to IEEE-754 half precision (16 bits/param); values beyond +-65504 saturate."""

    name = "fp16"
    unbiased = False
    paper = "baseline"
    wire = "16-bit floats"

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        out = BodyWriter()
        out.add_array(flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).cpu().numpy(), "<f2")
        return out

    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        return torch.from_numpy(body.take_array("<f2", numel, "float16 values").astype(np.float32))
