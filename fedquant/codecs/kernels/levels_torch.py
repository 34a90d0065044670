"""Torch twin of :mod:`fedquant.codecs.kernels.levels`: per-bucket levels and rounding onto them.

The path of CUDA tensors (and of CPU tensors with ``force_torch``); the numba kernels of the CPU
path compute the same levels and indices with the same arithmetic (``tests/codecs/quantizers/test_orq.py`` and
``tests/codecs/quantizers/test_bingrad.py`` check them equal).

Level selection works on a batch of buckets at once: a ``(buckets, m)`` tensor whose rows are
sorted ascending (all rows of one call have the same length ``m``; the short last bucket of a
tensor is a separate call). There is no Python loop over buckets or elements; the only loops
run over the ``s - 2`` levels of the recursion tree or over a fixed number of search steps.
Sums are accumulated in float64 prefix sums; the selected levels are data points of the bucket
(ORQ, Linear) or float64 means cast to float32 (BinGrad).

Rounding (algorithms.md §0): unbiased random rounding sends a value ``v`` with
``l_k <= v <= l_{k+1}`` to ``l_{k+1}`` with probability ``(v - l_k) / (l_{k+1} - l_k)`` and to
``l_k`` otherwise, so ``E[Q(v)] = v``. Element ``i`` moves up iff ``u_i (l_{k+1} - l_k) < v - l_k``
(float64, no division; for ``u`` with 24 random bits the probability is exact to ``2**-24``).
The uniform variate of element ``i`` (its index in the flattened tensor) is
``fedquant.rng.uniform(seed, n)[i]``; the numba kernels draw the same numbers inline. Values
outside ``[l_0, l_{s-1}]`` are clipped to the nearest end level (which only BinGrad-pb relies
on: ORQ and Linear include the bucket's min and max).

The paper's text available to us has no equations; the formulas are the reconstruction of
``shared/reference/algorithms.md`` §4 (cited per function).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fedquant.codecs.buckets import to_buckets
from fedquant.rng import uniform

PB_MAX_SWEEPS = 20


def per_bucket(flat: torch.Tensor, bucket_size: int, select: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply a level selector to every bucket of a flat tensor.

    Parameters
    ----------
    flat : torch.Tensor
        1-D float32 tensor (any device).
    bucket_size : int
        Bucket length ``d``; the last bucket may be shorter and is selected from its own
        elements only.
    select : callable
        Maps sorted ``(buckets, m)`` rows to ``(buckets, s)`` levels.

    Returns
    -------
    torch.Tensor
        ``(num_buckets, s)`` float32 levels.
    """
    n = flat.numel()
    full = n // bucket_size
    parts = []
    if full:
        rows = flat[: full * bucket_size].view(full, bucket_size)
        parts.append(select(sorted_rows(rows)))
    if n - full * bucket_size:
        tail = flat[full * bucket_size :].view(1, -1)
        parts.append(select(sorted_rows(tail)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row of float32 ``rows`` sorted ascending as the kernels sort a bucket: ``-0.0`` before
    ``0.0`` (``torch.sort`` takes them as equal and keeps their order, and the levels picked from
    the sorted row go on the wire as bits). Sorts the order-preserving int32 keys of the values."""
    bits = rows.contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: their magnitude bits reversed
    ordered = torch.sort(keys, dim=1).values
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).view(torch.float32)


def prefix_sums(w: torch.Tensor) -> torch.Tensor:
    """``P[:, j] = sum(w[:, :j])`` in float64, shape ``(buckets, m + 1)``.

    As the kernels accumulate it, from ``+0.0``: a cumulative sum starts from ``w[:, 0]`` itself,
    which keeps a leading ``-0.0`` (the kernels' ``0.0 + -0.0`` is ``+0.0``); adding ``0.0``
    changes nothing but the sign of such zeros, which BinGrad-pb's levels otherwise inherit.
    """
    p = torch.zeros(w.shape[0], w.shape[1] + 1, dtype=torch.float64, device=w.device)
    torch.cumsum(w.to(torch.float64), dim=1, out=p[:, 1:])
    return p.add_(0.0)


def recursion_tree(s: int) -> list[tuple[int, int, int]]:
    """The greedy recursion of ORQ as ``(left, middle, right)`` level indices, parents first.

    Level 0 and level ``s - 1`` are fixed (bucket min and max); each node places level
    ``middle = (left + right) // 2`` between its already placed neighbours, then recurses into
    ``(left, middle)`` and ``(middle, right)``.
    """
    nodes: list[tuple[int, int, int]] = []
    stack = [(0, s - 1)]
    while stack:
        lo, hi = stack.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        nodes.append((lo, mid, hi))
        stack += [(lo, mid), (mid, hi)]
    return nodes


def level_schedule(s: int, refine: int = 0) -> list[tuple[int, int, int]]:
    """The greedy recursion of :func:`recursion_tree`, then ``refine`` sweeps of coordinate descent.

    A refinement step ``(k - 1, k, k + 1)`` moves level ``k`` to the variance-optimal point
    between its current neighbours (exact, so the variance never increases). ``refine=0`` is
    the paper's greedy algorithm; the paper notes that the greedy "may be further improved", and
    refinement is our extension, off by default.
    """
    return recursion_tree(s) + [(k - 1, k, k + 1) for _ in range(refine) for k in range(1, s - 1)]


def best_middle_index(w: torch.Tensor, p: torch.Tensor, il: torch.Tensor, ir: torch.Tensor) -> torch.Tensor:
    """Index of the variance-optimal middle level between data points ``w[il]`` and ``w[ir]``.

    For levels ``a = w[il] < c = w[ir]`` and the ``n = ir - il + 1`` points between them, the
    rounding variance ``V(b) = sum_{w<b} (b-w)(w-a) + sum_{w>=b} (c-w)(w-b)`` is convex and
    piecewise linear in ``b`` with slope ``j (c - a) - sum (c - w)`` when ``j`` points lie below
    ``b`` (algorithms.md §4.3/§4.4, BEST_MIDDLE). The slope turns non-negative at
    ``j* = ceil(sum(c - w) / (c - a))`` and the minimum is the ``j*``-th point. In words: the
    middle level sits at the empirical quantile ``(c - mean) / (c - a)`` of the interval.
    """
    a = w.gather(1, il[:, None])[:, 0].to(torch.float64)
    c = w.gather(1, ir[:, None])[:, 0].to(torch.float64)
    count = (ir - il + 1).to(torch.float64)
    total = p.gather(1, (ir + 1)[:, None])[:, 0] - p.gather(1, il[:, None])[:, 0]
    spread = c - a
    ok = spread > 0
    t = (count * c - total) / torch.where(ok, spread, torch.ones_like(spread))
    j = torch.ceil(t).to(torch.int64)
    pos = torch.minimum(torch.maximum(il + j - 1, il), ir)
    return torch.where(ok, pos, il)


def orq_levels(w: torch.Tensor, s: int, refine: int = 0) -> torch.Tensor:
    """ORQ-s levels by the greedy recursive algorithm (algorithms.md §4.4, bisection reading).

    Parameters
    ----------
    w : torch.Tensor
        ``(buckets, m)`` rows sorted ascending.
    s : int
        Number of levels, at least 2. The end levels are each bucket's min and max (required
        for unbiased rounding); interior levels are placed by :func:`best_middle_index`, the
        first-order optimality condition of the 3-level problem between fixed neighbours.
    refine : int
        Sweeps of coordinate descent after the greedy pass (see :func:`level_schedule`).

    Returns
    -------
    torch.Tensor
        ``(buckets, s)`` float32 levels, non-decreasing along each row, all data points.
    """
    nb, m = w.shape
    p = prefix_sums(w)
    idx = torch.empty(nb, s, dtype=torch.int64, device=w.device)
    idx[:, 0] = 0
    idx[:, s - 1] = m - 1
    for lo, mid, hi in level_schedule(s, refine):
        idx[:, mid] = best_middle_index(w, p, idx[:, lo].contiguous(), idx[:, hi].contiguous())
    return w.gather(1, idx)


def linear_indices(m: int, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of the empirical quantiles ``F^-1(k / (s-1))`` in a sorted row of ``m`` values.

    ``F^-1(q) = min{x : F(x) >= q}`` is the ``ceil(q m)``-th smallest value (the first for
    ``q = 0``), computed in integers.
    """
    k = torch.arange(s, dtype=torch.int64, device=device)
    return torch.clamp((k * m + (s - 2)) // (s - 1) - 1, min=0)


def linear_levels(w: torch.Tensor, s: int) -> torch.Tensor:
    """Linear-s levels: ``s`` equally spaced quantiles of each bucket's empirical CDF.

    The paper's naive baseline, "linearly dividing the gradient cumulative distribution"
    (algorithms.md §4.7): ``b_k = F^-1(k / (s - 1))``, so ``b_0`` = min and ``b_{s-1}`` = max.
    """
    idx = linear_indices(w.shape[1], s, w.device)
    return w[:, idx]


def two_means_levels(w: torch.Tensor) -> torch.Tensor:
    """BinGrad-b levels: the exact 1-D 2-means of each bucket (algorithms.md §4.5).

    Over every split of the sorted row into ``j`` smallest and ``m - j`` largest values, the
    within-cluster squared error is smallest where the between-cluster term
    ``S_j^2 m / (j (m - j))`` is largest (``S_j`` = sum of the ``j`` smallest values minus ``j``
    times the mean). Ties go to the smallest ``j``. Levels are the two cluster means; a bucket of
    one value gets that value twice.
    """
    nb, m = w.shape
    p = prefix_sums(w)
    if m < 2:
        return torch.cat([w, w], dim=1)
    j = torch.arange(1, m, dtype=torch.float64, device=w.device)
    mean = p[:, m : m + 1] / m
    centred = p[:, 1:m] - j * mean
    score = centred * centred / (j * (m - j))
    best = torch.argmax(score, dim=1, keepdim=True) + 1
    left = p.gather(1, best)
    b0 = left / best.to(torch.float64)
    b1 = (p[:, m : m + 1] - left) / (m - best).to(torch.float64)
    return torch.cat([b0, b1], dim=1).to(torch.float32)


def _pb_update_low(w: torch.Tensor, p: torch.Tensor, b1: torch.Tensor, steps: int) -> torch.Tensor:
    """Exact minimiser of the BinGrad-pb error over ``b0 <= b1`` with ``b1`` fixed.

    With ``k`` points ``<= b1`` and ``j`` points below ``b0`` the derivative is
    ``g_j(b0) = 2 (j b0 - P_j) - (k - j) b1 + (P_k - P_j)`` (algorithms.md §4.6,
    ``d/db0 = 2 sum_{v<b0} (b0-v) - sum_{b0<=v<=b1} (b1-v)``), non-decreasing in ``b0``. A
    binary search finds the first piece ``j`` in ``1..k`` whose right end ``e_j`` (``w_j``, or
    ``b1`` for ``j = k``) has ``g_j(e_j) >= 0``; the minimiser is its stationary point
    ``(3 P_j + (k - j) b1 - P_k) / (2 j)`` clamped to ``[w_{j-1}, e_j]`` (the clamp lands on the
    data point ``w_{j-1}`` when the derivative jumps over zero there).
    """
    nb, m = w.shape
    b1_32 = b1.to(torch.float32)
    k = torch.searchsorted(w, b1_32[:, None], right=True)[:, 0]
    pk = p.gather(1, k[:, None])[:, 0]
    b1 = b1_32.to(torch.float64)

    def right_end(j: torch.Tensor) -> torch.Tensor:
        wj = w.gather(1, torch.clamp(j, max=m - 1)[:, None])[:, 0].to(torch.float64)
        return torch.where(j < k, wj, b1)

    def slope(j: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        pj = p.gather(1, j[:, None])[:, 0]
        jf = j.to(torch.float64)
        return 2.0 * (jf * b - pj) - (k - j).to(torch.float64) * b1 + (pk - pj)

    lo = torch.ones_like(k)
    hi = k.clone()
    for _ in range(steps):
        mid = (lo + hi) // 2
        nonneg = slope(mid, right_end(mid)) >= 0
        hi = torch.where(nonneg, mid, hi)
        lo = torch.where(nonneg, lo, mid + 1)
    j = lo
    pj = p.gather(1, j[:, None])[:, 0]
    jf = j.to(torch.float64)
    stationary = (3.0 * pj + (k - j).to(torch.float64) * b1 - pk) / (2.0 * jf)
    left = w.gather(1, (j - 1)[:, None])[:, 0].to(torch.float64)
    # max then min as the kernels' Python builtins take them, the first argument on a tie: on
    # zeros of both signs torch.maximum/minimum return either, and the level's sign goes on the wire
    low = torch.where(stationary >= left, stationary, left)
    right = right_end(j)
    return torch.where(low <= right, low, right).to(torch.float32)


def partially_biased_levels(w: torch.Tensor, max_sweeps: int = PB_MAX_SWEEPS) -> torch.Tensor:
    """BinGrad-pb levels ``b0 <= b1`` minimising the clipped-plus-rounded error (algorithms.md §4.6).

    ``J = sum_{v<b0} (b0-v)^2 + sum_{b0<=v<=b1} (b1-v)(v-b0) + sum_{v>b1} (v-b1)^2``: values
    outside ``[b0, b1]`` are clipped, those inside are rounded without bias. ``J`` is convex in
    each level with the other fixed (not jointly), so the levels come from exact coordinate
    descent started at the 25 % / 75 % quantiles, until no bucket changes (at most
    ``max_sweeps`` sweeps). At the result each level satisfies its optimality condition
    ``2 sum_{v<b0} (b0-v) = sum_{b0<=v<=b1} (b1-v)`` and
    ``2 sum_{v>b1} (v-b1) = sum_{b0<=v<=b1} (v-b0)`` (up to the jump at a data point, where
    the subgradient contains zero). The ``b1`` step is the ``b0`` step on the mirrored bucket.
    """
    nb, m = w.shape
    steps = max(1, math.ceil(math.log2(m + 1))) + 1
    p = prefix_sums(w)
    wr = torch.flip(-w, dims=[1])
    pr = prefix_sums(wr)
    b0 = w[:, (m - 1) // 4].clone()
    b1 = w[:, (3 * (m - 1)) // 4].clone()
    for _ in range(max_sweeps):
        nb0 = _pb_update_low(w, p, b1, steps)
        nb1 = -_pb_update_low(wr, pr, -nb0, steps)
        done = torch.equal(nb0, b0) and torch.equal(nb1, b1)
        b0, b1 = nb0, nb1
        if done:
            break
    return torch.stack([b0, b1], dim=1)


# ---------------------------------------------------------------- rounding onto the levels
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
