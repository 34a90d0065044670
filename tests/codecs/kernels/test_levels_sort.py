"""The levels kernels' two bucket sorts (sorting network, radix sort) give the same bits."""

import numpy as np
import pytest

from fedquant.codecs.kernels import levels as kernels
from fedquant.codecs.kernels import levels_torch as twin

LANES = kernels.LANES


def _awkward(n: int, seed: int) -> np.ndarray:
    """float32 values with ties, both zeros, infinities, NaNs of both signs and subnormals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    kind = rng.integers(0, 8, n)
    x[kind == 1] = 0.0
    x[kind == 2] = -0.0
    x[kind == 3] = np.float32(1.5)
    x[kind == 4] = np.float32(1e-41) * rng.choice([-1, 1], n)[kind == 4]  # subnormal
    x[kind == 5] = rng.choice([np.inf, -np.inf], n)[kind == 5]
    bits = x.view(np.uint32)
    bits[kind == 6] = rng.choice([0x7FC00001, 0xFFC00002, 0x7F800003], n)[kind == 6]  # NaNs
    return x


def _radix_sorted(x: np.ndarray, start: int, end: int) -> np.ndarray:
    m = end - start
    scratch = (np.empty(m, np.uint32), np.empty(m, np.uint32), np.empty(1024, np.int64))
    return kernels._sorted_bucket(x, start, end, *scratch).copy()


@pytest.mark.parametrize("d", [1, 16, 100, 512, 1000])
@pytest.mark.parametrize("data", ["awkward", "zeros", "gauss"])
def test_network_sort_gives_the_radix_sort_bits(d, data):
    n = LANES * d
    if data == "awkward":
        x = _awkward(n, d)
    elif data == "zeros":  # -0.0 before 0.0, and the padding rows stay after them
        x = np.where(np.random.default_rng(d).random(n) < 0.5, np.float32(-0.0), np.float32(0.0))
    else:
        x = np.random.default_rng(d).standard_normal(n).astype(np.float32)
    t = np.empty(kernels.network_rows(d) * LANES, np.int32)
    kernels._sorted_lanes(x, 0, d, t)
    for q in range(LANES):
        lane = kernels._lane_values(t, q, d, np.empty(d, np.float32))
        want = _radix_sorted(x, q * d, (q + 1) * d)
        assert lane.view(np.uint32).tobytes() == want.view(np.uint32).tobytes(), q


@pytest.mark.parametrize("version", ["serial", "parallel"])
@pytest.mark.parametrize("family", [0, 1, 2, 3])
@pytest.mark.parametrize("d", [64, 100])
def test_bucket_levels_do_not_depend_on_which_sort_ran(version, family, d):
    # 3 * LANES + 5 full buckets and a short one: network runs, radix left-overs, a partial bucket.
    # Each bucket alone (fewer than LANES buckets) always takes the radix sort.
    # Finite values only: the codecs reject others before selecting levels, and NaN levels may
    # differ in their payload bits between the scalar and the vectorized arithmetic.
    n = (3 * LANES + 5) * d + d // 3
    x = _awkward(n, family)
    x[~np.isfinite(x)] = np.float32(-3e38)
    s = 9 if family < 2 else 2
    tree = tuple(np.array(a, np.int64) for a in zip(*twin.level_schedule(s), strict=True))
    none = np.zeros(0, np.int64)
    args = (s, family, *(tree if family == 0 else (none, none, none)), 20 if family == 3 else 0)
    select = getattr(kernels.select_levels, version)
    together = select(x, d, *args)
    alone = np.concatenate([select(x[b : b + d], d, *args) for b in range(0, n, d)])
    assert together.view(np.uint32).tobytes() == alone.view(np.uint32).tobytes()
