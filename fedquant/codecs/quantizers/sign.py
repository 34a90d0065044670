"""Scaled sign (Karimireddy et al., ICML 2019): ``(||v||_1 / d) sign(v)`` per bucket.

Body::

    scales    num_buckets float32, little-endian: ||v||_1 / d of each bucket (d its true count)
    symbols   one per element, 1 for v_i < 0 and 0 otherwise, coded by ``coding``:
              "fixed"   1 bit each, LSB first
              "entropy" rANS under the two symbols' empirical distribution

``sign(0)`` is taken as ``+1`` (as GRACE does; ``torch.sign`` would give 0, which a 1-bit code
cannot send). Deterministic and biased; the error is ``||v||^2 - ||v||_1^2 / d`` per bucket (and
``||v||^2 - (||v||_1 / d)^2 z`` more for ``z`` zero entries). Use it with error feedback
(``"ef+signsgd"``), as EF-SignSGD does.

``bucket_size=0`` gives the paper's code, one scale per tensor; the default 512 sends
``1 + 32 / 512`` bits per element. Sign bits carry close to 1 bit of entropy each, so
``coding="entropy"`` gains only on skewed updates.
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.buckets import bucket_stat, effective_bucket_size
from fedquant.codecs.kernels import grid as kernels
from fedquant.codecs.params import Param
from fedquant.codecs.quantizers.base import BucketScaledQuantizer, Quantized, require_finite
from fedquant.wire.bitpack import packed_size
from fedquant.wire.body import require_items


class SignSGDQuantizer(BucketScaledQuantizer):
    """Scaled sign: mean absolute value per bucket times the sign, one binary symbol per element."""

    name = "signsgd"
    codings = ("fixed", "entropy")  # two symbols: no symmetric alphabet for Elias
    params = {
        "bucket_size": Param(int, 512, "elements per scale; 0 = one scale per tensor", minimum=0),
    }
    unbiased = False
    paper = "Karimireddy et al. 2019, EF-SignSGD (scaled sign)"
    wire = "float32 mean |v| per bucket + 1 sign bit per element (or entropy coded)"

    def num_symbols(self) -> int:
        return 2

    def error_bound(self, numel: int) -> float:
        """``1 - 1/d``: the error ``||v||^2 - ||v||_1^2 / d`` of a bucket is at most that (``||v||_1 >= ||v||_2``)."""
        return 1.0 - 1.0 / effective_bucket_size(self.bucket_size, numel)

    def checks_finite(self) -> bool:
        """Per bucket (``bucket_size`` set, below ``2**28``) the mean ``|v|`` is finite exactly when the bucket is.

        Its float64 sum cannot overflow and rounds the mean by less than half a float32 ulp, so a
        finite bucket's mean stays at most the float32 maximum.
        """
        return 0 < self.bucket_size < 1 << 28

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        d = effective_bucket_size(self.bucket_size, flat.numel())
        use_kernels = self.uses_kernels(flat)
        if use_kernels and packed_width is not None and kernels.CHUNK % d == 0:  # means and signs in one pass
            scales, packed = kernels.l1_sign_pack(flat.numpy(), d)
            if self.checks_finite():
                require_finite(scales)
            return Quantized([scales], packed=packed)
        scales = bucket_stat(flat, d, "l1mean", use_kernels)
        if self.checks_finite():
            require_finite(scales)
        if use_kernels and packed_width is not None:
            return Quantized([scales], packed=kernels.sign_pack(flat.numpy()))
        if use_kernels:
            symbols, counts = kernels.sign_codes(flat.numpy())
            return Quantized([scales], symbols=symbols, counts=counts if self.wants_counts() else None)
        return Quantized([scales], symbols=(flat < 0).to(torch.uint8).cpu().numpy())

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        d, scales = self.bucket_scales(side, numel)
        if self.uses_kernels():
            codes = np.ascontiguousarray(symbols, dtype=np.uint8)  # checked below 2
            require_items(codes, numel, "sign symbols")
            self.values_finite = True  # +-scale, and check_side found every scale finite
            return torch.from_numpy(kernels.sign_values(codes[:numel], d, scales))
        return kernels.torch_sign_values(torch.from_numpy(np.asarray(symbols) != 0), d, scales)

    def dequantize_packed(self, side, packed, width, numel, seed) -> torch.Tensor:
        if not self.uses_kernels():
            return super().dequantize_packed(side, packed, width, numel, seed)
        d, scales = self.bucket_scales(side, numel)
        require_items(packed, packed_size(numel, 1), "sign bits")  # the kernel does not check
        self.values_finite = True  # +-scale, and check_side found every scale finite
        return torch.from_numpy(kernels.sign_unpack(packed, numel, d, scales))
