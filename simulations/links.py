"""Per-client uplink speed profiles: turn each round's bytes into simulated upload seconds.

A profile spec is one string, speeds in Mbit/s:

``none``
    No profile; no ``simulated-upload-seconds`` metric.
``fixed:mbps=2``
    Every client uploads at 2 Mbit/s.
``uniform:low=0.5,high=10``
    Each client's speed drawn once, uniformly on [low, high).
``lognormal:median=2,sigma=1``
    Each client's speed drawn once from a log-normal with that median (Mbit/s) and log-sd, the
    usual shape of measured mobile uplinks.

Draws come from fedquant's counter-based stream keyed by (seed, client key), so a client keeps its
speed across rounds, runs and codecs; the client key is its partition id when known (the node id
of a simulated node changes between runs), else the node id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fedquant.codecs.params import parse_spec
from fedquant.rng import derive_seed, uniform

_KINDS = {"fixed": {"mbps"}, "uniform": {"low", "high"}, "lognormal": {"median", "sigma"}}


@dataclass
class UplinkProfile:
    """Callable ``node_id -> bytes per second`` for :class:`fedquant.strategies.QuantizedStrategy`.

    Parameters
    ----------
    kind : {"fixed", "uniform", "lognormal"}
        Distribution of the per-client speed.
    params : dict
        ``mbps`` / ``low``, ``high`` / ``median``, ``sigma`` in Mbit/s (sigma unitless).
    seed : int
        Seed of the draws.
    """

    kind: str
    params: dict[str, float]
    seed: int = 0
    client_keys: dict[int, int] = field(default_factory=dict)  # node id -> partition id

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown uplink profile {self.kind!r}; use none, {', '.join(_KINDS)}")
        if set(self.params) != _KINDS[self.kind]:
            raise ValueError(f"uplink profile {self.kind!r} takes exactly {sorted(_KINDS[self.kind])}")
        if any(not (v > 0 and math.isfinite(v)) for k, v in self.params.items() if k != "sigma"):
            raise ValueError(f"uplink speeds must be positive finite Mbit/s, got {self.params}")
        if self.kind == "uniform" and not self.params["low"] < self.params["high"]:
            raise ValueError("uplink profile uniform needs low < high")
        if self.kind == "lognormal" and not self.params["sigma"] >= 0:
            raise ValueError("uplink profile lognormal needs sigma >= 0")

    def mbps(self, key: int) -> float:
        """Speed in Mbit/s of the client with this key."""
        p = self.params
        if self.kind == "fixed":
            return p["mbps"]
        u1, u2 = (float(v) for v in uniform(derive_seed(self.seed, "uplink", int(key)), 2))
        if self.kind == "uniform":
            return p["low"] + (p["high"] - p["low"]) * u1
        normal = math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)  # Box-Muller; 1-u1 > 0
        return p["median"] * math.exp(p["sigma"] * normal)

    def __call__(self, node_id: int) -> float:
        """Bytes per second of node ``node_id``."""
        return self.mbps(self.client_keys.get(int(node_id), int(node_id))) * 1e6 / 8


def parse_uplink(spec: str, seed: int = 0) -> UplinkProfile | None:
    """Build a profile from its spec string (see the module doc); ``"none"`` or ``""`` gives None."""
    spec = spec.strip()
    if spec.lower() in ("", "none"):
        return None
    kind, raw = parse_spec(spec) if ":" in spec else (spec, {})
    try:
        params = {k.replace("-", "_"): float(v) for k, v in raw.items()}
    except (TypeError, ValueError) as err:
        raise ValueError(f"uplink profile {spec!r}: values must be numbers") from err
    return UplinkProfile(kind, params, seed)
