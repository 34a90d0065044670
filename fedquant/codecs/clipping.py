"""TernGrad's gradient clipping, shared by the codecs that offer ``clip=c``."""

from __future__ import annotations

import torch


def clip_sigma(flat: torch.Tensor, c: float | None) -> torch.Tensor:
    """Clip a tensor's entries to ``[-c*sigma, c*sigma]``, sigma = its standard deviation.

    TernGrad (Wen et al. 2017, §3.3) clips each layer's gradient at ``c = 2.5`` standard
    deviations before ternarizing; Xu et al. (2020) apply the same rule to BinGrad and ORQ. sigma
    is the population standard deviation of the whole tensor (one layer), as in TernGrad's code.

    Parameters
    ----------
    flat : torch.Tensor
        The tensor (any shape).
    c : float or None
        Clip factor; ``None`` or ``0`` returns ``flat`` unchanged, and so does a tensor with
        fewer than two elements or a constant one (sigma = 0), which clipping would zero.
    """
    if not c or flat.numel() < 2:
        return flat
    sigma = flat.std(correction=0)
    if not bool(sigma > 0):
        # A constant tensor has sigma = 0: clipping it at 0 would erase it, so leave it as is.
        return flat
    bound = c * sigma
    return torch.clamp(flat, -bound, bound)
