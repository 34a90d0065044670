"""The shared integer grid of a secure round, and the rule that sizes it from the last aggregate.

Under secure aggregation the server only ever sees the sum of the clients' vectors modulo
``2**bits``. That sum decodes to the right integers only when every client encoded on the same
grid: the same clipping bound, the same rotation, the same steps. :class:`SumGrid` is that grid
(it travels in the round config); :class:`ScaleRule` picks it for round ``t`` from the
*aggregate* of round ``t - 1``, which the server learns anyway, never from one client's values.

Sizing (derived in ``docs/secure-aggregation.md``): a client's update ``x`` (clipped to L2 norm
``clip``) is rotated by blocks of ``B_k`` elements with the round's random signs. A coordinate
of block ``k`` of the rotated *sum* is sub-Gaussian with variance proxy
``||sum_k||^2 / B_k``. The rule predicts the mean's block norms as ``M_k = min(clip, growth *
||previous mean_k||)`` and sets the block's step so that ``2**quantizer_bits`` steps span
``+-R_k = +-M_k / sqrt(B_k)``, one proxy standard deviation of the mean's coordinate. The
integer sum of ``n`` clients then has proxy ``V = n^2 4^(q-1) + n (1 + noise variance)``
(signal, rounding, noise) and wraps around at a coordinate with probability at most
``2 exp(-4^(b-1) / (2V))``. ``bits = q + ceil(log2 n) + headroom``, with the smallest headroom
(at least ``headroom_bits``) whose union bound over all coordinates is below
``wrap_probability``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedquant.codecs.transforms.rht import block_layout
from fedquant.rng import derive_seed, uniform

ROUNDINGS = ("dither", "stochastic")
MAX_BITS = 32
#: The floor of a predicted block norm, relative to the clip (a zero block still needs a step).
MIN_NORM_FRACTION = 2.0**-24


@dataclass(frozen=True)
class SumGrid:
    """What every client of one secure round encodes with.

    Attributes
    ----------
    bits : int
        Values live in ``Z_{2**bits}``; each is packed at exactly ``bits`` bits.
    steps : tuple of float
        The quantization step of each rotation block (grid units to float).
    clip : float
        L2 bound each client clips its update to before encoding.
    numel : int
        Elements of the (flattened) update.
    rotation_seed : int
        Seed of the round's shared rotation signs (the same for every client).
    rounding : {"dither", "stochastic"}
        Unbiased integer rounding: subtractive dither (the server knows each client's dither seed
        and subtracts their sum) or stochastic rounding with the client's private randomness.
    noise_variance : float
        Variance of the discrete Gaussian noise each client adds per coordinate, in grid units
        (0: no noise).
    num_clients : int
        The number of clients the grid was sized for (the sum of fewer wraps less).
    wrap_bound : float
        Union bound on the probability that any coordinate of the sum wraps around, for honest
        clients whose mean moves by at most the rule's ``growth``.
    keep : float
        Fraction of the rotated coordinates every client sends this round: the same random subset
        for all (from ``rotation_seed``), rescaled by ``1 / keep`` on decoding, so the mean stays
        unbiased (a subsampled randomized Hadamard projection). 1: every coordinate.
    """

    bits: int
    steps: tuple[float, ...]
    clip: float
    numel: int
    rotation_seed: int
    rounding: str = "dither"
    noise_variance: float = 0.0
    num_clients: int = 1
    wrap_bound: float = 0.0
    keep: float = 1.0
    _blocks: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be an int in 2..{MAX_BITS}, got {self.bits!r}")
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise ValueError(f"numel must be a positive int, got {self.numel!r}")
        blocks = block_layout(self.numel)
        object.__setattr__(self, "_blocks", blocks)
        if len(self.steps) != len(blocks):
            raise ValueError(f"{len(self.steps)} steps for {len(blocks)} rotation blocks of {self.numel} elements")
        if not all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in self.steps):
            raise ValueError("every step must be a finite positive float")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be finite and positive, got {self.clip!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if not (math.isfinite(self.noise_variance) and self.noise_variance >= 0):
            raise ValueError(f"noise_variance must be finite and >= 0, got {self.noise_variance!r}")
        if isinstance(self.rotation_seed, bool) or not isinstance(self.rotation_seed, int):
            raise ValueError("rotation_seed must be an int")
        if not (isinstance(self.keep, float) and 0.0 < self.keep <= 1.0):
            raise ValueError(f"keep must be a float in (0, 1], got {self.keep!r}")

    @property
    def blocks(self) -> tuple[int, ...]:
        """log2 of the rotation block sizes (the layout of ``rht``)."""
        return self._blocks

    @property
    def padded_numel(self) -> int:
        """Elements of the rotated vector: what goes on the wire."""
        return sum(1 << k for k in self._blocks)

    @property
    def sent_numel(self) -> int:
        """Rotated coordinates each client sends (``keep`` of ``padded_numel``, at least 1)."""
        return kept_count(self.padded_numel, self.keep)

    def kept_indices(self) -> np.ndarray:
        """The sorted rotated coordinates every client sends this round (all when ``keep`` is 1)."""
        if self.sent_numel == self.padded_numel:
            return np.arange(self.padded_numel)
        ranks = uniform(derive_seed(self.rotation_seed, "secagg-subset"), self.padded_numel).numpy()
        return np.sort(np.argsort(ranks, kind="stable")[: self.sent_numel])

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    def step_per_element(self) -> np.ndarray:
        """The step of every rotated element (float64, ``padded_numel`` long)."""
        return np.repeat(np.asarray(self.steps, dtype=np.float64), [1 << k for k in self._blocks])

    def real_elements_per_block(self) -> np.ndarray:
        """Elements of the update in each block (the tail block's padding excluded)."""
        sizes = np.array([1 << k for k in self._blocks], dtype=np.int64)
        ends = np.minimum(np.cumsum(sizes), self.numel)
        return np.diff(np.concatenate([[0], ends]))

    def l2_sensitivity(self) -> float:
        """Largest L2 norm of one client's integer vector: ``clip / min step + sqrt(padded_numel)``.

        Rounding moves each coordinate by less than one unit (dither: ``|q - y| <= 1``), so the
        second term bounds it deterministically; the noise is not part of a client's input.
        """
        return self.clip / min(self.steps) + math.sqrt(self.sent_numel)

    def to_config(self, prefix: str) -> dict[str, object]:
        """ConfigRecord entries (all under ``prefix``)."""
        return {
            f"{prefix}bits": self.bits,
            f"{prefix}steps": [float(s) for s in self.steps],
            f"{prefix}clip": float(self.clip),
            f"{prefix}numel": self.numel,
            f"{prefix}rotation-seed": self.rotation_seed,
            f"{prefix}rounding": self.rounding,
            f"{prefix}noise-variance": float(self.noise_variance),
            f"{prefix}num-clients": self.num_clients,
            f"{prefix}keep": float(self.keep),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, object], prefix: str, *, max_numel: int = 1 << 31) -> SumGrid:
        """Read a grid back from round-config entries; ``ValueError`` names what is wrong."""

        def get(key: str, kind: type | tuple[type, ...]) -> object:
            value = config.get(prefix + key)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"round config {prefix + key} must be {kind}, got {type(value).__name__}")
            return value

        numel = get("numel", int)
        if not 1 <= numel <= max_numel:
            raise ValueError(f"round config {prefix}numel = {numel} is out of range")
        steps = get("steps", list)
        if len(steps) != len(block_layout(numel)):
            raise ValueError(f"round config {prefix}steps has {len(steps)} entries for {numel} elements")
        return cls(
            bits=get("bits", int),
            steps=tuple(float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else -1.0 for s in steps),
            clip=float(get("clip", (int, float))),
            numel=numel,
            rotation_seed=get("rotation-seed", int),
            rounding=get("rounding", str),
            noise_variance=float(get("noise-variance", (int, float))),
            num_clients=get("num-clients", int),
            keep=float(get("keep", float)),
        )


def kept_count(padded_numel: int, keep: float) -> int:
    """How many of ``padded_numel`` rotated coordinates a fraction ``keep`` sends (at least 1)."""
    return max(1, min(padded_numel, math.ceil(keep * padded_numel)))


def block_norms(flat: np.ndarray, numel: int) -> np.ndarray:
    """L2 norm of ``flat`` (``numel`` elements) over each rotation block of ``rht``."""
    sizes = [1 << k for k in block_layout(numel)]
    edges = np.minimum(np.cumsum([0, *sizes]), numel)
    x = np.asarray(flat, dtype=np.float64).reshape(-1)
    return np.array([math.sqrt(float(np.dot(x[a:b], x[a:b]))) for a, b in zip(edges[:-1], edges[1:])])


def wrap_bound(bits: int, num_clients: int, quantizer_bits: int, noise_variance: float, padded_numel: int) -> float:
    """Union bound on the probability that any coordinate of the integer sum wraps (see module doc)."""
    proxy = num_clients**2 * 4.0 ** (quantizer_bits - 1) + num_clients * (1.0 + noise_variance)
    per_coordinate = 2.0 * math.exp(-(4.0 ** (bits - 1)) / (2.0 * proxy))
    return min(1.0, padded_numel * per_coordinate)


@dataclass(frozen=True)
class ScaleRule:
    """Sizes each round's :class:`SumGrid` from the previous round's aggregate.

    Parameters
    ----------
    quantizer_bits : int
        ``q``: steps per proxy standard deviation of the mean's coordinate is ``2**q / 2``; the
        decoded mean's relative squared error is about ``growth^2 / (3 * 4^q * n)``.
    clip : float
        L2 bound of every client's update (client-side clipping; also the first round's scale).
    headroom_bits : int
        Least headroom; more is added until the wrap bound holds.
    growth : float
        How much the mean's block norms may grow from one round to the next (>= 1).
    wrap_probability : float
        Target for the union bound on any wrap-around in a round.
    rounding : {"dither", "stochastic"}
    noise_multiplier : float
        Distributed DP: the sum carries discrete Gaussian noise of standard deviation
        ``noise_multiplier * l2_sensitivity`` (0: no noise).
    keep : float
        Fraction of the rotated coordinates sent (see :class:`SumGrid`).
    """

    quantizer_bits: int = 4
    clip: float = 1.0
    headroom_bits: int = 0
    growth: float = 2.0
    wrap_probability: float = 1e-6
    rounding: str = "dither"
    noise_multiplier: float = 0.0
    keep: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.keep, float) and 0.0 < self.keep <= 1.0):
            raise ValueError(f"keep must be a float in (0, 1], got {self.keep!r}")
        if isinstance(self.quantizer_bits, bool) or not isinstance(self.quantizer_bits, int):
            raise ValueError("quantizer_bits must be an int")
        if not 0 <= self.quantizer_bits <= 24:
            raise ValueError(f"quantizer_bits must be in 0..24, got {self.quantizer_bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be finite and positive, got {self.clip}")
        if not 0 <= self.headroom_bits <= MAX_BITS:
            raise ValueError(f"headroom_bits must be in 0..{MAX_BITS}, got {self.headroom_bits}")
        if not (math.isfinite(self.growth) and self.growth >= 1):
            raise ValueError(f"growth must be >= 1, got {self.growth}")
        if not 0 < self.wrap_probability < 1:
            raise ValueError(f"wrap_probability must be in (0, 1), got {self.wrap_probability}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")

    def predicted_block_norms(self, numel: int, previous_mean: np.ndarray | None) -> np.ndarray:
        """``M_k = min(clip, growth * ||previous mean_k||)``, or ``clip`` without a previous round."""
        count = len(block_layout(numel))
        if previous_mean is None:
            return np.full(count, self.clip)
        if np.asarray(previous_mean).size != numel:
            raise ValueError(f"previous mean has {np.asarray(previous_mean).size} elements, expected {numel}")
        norms = self.growth * block_norms(previous_mean, numel)
        norms = np.where(np.isfinite(norms), norms, self.clip)
        return np.clip(norms, self.clip * MIN_NORM_FRACTION, self.clip)

    def grid(
        self, numel: int, num_clients: int, rotation_seed: int, previous_mean: np.ndarray | None = None
    ) -> SumGrid:
        """The grid of a round of ``num_clients`` clients (see the module doc for the maths).

        Raises
        ------
        ValueError
            If no width up to 32 bits meets ``wrap_probability``.
        """
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        q = self.quantizer_bits
        sizes = np.array([1 << k for k in block_layout(numel)], dtype=np.float64)
        norms = self.predicted_block_norms(numel, previous_mean)
        steps = tuple(float(s) for s in 2.0 * norms / np.sqrt(sizes) / 2.0**q)
        sent = kept_count(int(sizes.sum()), self.keep)
        noise_variance = 0.0
        if self.noise_multiplier > 0:
            sensitivity = self.clip / min(steps) + math.sqrt(sent)
            noise_variance = (self.noise_multiplier * sensitivity) ** 2 / num_clients
        base = q + math.ceil(math.log2(num_clients)) if num_clients > 1 else q
        for headroom in range(self.headroom_bits, MAX_BITS + 1):
            bits = max(2, base + headroom)
            if bits > MAX_BITS:
                break
            bound = wrap_bound(bits, num_clients, q, noise_variance, sent)
            if bound <= self.wrap_probability:
                return SumGrid(
                    bits=bits,
                    steps=steps,
                    clip=float(self.clip),
                    numel=numel,
                    rotation_seed=rotation_seed,
                    rounding=self.rounding,
                    noise_variance=noise_variance,
                    num_clients=num_clients,
                    wrap_bound=bound,
                    keep=self.keep,
                )
        raise ValueError(
            f"no modulus up to {MAX_BITS} bits keeps the wrap bound below {self.wrap_probability} "
            f"for {num_clients} clients at quantizer_bits={q} (noise variance {noise_variance:.3g})"
        )
