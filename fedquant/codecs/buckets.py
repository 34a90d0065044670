"""Splitting a flat tensor into buckets of ``d`` elements (the last one may be short)."""

from __future__ import annotations

import torch


def num_buckets(numel: int, bucket_size: int) -> int:
    """Number of buckets of ``bucket_size`` that cover ``numel`` elements."""
    return -(-numel // bucket_size)


def to_buckets(flat: torch.Tensor, bucket_size: int, fill: float = 0.0) -> torch.Tensor:
    """View (or, when the last bucket is short, a padded copy of) ``flat`` as ``(buckets, d)``.

    Padding uses ``fill``; callers that compute per-bucket statistics which padding would change
    (means, norms over the true count, minima) must mask or use :func:`bucket_lengths`.
    """
    n = flat.numel()
    pad = (-n) % bucket_size
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), fill)])
    return flat.view(-1, bucket_size)


def bucket_lengths(numel: int, bucket_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """True element count of each bucket (all ``bucket_size`` except possibly the last)."""
    nb = num_buckets(numel, bucket_size)
    lengths = torch.full((nb,), bucket_size, dtype=torch.int64, device=device)
    if nb:
        lengths[-1] = numel - (nb - 1) * bucket_size
    return lengths
