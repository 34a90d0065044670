"""NDQSG's parameter rules: ``rho`` and ``alpha`` from the spread of updates around side information.

The NDQSG quantizer (``ndqsg``, nested dithered quantization) sends each coordinate's fine bin
position inside its coarse bin; this module holds the maths that sets its parameters, Flower-free.
The server's decode plan (:class:`fedquant.strategies.nested.NestedDecodePlan`) only orchestrates:
it collects decoded updates per tensor, calls :func:`estimate_spread` and :func:`choose_parameters`,
and tells each client which codec to use for each tensor.

Model (Abdi & Fekri 2019, Alg. 2): a client's tensor is ``x = y + z`` where ``y`` is the
server's side information (the running mean of the updates it has already decoded) and ``z`` an
independent spread of per-coordinate standard deviation ``sigma_z``. With fine step ``Delta1``,
coarse step ``Delta2 = rho Delta1`` and shrinkage ``alpha`` the decoder is correct while
``|alpha z + Delta1 eps| < Delta2 / 2`` (``eps ~ U[-1/2, 1/2]`` the fine rounding error), and then
its MSE is ``(1 - alpha**2)**2 sigma_z**2 + alpha**2 Delta1**2 / 12`` (algorithms.md §5.5, derived
there and checked by Monte Carlo in the tests).

All step sizes and spreads are in the same units: gradient units, or units of ``Delta1`` when
``delta1 = 1`` (see :func:`spread_in_steps`).

Rules, from the simplest:

* :func:`choose_rho`: §5.5's margin of ``k`` standard deviations;
* :func:`choose_rho_for_variance`: wraps add at most ``max_excess`` of the MSE, Gaussian ``z``;
* :func:`empirical_rho`: the same bound on a histogram of ``|z| / Delta1`` (real updates are
  heavy-tailed: on the digits MLP wraps were 10^3-10^4 times more frequent than the Gaussian
  model predicts at the same spread);
* :func:`choose_parameters`: what the plan uses per tensor, the larger ``rho`` of the last two on
  a :class:`SpreadEstimate` with a :data:`SPREAD_MARGIN`;
* :data:`AUTHORS_LEVELS`, :data:`AUTHORS_RHO`: the authors' fixed ``(M, rho) = (3, 3)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedquant.codecs.quantizers.dither import MAX_RHO

# The authors' setting (compare_algorithms_*.py): P2 at M = 3 with rho = 3, alpha = 1.
AUTHORS_LEVELS = 3
AUTHORS_RHO = 3

# Histogram of |z| / Delta1 for the empirical wrap criterion: bins of 1/64 fine step up to 256
# steps (larger values land in the last bin, which only makes rho larger).
TAIL_BIN = 1.0 / 64
TAIL_MAX = 256.0

# spread_in_steps came out 5-8 % below the nested clients' real spread in a synthetic check
# (decoded maxima, hence steps, are a little larger than the raw ones).
SPREAD_MARGIN = 1.1


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
    sigma_z: float, delta1: float, alpha: float = 1.0, max_excess: float = 0.01, max_rho: int = MAX_RHO
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
    :func:`spread_in_steps` and by :func:`estimate_spread` (the tail histogram).
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


def nesting_saves_bits(rho: int, levels: int) -> bool:
    """Whether NDQSG at ``rho`` can send fewer bits than DQSG at the same ``levels``.

    For ``rho >= 2M + 1`` the coset index of every ``|q1| <= M`` *is* the DQSG index (same width,
    same entropy), so nesting only adds wrap-around risk. Below, the index is a function of the
    DQSG index folded onto ``rho`` values: never more entropy, fewer fixed-width bits or equal.
    """
    return rho < 2 * levels + 1


def empirical_rho(
    tail: np.ndarray,
    spread: float,
    alpha: float = 1.0,
    max_excess: float = 0.01,
    scale: float = 1.0,
    max_rho: int = MAX_RHO,
) -> int:
    """Smallest odd ``rho >= 3`` whose wrap excess, from a histogram of ``|z| / Delta1``, is within bound.

    For a coordinate with ``|z| = r Delta1`` the decoder wraps with probability
    ``clip(alpha r + 1/2 - rho/2, 0, 1)`` (the fine rounding error is uniform on ``[-1/2, 1/2]``)
    and then errs by about ``alpha rho Delta1``. The rule keeps the mean of
    ``P(wrap) (alpha rho)**2`` over the histogram (bins of ``TAIL_BIN`` from 0, counts) under
    ``max_excess`` times the MSE without wrap, ``(1 - alpha**2)**2 spread**2 + alpha**2 / 12``.
    ``scale`` multiplies every ``r`` (a safety margin; ``spread`` should include it).

    Returns
    -------
    int
        Odd ``rho``; at most the first odd value beyond every non-empty bin (where no wrap is
        left), and at most ``max_rho``.
    """
    total = int(tail.sum())
    if total == 0:
        return 3
    centers = (np.arange(tail.size) + 0.5) * TAIL_BIN * scale
    weights = tail / total
    bound = max_excess * ((1 - alpha**2) ** 2 * spread**2 + alpha**2 / 12)
    largest = float(centers[np.nonzero(tail)[0][-1]])
    last = min(max_rho, 2 * math.ceil(alpha * largest + 1) + 1)
    for rho in range(3, last + 1, 2):
        wrap = np.clip(alpha * centers + 0.5 - rho / 2, 0.0, 1.0)
        if float(weights @ wrap) * (alpha * rho) ** 2 <= bound:
            return rho
    return last


@dataclass(frozen=True)
class SpreadEstimate:
    """What one tensor's decoded updates say about the spread of the next round's nested clients.

    Attributes
    ----------
    spread : float
        ``sigma_z / Delta1`` (:func:`spread_in_steps`, without margin).
    tail : numpy.ndarray
        Histogram of the leave-one-out ``|z| / Delta1`` in bins of :data:`TAIL_BIN` (counts).
    numel : int
        Elements of the tensor.
    values : numpy.ndarray, optional
        Histogram of the updates in fine steps, ``g / Delta1`` (signed), in bins of
        :data:`TAIL_BIN` from ``-(levels + 1)``: what the rate rule predicts index entropies from.
    """

    spread: float
    tail: np.ndarray
    numel: int
    values: np.ndarray | None = None


def estimate_spread(
    updates: Sequence[torch.Tensor], levels: int, bucket_size: int, dqsg_levels: int | None = None
) -> SpreadEstimate | None:
    """Spread and tail histogram of one tensor's decoded updates (e.g. a round's DQSG group).

    Parameters
    ----------
    updates : sequence of torch.Tensor
        At least 2 decoded updates of the same tensor.
    levels, bucket_size : int
        The NDQSG codec's ``levels`` and ``bucket_size`` (0: one bucket for the whole tensor).
    dqsg_levels : int, optional
        ``levels`` of the DQSG codec the updates were decoded with (see :func:`spread_in_steps`).

    Returns
    -------
    SpreadEstimate or None
        None when there are fewer than 2 updates, they are empty, or every bucket is zero.
    """
    if len(updates) < 2 or updates[0].numel() == 0:
        return None
    d = bucket_size or updates[0].numel()
    ratios = leave_one_out_steps(updates, levels, d).abs().numpy()
    spread = spread_in_steps(updates, levels, d, dqsg_levels=dqsg_levels)
    if ratios.size == 0 or not math.isfinite(spread):
        return None
    bins = int(TAIL_MAX / TAIL_BIN)
    tail = np.bincount(np.minimum(ratios / TAIL_BIN, bins - 1).astype(np.int64), minlength=bins)
    return SpreadEstimate(spread, tail, int(updates[0].numel()), _value_histogram(updates, levels, d))


def _value_histogram(updates: Sequence[torch.Tensor], levels: int, bucket_size: int) -> np.ndarray:
    """Histogram of ``g / Delta1`` over every update, bins of ``TAIL_BIN`` on ``[-(levels + 1), levels + 1]``."""
    stacked = torch.stack([u.detach().reshape(-1).to("cpu", torch.float64) for u in updates])
    n = stacked.shape[1]
    g = torch.nn.functional.pad(stacked, (0, (-n) % bucket_size)).view(len(updates), -1, bucket_size)
    step = g.abs().amax(dim=2, keepdim=True) / levels
    keep = ((step > 0) & (torch.arange(g.shape[1] * bucket_size) < n).view(1, -1, bucket_size)).expand_as(g)
    v = (g / torch.where(step > 0, step, torch.ones_like(step)))[keep].numpy()
    bins = int(round(2 * (levels + 1) / TAIL_BIN))
    index = np.clip((v + levels + 1) / TAIL_BIN, 0, bins - 1).astype(np.int64)
    return np.bincount(index, minlength=bins)


RULES = ("variance", "rate")


def choose_parameters(
    estimate: SpreadEstimate | None,
    alpha: float | str = 1.0,
    max_excess: float = 0.01,
    max_rho: int = MAX_RHO,
    rule: str = "variance",
    levels: int | None = None,
    coding: str = "fixed",
) -> tuple[int | None, float]:
    """``(rho, alpha)`` for nested clients of one tensor, from its spread estimate.

    The spread is taken with :data:`SPREAD_MARGIN`. ``alpha="auto"`` uses :func:`optimal_alpha`
    on it (1.0 without an estimate); the result is rounded to 6 decimals, since the codec spec
    carries it as text and client and server must agree exactly.

    ``rule="variance"`` (default): ``rho`` is the larger of :func:`choose_rho_for_variance`
    (Gaussian ``z``) and :func:`empirical_rho` (the measured tail), both keeping the wrap excess
    under ``max_excess`` of the MSE: NDQSG at DQSG's error.

    ``rule="rate"``: :func:`rate_rho`, the ``rho`` with the largest predicted saving of bits
    against DQSG *at the same MSE* (wraps included), among those whose predicted wrap excess is
    at most ``max_excess``; ``2 levels + 1`` (DQSG) when none saves. Needs ``levels``, ``coding``
    and the estimate's ``values``.

    Returns
    -------
    tuple of (int or None, float)
        ``rho`` (None without an estimate) and ``alpha``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    spread = None if estimate is None else SPREAD_MARGIN * estimate.spread
    if alpha == "auto":
        alpha = optimal_alpha(spread, 1.0) if spread is not None else 1.0
    alpha = round(float(alpha), 6)
    if spread is None:
        return None, alpha
    if rule == "rate":
        if levels is None or estimate.values is None:
            raise ValueError("the rate rule needs levels and an estimate with a value histogram")
        return rate_rho(estimate, levels, coding, alpha, max_excess), alpha
    rho = choose_rho_for_variance(spread, 1.0, alpha, max_excess, max_rho)
    rho = max(rho, empirical_rho(estimate.tail, spread, alpha, max_excess, max_rho=max_rho))
    return min(rho, max_rho), alpha


# ---------------------------------------------------------------------- rate at equal MSE
def wrap_excess(tail: np.ndarray, rho: int, alpha: float = 1.0) -> float:
    """Expected MSE added by wraps, in ``Delta1**2``, from a histogram of leave-one-out ``|r| / Delta1``.

    The histogram comes from DQSG-decoded updates (:func:`estimate_spread`), so each ``r`` already
    holds a fine rounding error, uniform on ``[-1/2, 1/2]``, like the nested decoder's
    ``z + Delta1 eps``: a coordinate wraps when ``alpha |r| >= rho / 2`` (no second uniform term,
    unlike :func:`empirical_rho`, which adds one for a safety margin) and then errs by about
    ``alpha rho Delta1``. The bin that straddles ``rho / 2`` counts in proportion.
    """
    total = int(tail.sum())
    if total == 0:
        return 0.0
    low = np.arange(tail.size) * TAIL_BIN * alpha
    wrap = np.clip((low + TAIL_BIN * alpha - rho / 2) / (TAIL_BIN * alpha), 0.0, 1.0)
    return float((tail / total) @ wrap) * (alpha * rho) ** 2


def index_distribution(values: np.ndarray, levels: int, scale: float = 1.0) -> np.ndarray:
    """Probabilities of the dithered indices ``q = round(v scale + u)`` on ``-K..K``, from a histogram of ``v``.

    ``values`` is a histogram of ``v = g / Delta1`` in bins of :data:`TAIL_BIN` from
    ``-(levels + 1)``; ``scale = k / levels`` gives DQSG at ``k`` levels. With subtractive dither
    ``P(q = k | v) = max(0, 1 - |v - k|)`` (the dither spreads ``v`` over its two nearest indices).
    """
    centers = (np.arange(values.size) + 0.5) * TAIL_BIN - (levels + 1)
    v = centers * scale
    top = int(math.ceil(np.abs(v).max())) + 1
    k = np.arange(-top, top + 1)
    weights = values / max(1, int(values.sum()))
    return weights @ np.clip(1 - np.abs(v[:, None] - k[None, :]), 0, None)


def entropy_bits(p: np.ndarray) -> float:
    """Shannon entropy of a distribution in bits."""
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def folded(p: np.ndarray, rho: int) -> np.ndarray:
    """Distribution of the coset index ``q mod rho`` (centred) of an index distribution on ``-K..K``."""
    top = (p.size - 1) // 2
    out = np.zeros(rho)
    np.add.at(out, (np.arange(-top, top + 1) + rho // 2) % rho, p)
    return out


def cheapest_bits_at(points: Sequence[tuple[float, float]], target: float) -> float:
    """Fewest bits that reach MSE ``target`` by mixing two of the ``(bits, mse)`` settings.

    Sending a share of the coordinates with one setting and the rest with another reaches every
    convex combination of their points, so the curve is the lower convex hull in linear
    ``(bits, MSE)``; with fixed-width indices (DQSG's ``M = 2`` costs the 3 bits of ``M = 3``) that
    makes an MSE between two settings cheaper than the finer one. Beyond the ends the nearest hull
    segment is extended.
    """
    hull: list[tuple[float, float]] = []
    for b, m in sorted((float(b), float(m)) for b, m in points):
        if hull and m >= hull[-1][1]:  # more bits, no less error: never worth it
            continue
        while len(hull) >= 2:
            (b0, m0), (b1, m1) = hull[-2], hull[-1]
            if (m1 - m0) * (b - b0) >= (m - m0) * (b1 - b0):  # hull[-1] on or above the chord
                hull.pop()
            else:
                break
        hull.append((b, m))
    if len(hull) == 1:
        return hull[0][0]
    for k in range(1, len(hull)):
        if target >= hull[k][1] or k == len(hull) - 1:
            (b0, m0), (b1, m1) = hull[k - 1], hull[k]
            return b0 + (target - m0) * (b1 - b0) / (m1 - m0)
    raise AssertionError("unreachable")


def _index_bits(p: np.ndarray, symbols: int, coding: str) -> float:
    return entropy_bits(p) if coding == "entropy" else float(math.ceil(math.log2(symbols)))


def rate_rho(
    estimate: SpreadEstimate, levels: int, coding: str = "fixed", alpha: float = 1.0, max_excess: float = 1.0
) -> int:
    """The odd ``rho < 2 levels + 1`` that saves the most index bits against DQSG at the same MSE.

    Predicted per coordinate, in units of DQSG's MSE at ``levels`` (``Delta1**2 / 12``):

    * NDQSG at ``rho``: MSE ``12 nested_mse(alpha, spread, 1) + 12 wrap_excess(tail, rho)``; bits
      ``ceil(log2 rho)`` (``fixed``) or the entropy of the folded index distribution (``entropy``);
    * DQSG at ``k = 1 .. levels``: MSE ``(levels / k)**2``; bits ``ceil(log2(2k + 1))`` or the entropy
      of its index distribution (:func:`index_distribution` of the value histogram);

    and DQSG's bits at NDQSG's MSE by :func:`cheapest_bits_at`. Candidates whose wrap excess is
    above ``max_excess`` of the MSE are left out. The estimate's values are decoded updates (their
    dither noise makes the predicted entropies a little high for both codecs).

    Returns
    -------
    int
        The best ``rho``, or ``2 levels + 1`` (send DQSG) when no ``rho`` saves bits.
    """
    dqsg_symbols = 2 * levels + 1
    fine = index_distribution(estimate.values, levels)
    curve = []
    for k in range(1, levels + 1):
        p = fine if k == levels else index_distribution(estimate.values, levels, k / levels)
        curve.append((_index_bits(p, 2 * k + 1, coding), (levels / k) ** 2))
    spread = SPREAD_MARGIN * estimate.spread
    best, best_saving = dqsg_symbols, 0.0
    for rho in range(3, dqsg_symbols, 2):
        excess = wrap_excess(estimate.tail, rho, alpha)
        if 12 * excess > max_excess:
            continue
        mse = 12 * nested_mse(alpha, spread, 1.0) + 12 * excess
        saving = cheapest_bits_at(curve, mse) - _index_bits(folded(fine, rho), rho, coding)
        if saving > best_saving:
            best, best_saving = rho, saving
    return best
