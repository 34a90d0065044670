"""The side-information kind of codec: its decoder needs an estimate of the tensor (NDQSG).

A nested quantizer sends only where each value sits inside a coarse cell; the decoder picks the
cell from side information ``y``, its own estimate of the tensor (on the server: the mean of
the updates decoded before it in the round). Such a quantizer subclasses
:class:`SideInfoQuantizer`, and :func:`~fedquant.codecs.get_codec` then builds a
:class:`SideInfoCodec`, whose ``decode`` requires ``side_info``. Everything else in the
pipeline is the generic one; the server side of the seam (who provides ``y``, in which order)
is :mod:`fedquant.strategies.side_info`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from fedquant.codecs.codec import Codec
from fedquant.codecs.quantizers.base import Quantizer
from fedquant.errors import PayloadError


class SideInfoQuantizer(Quantizer):
    """Base of the quantizers whose ``dequantize`` reads side information (``self.side_info``).

    The codec hands it over with :meth:`with_side_info` on a copy, rotated to the quantizer's
    coordinates; ``side_info`` is None on the quantizer itself.
    """

    side_info: torch.Tensor | None = None
    needs_side_info = True

    def with_side_info(self, side_info: torch.Tensor) -> SideInfoQuantizer:
        """A copy that decodes against ``side_info`` (flat float32, the quantizer's numel)."""
        bound = copy.copy(self)
        bound.side_info = side_info
        return bound


class SideInfoCodec(Codec):
    """A codec whose decoder needs side information: ``decode(payload, seed, side_info, ...)``.

    On the client, error feedback decodes against the exact value (the encoder knows it); a
    stateless encoder measures no error (``measurable`` False), since its decoder's error
    depends on side information only the server has.
    """

    needs_side_info = True
    measurable = False

    def _body_quantizer(
        self, numel: int, seed: int, side_info: torch.Tensor | None, transforms: int | None = None
    ) -> Quantizer:
        if side_info is None:
            raise ValueError(f"{self.name}: decoding needs side_info (the decoder's estimate of the update)")
        side = side_info.detach().reshape(-1).to(torch.float32)
        if side.numel() != numel:
            raise PayloadError(f"{self.name} payload declares {numel} elements, its side_info has {side.numel()}")
        # Side information lives where the quantizer works: after the wire transforms, except those
        # its kernels apply themselves (a fused rotation rotates the side information too).
        for t in self.wire_transforms[:transforms]:
            side = t.forward(side.contiguous(), seed)
        return self.quantizer.with_side_info(side.contiguous())

    def _decoded_by_encoder(self, payload: bytes, seed: int, flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return self.decode(payload, seed, flat, shape=shape, device=flat.device).to(torch.float32).reshape(-1)


SideInfoQuantizer.codec_kind = SideInfoCodec
