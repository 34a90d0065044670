"""Scaled uniform grids per bucket: scales, stochastic rounding, packing and the inverse.

This is the machinery shared by QSGD (``s`` levels per sign) and TernGrad (``s = 1``): each
bucket ``b`` of ``d`` elements has a float32 ``scale[b]`` and grid step ``scale[b] / s``; every
element is rounded without bias to a signed level ``q`` in ``[-s, s]`` and sent as the symbol
``q + s``.

Two implementations produce identical bytes for the same seed:

* CPU tensors go through the fused numba kernels of :mod:`fedquant.codecs.kernels`;
* tensors on other devices (CUDA) are computed with torch on the device, with the same float32
  operations in the same order and the same counter-based uniforms (:func:`fedquant.rng.uniform`);
  only the small symbol array travels to the host for bit packing.

The only operation whose result may depend on the implementation is a float64 sum (the L2 and
L1 norms): both paths round it to float32, so they differ only if the two float64 sums straddle
a float32 rounding boundary (probability about 2**-29 per bucket).
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs import index_coding
from fedquant.codecs.base import Codec
from fedquant.codecs.kernels import grid as kernels
from fedquant.errors import PayloadError
from fedquant.rng import stream_key, uniform
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader, BodyWriter, require_items


def uses_kernels(flat: torch.Tensor) -> bool:
    """Whether ``flat`` is handled by the numba kernels (CPU) or by torch on its device."""
    return flat.device.type == "cpu"


def _key(seed: int) -> np.uint64:
    return np.uint64(stream_key(seed))


# ---------------------------------------------------------------- scales
def bucket_scales(flat: torch.Tensor, d: int, norm: str, *, use_torch: bool = False) -> np.ndarray:
    """Per-bucket scale as float32 NumPy array: ``"max"`` (max |x|), ``"l2"`` or ``"l1mean"`` (||x||_1 / count)."""
    if uses_kernels(flat) and not use_torch:
        x = flat.numpy()
        if norm == "max":
            return kernels.bucket_max_abs(x, d)
        if norm == "l2":
            return kernels.bucket_l2(x, d)
        if norm == "l1mean":
            return kernels.bucket_l1_mean(x, d)
        raise ValueError(f"unknown norm {norm!r}")
    return torch_bucket_scales(flat, d, norm).cpu().numpy()


def torch_bucket_scales(flat: torch.Tensor, d: int, norm: str) -> torch.Tensor:
    """The torch version of :func:`bucket_scales` (on ``flat``'s device)."""
    n = flat.numel()
    pad = (-n) % d
    v = torch.nn.functional.pad(flat, (0, pad)).view(-1, d)
    if norm == "max":
        return v.abs().amax(dim=1)
    w = v.double()
    if norm == "l2":
        return (w * w).sum(dim=1).sqrt().float()
    if norm == "l1mean":
        counts = torch.full((v.shape[0],), float(d), dtype=torch.float64, device=flat.device)
        counts[-1] = n - (v.shape[0] - 1) * d
        return (w.abs().sum(dim=1) / counts).float()
    raise ValueError(f"unknown norm {norm!r}")


def grid_steps(scales: np.ndarray, levels: int) -> np.ndarray:
    """Grid step ``scale / s`` per bucket, in float32 (the decoder computes the same)."""
    return (scales.astype(np.float32, copy=False) / np.float32(levels)).astype(np.float32, copy=False)


# ---------------------------------------------------------------- encode
def round_pack(
    flat: torch.Tensor, d: int, steps: np.ndarray, levels: int, seed: int, width: int, *, use_torch: bool = False
) -> np.ndarray:
    """Symbols ``q + s`` of all elements packed at ``width`` bits (uint8 array)."""
    if uses_kernels(flat) and not use_torch:
        return kernels.round_pack(flat.numpy(), d, steps, levels, _key(seed), width)
    return pack_bits(torch_round_codes(flat, d, steps, levels, seed).cpu().numpy(), width)


def round_codes(
    flat: torch.Tensor, d: int, steps: np.ndarray, levels: int, seed: int, *, use_torch: bool = False
) -> np.ndarray:
    """Unpacked symbols ``q + s`` of all elements (uint16 array)."""
    if uses_kernels(flat) and not use_torch:
        return kernels.round_codes(flat.numpy(), d, steps, levels, _key(seed))
    return torch_round_codes(flat, d, steps, levels, seed).cpu().numpy().astype(np.uint16)


def torch_round_codes(flat: torch.Tensor, d: int, steps: np.ndarray, levels: int, seed: int) -> torch.Tensor:
    """Torch version of the rounding kernel, on ``flat``'s device (int32 symbols)."""
    n = flat.numel()
    device = flat.device
    step = torch.from_numpy(steps).to(device).repeat_interleave(d)[:n]
    a = flat.abs()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    t = a / safe
    f = torch.floor(t)
    up = uniform(seed, n, device=device) < (t - f)
    lvl = torch.clamp(f.clamp(max=levels).to(torch.int32) + up.to(torch.int32), max=levels)
    lvl = torch.where(step > 0, lvl, 0)
    return torch.where(flat < 0, -lvl, lvl) + levels


# ---------------------------------------------------------------- decode
def dequantize_packed(
    data: np.ndarray, n: int, d: int, steps: np.ndarray, levels: int, width: int, *, use_torch: bool = False
) -> tuple[torch.Tensor, int]:
    """Values ``(code - s) * step`` from packed symbols; also the number of symbols above ``2s``."""
    require_items(steps, -(-n // d), "bucket steps")
    if use_torch:
        codes = torch.from_numpy(unpack_bits(data, width, n).astype(np.int32))
        return torch_dequantize(codes, d, steps, levels)
    require_items(data, packed_size(n, width), "packed indices")
    values, bad = kernels.unpack_dequant(data, n, d, steps, levels, width)
    return torch.from_numpy(values), int(bad)


def dequantize_codes(codes: np.ndarray, d: int, steps: np.ndarray, levels: int) -> tuple[torch.Tensor, int]:
    """Values from unpacked symbols (as an entropy decoder returns them)."""
    require_items(steps, -(-len(codes) // d), "bucket steps")
    values, bad = kernels.codes_dequant(np.ascontiguousarray(codes, dtype=np.uint16), d, steps, levels)
    return torch.from_numpy(values), int(bad)


def torch_dequantize(codes: torch.Tensor, d: int, steps: np.ndarray, levels: int) -> tuple[torch.Tensor, int]:
    """Torch version of the decoding kernel."""
    n = codes.numel()
    step = torch.from_numpy(steps).to(codes.device).repeat_interleave(d)[:n]
    bad = int((codes > 2 * levels).sum())
    return (codes - levels).to(torch.float32) * step, bad


# ---------------------------------------------------------------- the codec skeleton
def effective_bucket_size(bucket_size: int, numel: int) -> int:
    """``bucket_size``, or the whole tensor (at least 1) when it is 0."""
    return bucket_size if bucket_size > 0 else max(numel, 1)


def check_scales(scales: np.ndarray, codec: str) -> None:
    """PayloadError unless every bucket scale is finite and non-negative."""
    if scales.size and not bool(np.all(np.isfinite(scales) & (scales >= 0))):
        raise PayloadError(f"{codec} payload holds a negative or non-finite bucket scale")


def check_padding(packed: np.ndarray, count: int, width: int, codec: str) -> None:
    """PayloadError unless the unused high bits of the last packed byte are zero."""
    used = (count * width) % 8
    if used and packed.size and int(packed[-1]) >> used:
        raise PayloadError(f"{codec} payload has nonzero padding bits after the last index")


class ScaledGridCodec(Codec):
    """Base of codecs that round each bucket onto ``scale * {-s..s} / s`` (QSGD, TernGrad).

    Body layout: ``nb`` float32 bucket scales, then the symbols ``q + s`` of all elements in the
    stream of the ``coding`` parameter: ``"fixed"`` packs them at ``bit_width(2s + 1)`` bits,
    ``"entropy"`` codes them with rANS under their own exact empirical distribution (see
    :mod:`fedquant.wire.entropy`), ``"elias"`` uses QSGD's Code_s or Code'_s (see
    :mod:`fedquant.codecs.index_coding`). Subclasses provide ``(s, norm)`` through ``_grid`` and
    may transform the input in ``_prepare`` (TernGrad's clipping). CPU tensors run the numba
    kernels, other devices the torch twins; ``force_torch`` selects the torch path on CPU too.
    """

    #: Set to True to run the torch implementation on CPU tensors too (tests of path equality).
    force_torch: bool = False

    def _grid(self) -> tuple[int, str]:
        """``(s, norm)`` of this codec."""
        raise NotImplementedError

    def _prepare(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    @property
    def symbol_width(self) -> int:
        """Bits per packed symbol with ``coding="fixed"``."""
        return bit_width(2 * self._grid()[0] + 1)

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        s, norm = self._grid()
        flat = self._prepare(flat)
        d = effective_bucket_size(self.bucket_size, flat.numel())
        use_torch = self.force_torch
        out = BodyWriter()
        coding = getattr(self, "coding", "fixed")
        if coding == "fixed" and uses_kernels(flat) and not use_torch and kernels.CHUNK % d == 0:
            scales, packed = kernels.scale_round_pack(flat.numpy(), d, s, _key(seed), self.symbol_width, norm == "l2")
            out.add_array(scales, "<f4")
            out.add(packed)
            return out
        scales = bucket_scales(flat, d, norm, use_torch=use_torch)
        steps = grid_steps(scales, s)
        out.add_array(scales, "<f4")
        if coding == "fixed":
            out.add(round_pack(flat, d, steps, s, seed, self.symbol_width, use_torch=use_torch))
        else:
            codes = round_codes(flat, d, steps, s, seed, use_torch=use_torch)
            index_coding.encode_symbols(out, codes, s, coding)
        return out

    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        s, _ = self._grid()
        d = effective_bucket_size(self.bucket_size, numel)
        nb = -(-numel // d)
        scales = body.take_array("<f4", nb, "bucket scales").astype(np.float32)
        check_scales(scales, self.name)
        steps = grid_steps(scales, s)
        coding = getattr(self, "coding", "fixed")
        if coding == "fixed":
            width = self.symbol_width
            packed = np.frombuffer(body.take(packed_size(numel, width), "packed indices"), np.uint8)
            check_padding(packed, numel, width, self.name)
            values, bad = dequantize_packed(packed, numel, d, steps, s, width, use_torch=self.force_torch)
        else:
            codes = index_coding.decode_symbols(body, numel, s, coding, self.name)
            values, bad = dequantize_codes(codes, d, steps, s)
        if bad:
            raise PayloadError(f"{self.name} payload holds {bad} indices beyond the {2 * s + 1} levels")
        return values
