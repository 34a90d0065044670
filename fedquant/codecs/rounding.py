"""Rounding each bucket's values onto that bucket's sorted levels, and the inverse (torch, any device).

Unbiased random rounding (algorithms.md §0): a value ``v`` with ``l_k <= v <= l_{k+1}`` becomes
``l_{k+1}`` with probability ``(v - l_k) / (l_{k+1} - l_k)`` and ``l_k`` otherwise, so
``E[Q(v)] = v``. Element ``i`` moves up iff ``u_i (l_{k+1} - l_k) < v - l_k`` (float64, no
division; for ``u`` with 24 random bits the probability is exact to ``2**-24``). The uniform
variate of element ``i`` (its index in the flattened tensor) is
``fedquant.rng.uniform(seed, n)[i]``; the CPU kernels draw the same numbers inline, so both paths
give identical indices. Values outside ``[l_0, l_{s-1}]`` are clipped to the nearest end level
(which only BinGrad-pb relies on: ORQ and Linear include the bucket's min and max).
"""

from __future__ import annotations

import torch

from fedquant.codecs.buckets import to_buckets
from fedquant.rng import uniform


def _bucket_view(flat: torch.Tensor, levels: torch.Tensor, bucket_size: int) -> torch.Tensor:
    nb = levels.shape[0]
    rows = to_buckets(flat, bucket_size)
    if rows.shape[0] != nb:
        raise ValueError(f"{rows.shape[0]} buckets of values but {nb} rows of levels")
    return rows


def random_round(flat: torch.Tensor, levels: torch.Tensor, bucket_size: int, seed: int) -> torch.Tensor:
    """Indices of unbiased random rounding of ``flat`` onto each bucket's levels.

    Parameters
    ----------
    flat : torch.Tensor
        1-D float32 values.
    levels : torch.Tensor
        ``(num_buckets, s)`` float32 levels, non-decreasing along each row, same device.
    bucket_size : int
        Bucket length ``d`` (the last bucket may be short).
    seed : int
        Seed of the rounding stream.

    Returns
    -------
    torch.Tensor
        ``uint8`` level indices, shape ``(numel,)``, on ``flat``'s device.
    """
    n = flat.numel()
    s = levels.shape[1]
    rows = _bucket_view(flat, levels, bucket_size)
    k = torch.searchsorted(levels.contiguous(), rows.contiguous(), right=True) - 1
    k = torch.clamp(k, 0, max(s - 2, 0))
    lo = levels.gather(1, k).to(torch.float64)
    gap = levels.gather(1, torch.clamp(k + 1, max=s - 1)).to(torch.float64) - lo
    above = (rows.to(torch.float64) - lo).reshape(-1)[:n]
    u = uniform(seed, n, device=flat.device).to(torch.float64)
    up = u * gap.reshape(-1)[:n] < above
    return (k.reshape(-1)[:n] + up.to(torch.int64)).to(torch.uint8)


def nearest_of_two(flat: torch.Tensor, levels: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Deterministic rounding onto two levels per bucket: 1 where ``v >= (b0 + b1) / 2``, else 0."""
    n = flat.numel()
    rows = _bucket_view(flat, levels, bucket_size)
    mid = (levels[:, :1].to(torch.float64) + levels[:, 1:2].to(torch.float64)) * 0.5
    bits = rows.to(torch.float64) >= mid
    return bits.reshape(-1)[:n].to(torch.uint8)


def gather_levels(indices: torch.Tensor, levels: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Decoded values: ``levels[bucket(i), indices[i]]`` for every element ``i``."""
    n = indices.numel()
    s = levels.shape[1]
    bucket = torch.arange(n, device=indices.device) // bucket_size
    return levels.reshape(-1)[bucket * s + indices.to(torch.int64)]
