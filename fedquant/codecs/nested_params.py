"""Parameter rules and side information for nested dithered quantization (NDQSG), Flower-free.

Model (Abdi & Fekri 2019, Alg. 2): a client's tensor is ``x = y + z`` where ``y`` is the
server's side information (the running mean of the updates it has already decoded) and ``z`` an
independent spread of per-coordinate standard deviation ``sigma_z``. With fine step ``Delta1``,
coarse step ``Delta2 = rho Delta1`` and shrinkage ``alpha`` the decoder is correct while
``|alpha z + Delta1 eps| < Delta2 / 2`` (``eps ~ U[-1/2, 1/2]`` the fine rounding error), and then
its MSE is ``(1 - alpha**2)**2 sigma_z**2 + alpha**2 Delta1**2 / 12`` (algorithms.md §5.5, derived
there and checked here by Monte Carlo in the tests).

All step sizes and spreads are in the same units: gradient units, or units of ``Delta1`` when
``delta1 = 1`` (see :func:`spread_in_steps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _check(sigma_z: float, delta1: float, alpha: float = 1.0) -> None:
    if not (math.isfinite(sigma_z) and sigma_z >= 0):
        raise ValueError(f"sigma_z must be a finite number >= 0, got {sigma_z}")
    if not (math.isfinite(delta1) and delta1 > 0):
        raise ValueError(f"delta1 must be a finite number > 0, got {delta1}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")


def choose_rho(sigma_z: float, delta1: float, alpha: float = 1.0, k: float = 3.0) -> int:
    """Smallest odd ``rho >= 3`` with ``Delta2 / 2 >= alpha k sigma_z + Delta1 / 2`` (§5.5).

    The condition guarantees correct decoding whenever ``|z| <= k sigma_z``: the worst fine
    rounding error adds ``Delta1 / 2``. For Gaussian ``z`` the wrap-around rate is then below
    ``P(|z| > k sigma_z)`` (0.27 % for ``k = 3``, 6e-5 for ``k = 4``); each wrap adds an error of
    about ``alpha Delta2``, so matching DQSG's variance closely may need ``k`` near 4 (see
    :func:`wrap_probability` and ``benchmarks/nested_rate_distortion.py``).

    Parameters
    ----------
    sigma_z : float
        Spread of the client's tensor around the side information (per coordinate).
    delta1 : float
        Fine step, same units as ``sigma_z``.
    alpha : float
        Shrinkage in (0, 1].
    k : float
        Margin in standard deviations (> 0).

    Returns
    -------
    int
        Odd ``rho >= 3``; ``ceil(log2(rho))`` bits per coordinate on the wire.
    """
    _check(sigma_z, delta1, alpha)
    if not (math.isfinite(k) and k > 0):
        raise ValueError(f"k must be a finite number > 0, got {k}")
    # rho >= 2 alpha k sigma_z / delta1 + 1; the tolerance keeps exact integers (7.000000001) at 7
    need = math.ceil(2 * alpha * k * sigma_z / delta1 + 1 - 1e-9)
    rho = max(3, need)
    return rho if rho % 2 else rho + 1


def choose_rho_for_variance(
    sigma_z: float, delta1: float, alpha: float = 1.0, max_excess: float = 0.01, max_rho: int = (1 << 16) - 1
) -> int:
    """Smallest odd ``rho >= 3`` whose expected wrap-around excess is at most ``max_excess`` of the MSE.

    A wrap moves the estimate by about ``alpha Delta2 = alpha rho Delta1``, so wraps add about
    ``wrap_probability * (alpha rho Delta1)**2`` to the per-coordinate MSE. This rule keeps that
    below ``max_excess * nested_mse(alpha, sigma_z, delta1)`` for Gaussian ``z``. Unlike a fixed
    ``k`` it accounts for the excess growing with ``rho**2``: ``choose_rho``'s ``k = 3`` lets the
    MSE grow by up to about 45 % once ``sigma_z`` approaches ``Delta1`` (see the benchmark
    ``benchmarks/nested_rate_distortion.py``). Starts from ``choose_rho(..., k=3)`` and steps by 2.

    Returns
    -------
    int
        Odd ``rho``, at most ``max_rho`` (returned when even it does not meet the target).
    """
    if not max_excess > 0:
        raise ValueError(f"max_excess must be > 0, got {max_excess}")
    rho = choose_rho(sigma_z, delta1, alpha, k=3.0)
    target = max_excess * nested_mse(alpha, sigma_z, delta1)
    while rho + 2 <= max_rho and wrap_probability(alpha, sigma_z, delta1, rho) * (alpha * rho * delta1) ** 2 > target:
        rho += 2
    return min(rho, max_rho)


def optimal_alpha(sigma_z: float, delta1: float, min_alpha: float = 1e-3) -> float:
    """MSE-minimizing shrinkage ``alpha = sqrt(1 - Delta1**2 / (24 sigma_z**2))``, within ``[min_alpha, 1]``.

    When ``sigma_z <= Delta1 / sqrt(24)`` the side information alone is better than any
    quantized refinement and the unconstrained optimum is ``alpha -> 0`` (estimate ``y``); the
    result is then ``min_alpha``.
    """
    _check(sigma_z, delta1)
    if not 0 < min_alpha <= 1:
        raise ValueError(f"min_alpha must be in (0, 1], got {min_alpha}")
    if sigma_z == 0:
        return min_alpha
    a2 = 1.0 - delta1**2 / (24.0 * sigma_z**2)
    return min(1.0, max(min_alpha, math.sqrt(max(a2, 0.0))))


def nested_mse(alpha: float, sigma_z: float, delta1: float) -> float:
    """Per-coordinate MSE ``(1 - alpha**2)**2 sigma_z**2 + alpha**2 Delta1**2 / 12`` without wrap-around."""
    _check(sigma_z, delta1, alpha)
    return (1.0 - alpha**2) ** 2 * sigma_z**2 + alpha**2 * delta1**2 / 12.0


def wrap_probability(alpha: float, sigma_z: float, delta1: float, rho: int) -> float:
    """Probability of a wrap-around, ``P(|alpha z + Delta1 eps| >= rho Delta1 / 2)``, for Gaussian ``z``.

    Exact for ``z ~ N(0, sigma_z**2)`` and ``eps ~ U[-1/2, 1/2]`` independent (the dither makes
    ``eps`` uniform and independent of ``z``): the CDF of ``w + e`` with ``w ~ N(0, s**2)``,
    ``e ~ U[-h1, h1]`` is ``(G(c + h1) - G(c - h1)) / (2 h1)`` with ``G(t) = t Phi(t/s) + s phi(t/s)``.
    """
    _check(sigma_z, delta1, alpha)
    half = rho * delta1 / 2.0
    h1 = delta1 / 2.0
    s = alpha * sigma_z
    if s == 0:
        return 0.0 if h1 < half else 1.0

    def big_g(t: float) -> float:
        return t * 0.5 * math.erfc(-t / (s * math.sqrt(2))) + s * math.exp(-0.5 * (t / s) ** 2) / math.sqrt(2 * math.pi)

    upper_tail = 1.0 - (big_g(half + h1) - big_g(half - h1)) / (2 * h1)
    return min(1.0, max(0.0, 2.0 * upper_tail))


def spread_in_steps(
    updates: Sequence[torch.Tensor], levels: int, bucket_size: int, dqsg_levels: int | None = None
) -> float:
    """Estimate ``sigma_z / Delta1`` of a nested client decoded against the mean of ``m >= 2`` updates.

    Model: each decoded update is ``g_p = g + nu_p + q_p`` with client spread ``nu_p``
    (variance ``s2``) and quantization noise ``q_p`` (variance ``qv``, known for DQSG:
    ``step**2 / 12``). A nested client's raw update ``g + nu`` against the mean ``y`` of the ``m``
    decoded updates has spread ``sigma_z**2 = s2 + (s2 + qv) / m``.

    Estimate: each ``g_p`` is compared with the mean of the others (leave-one-out), the
    difference divided, bucket by bucket, by the fine step ``max|g_p| / levels`` of an NDQSG client
    with the same ``levels`` and ``bucket_size``; the mean square ``L`` of these ratios estimates
    ``(s2 + qv) m / (m - 1)``. With ``dqsg_levels`` (the updates were decoded from DQSG at that
    ``M``), ``qv = (levels / dqsg_levels)**2 / 12`` in fine steps is removed from ``s2``; without it
    ``qv`` is taken as 0, which overstates the spread (a larger, safer ``rho``). Buckets whose step
    is 0 are left out. In a synthetic check (4 DQSG updates at ``M = 3``, 4 nested clients) the
    estimate came out 5-8 % below the spread the nested clients really had (the decoded maxima,
    hence the steps, are a little larger than the raw ones): leave a margin when choosing ``rho``.

    Parameters
    ----------
    updates : sequence of torch.Tensor
        Decoded updates of the same shape (e.g. those of the DQSG group this round).
    levels, bucket_size : int
        The NDQSG codec's ``levels`` and ``bucket_size``.
    dqsg_levels : int, optional
        ``levels`` of the DQSG codec the updates were decoded with.

    Returns
    -------
    float
        ``sigma_z / Delta1``, for ``choose_rho(spread, 1.0, ...)`` or ``choose_rho_for_variance``.
    """
    m = len(updates)
    if m < 2:
        raise ValueError(f"estimating the spread needs at least 2 updates, got {m}")
    ratios = leave_one_out_steps(updates, levels, bucket_size)
    if not ratios.numel():
        return 0.0
    total = float((ratios**2).mean()) * (m - 1) / m  # s2 + qv
    qv = (levels / dqsg_levels) ** 2 / 12 if dqsg_levels else 0.0
    return math.sqrt(max(total - qv, 0.0) + total / m)


def leave_one_out_steps(updates: Sequence[torch.Tensor], levels: int, bucket_size: int) -> torch.Tensor:
    """``(g_p - mean of the other updates) / Delta1`` of every coordinate, flat, float64.

    ``Delta1 = max|g_p| / levels`` per bucket of ``g_p`` (an NDQSG client's fine step with these
    ``levels`` and ``bucket_size``); coordinates of buckets whose step is 0 are left out. Used by
    :func:`spread_in_steps` and by the NDQSG server plan's wrap-around tail estimate.
    """
    m = len(updates)
    stacked = torch.stack([u.detach().reshape(-1).to("cpu", torch.float64) for u in updates])
    n = stacked.shape[1]
    z = stacked - (stacked.sum(0, keepdim=True) - stacked) / (m - 1)
    pad = (-n) % bucket_size
    g = torch.nn.functional.pad(stacked, (0, pad)).view(m, -1, bucket_size)
    z = torch.nn.functional.pad(z, (0, pad)).view(m, -1, bucket_size)
    step = g.abs().amax(dim=2, keepdim=True) / levels
    real = (torch.arange(g.shape[1] * bucket_size) < n).view(1, -1, bucket_size)
    keep = ((step > 0) & real).expand_as(z)
    return (z / torch.where(step > 0, step, torch.ones_like(step)))[keep]


class RunningMean:
    """Running mean of decoded updates in arrival order (the authors' ``AggregationNode``).

    ``add(x)`` sets ``mean <- mean + (x - mean) / count``, the same recursion as the authors'
    ``g <- g / cnt + (1 - 1/cnt) g_prev``. :meth:`side_info` is what the server hands the nested
    decoder of the next client: the current mean, or zeros before anything was decoded (as in
    the authors' code).

    Parameters
    ----------
    dtype : torch.dtype
        Accumulation dtype (float64 by default, so that long rounds do not drift).
    """

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype
        self.count = 0
        self._mean: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        """Fold one decoded update in."""
        x = x.detach().to(self.dtype)
        if self._mean is None:
            self._mean = x.clone()
        else:
            if x.shape != self._mean.shape:
                raise ValueError(f"RunningMean: update of shape {list(x.shape)}, mean has {list(self._mean.shape)}")
            self._mean += (x.to(self._mean.device) - self._mean) / (self.count + 1)
        self.count += 1

    @property
    def mean(self) -> torch.Tensor | None:
        """The mean of the updates added so far (``None`` before the first)."""
        return self._mean

    def side_info(self, like: torch.Tensor) -> torch.Tensor:
        """Side information for a tensor shaped like ``like``: the mean, or zeros when empty."""
        if self._mean is None:
            return torch.zeros(like.shape, dtype=torch.float32)
        if self._mean.shape != like.shape:
            raise ValueError(f"RunningMean: asked for shape {list(like.shape)}, mean has {list(self._mean.shape)}")
        return self._mean.to(torch.float32)

    def reset(self) -> None:
        """Forget everything (start of a round)."""
        self.count = 0
        self._mean = None
