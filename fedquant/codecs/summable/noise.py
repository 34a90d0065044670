"""Discrete Gaussian noise for distributed differential privacy.

:func:`discrete_gaussian` samples ``N_Z(0, sigma^2)``, ``P(x) ∝ exp(-x^2 / (2 sigma^2))`` on the
integers, by the rejection sampler of Canonne, Kamath and Steinke (NeurIPS 2020, Algorithm 3):
propose from the discrete Laplace distribution of scale ``t = floor(sigma) + 1`` (the difference
of two geometric variables, NumPy's sampler) and accept with probability
``exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2))``. The acceptance test runs in float64 (not in the
exact rational arithmetic of the paper); the noise is added to integers, so no floating-point
value of the update leaks through it (Mironov 2012's attack targets float noise on floats).

Each client draws from its own private generator: the server must not know the noise.
"""

from __future__ import annotations

import math

import numpy as np

MAX_ROUNDS = 64  # rejection rounds; each accepts at least ~half the proposals


def discrete_gaussian(rng: np.random.Generator, variance: float, size: int) -> np.ndarray:
    """``size`` iid samples of the discrete Gaussian of parameter ``sigma^2 = variance`` (int64).

    The variance of ``N_Z(0, sigma^2)`` is at most ``sigma^2`` (and within ``1e-6`` of it for
    ``sigma >= 1``).
    """
    if not (math.isfinite(variance) and variance >= 0):
        raise ValueError(f"variance must be finite and >= 0, got {variance}")
    out = np.zeros(size, dtype=np.int64)
    if variance == 0 or size == 0:
        return out
    sigma = math.sqrt(variance)
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # 1 - exp(-1/t), the geometric success probability
    filled = 0
    for _ in range(MAX_ROUNDS):
        want = size - filled
        draw = want + want // 2 + 16
        y = rng.geometric(p, draw) - rng.geometric(p, draw)
        accept = rng.random(draw) < np.exp(-((np.abs(y) - variance / t) ** 2) / (2.0 * variance))
        taken = y[accept][:want]
        out[filled : filled + taken.size] = taken
        filled += taken.size
        if filled == size:
            return out
    raise RuntimeError("discrete Gaussian sampler did not finish")  # probability < 2**-64
