"""Shared machinery of the codecs that send per-bucket levels plus per-element level indices.

ORQ, Linear, BinGrad-b and BinGrad-pb (Xu, Huo, Huang 2020) all choose a few levels per bucket
from the bucket's own values and send, per bucket, those levels followed by, per element, the
index of the level it was rounded to. Subclasses only say how many levels there are, how they
are chosen (a torch function for any device and a numba kernel for the CPU, giving the same
levels) and how values are rounded onto them.

Wire format of the body::

    levels    num_buckets * s values, float32 (or float16 with level_dtype="float16"),
              bucket by bucket
    indices   coding="fixed":   numel values of bit_width(s) bits, packed LSB first
                                (fedquant.wire.bitpack layout)
              coding="entropy": fedquant.wire.entropy.entropy_encode(indices, s) (count table +
                                rANS over the whole tensor's indices), to the end of the body
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from fedquant.codecs.base import Codec
from fedquant.codecs.buckets import num_buckets
from fedquant.codecs.clipping import clip_sigma
from fedquant.codecs.index_coding import coder_available
from fedquant.codecs.kernels import levels as cpu_kernels
from fedquant.codecs.params import Param
from fedquant.codecs.rounding import nearest_of_two, random_round
from fedquant.errors import PayloadError
from fedquant.rng import stream_key
from fedquant.wire.bitpack import bit_width, packed_size
from fedquant.wire.body import BodyReader, BodyWriter

FP16_MAX = 65504.0
LEVEL_DTYPES = {"float32": "<f4", "float16": "<f2"}

COMMON_PARAMS: dict[str, Param] = {
    "bucket_size": Param(int, 512, "elements per bucket; each bucket gets its own levels", minimum=1),
    "clip": Param(
        float,
        None,
        "clip at c standard deviations of the whole tensor before quantizing (TernGrad's rule, c=2.5); off when unset",
        minimum=0.0,
    ),
    "level_dtype": Param(str, "float32", "how levels travel: float32 or float16", choices=tuple(LEVEL_DTYPES)),
    "coding": Param(
        str, "fixed", "level indices: fixed width (ceil(log2 s) bits) or entropy coded", choices=("fixed", "entropy")
    ),
}


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` is encoded by the numba kernels (CPU tensors) or the torch code (others)."""
    return x.device.type == "cpu"


class LevelCodec(Codec):
    """Base of codecs that send each bucket's levels and one level index per element.

    Subclasses set ``rounding`` (``"random"``: unbiased random rounding, values outside the end
    levels clipped; ``"nearest"``: deterministic, two levels only) and ``outward_ends`` (round
    the end levels outward when they travel as float16, so that every value stays inside them
    and random rounding stays unbiased), and implement :meth:`num_levels`,
    :meth:`_levels_torch` and :meth:`_levels_cpu`.
    """

    rounding: ClassVar[str] = "random"
    outward_ends: ClassVar[bool] = True

    def _validate(self) -> None:
        if not coder_available(self.coding):
            raise ValueError(f"{self.name}: coding '{self.coding}' is not available in this installation")

    def num_levels(self) -> int:
        """Levels per bucket, ``s``."""
        raise NotImplementedError

    def _levels_torch(self, flat: torch.Tensor) -> torch.Tensor:
        """``(num_buckets, s)`` float32 levels of a non-empty flat tensor, on its device."""
        raise NotImplementedError

    def _levels_cpu(self, flat: np.ndarray) -> np.ndarray:
        """Same as :meth:`_levels_torch` with the numba kernels (CPU)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ encode
    def select_levels(self, x: torch.Tensor) -> torch.Tensor:
        """The levels this codec chooses for a flat float32 tensor (after clipping), float32.

        On the CPU the numba kernels compute them, on other devices the batched torch code;
        both give the same levels. The result is on ``x``'s device, before any float16 rounding.
        """
        if x.numel() == 0:
            return x.new_zeros((0, self.num_levels()))
        if use_cpu_kernels(x):
            return torch.from_numpy(self._levels_cpu(x.numpy()))
        return self._levels_torch(x)

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        x = clip_sigma(flat, self.clip).contiguous()
        levels = self.select_levels(x)
        wire_levels = self._wire_levels(levels.cpu().numpy())
        levels = torch.from_numpy(wire_levels.astype(np.float32)).to(x.device)
        indices = self._indices(x, levels, seed)
        out = BodyWriter()
        out.add(wire_levels)
        if self.coding == "entropy":
            from fedquant.wire.entropy import entropy_encode

            out.add(np.asarray(entropy_encode(indices, self.num_levels()), dtype=np.uint8))
        else:
            out.add(cpu_kernels.pack_indices(indices, bit_width(self.num_levels())))
        return out

    def _wire_levels(self, levels: np.ndarray) -> np.ndarray:
        """Levels as they travel (little-endian float32 or float16, with outward end rounding)."""
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

    def _indices(self, x: torch.Tensor, levels: torch.Tensor, seed: int) -> np.ndarray:
        """uint8 level index of every element (numba on the CPU, torch elsewhere)."""
        d = self.bucket_size
        if use_cpu_kernels(x):
            if self.rounding == "nearest":
                return cpu_kernels.nearest_of_two(x.numpy(), levels.numpy(), d)
            return cpu_kernels.random_round(x.numpy(), levels.numpy(), d, np.uint64(stream_key(seed)))
        if self.rounding == "nearest":
            return nearest_of_two(x, levels, d).cpu().numpy()
        return random_round(x, levels, d, seed).cpu().numpy()

    # ------------------------------------------------------------------ decode
    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        s = self.num_levels()
        nb = num_buckets(numel, self.bucket_size)
        levels = body.take_array(LEVEL_DTYPES[self.level_dtype], nb * s, "levels").astype(np.float32)
        width = bit_width(s)
        if self.coding == "entropy":
            from fedquant.wire.entropy import entropy_decode

            # One symbol per byte: the gather kernel reads them as 8-bit "packed" indices.
            data = np.ascontiguousarray(entropy_decode(body.take_rest(), numel, s), dtype=np.uint8)
            width = 8
        else:
            data = np.frombuffer(body.take(packed_size(numel, width), "level indices"), dtype=np.uint8)
        values, bad = cpu_kernels.decode_levels(data, width, levels.reshape(nb, s), self.bucket_size, numel)
        if bad:
            raise PayloadError(f"{self.name} payload holds {bad} level indices >= {s}, the number of levels")
        return torch.from_numpy(values)
