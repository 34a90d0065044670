"""The cross-round rule: what one client moves a FedAvg aggregate over many rounds, bounded.

The per-round rules bound one reply's term in a round (``s c r``); nothing bounded the sum over
rounds, so a client pushing one direction inside the bounds every round moved the model ``T``
times as far. A weighted mean is the round's robust centre ``c`` (the coordinate-wise median)
plus each reply's *pull* ``s_i (u_i - c)`` (``s_i`` its weight share), exactly. This rule keeps,
per node id, the sum of its admitted pulls across rounds as a count sketch (:class:`CountSketch`,
``sketch_size`` float64: 8 KiB a client by default; linear, so the sum of sketches is the sketch
of the sum) and lowers a reply's *weight* (never its update) so that

* in a round, ``|pull_i| <= round_factor x a`` (``a`` the round's median pull), and
* across rounds, ``|sum of the node's pulls| <= total_factor x`` the round's median of the same
  sums (its participants', this round's pull included).

Both references are taken at the weights as lowered (a lower weight raises the others' shares),
in a few passes.

They are medians over the round's clients, so a minority cannot move them; a pull
that stays in one direction is held to what the median client has pulled in all. A node seen
for the first time is charged to a shared newcomers' account as well (its budget grows as a random
walk of the newcomers it holds), so a client that comes back under a new node id every round is
held by that account. The rule works on the sketches: its centre is their coordinate-wise
median, and its norms carry a relative error of about ``1 / sqrt(2 sketch_size)`` (2% at 1,024).
It reads each admitted update once more (the values the vote's pass wrote out, or those a
deferring codec computes again); server costs are measured in docs/threat-model.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit

from fedquant.codecs.deferred import DeferredValues
from fedquant.rng import derive_seed
from fedquant.strategies.node_memory import NodeMemory

NEWCOMERS = "newcomers"


@dataclass(frozen=True)
class DriftRule:
    """The cross-round rule's factors (see the module docstring).

    Parameters
    ----------
    round_factor : float
        A reply's displacement of the round's aggregate is at most this many typical ones.
    total_factor : float
        A node's summed displacement is at most this times the root of its rounds' squared typical ones.
    sketch_size : int
        Buckets of the count sketch kept per node (relative norm error about ``1 / sqrt(2 sketch_size)``).
    max_clients : int
        Node ids remembered; the least recently seen are forgotten first.
    """

    round_factor: float = 1.5
    total_factor: float = 1.25
    sketch_size: int = 1024
    max_clients: int = 100_000

    def __post_init__(self) -> None:
        for name in ("round_factor", "total_factor"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name, low in (("sketch_size", 16), ("max_clients", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


class CountSketch:
    """A linear map of an update's float entries to ``size`` numbers whose L2 norm estimates the update's.

    A count sketch laid out for speed: an entry's flat values are taken in blocks of ``size``; a
    block goes to the buckets cyclically shifted by its own random offset, each value with its own
    random sign (both derived from a seed the clients never see). Two values of one block never
    share a bucket, two of different blocks do with probability ``1 / size``, so a sparse direction
    is seen exactly and a dense one's norm within about ``1 / sqrt(2 size)``, as with a hashed count sketch;
    but a block is two contiguous runs of adds, which vectorize (:func:`_sketch_add`). Memory: one
    sign byte per parameter, kept once per entry layout.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self._layouts: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}  # (signs, block shifts)

    def _layout(self, name: str, numel: int) -> tuple[np.ndarray, np.ndarray]:
        key = (name, numel)
        if key not in self._layouts:
            rng = np.random.default_rng(derive_seed(self.seed, "drift-sketch", name, numel))
            signs = rng.integers(0, 2, numel, dtype=np.int8)
            np.multiply(signs, 2, out=signs)
            np.subtract(signs, 1, out=signs)
            shifts = rng.integers(0, self.size, -(-numel // self.size), dtype=np.int64)
            self._layouts[key] = (signs, shifts)
        return self._layouts[key]

    def of(self, update: Mapping[str, np.ndarray | DeferredValues]) -> np.ndarray:
        """The sketch (float64) of an update given entry by entry (deferred entries read where written)."""
        out = np.zeros(self.size)
        for name, value in update.items():
            flat = np.ascontiguousarray(_values(value), dtype=np.float32).reshape(-1)
            signs, shifts = self._layout(name, flat.size)
            _sketch_add(flat, signs, shifts, out)
        return out


def _values(value: np.ndarray | DeferredValues) -> np.ndarray:
    """An entry's values: a deferred entry's as written by the vote's pass, else computed (not kept)."""
    if not isinstance(value, DeferredValues):
        return value
    written = value.written()
    return written if written is not None else value.materialize().numpy()


@njit(cache=True, nogil=True)
def _sketch_add(x: np.ndarray, signs: np.ndarray, shifts: np.ndarray, out: np.ndarray) -> None:
    """``out[(i mod m + shifts[i // m]) mod m] += signs[i] x[i]`` over ``x`` (``m = out.size``).

    Adds in float32 per 64 blocks, then into ``out`` (float64); 0.09 ms for 1M values in cache.
    """
    m = out.size
    n = x.size
    acc = np.zeros(m, np.float32)
    for b in range(shifts.size):
        start = b * m
        length = min(m, n - start)
        first = min(length, m - shifts[b])
        head, xs, ss = acc[shifts[b] : shifts[b] + first], x[start : start + first], signs[start : start + first]
        for p in range(first):
            head[p] += xs[p] * np.float32(ss[p])
        rest = length - first
        tail, xs, ss = acc[:rest], x[start + first : start + length], signs[start + first : start + length]
        for p in range(rest):
            tail[p] += xs[p] * np.float32(ss[p])
        if b % 64 == 63 or b == shifts.size - 1:
            for j in range(m):
                out[j] += acc[j]
                acc[j] = 0.0


class DriftLedger:
    """Per node id, the sketched sum of its displacements and its budget (a :class:`NodeMemory`)."""

    def __init__(self, rule: DriftRule, seed: int) -> None:
        self.rule = rule
        self.sketch = CountSketch(rule.sketch_size, seed)
        self._accounts: NodeMemory[np.ndarray] = NodeMemory(rule.max_clients)  # node -> sketch of its summed pulls
        self._newcomers = [0, 0]  # replies and rounds charged to the newcomers' account

    def __len__(self) -> int:
        return len(self._accounts)

    def displacement(self, node: object) -> float:
        """The norm of a node's summed displacement so far (0 when not seen or forgotten)."""
        return float(np.linalg.norm(self._summed(node)))

    def bound(
        self, nodes: Sequence[int], updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
    ) -> list[float]:
        """The round's weights lowered where a reply's pull would break a bound; the pulls as
        admitted are added to the nodes' accounts."""
        if len(nodes) < 2:
            return list(weights)
        sketches = np.stack([self.sketch.of(u) for u in updates])
        offsets = sketches - np.median(sketches, axis=0)  # against a centre a minority cannot move
        fresh = np.array([node not in self._accounts for node in nodes])
        accounts = np.stack([self._summed(node) for node in nodes])
        pulls, rounds = self._newcomers[0] + int(fresh.sum()), self._newcomers[1] + 1
        w = np.asarray(weights, dtype=np.float64)
        bounded = w.copy()
        for _ in range(3):  # lower weights raise the others' shares: the references follow them
            asks = (bounded / bounded.sum())[:, None] * offsets
            typical = float(np.median(np.linalg.norm(asks, axis=1)))
            if not (math.isfinite(typical) and typical > 0):
                return list(weights)
            budget = self.rule.total_factor * max(typical, float(np.median(np.linalg.norm(accounts + asks, axis=1))))
            newcomers = budget * math.sqrt(max(1.0, pulls / rounds))  # a random walk of many newcomers
            bounded = np.minimum(bounded, self._allowed(accounts, fresh, offsets, bounded, typical, budget, newcomers))
        if fresh.any():
            self._newcomers = [pulls, rounds]
        self._commit(nodes, offsets, bounded)
        return [float(b) if b < float(o) else o for b, o in zip(bounded, weights, strict=True)]

    def _summed(self, key: object) -> np.ndarray:
        account = self._accounts.get(key, None)
        return np.zeros(self.rule.sketch_size) if account is None else account

    def _keys(self, node: object) -> tuple:
        """The accounts a reply is charged to: its node's, and the newcomers' for a node not seen before."""
        return (node, NEWCOMERS) if node not in self._accounts else (node,)

    def _allowed(
        self,
        accounts: np.ndarray,
        fresh: np.ndarray,
        offsets: np.ndarray,
        w: np.ndarray,
        typical: float,
        budget: float,
        newcomers: float,
    ) -> np.ndarray:
        """The weights at which each reply's pull keeps both bounds (its node's account, and the
        newcomers' for a node not seen before); a weight that keeps them stands as it is."""
        total = w.sum()
        dd = np.einsum("ij,ij->i", offsets, offsets)
        with np.errstate(divide="ignore"):
            share = np.where(dd > 0, self.rule.round_factor * typical / np.sqrt(dd), np.inf)
        share = np.minimum(share, _largest_shares(accounts, offsets, dd, budget))
        if fresh.any():
            held = self._summed(NEWCOMERS)[None, :]
            share[fresh] = np.minimum(share[fresh], _largest_shares(held, offsets[fresh], dd[fresh], newcomers))
        lowered = (dd > 0) & (share < w / total)
        out = w.copy()
        out[lowered] = share[lowered] * (total - w[lowered]) / (1 - share[lowered])
        return np.maximum(out, np.finfo(np.float64).tiny)

    def _commit(self, nodes: Sequence[int], offsets: np.ndarray, w: np.ndarray) -> None:
        pulls = (w / w.sum())[:, None] * offsets
        for node, pull in zip(nodes, pulls, strict=True):
            for key in self._keys(node):
                self._accounts.put(key, self._summed(key) + pull)


def _largest_shares(summed: np.ndarray, d: np.ndarray, dd: np.ndarray, budget: float) -> np.ndarray:
    """Per row, the largest ``s >= 0`` with ``|summed + s d| <= budget`` (0 when none is, inf when
    ``d`` is 0); ``summed`` one row or one per row of ``d``, ``dd`` the rows' ``d @ d``."""
    summed = np.broadcast_to(summed, d.shape)
    ad = np.einsum("ij,ij->i", summed, d)
    aa = np.einsum("ij,ij->i", summed, summed)
    room = ad * ad - dd * (aa - budget * budget)
    with np.errstate(divide="ignore", invalid="ignore"):
        largest = np.maximum(0.0, (-ad + np.sqrt(np.maximum(room, 0.0))) / dd)
    return np.where(dd > 0, np.where(room > 0, largest, 0.0), np.inf)
