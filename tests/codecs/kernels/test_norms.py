"""The server's float64-accumulated sums of squares of float32 tensors (fedquant/codecs/kernels/norms.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba.typed import List

from fedquant.codecs.kernels import norms as kernels_norms
from fedquant.codecs.kernels.norms import (
    add_scaled,
    add_scaled_float32,
    add_sum_squares,
    checked_accumulate,
    checked_sum_squares,
    cosine_with,
    dot_terms,
    dot_terms_many,
    sum_squares,
)
from fedquant.jit import PARALLEL_MIN, TWIN_MAX

F32_MAX = float(np.finfo(np.float32).max)


def _exact(x: np.ndarray) -> float:
    """The correctly rounded sum of the float64 squares (math.fsum)."""
    return math.fsum((x.astype(np.float64) ** 2).tolist())


def _adversarial(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    gauss = rng.standard_normal(n).astype(np.float32)
    mixed = gauss * np.float32(1e-30)
    mixed[::997] = np.float32(3e38)  # huge outliers among tiny values: float32 squares overflow, float64 do not
    spread = (gauss * np.exp2(rng.integers(-140, 120, n))).astype(np.float32)  # every float32 exponent, denormals too
    return {
        "gauss": gauss,
        "near-max": np.full(n, F32_MAX, np.float32) * np.sign(gauss).astype(np.float32),
        "tiny": np.full(n, 1e-40, np.float32),  # denormal float32: its square underflows float32, not float64
        "mixed": mixed,
        "spread": spread,
    }


@pytest.mark.parametrize("n", [0, 1, 4095, 4097, (1 << 21) + 3])
def test_sum_squares_matches_the_exact_float64_sum_on_adversarial_inputs(n):
    for kind, x in _adversarial(n, n).items():
        got, exact = sum_squares(x), _exact(x)
        assert math.isfinite(got), kind
        assert got == pytest.approx(exact, rel=1e-12, abs=0.0), kind
        # what the float32 shortcut would report: off by orders of magnitude, or not finite
        if kind in ("near-max", "tiny", "mixed") and n:
            with np.errstate(over="ignore", under="ignore"):
                float32_sum = float(np.sum(x * x, dtype=np.float32))
            assert not abs(float32_sum - exact) <= 1e-3 * exact, kind  # also true for Inf and NaN


def test_serial_parallel_and_twin_versions_agree():
    x = _adversarial(PARALLEL_MIN + 12345, 3)["spread"]
    exact = _exact(x)
    for version in (sum_squares.serial, sum_squares.parallel, sum_squares.twin):
        assert version(x) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("n", [5, PARALLEL_MIN + 7, TWIN_MAX + 9])
def test_add_sum_squares_writes_the_float32_sum_and_counts_non_finite_results(n):
    rng = np.random.default_rng(n)
    base = rng.standard_normal(n).astype(np.float32)
    update = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
    out = np.empty(n, np.float32)
    squares, nonfinite = add_sum_squares(base, update, out)
    np.testing.assert_array_equal(out, base + update)  # the same float32 additions, bit for bit
    assert squares == pytest.approx(_exact(update), rel=1e-12) and nonfinite == 0
    base[:3] = F32_MAX
    update[:3] = np.float32(F32_MAX)  # overflows to +Inf
    update[3] = np.nan
    squares, nonfinite = add_sum_squares(base, update, out)
    assert nonfinite == 4 and not np.isfinite(out[:4]).any()
    assert add_sum_squares.twin(base, update, np.empty_like(out))[1] == 4


@pytest.mark.parametrize("n", [0, 1, 4097, PARALLEL_MIN + 11])
@pytest.mark.parametrize("weight", [1.0, -1.0, 0.0])
def test_the_cosine_terms_from_one_pass_are_the_exact_inner_products_of_the_shifted_consensus(n, weight):
    # The direction rules' three inner products with c' = c + weight u, against math.fsum of the
    # float64 products, from dot_terms' two sums and the consensus's own squares (taken once).
    rng = np.random.default_rng(n + 7)
    update = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    u = update.astype(np.float64)
    for consensus in (rng.standard_normal(n) * 1e3, (rng.standard_normal(n) * 1e3).astype(np.float32)):
        c64 = consensus.astype(np.float64)
        c = c64 + weight * u
        exact = (math.fsum((u * c).tolist()), math.fsum((c * c).tolist()), math.fsum((u * u).tolist()))
        for version in (dot_terms, dot_terms.serial, dot_terms.parallel, dot_terms.twin):
            dot, own = version(update, consensus)
            assert dot == pytest.approx(math.fsum((u * c64).tolist()), rel=1e-12, abs=1e-300)
            got = cosine_with(dot, own, math.fsum((c64 * c64).tolist()), weight)
            scales = (math.sqrt(exact[1] * exact[2]), exact[1], exact[2])
            for value, want, scale in zip(got, exact, scales, strict=True):
                assert abs(value - want) <= 1e-12 * scale + 1e-300


@pytest.mark.parametrize("n", [5, PARALLEL_MIN + 7])
def test_checked_sum_squares_counts_what_add_sum_squares_counts_without_writing(n):
    rng = np.random.default_rng(n + 1)
    base = rng.standard_normal(n).astype(np.float32)
    update = rng.standard_normal(n).astype(np.float32)
    base[:2] = F32_MAX
    update[:2] = np.float32(F32_MAX)  # overflows to +Inf
    update[-1] = np.nan
    want = add_sum_squares(base, update, np.empty(n, np.float32))
    for version in (checked_sum_squares, checked_sum_squares.serial, checked_sum_squares.parallel):
        squares, nonfinite = version(base, update)
        assert nonfinite == want[1] == 3 and math.isnan(squares)
    assert checked_sum_squares.twin(base, update)[1] == 3
    update[-1] = 0.0
    assert checked_sum_squares(base, update)[0] == pytest.approx(_exact(update), rel=1e-12)


@pytest.mark.parametrize("n", [1, 4097, PARALLEL_MIN + 3])
def test_add_scaled_is_numpys_float64_axpy_bit_for_bit(n):
    rng = np.random.default_rng(n)
    update = rng.standard_normal(n).astype(np.float32)
    acc = rng.standard_normal(n)
    want = acc + 0.3 * update.astype(np.float64)
    for version in (add_scaled, add_scaled.serial, add_scaled.parallel, add_scaled.twin):
        got = acc.copy()
        version(got, update, 0.3)
        np.testing.assert_array_equal(got, want)
    out = np.empty(n, np.float32)
    add_scaled_float32(acc, update, 0.7, out)
    np.testing.assert_array_equal(out, (acc + 0.7 * update.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize("n", [5, 4097, PARALLEL_MIN + 7])
def test_checked_accumulate_checks_as_checked_sum_squares_and_adds_to_both_sums(n):
    rng = np.random.default_rng(n + 2)
    base = rng.standard_normal(n).astype(np.float32)
    update = rng.standard_normal(n).astype(np.float32) * np.float32(1e-2)
    consensus0 = rng.standard_normal(n).astype(np.float32)
    weighted0 = rng.standard_normal(n)
    for version in (
        checked_accumulate,
        checked_accumulate.serial,
        checked_accumulate.parallel,
        checked_accumulate.twin,
    ):
        consensus, weighted = consensus0.copy(), weighted0.copy()
        squares, nonfinite = version(base, update, consensus, weighted, 2.5)
        assert nonfinite == 0 and squares == pytest.approx(_exact(update), rel=1e-12)
        np.testing.assert_array_equal(consensus, consensus0 + update)  # float32 additions, bit for bit
        np.testing.assert_allclose(weighted, weighted0 + 2.5 * update.astype(np.float64), rtol=1e-15, atol=1e-300)
        # a sum may be left out (an empty array)
        assert version(base, update, np.zeros(0, np.float32), np.zeros(0), 2.5) == pytest.approx((squares, 0))
    base[:2] = F32_MAX
    update[:2] = np.float32(F32_MAX)  # base + update overflows to +Inf
    update[-1] = np.nan
    for version in (checked_accumulate, checked_accumulate.twin):
        assert (
            version(base, update, consensus0.copy(), weighted0.copy(), 1.0)[1]
            == checked_sum_squares(base, update)[1]
            == 3
        )


@pytest.mark.parametrize("n", [0, 1, 4097, 50_000])
def test_accumulate_bounded_counts_as_checked_accumulate_without_reading_base_when_it_may(n):
    from fedquant.codecs.kernels.norms import accumulate_bounded

    rng = np.random.default_rng(n + 7)
    base = rng.standard_normal(n).astype(np.float32)
    update = rng.standard_normal(n).astype(np.float32)
    consensus0, weighted0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n)
    bound = float(np.max(np.abs(base))) if n else 0.0

    def both(b, u, base_bound):
        c1, w1, c2, w2 = consensus0.copy(), weighted0.copy(), consensus0.copy(), weighted0.copy()
        got = accumulate_bounded(b, u, c1, w1, 2.5, base_bound)
        want = checked_accumulate(b, u, c2, w2, 2.5)
        np.testing.assert_array_equal(c1, c2)
        np.testing.assert_array_equal(w1, w2)
        assert got[0] == pytest.approx(want[0], rel=1e-12, nan_ok=True)
        return got[1], want[1]

    assert both(base, update, bound) == (0, 0)
    unread = np.full(n, np.nan, np.float32)  # a base the bound vouches for is not read
    assert both(unread, update, bound)[0] == 0
    if n < 2:
        return
    big = update.copy()
    big[0] = np.float32(F32_MAX)  # near the limit: the count runs, and finds the one overflow
    base[0] = np.float32(F32_MAX)
    got, want = both(base, big, float(np.max(np.abs(base))))
    assert got == want == 1
    big[0] = np.float32(F32_MAX) * np.float32(0.6)  # the bound cannot vouch; no element overflows
    base[0], base[1] = 1.0, np.float32(F32_MAX) * np.float32(0.6)
    assert both(base, big, float(np.max(np.abs(base)))) == (0, 0)
    for bad in (np.nan, np.inf):
        u = update.copy()
        u[-1] = bad
        assert both(base, u, bound) == (1, 1)
    assert both(base, update, float("nan")) == (0, 0)  # no bound known: counted, none


@pytest.mark.parametrize("n", [0, 1, 4097, 32 * 4096 + 5, PARALLEL_MIN + 11])
def test_dot_terms_many_gives_each_updates_dot_terms(n):
    """Each update's terms as dot_terms gives them alone (the same block sums, added in block order:
    equal to float64 rounding), serial and parallel bit for bit alike, whatever the group of blocks
    the consensus is read in; float32 and float64 consensus."""
    rng = np.random.default_rng(n + 3)
    updates = [(rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32) for _ in range(5)]
    for consensus in (rng.standard_normal(n) * 1e3, (rng.standard_normal(n) * 1e3).astype(np.float32)):
        got = dot_terms_many(updates, consensus)
        assert len(got) == len(updates)
        for (dot, own), update in zip(got, updates, strict=True):
            alone = dot_terms(update, consensus)
            scale = math.sqrt(alone[1] * float(np.dot(consensus, consensus)))
            assert abs(dot - alone[0]) <= 1e-13 * scale + 1e-300
            assert own == pytest.approx(alone[1], rel=1e-13, abs=1e-300)
        runs = []
        for version in (kernels_norms._dot_terms_many.serial, kernels_norms._dot_terms_many.parallel):
            terms = np.zeros((len(updates), 2))
            version(List(updates), consensus, terms)
            runs.append(terms)
        assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], np.array(got).reshape(-1, 2))


def test_dot_terms_many_refuses_updates_it_cannot_read():
    c = np.zeros(8, np.float32)
    assert dot_terms_many([], c) == []
    for bad in (np.zeros(8), np.zeros(7, np.float32), np.zeros((2, 4), np.float32)):
        with pytest.raises(ValueError, match="1-D float32"):
            dot_terms_many([np.zeros(8, np.float32), bad], c)
