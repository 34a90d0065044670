"""The vector rounding of the levels kernels (``_round16``) gives the indices of the scalar ladder."""

import numpy as np
import pytest
from numba import njit

from fedquant.codecs.kernels import levels as kernels
from fedquant.codecs.kernels.common import hash24_run
from fedquant.jit import target

VECTOR = kernels.VECTOR_LEVELS


@njit
def _ladder(xs, row, us, s):
    cs = np.empty(xs.size, np.uint8)
    kernels._random_round_bucket(xs, row, us, cs, s)
    return cs


@njit
def _vector(xs, row16, us, s):
    cs = np.empty(xs.size, np.uint8)
    kernels._round16(xs, us, cs, row16, s, xs.size // VECTOR)
    return cs


@njit
def _reference(x, levels, d, key):
    """Every bucket by the scalar ladder, with the random bits of ``round_pack``'s stream."""
    s = levels.shape[1]
    us = np.empty(x.size, np.uint32)
    hash24_run(key, 0, x.size, us)
    out = np.empty(x.size, np.uint8)
    for b in range(levels.shape[0]):
        a = b * d
        e = min(a + d, x.size)
        kernels._random_round_bucket(x[a:e], levels[b], us[a:e], out[a:e], s)
    return out


def _rows(rng, buckets: int, s: int, ties: bool) -> np.ndarray:
    """Non-decreasing float32 rows; with ``ties``, drawn from a few values (duplicate levels, ``-0.0`` and ``0.0``)."""
    if ties:
        pool = np.array([-1.5, -0.25, -0.0, 0.0, 0.25, 0.75, 2.0], np.float32)
        rows = rng.choice(pool, size=(buckets, s))
    else:
        rows = rng.standard_normal((buckets, s)).astype(np.float32)
    return np.sort(rows, axis=1)


def _values(rng, n: int, rows: np.ndarray) -> np.ndarray:
    """Finite float32 values: Gaussian, beyond both ends, and exactly on levels."""
    x = (1.5 * rng.standard_normal(n)).astype(np.float32)
    kind = rng.integers(0, 4, n)
    x[kind == 1] = rng.choice(rows.ravel(), n)[kind == 1]  # on a level (a tie of the search)
    x[kind == 2] = rng.choice(np.array([-1e30, 1e30, -0.0, 0.0], np.float32), n)[kind == 2]
    return x


@pytest.mark.parametrize("s", [3, 4, 9, 15, 16])
@pytest.mark.parametrize("ties", [False, True])
def test_vector_rounding_is_the_ladder(s, ties):
    rng = np.random.default_rng(100 * s + ties)
    for trial in range(40):
        row = _rows(rng, 1, s, ties)[0]
        row16 = np.full(VECTOR, np.float32(np.nan))  # the lanes from s on must not matter
        row16[:s] = row
        xs = _values(rng, 16 * 12, row[None])
        us = rng.integers(0, 1 << 24, xs.size).astype(np.uint32)
        us[: us.size // 8] = rng.choice(np.array([0, 1, (1 << 24) - 1], np.uint32), us.size // 8)
        expected = _ladder(xs, row, us, s)
        assert np.array_equal(_vector(xs, row16, us, s), expected), (trial, row)


@pytest.mark.parametrize("version", ["serial", "parallel"])
@pytest.mark.parametrize("s", [2, 3, 7, 16])
@pytest.mark.parametrize("d", [1, 5, 16, 100, 512, 1000])
def test_round_pack_indices_match_the_ladder_per_bucket(version, s, d):
    # Buckets not multiples of 16 (vector groups, then a scalar tail), a short last bucket, buckets
    # across chunk boundaries (d = 1000 does not divide CHUNK).
    rng = np.random.default_rng(7 * d + s)
    n = 3 * kernels.CHUNK + 37 * d + d // 3 + 1
    buckets = (n + d - 1) // d
    levels = _rows(rng, buckets, s, ties=bool(d % 2))
    x = _values(rng, n, levels)
    key = np.uint64(11 + d)
    out = np.empty(n, np.uint8)
    counts = np.zeros((3, 0), np.int64)  # three runs of chunks
    getattr(kernels.round_pack_into, version)(x, levels, d, key, False, 8, out, counts)
    assert np.array_equal(out, _reference(x, levels, d, key))


def test_without_avx512_the_lookups_go_lane_by_lane_to_the_same_indices(monkeypatch):
    # CPUs without AVX-512F (ARM, older x86) compile the portable lookups instead of vpermps
    monkeypatch.setattr(target, "has_avx512f", lambda: False)

    @njit  # a new caller: lowered now, under the patched target
    def portable(xs, row16, us, s):
        cs = np.empty(xs.size, np.uint8)
        kernels._round16(xs, us, cs, row16, s, xs.size // VECTOR)
        return cs

    rng = np.random.default_rng(7)
    for s in (3, 9, 16):
        for ties in (False, True):
            row = _rows(rng, 1, s, ties)[0]
            row16 = np.full(VECTOR, np.float32(np.nan))
            row16[:s] = row
            xs = _values(rng, 16 * 20, row[None])
            us = rng.integers(0, 1 << 24, xs.size).astype(np.uint32)
            assert np.array_equal(portable(xs, row16, us, s), _ladder(xs, row, us, s)), (s, row)
    ir_text = "".join(portable.inspect_llvm().values())
    assert "llvm.x86.avx512" not in ir_text and "extractelement" in ir_text
