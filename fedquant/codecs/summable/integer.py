"""Summable integer encoding: a client's update as integers in ``Z_{2^b}``, and the decoding of their sum.

Client (:func:`encode_update`): clip ``x`` to the grid's L2 bound, scale it by the client's
weight ``w`` in ``[0, 1]``, rotate with the round's shared signs (``rht``), divide each block by
its step, round to integers without bias, add private discrete Gaussian noise if the round asks
for it, reduce modulo ``2**bits``. Every client uses the same grid, so the rotation and the steps
are linear maps common to all and the integers simply add up:
``sum_i q_i = sum_i (y_i + e_i) + noise`` with ``y_i = H D w_i x_i / step``.

Server (:func:`decode_sum`): read the modular sum as a signed integer (correct while the true
sum stays within ``+-2**(bits-1)``, which :class:`~fedquant.codecs.summable.grid.ScaleRule`
bounds), subtract the sum of the surviving clients' dithers (subtractive dither: the server
knows each client's dither seed), multiply by the steps, divide by the weight total, rotate back.

Rounding
--------
``dither``: ``q = round(y + u)`` with ``u`` uniform on ``[-1/2, 1/2)`` from the client's seed;
``q - u - y`` is uniform on ``[-1/2, 1/2)`` and independent of ``y`` (Schuchman), so the decoded
mean has error variance ``step^2 / 12 * n / W^2`` per coordinate. ``stochastic``:
``q = floor(y + U)`` with private ``U``; unbiased, variance ``frac(1 - frac) <= 1/4`` per client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedquant.codecs.summable.grid import SumGrid
from fedquant.codecs.summable.noise import discrete_gaussian
from fedquant.codecs.transforms.rht import RandomizedHadamard
from fedquant.rng import uniform

#: A client weight as an integer ``round(w * WEIGHT_SCALE)`` (the update is scaled by it; no weight
#: travels: the secure round divides by the number of inputs). WEIGHT_BITS: its width in protocol tests.
WEIGHT_SCALE = 1 << 16
WEIGHT_BITS = 32

_ROTATION = RandomizedHadamard()


@dataclass(frozen=True)
class EncodedUpdate:
    """A client's encoding: what it masks and sends, and what it knows about it.

    Attributes
    ----------
    values : np.ndarray
        uint32, ``grid.sent_numel`` values in ``0 .. 2**bits - 1``.
    integers : np.ndarray
        int64, the same values before the modular reduction (for tests and wrap measurements;
        never sent).
    weight_units : int
        ``round(weight * WEIGHT_SCALE)``, the client's share of the weight segment.
    clipped : bool
        Whether the update's norm exceeded the clip.
    norm : float
        The update's L2 norm before clipping.
    """

    values: np.ndarray
    integers: np.ndarray
    weight_units: int
    clipped: bool
    norm: float


def weight_units(weight: float) -> int:
    """A weight in ``[0, 1]`` as the integer that the weight segment carries."""
    if not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
        raise ValueError(f"client weight must be in [0, 1], got {weight}")
    return round(weight * WEIGHT_SCALE)


def dither(seed: int, count: int) -> np.ndarray:
    """The subtractive dither of a client seed: ``count`` float64 values in ``[-1/2, 1/2)``."""
    return uniform(seed, count).numpy().astype(np.float64) - 0.5


def rotate_scaled(update: torch.Tensor, grid: SumGrid, scale: float) -> np.ndarray:
    """``H D (scale * update) / step`` as float64, ``grid.padded_numel`` long."""
    flat = update.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if flat.numel() != grid.numel:
        raise ValueError(f"update has {flat.numel()} elements, the grid {grid.numel}")
    rotated = _ROTATION.forward(flat * scale, grid.rotation_seed).numpy().astype(np.float64)
    return rotated / grid.step_per_element()


def encode_update(
    update: torch.Tensor,
    grid: SumGrid,
    dither_seed: int,
    *,
    weight: float = 1.0,
    rng: np.random.Generator | None = None,
) -> EncodedUpdate:
    """Encode one client's update on the round's grid.

    Parameters
    ----------
    update : torch.Tensor
        The client's update (any shape, ``grid.numel`` elements, finite).
    grid : SumGrid
        The round's grid, from the round config.
    dither_seed : int
        The client's dither seed (the server derives the same one).
    weight : float
        The client's weight in ``[0, 1]`` (e.g. ``min(num_examples, max) / max``).
    rng : numpy.random.Generator, optional
        The client's private randomness (stochastic rounding, noise). ``None`` draws a fresh
        generator from the OS's entropy: pass one only to make tests reproducible.

    Raises
    ------
    ValueError
        If the update is not finite or does not have ``grid.numel`` elements.
    """
    flat = update.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("the update holds NaN or Inf")
    rng = np.random.default_rng() if rng is None else rng
    units = weight_units(weight)
    norm = float(torch.linalg.vector_norm(flat.double()))
    clipped = norm > grid.clip
    scale = (units / WEIGHT_SCALE) * (grid.clip / norm if clipped else 1.0)
    y = rotate_scaled(flat, grid, scale)
    if grid.sent_numel < y.size:
        y = y[grid.kept_indices()]  # the round's shared subset of rotated coordinates
    if grid.rounding == "dither":
        integers = np.floor(y + dither(dither_seed, y.size) + 0.5).astype(np.int64)
    else:
        integers = np.floor(y + rng.random(y.size)).astype(np.int64)
    if grid.noise_variance > 0:
        integers += discrete_gaussian(rng, grid.noise_variance, integers.size)
    values = (integers & (grid.modulus - 1)).astype(np.uint32)
    return EncodedUpdate(values=values, integers=integers, weight_units=units, clipped=clipped, norm=norm)


def to_signed(total: np.ndarray, bits: int) -> np.ndarray:
    """A sum modulo ``2**bits`` read as the integer in ``[-2**(bits-1), 2**(bits-1))`` (int64)."""
    half = 1 << (bits - 1)
    return ((np.asarray(total).astype(np.int64) + half) & ((1 << bits) - 1)) - half


def wrapped(integer_sum: np.ndarray, bits: int) -> int:
    """How many coordinates of a true integer sum fall outside the signed range of ``bits`` bits."""
    half = 1 << (bits - 1)
    s = np.asarray(integer_sum)
    return int(np.count_nonzero((s < -half) | (s >= half)))


def decode_sum(
    total: np.ndarray, grid: SumGrid, dither_seeds: list[int], weight_total_units: int
) -> torch.Tensor:
    """The weighted mean update from the modular sum of the surviving clients' encodings.

    Parameters
    ----------
    total : np.ndarray
        ``sum_i values_i mod 2**bits`` (``grid.padded_numel`` values).
    grid : SumGrid
        The round's grid.
    dither_seeds : list of int
        The dither seeds of the clients whose values are in ``total`` (ignored for stochastic
        rounding).
    weight_total_units : int
        The sum of their ``weight_units`` (the weight segment's sum).

    Returns
    -------
    torch.Tensor
        float32, ``grid.numel`` elements: ``sum_i w_i clip(x_i) / sum_i w_i`` plus the rounding
        error and noise.
    """
    if np.asarray(total).size != grid.sent_numel:
        raise ValueError(f"sum has {np.asarray(total).size} values, the grid sends {grid.sent_numel}")
    if weight_total_units <= 0:
        raise ValueError("the surviving clients' weights sum to zero")
    s = to_signed(total, grid.bits).astype(np.float64)
    if grid.rounding == "dither":
        for seed in dither_seeds:
            s -= dither(seed, s.size)
    if grid.sent_numel == grid.padded_numel:
        rotated = s * grid.step_per_element() * (WEIGHT_SCALE / weight_total_units)
    else:  # scatter the subset back and rescale: each coordinate was sent with probability keep
        kept = grid.kept_indices()
        rotated = np.zeros(grid.padded_numel)
        scale = (WEIGHT_SCALE / weight_total_units) * (grid.padded_numel / grid.sent_numel)
        rotated[kept] = s * grid.step_per_element()[kept] * scale
    return _ROTATION.inverse(torch.from_numpy(rotated.astype(np.float32)), grid.numel, grid.rotation_seed)


def expected_mean_error(grid: SumGrid, num_clients: int, weight_total: float) -> float:
    """Theory: ``E ||decoded mean - mean||^2`` for dithered rounding, no clipping and no wrap.

    Each client's dither error is uniform on ``[-step/2, step/2)`` per rotated coordinate,
    independent across coordinates and clients; the noise adds ``noise_variance`` units each. The
    inverse rotation is orthonormal by block and keeps the block's real elements, so the error
    energy is ``sum_k d_k step_k^2 (1/12 + noise_variance) * n / W^2`` (``d_k`` real elements).
    """
    if grid.rounding != "dither" or grid.sent_numel != grid.padded_numel:
        raise ValueError("the closed form holds for dithered rounding of every coordinate")
    steps = np.asarray(grid.steps, dtype=np.float64)
    per_unit = (1.0 / 12.0 + grid.noise_variance) * num_clients / weight_total**2
    return float(np.sum(grid.real_elements_per_block() * steps**2) * per_unit)


def modulus_bound(grid: SumGrid, weight_total: float) -> float:
    """Largest L2 norm any set of clients can give the decoded mean, whatever they send.

    Every coordinate of the signed sum lies in ``[-2**(bits-1), 2**(bits-1)]``: a client that
    ignores the clip moves the mean by at most this much in total (minus the dithers' sum).
    """
    half = float(1 << (grid.bits - 1)) + 0.5 * grid.num_clients
    rescale = grid.padded_numel / grid.sent_numel
    steps = grid.step_per_element()[grid.kept_indices()]
    return math.sqrt(float(np.sum((half * steps * rescale) ** 2))) / weight_total
