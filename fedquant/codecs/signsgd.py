"""Scaled sign (Karimireddy et al., ICML 2019): ``(||v||_1 / d) sign(v)`` per bucket.

Each bucket is sent as one float32 ``||v||_1 / d`` (``d`` the bucket's true element count, so
the short last bucket is not diluted) and one bit per element, 1 for ``v_i < 0``: ``sign(0)``
is taken as ``+1`` (as GRACE does; ``torch.sign`` would give 0, which a 1-bit code cannot send).
Deterministic and biased; the error is ``||v||^2 - ||v||_1^2 / d`` per bucket (and
``||v||^2 - (||v||_1 / d)^2 z`` more for ``z`` zero entries). Use it with error feedback
(``"ef+signsgd"``), as EF-SignSGD does.

``bucket_size=0`` gives the paper's code, one scale per tensor; the default 512 sends
``1 + 32 / 512`` bits per element. No entropy coding: the sign bits are close to 1 bit of
entropy each, so there is nothing to gain.
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.base import Codec
from fedquant.codecs.grid import bucket_scales, check_padding, check_scales, effective_bucket_size
from fedquant.codecs.kernels import grid as kernels
from fedquant.codecs.params import Param
from fedquant.wire.bitpack import pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader, BodyWriter, require_items


class SignSGDCodec(Codec):
    """Scaled sign: mean absolute value per bucket times the sign, 1 bit per element."""

    name = "signsgd"
    params = {
        "bucket_size": Param(int, 512, "elements per scale; 0 = one scale per tensor", minimum=0),
    }
    unbiased = False
    paper = "Karimireddy et al. 2019, EF-SignSGD (scaled sign)"
    wire = "float32 mean |v| per bucket + 1 sign bit per element"

    #: Set to True to run the torch implementation on CPU tensors too (tests of path equality).
    force_torch: bool = False

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        d = effective_bucket_size(self.bucket_size, flat.numel())
        use_torch = self.force_torch or flat.device.type != "cpu"
        out = BodyWriter()
        out.add_array(bucket_scales(flat, d, "l1mean", use_torch=use_torch), "<f4")
        if use_torch:
            out.add(pack_bits((flat < 0).to(torch.uint8).cpu().numpy(), 1))
        else:
            out.add(kernels.sign_pack(flat.numpy()))
        return out

    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        d = effective_bucket_size(self.bucket_size, numel)
        scales = body.take_array("<f4", -(-numel // d), "bucket scales").astype(np.float32)
        check_scales(scales, self.name)
        bits = np.frombuffer(body.take(packed_size(numel, 1), "sign bits"), np.uint8)
        check_padding(bits, numel, 1, self.name)
        if self.force_torch:
            neg = torch.from_numpy(unpack_bits(bits, 1, numel).astype(np.bool_))
            m = torch.from_numpy(scales).repeat_interleave(d)[:numel]
            return torch.where(neg, -m, m)
        require_items(bits, packed_size(numel, 1), "sign bits")  # the kernel does not check
        require_items(scales, -(-numel // d), "bucket scales")
        return torch.from_numpy(kernels.sign_unpack(bits, numel, d, scales))
