"""What a user sets for a secure round: :class:`SecAggConfig`."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fedquant.codecs.summable.grid import ROUNDINGS, ScaleRule


@dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation (SecAgg+) of summable integer updates, with optional distributed DP.

    Parameters
    ----------
    threshold : int or float
        Shares needed to rebuild a client's secrets. A float in (0.5, 1] is a fraction of the
        client's share holders (itself and its neighbours), rounded up; an int is used as is.
        A round fails when a secret has fewer live holders, or fewer than ``threshold`` inputs
        survive. Must be more than half the holders (so no two disjoint sets of honest
        holders can reveal both of a client's secrets) and at least 2.
    bits : int
        Quantizer bits ``q`` of the summable codec. The wire width is
        ``b = q + ceil(log2 n) + headroom`` bits per parameter.
    clip : float
        L2 bound every client clips its update to (replaces the server's norm check, which
        cannot see single updates).
    neighbours : int or None
        SecAgg+ neighbourhood: each client shares its secrets with this many others, on a ring
        of the round's clients in a random order (Bell et al. 2020). ``None``: all of them.
    noise_multiplier : float
        Distributed DP: each client adds discrete Gaussian noise so that the sum carries noise
        of standard deviation ``noise_multiplier * sensitivity`` (0: off).
    delta : float
        The delta of the (epsilon, delta) report.
    growth, wrap_probability, rounding
        Passed to :class:`~fedquant.codecs.summable.grid.ScaleRule`.
    max_examples : int or None
        Weight clients by ``min(num_examples, max_examples) / max_examples`` (FedAvg's weighting;
        the weight total is summed securely). ``None``: every client weighs 1.
    """

    threshold: int | float = 0.6
    bits: int = 2
    clip: float = 1.0
    neighbours: int | None = None
    noise_multiplier: float = 0.0
    delta: float = 1e-5
    growth: float = 2.0
    wrap_probability: float = 1e-6
    rounding: str = "dither"
    max_examples: int | None = None

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise ValueError("threshold must be an int or a float")
        if isinstance(t, float) and not 0.5 < t <= 1.0:
            raise ValueError(f"a fractional threshold must be in (0.5, 1], got {t}")
        if isinstance(t, int) and t < 2:
            raise ValueError(f"threshold must be at least 2, got {t}")
        if self.neighbours is not None and (isinstance(self.neighbours, bool) or self.neighbours < 2):
            raise ValueError(f"neighbours must be None or >= 2, got {self.neighbours}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError("max_examples must be None or >= 1")
        self.scale_rule()  # validates the codec's parameters

    def scale_rule(self) -> ScaleRule:
        """The rule that sizes each round's grid."""
        return ScaleRule(
            quantizer_bits=self.bits,
            clip=self.clip,
            growth=self.growth,
            wrap_probability=self.wrap_probability,
            rounding=self.rounding,
            noise_multiplier=self.noise_multiplier,
        )

    def threshold_for(self, holders: int) -> int:
        """The threshold for a client with ``holders`` share holders (itself included).

        Raises
        ------
        ValueError
            If it is not more than half of ``holders`` or exceeds it.
        """
        t = math.ceil(self.threshold * holders) if isinstance(self.threshold, float) else self.threshold
        t = max(t, holders // 2 + 1, 2)
        if t > holders:
            raise ValueError(f"threshold {t} exceeds the {holders} share holders")
        return t

    def holders(self, nodes: list[int], rng: random.Random) -> dict[int, list[int]]:
        """Each node's share holders (sorted, itself included): all nodes, or a ring neighbourhood."""
        nodes = sorted(nodes)
        k = self.neighbours
        if k is None or k >= len(nodes) - 1:
            return {n: list(nodes) for n in nodes}
        order = nodes[:]
        rng.shuffle(order)
        half = k // 2
        out = {}
        for pos, n in enumerate(order):
            near = {order[(pos + off) % len(order)] for off in range(-half, k - half + 1)}
            out[n] = sorted(near)
        # The ring is symmetric for even k; make it so for odd k too.
        for n, near in out.items():
            for m in near:
                if n not in out[m]:
                    out[m] = sorted({*out[m], n})
        return out

    def weight(self, num_examples: float) -> float:
        """A client's weight in [0, 1]."""
        if self.max_examples is None:
            return 1.0
        if not (math.isfinite(num_examples) and num_examples > 0):
            raise ValueError(f"num_examples must be finite and positive, got {num_examples}")
        return min(float(num_examples), float(self.max_examples)) / self.max_examples
