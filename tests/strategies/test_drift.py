"""The cross-round rule (fedquant.strategies.drift): sketches, per-round and cross-round bounds."""

import numpy as np
import pytest
import torch

from fedquant.codecs.deferred import DeferredValues
from fedquant.strategies import AdmissionRules
from fedquant.strategies.drift import CountSketch, DriftLedger, DriftRule

SIZE = 3000


def _honest(rng, n, scale=1.0):
    """``n`` updates: a shared step plus each client's own noise (fresh every round)."""
    shared = rng.standard_normal(SIZE)
    return [{"w": (shared + 2.0 * rng.standard_normal(SIZE)) * scale} for _ in range(n)]


def _moved(ledger, nodes, updates, weights):
    """Each reply's pull on the weighted mean (its share times its offset from the coordinate-wise
    median: the mean is the median plus the pulls), with the weights the ledger returns."""
    bounded = np.asarray(ledger.bound(nodes, updates, weights))
    u = np.stack([x["w"] for x in updates])
    offsets = u - np.median(u, axis=0)
    return bounded, list((bounded / bounded.sum())[:, None] * offsets)


def test_the_sketch_is_linear_and_keeps_norms():
    sketch = CountSketch(1024, seed=7)
    rng = np.random.default_rng(0)
    a, b = {"w": rng.standard_normal(SIZE)}, {"w": rng.standard_normal(SIZE)}
    # linear up to the float32 rounding of the values it reads
    np.testing.assert_allclose(sketch.of({"w": a["w"] + 2 * b["w"]}), sketch.of(a) + 2 * sketch.of(b), atol=1e-5)
    assert np.linalg.norm(sketch.of(a)) == pytest.approx(np.linalg.norm(a["w"]), rel=0.15)
    sparse = np.zeros(SIZE)
    sparse[[3, 1700]] = [5.0, -2.0]  # two coordinates: in different buckets, seen exactly
    assert np.linalg.norm(sketch.of({"w": sparse})) == pytest.approx(np.hypot(5.0, 2.0))
    assert not np.array_equal(CountSketch(1024, seed=8).of(a), sketch.of(a))  # the seed picks the map


def test_the_sketch_is_the_blocked_count_sketch_it_describes():
    """Block ``b`` of ``size`` values goes to the buckets shifted by its own offset, each value signed."""
    size, numel = 64, 64 * 40 + 17  # a partial last block
    sketch = CountSketch(size, seed=11)
    x = np.random.default_rng(3).standard_normal(numel).astype(np.float32)
    signs, shifts = sketch._layout("w", numel)
    assert set(np.unique(signs)) == {-1, 1} and shifts.size == 41 and 0 <= shifts.min() and shifts.max() < size
    i = np.arange(numel)
    buckets = (i % size + shifts[i // size]) % size
    expected = np.bincount(buckets, weights=x.astype(np.float64) * signs, minlength=size)
    np.testing.assert_allclose(sketch.of({"w": x}), expected, rtol=1e-5, atol=1e-5)
    assert len(set(buckets[:size])) == size  # one block fills every bucket once


def test_a_dense_direction_keeps_its_norm_whatever_its_layout():
    """Mass spread over many blocks, or put on one position of every block, is seen at its norm."""
    sketch = CountSketch(1024, seed=5)
    numel = 1024 * 200
    layouts = [np.random.default_rng(9).standard_normal(numel)]
    for position in range(10):  # one position of every block: the block shifts spread it over buckets
        strided = np.zeros(numel)
        strided[position::1024] = 1.0
        layouts.append(strided)
    for x in layouts:
        assert np.linalg.norm(sketch.of({"w": x})) == pytest.approx(np.linalg.norm(x), rel=0.12)


class _Deferred(DeferredValues):
    """Values a decoder defers: written out by the vote's pass (``written``) or computed on demand."""

    def __init__(self, values: np.ndarray, written: bool) -> None:
        self.values, self.numel, self.was_written, self.computed = values, values.size, written, 0

    def accumulate(self, base, consensus, weighted, weight, base_bound=None):
        raise AssertionError("the sketch only reads values")

    def dot_terms(self, consensus):
        raise AssertionError("the sketch only reads values")

    def written(self):
        return self.values if self.was_written else None

    def materialize(self):
        self.computed += 1
        return torch.from_numpy(self.values.copy())


def test_deferred_entries_are_sketched_from_their_values():
    sketch = CountSketch(256, seed=2)
    x = np.random.default_rng(4).standard_normal(5000).astype(np.float32)
    written, computed = _Deferred(x, written=True), _Deferred(x, written=False)
    expected = sketch.of({"w": x})
    np.testing.assert_array_equal(sketch.of({"w": written}), expected)
    np.testing.assert_array_equal(sketch.of({"w": computed}), expected)
    assert written.computed == 0 and computed.computed == 1


def test_a_fixed_push_is_held_to_the_budget_while_an_unbounded_one_grows():
    rng = np.random.default_rng(1)
    rule = DriftRule(round_factor=1.5, total_factor=1.25)
    ledger = DriftLedger(rule, seed=3)
    nodes = list(range(10))
    push = rng.standard_normal(SIZE)
    push *= 6.0 * np.sqrt(SIZE) / np.linalg.norm(push)  # 1.5 x an honest update's norm, one direction
    total, free = np.zeros(SIZE), np.zeros(SIZE)
    for _ in range(30):
        updates = _honest(rng, 10)
        updates[0] = {"w": push}
        weights = [3.0] + [1.0] * 9
        bounded, moves = _moved(ledger, nodes, updates, weights)
        total += moves[0]
        u = np.stack([x["w"] for x in updates])
        free += 3.0 / 12 * (u[0] - np.median(u, axis=0))
        assert bounded[0] < 3.0
    honest = [ledger.displacement(n) for n in nodes[1:]]
    assert np.linalg.norm(total) < 0.15 * np.linalg.norm(free)
    assert np.linalg.norm(total) <= 1.2 * rule.total_factor * max(np.median(honest), 1e-9) + 0.1
    assert ledger.displacement(0) == pytest.approx(np.linalg.norm(total), rel=0.15)


def test_honest_clients_of_one_round_keep_their_weights_and_a_heavy_one_is_cut():
    rng = np.random.default_rng(2)
    ledger = DriftLedger(DriftRule(), seed=0)
    weights = [100.0] * 10
    assert ledger.bound(list(range(10)), _honest(rng, 10), weights) == weights
    # the cost: an honest client of 3x the data pulls 3x as far and is held to round_factor x typical
    bounded = ledger.bound(list(range(10, 20)), _honest(rng, 10), [300.0] + [100.0] * 9)
    assert 100.0 < bounded[0] < 200.0 and bounded[1:] == [100.0] * 9


def test_one_round_outlier_is_cut_to_the_round_factor():
    rng = np.random.default_rng(4)
    rule = DriftRule(round_factor=2.0)
    updates = _honest(rng, 10)
    updates[0] = {"w": 20.0 * rng.standard_normal(SIZE)}  # far from the others
    bounded, moves = _moved(DriftLedger(rule, seed=0), list(range(10)), updates, [1.0] * 10)
    norms = [np.linalg.norm(m) for m in moves]
    assert bounded[0] < 0.5 and bounded[1:].tolist() == [1.0] * 9
    assert norms[0] <= 1.2 * rule.round_factor * np.median(norms[1:])


def test_a_new_node_id_every_round_is_held_by_the_newcomers_account():
    rng = np.random.default_rng(5)
    ledger = DriftLedger(DriftRule(round_factor=1.5, total_factor=1.25), seed=1)
    push = rng.standard_normal(SIZE) * 3.0
    total, free = np.zeros(SIZE), np.zeros(SIZE)
    for t in range(30):
        updates = _honest(rng, 9) + [{"w": push}]
        bounded, moves = _moved(ledger, [*range(9), 1000 + t], updates, [1.0] * 10)
        total += moves[-1]
        free += 0.1 * (push - np.median([u["w"] for u in updates], axis=0))
        assert min(bounded[:9]) == 1.0  # the honest clients keep their weights
    assert np.linalg.norm(total) < 0.3 * np.linalg.norm(free)  # not 30 rounds' worth in one direction
    assert ledger.displacement("newcomers") >= 0.8 * np.linalg.norm(total)


def test_nodes_are_forgotten_least_recently_seen_first():
    rng = np.random.default_rng(6)
    ledger = DriftLedger(DriftRule(max_clients=5), seed=0)
    for t in range(4):
        ledger.bound([10 * t, 10 * t + 1, 10 * t + 2], _honest(rng, 3), [1.0] * 3)
    assert len(ledger) == 5 and ledger.displacement(0) == 0.0 and ledger.displacement(32) > 0


@pytest.mark.parametrize(
    "kwargs", [{"round_factor": 0}, {"total_factor": float("nan")}, {"sketch_size": 8}, {"max_clients": True}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        DriftRule(**kwargs)
    with pytest.raises(ValueError, match="cross_round"):
        AdmissionRules(cross_round=0.5)
