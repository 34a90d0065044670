"""TernGrad (Wen et al., NeurIPS 2017): stochastic ternarization with a max-norm scaler.

Each bucket ``v`` (after optional clipping) is sent as one float32 scaler ``m = max |v_i|`` and
one ternary ``t_i`` in ``{-1, 0, 1}`` per element with ``P(t_i = sign(v_i)) = |v_i| / m``, so
``E[m t_i] = v_i`` and the error is ``E||Q(v) - v||^2 = m ||v||_1 - ||v||_2^2``. It is QSGD's
quantizer with ``s = 1`` and max scaling, and shares its kernels.

* ``bucket_size``: elements per scaler (default 512, the per-bucket scalers of Xu et al.);
  ``0`` gives TernGrad's layer-wise scaler (one per tensor).
* ``clip``: clip to ``[-c sigma, c sigma]`` before ternarizing, sigma the standard deviation of
  the whole tensor (TernGrad uses ``c = 2.5``); off by default. The scaler is then the max of
  the clipped bucket (as GRACE does; TernGrad's code uses ``c sigma`` itself), and the codec is
  unbiased only with respect to the clipped tensor.
* ``coding``: ``"fixed"`` packs ``t + 1`` at 2 bits (TernGrad's practice), ``"entropy"`` codes the
  three symbols with rANS under their empirical distribution (at most about ``log2(3)`` bits,
  much less when most entries ternarize to 0).
"""

from __future__ import annotations

import torch

from fedquant.codecs.clipping import clip_sigma
from fedquant.codecs.grid import ScaledGridCodec
from fedquant.codecs.index_coding import coder_available
from fedquant.codecs.params import Param


class TernGradCodec(ScaledGridCodec):
    """TernGrad: ternary levels with a max-norm scaler per bucket (or per tensor), optional clipping."""

    name = "terngrad"
    params = {
        "bucket_size": Param(int, 512, "elements per scaler; 0 = one scaler per tensor (layer-wise)", minimum=0),
        "clip": Param(
            float, None, "clip at clip x sigma before ternarizing (TernGrad uses 2.5); none = off", minimum=0.0
        ),
        "coding": Param(str, "fixed", "index stream: 2-bit packing or entropy coded", choices=("fixed", "entropy")),
    }
    unbiased = True
    paper = "Wen et al. 2017, TernGrad"
    wire = "float32 scaler per bucket + ternary per element (2 bits, or entropy coded)"

    def _validate(self) -> None:
        if not coder_available(self.coding):
            raise ValueError(f"terngrad: coding '{self.coding}' is not available in this installation")
        self.unbiased = not self.clip

    def _grid(self) -> tuple[int, str]:
        return 1, "max"

    def _prepare(self, flat: torch.Tensor) -> torch.Tensor:
        return clip_sigma(flat, self.clip).contiguous() if self.clip else flat
