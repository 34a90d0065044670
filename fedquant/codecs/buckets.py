"""Buckets of a flat tensor and their statistics: the one place every quantizer family gets them.

A flat tensor of ``n`` elements is split into buckets of ``d`` elements, the last one possibly
short (``num_buckets(n, d) = ceil(n / d)``); ``bucket_size = 0`` in a codec's parameters means
one bucket for the whole tensor (:func:`effective_bucket_size`).

Per-bucket statistics (:func:`bucket_stat`), returned as float32 NumPy arrays:

* ``"max"``: ``max |x|`` (exact);
* ``"l2"``: ``||x||_2``, summed in float64 and rounded to float32;
* ``"l1mean"``: ``||x||_1 / count``, with the true count of the short last bucket.

CPU tensors go through the numba kernels of :mod:`fedquant.codecs.kernels.common`, tensors on
other devices through the torch twin :func:`torch_bucket_stat` on their device. The two agree
bit for bit except where a float64 sum (``"l2"``, ``"l1mean"``), summed in a different order,
straddles a float32 rounding boundary (probability about 2**-29 per bucket).
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.kernels import common as kernels
from fedquant.errors import PayloadError

NORMS = ("max", "l2", "l1mean")
_KERNELS = {"max": kernels.bucket_max_abs, "l2": kernels.bucket_l2, "l1mean": kernels.bucket_l1_mean}


def num_buckets(numel: int, bucket_size: int) -> int:
    """Number of buckets of ``bucket_size`` that cover ``numel`` elements."""
    return -(-numel // bucket_size)


def effective_bucket_size(bucket_size: int, numel: int) -> int:
    """``bucket_size``, or the whole tensor (at least 1) when it is 0."""
    return bucket_size if bucket_size > 0 else max(numel, 1)


def to_buckets(flat: torch.Tensor, bucket_size: int, fill: float = 0.0) -> torch.Tensor:
    """View (or, when the last bucket is short, a padded copy of) ``flat`` as ``(buckets, d)``.

    Padding uses ``fill``; per-bucket statistics that padding would change (means, minima) must
    use the true count of the last bucket, ``numel - (buckets - 1) * d``.
    """
    n = flat.numel()
    pad = (-n) % bucket_size
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), fill)])
    return flat.view(-1, bucket_size)


def bucket_stat(flat: torch.Tensor, d: int, norm: str, use_kernels: bool) -> np.ndarray:
    """Statistic ``norm`` of each bucket of ``d`` elements of ``flat``, as a float32 NumPy array.

    Parameters
    ----------
    flat : torch.Tensor
        1-D float32, contiguous.
    d : int
        Bucket size (at least 1).
    norm : str
        ``"max"``, ``"l2"`` or ``"l1mean"`` (see the module docstring).
    use_kernels : bool
        Run the numba kernel (``flat`` must be on the CPU), else the torch twin on ``flat``'s
        device; a quantizer passes its ``uses_kernels(flat)``.
    """
    if norm not in _KERNELS:
        raise ValueError(f"unknown bucket statistic {norm!r}; expected one of {', '.join(NORMS)}")
    if use_kernels:
        return _KERNELS[norm](flat.numpy(), d)
    return torch_bucket_stat(flat, d, norm).cpu().numpy()


def torch_bucket_stat(flat: torch.Tensor, d: int, norm: str) -> torch.Tensor:
    """The torch twin of :func:`bucket_stat`: a float32 tensor on ``flat``'s device."""
    n = flat.numel()
    v = to_buckets(flat, d)
    if norm == "max":
        return v.abs().amax(dim=1)
    w = v.double()
    if norm == "l2":
        return (w * w).sum(dim=1).sqrt().float()
    if norm == "l1mean":
        counts = torch.full((v.shape[0],), float(d), dtype=torch.float64, device=flat.device)
        if v.shape[0]:
            counts[-1] = n - (v.shape[0] - 1) * d
        return (w.abs().sum(dim=1) / counts).float()
    raise ValueError(f"unknown bucket statistic {norm!r}; expected one of {', '.join(NORMS)}")


def check_bucket_scales(scales: np.ndarray, codec: str, what: str = "bucket scale") -> None:
    """PayloadError unless every decoded bucket scale (or step) is finite and non-negative."""
    if scales.size and not bool(np.all(np.isfinite(scales) & (scales >= 0))):
        raise PayloadError(f"{codec} payload holds a negative or non-finite {what}")
