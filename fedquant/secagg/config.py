"""What a user sets for a secure round: :class:`SecAggConfig`."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from fedquant.codecs.summable.grid import ROUNDINGS, ScaleRule

#: Share holders per client (itself included): each encrypts one share pair per holder, and the
#: threshold counts holders. Beyond this, use ``neighbours`` (SecAgg+).
MAX_HOLDERS = 1024
#: Quantizer bits ``q``: the wire width ``q + ceil(log2 n) + headroom`` must fit in 32 bits.
MAX_QUANTIZER_BITS = 24
#: The clip is an L2 norm of a model update and the first round's scale; the decoded mean's error
#: grows with it (about ``clip / 2**q``), so a clip far above any update's norm is a mistake.
MAX_CLIP = 1e6
#: Noise of ``noise_multiplier * sensitivity``: above this no signal survives and the grid's
#: noise variance leaves float range.
MAX_NOISE_MULTIPLIER = 1e3
MAX_GROWTH = 1e3
MIN_DELTA = 1e-30
#: The smallest fraction of coordinates sent: below it the rescaled mean is mostly sampling noise.
MIN_KEEP = 1e-3
MIN_WRAP_PROBABILITY = 1e-30


class SecAggConfigError(ValueError):
    """Options of :class:`SecAggConfig` out of range: ``problems`` lists ``(field, sentence)``."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(message for _, message in problems))
        self.problems = list(problems)
        self.option = problems[0][0]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _is_real(value: object) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


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
        Scale each client's update by ``min(num_examples, max_examples) / max_examples`` and
        divide the sum by the number of inputs, not by the weight total (the fixed-denominator
        estimator of McMahan et al. 2018): no client can move the denominator, and none counts
        more than a full one. ``None``: every client weighs 1 (the plain mean).
    groups : int
        Split the round's clients into this many SecAgg+ groups (at least 3 clients each): the
        server learns each group's sum, leaves out a group whose sum no clipped clients could
        send, and keeps the others (see :mod:`fedquant.secagg.groups`). 1: one sum over all.
    signed : bool
        The active-server defence: clients sign their advertised keys and, in an extra
        *consistency* stage, the survivor set with long-term Ed25519 identity keys, and reveal
        shares only against a survivor set signed by at least ``threshold`` of them. Clients need
        each other's identity public keys from a source the server cannot forge.
    keep : float
        Fraction of the rotated update's coordinates sent each round: one random subset for all
        clients from the round's seed, rescaled on decoding (unbiased; the mean's error grows by
        about ``(1 / keep - 1)`` times its energy). 1: every coordinate.
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
    groups: int = 1
    signed: bool = False
    keep: float = 1.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise SecAggConfigError(problems)
        try:
            self.scale_rule()  # the codec's own checks, for anything the ranges above let through
        except ValueError as err:
            raise SecAggConfigError([("bits", str(err))]) from None

    def problems(self) -> list[tuple[str, str]]:
        """Every ``(option, sentence)`` that makes this configuration unusable (empty: valid).

        The ranges keep every later computation finite: the grid's steps and noise variance, the
        wrap bound, the DP accounting (see the module constants for why each bound is where it is).
        """
        out: list[tuple[str, str]] = []

        def number(option: str, low: float, high: float, *, low_open: bool = False, what: str = "a number") -> None:
            value = getattr(self, option)
            ok = _is_real(value) and (low < value if low_open else low <= value) and value <= high
            if not ok:
                bracket = "(" if low_open else "["
                out.append((option, f"{option} must be {what} in {bracket}{low:g}, {high:g}], got {value!r}"))

        t = self.threshold
        if not _is_real(t):
            out.append(("threshold", f"threshold must be an int or a float, got {t!r}"))
        elif isinstance(t, float) and not 0.5 < t <= 1.0:
            out.append(("threshold", f"a fractional threshold must be in (0.5, 1], got {t!r}"))
        elif isinstance(t, int) and not 2 <= t <= MAX_HOLDERS:
            out.append(("threshold", f"an int threshold must be in 2..{MAX_HOLDERS} (share holders per client), "
                                     f"got {_short(t)}"))  # fmt: skip
        elif isinstance(t, int) and _is_int(self.neighbours) and t > self.neighbours + 1:
            out.append(("threshold", f"threshold {t} exceeds the {self.neighbours + 1} share holders of "
                                     f"neighbours={self.neighbours}"))  # fmt: skip
        if not _is_int(self.bits) or not 0 <= self.bits <= MAX_QUANTIZER_BITS:
            out.append(("bits", f"bits must be an int in 0..{MAX_QUANTIZER_BITS}, got {self.bits!r}"))
        number("clip", 0.0, MAX_CLIP, low_open=True)
        if self.neighbours is not None and (not _is_int(self.neighbours) or not 2 <= self.neighbours < MAX_HOLDERS):
            out.append(("neighbours", f"neighbours must be None or an int in 2..{MAX_HOLDERS - 1}, "
                                      f"got {self.neighbours!r}"))  # fmt: skip
        number("noise_multiplier", 0.0, MAX_NOISE_MULTIPLIER)
        if not (_is_real(self.delta) and MIN_DELTA <= self.delta < 1):
            out.append(("delta", f"delta must be a number in [{MIN_DELTA:g}, 1), got {self.delta!r}"))
        number("growth", 1.0, MAX_GROWTH)
        number("wrap_probability", MIN_WRAP_PROBABILITY, 0.5)
        if self.rounding not in ROUNDINGS:
            out.append(("rounding", f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}"))
        if self.max_examples is not None and (not _is_int(self.max_examples) or not 1 <= self.max_examples <= 1 << 31):
            out.append(("max_examples", f"max_examples must be None or an int in 1..2**31, got {self.max_examples!r}"))
        if not _is_int(self.groups) or not 1 <= self.groups <= MAX_HOLDERS:
            out.append(("groups", f"groups must be an int in 1..{MAX_HOLDERS}, got {self.groups!r}"))
        if not (isinstance(self.keep, float) and MIN_KEEP <= self.keep <= 1.0):
            out.append(("keep", f"keep must be a float in [{MIN_KEEP:g}, 1], got {self.keep!r}"))
        if not isinstance(self.signed, bool):
            out.append(("signed", f"signed must be a bool, got {self.signed!r}"))
        elif self.signed and self.neighbours is not None:
            out.append(("signed", "signed rounds need neighbours=None (run config secagg-neighbours=0): the "
                                  "consistency check counts a majority of one holder set (use groups to bound the "
                                  "cost instead)"))  # fmt: skip
        return out

    def scale_rule(self) -> ScaleRule:
        """The rule that sizes each round's grid."""
        return ScaleRule(
            quantizer_bits=self.bits,
            clip=self.clip,
            growth=self.growth,
            wrap_probability=self.wrap_probability,
            rounding=self.rounding,
            noise_multiplier=self.noise_multiplier,
            keep=self.keep,
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
