"""Monte Carlo helpers for the stochastic grid codecs (QSGD, TernGrad).

One encode of ``R`` copies of a vector ``v`` (one bucket per copy) gives ``R`` independent
quantizations of ``v``: every copy has the same scale, and its elements draw different uniforms
because the counter of the random stream is the element's global index.
"""

from __future__ import annotations

import numpy as np
import torch


def quantize_copies(codec, v: torch.Tensor, copies: int, seed: int = 7) -> torch.Tensor:
    """Decoded ``(copies, d)`` quantizations of ``v`` (the codec's bucket_size must be ``len(v)``)."""
    assert codec.bucket_size == v.numel()
    x = v.repeat(copies)
    return codec.decode(codec.encode(x, seed=seed), seed=seed).view(copies, -1)


def rounding_moments(v: torch.Tensor, step: float) -> tuple[np.ndarray, float, float]:
    """Per-element variance, expected squared error and variance of the squared error.

    Rounding ``|v_i| / step`` up with probability ``p_i`` (its fractional part) gives an error
    ``D_i`` equal to ``step (1 - p_i)`` w.p. ``p_i`` and ``-step p_i`` otherwise, so
    ``Var D_i = step^2 p_i (1 - p_i)`` and ``Var D_i^2 = step^4 p_i (1 - p_i) (1 - 2 p_i)^2``.
    """
    t = v.double().abs().numpy() / np.float64(np.float32(step))
    p = t - np.floor(t)
    var = step**2 * p * (1 - p)
    var_sq = step**4 * p * (1 - p) * (1 - 2 * p) ** 2
    return var, float(var.sum()), float(var_sq.sum())


def assert_unbiased_with_exact_variance(q: torch.Tensor, v: torch.Tensor, step: float) -> float:
    """Check the Monte Carlo mean and squared error of ``q`` (copies x d) against theory.

    The mean of ``R`` copies has standard deviation ``sqrt(Var D_i / R)``; we allow 5 of them
    (plus float32 rounding), a false alarm probability below 64 * 6e-7 per call. Likewise the mean
    squared error is compared with the exact ``sum Var D_i`` within 5 standard deviations
    ``sqrt(sum Var D_i^2 / R)``. Returns the measured mean squared error.
    """
    copies = q.shape[0]
    var, expected_err, var_err = rounding_moments(v, step)
    mean = q.double().mean(0).numpy()
    vd = v.double().numpy()
    tol = 5 * np.sqrt(var / copies) + 1e-6 * np.abs(vd) + 1e-12
    assert np.all(np.abs(mean - vd) <= tol), np.max(np.abs(mean - vd) / tol)
    err = ((q.double() - v.double()) ** 2).sum(1).mean().item()
    assert abs(err - expected_err) <= 5 * np.sqrt(var_err / copies) + 1e-9 * expected_err
    return err
