"""ORQ-s and Linear-s: unbiasedness, optimality of the levels, CPU/torch parity, wire format."""

import itertools

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec
from fedquant.codecs.kernels import levels as kernels
from fedquant.codecs.kernels import levels_torch as L
from fedquant.codecs.kernels.common import CHUNK, PARALLEL_MIN, kernel_key
from fedquant.codecs.kernels.levels_torch import gather_levels, nearest_of_two, random_round
from fedquant.wire import read_payload, write_payload
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size
from tests.codecs import test_codecs_common as common
from tests.helpers import cuda, sample_tensor


def _buckets(dist: str, count: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dist == "gauss":
        return rng.standard_normal((count, d))
    if dist == "laplace":
        return rng.laplace(size=(count, d))
    return rng.standard_t(3, size=(count, d))


def rounding_variance(w: np.ndarray, levels: np.ndarray) -> float:
    """Exact variance of unbiased random rounding of sorted ``w`` onto ``levels``: sum (hi-v)(v-lo)."""
    lv = np.sort(levels.astype(np.float64))
    v = w.astype(np.float64)
    k = np.clip(np.searchsorted(lv, v, side="right") - 1, 0, lv.size - 2)
    return float(np.sum((lv[k + 1] - v) * (v - lv[k])))


def optimal_variance(w: np.ndarray, s: int) -> float:
    """Exact minimum rounding variance over ``s`` levels with min and max fixed (dynamic programming).

    Each level can be restricted to the data points: the variance is piecewise linear in each
    single level, so moving any level to the data point at an end of its linear piece does not
    increase it. ``cost(i, j)`` is the variance of the points strictly
    between data points ``i < j`` used as adjacent levels.
    """
    w = np.sort(w.astype(np.float64))
    n = w.size
    p1 = np.concatenate([[0.0], np.cumsum(w)])
    p2 = np.concatenate([[0.0], np.cumsum(w * w)])
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    cnt = np.maximum(j - i - 1, 0)
    s1 = np.where(j > i + 1, p1[np.minimum(j, n)] - p1[np.minimum(i + 1, n)], 0.0)
    s2 = np.where(j > i + 1, p2[np.minimum(j, n)] - p2[np.minimum(i + 1, n)], 0.0)
    wi, wj = w[:, None], w[None, :]
    cost = -s2 + s1 * (wi + wj) - cnt * wi * wj
    cost = np.where(j >= i, cost, np.inf)
    best = cost[0].copy()  # two levels: w[0] and w[j]
    for _ in range(s - 2):
        best = np.min(best[:, None] + cost, axis=0)
    return float(best[n - 1])


def qsgd_levels(w: np.ndarray, s: int) -> np.ndarray:
    """QSGD-s with max-norm scaling: s levels (s odd) symmetric around 0, step max|v| / ((s-1)/2)."""
    m = np.abs(w).max()
    half = (s - 1) // 2
    return m * np.arange(-half, half + 1) / half


def _orq_levels_np(w: np.ndarray, s: int) -> np.ndarray:
    t = torch.from_numpy(np.sort(w).astype(np.float32))[None, :]
    return L.orq_levels(t, s)[0].numpy()


def _linear_levels_np(w: np.ndarray, s: int) -> np.ndarray:
    t = torch.from_numpy(np.sort(w).astype(np.float32))[None, :]
    return L.linear_levels(t, s)[0].numpy()


# ---------------------------------------------------------------- the dynamic program itself
def test_optimal_variance_equals_exhaustive_search():
    rng = np.random.default_rng(0)
    for n, s in [(7, 3), (8, 4), (9, 5)]:
        w = np.sort(rng.standard_normal(n))
        brute = min(
            rounding_variance(w, np.array([w[0], *mid, w[-1]]))
            for mid in itertools.combinations_with_replacement(w, s - 2)
        )
        assert optimal_variance(w, s) == pytest.approx(brute, rel=1e-12, abs=1e-12)


# ---------------------------------------------------------------- optimality of ORQ's levels
@pytest.mark.parametrize("dist", ["gauss", "laplace", "student"])
def test_orq_three_levels_are_exactly_optimal(dist):
    # With s = 3 the greedy step is the exact minimisation over the single interior level.
    for w in _buckets(dist, 6, 48, seed=1):
        w = w.astype(np.float32)
        assert rounding_variance(w, _orq_levels_np(w, 3)) == pytest.approx(optimal_variance(w, 3), rel=1e-6)


@pytest.mark.parametrize("dist", ["gauss", "laplace"])
@pytest.mark.parametrize("s", [5, 9])
def test_orq_is_within_a_few_percent_of_the_exact_optimum(dist, s):
    # Greedy bisection is not exact for s > 3; algorithms.md §4.4 measured ratios 1.00-1.03 at d = 256.
    ratios = []
    for w in _buckets(dist, 8, 256, seed=2):
        w = w.astype(np.float32)
        ratios.append(rounding_variance(w, _orq_levels_np(w, s)) / optimal_variance(w, s))
    assert min(ratios) >= 1 - 1e-6  # the optimum is a lower bound (sanity check of both)
    assert np.mean(ratios) <= 1.04 and max(ratios) <= 1.10, ratios


@pytest.mark.parametrize("dist", ["gauss", "laplace"])
@pytest.mark.parametrize("s", [3, 5, 9, 17])
def test_orq_never_worse_than_linear_or_qsgd(dist, s):
    orq, lin, qsgd = [], [], []
    for w in _buckets(dist, 16, 512, seed=3):
        w = w.astype(np.float32)
        orq.append(rounding_variance(w, _orq_levels_np(w, s)))
        lin.append(rounding_variance(w, _linear_levels_np(w, s)))
        qsgd.append(rounding_variance(w, qsgd_levels(w, s)))
    orq, lin, qsgd = map(np.array, (orq, lin, qsgd))
    assert np.all(orq <= lin * (1 + 1e-9)) and np.all(orq <= qsgd * (1 + 1e-9))
    if s >= 5:  # margins well inside the ratios of algorithms.md §4.7 (ORQ/Linear 0.5-0.75, ORQ/QSGD 0.5-0.67)
        assert orq.sum() <= 0.85 * lin.sum() and orq.sum() <= 0.85 * qsgd.sum()


@pytest.mark.parametrize("dist", ["gauss", "laplace"])
def test_refinement_never_increases_the_variance_and_fixes_unbalanced_splits(dist):
    # s = 8 is not 2**k + 1: the bisection is unbalanced and the greedy levels are ~1.4x the optimum.
    w = np.sort(_buckets(dist, 6, 256, seed=4).astype(np.float32), axis=1)
    opt = np.array([optimal_variance(row, 8) for row in w])
    var = {}
    for refine in (0, 1, 3, 10):
        lv = L.orq_levels(torch.from_numpy(w), 8, refine).numpy()
        var[refine] = np.array([rounding_variance(row, levels) for row, levels in zip(w, lv, strict=True)])
    assert np.all(var[1] <= var[0] * (1 + 1e-9)) and np.all(var[3] <= var[1] * (1 + 1e-9))
    assert np.all(var[10] <= var[3] * (1 + 1e-9))
    assert np.mean(var[0] / opt) > 1.2  # the unbalanced greedy really is off (this test can tell)
    assert np.mean(var[10] / opt) <= 1.04


def test_linear_levels_are_the_empirical_quantiles():
    w = np.arange(10, dtype=np.float32)  # F^-1(q) = ceil(10 q)-th smallest
    assert _linear_levels_np(w, 3).tolist() == [0.0, 4.0, 9.0]
    assert _linear_levels_np(w, 5).tolist() == [0.0, 2.0, 4.0, 7.0, 9.0]


def test_recursion_tree_places_every_interior_level_once_after_its_neighbours():
    for s in range(3, 40):
        placed = {0, s - 1}
        for lo, mid, hi in L.recursion_tree(s):
            assert lo in placed and hi in placed and mid not in placed
            placed.add(mid)
        assert placed == set(range(s))


# ---------------------------------------------------------------- unbiasedness (Monte Carlo)
def _exact_variance(codec, x: torch.Tensor) -> torch.Tensor:
    """Per-element variance (hi - v)(v - lo) of rounding ``x`` onto the codec's levels."""
    levels = codec.quantizer.select_levels(x).double()
    rows = torch.nn.functional.pad(x.double(), (0, (-x.numel()) % codec.bucket_size)).view(levels.shape[0], -1)
    k = torch.clamp(torch.searchsorted(levels, rows, right=True) - 1, 0, levels.shape[1] - 2)
    return ((levels.gather(1, k + 1) - rows) * (rows - levels.gather(1, k))).reshape(-1)[: x.numel()]


@pytest.mark.parametrize("spec", ["orq:levels=5,bucket_size=64", "linear:levels=4,bucket_size=64", "orq:levels=3"])
def test_unbiased_monte_carlo_end_to_end(spec):
    codec = get_codec(spec)
    x = sample_tensor((150,), seed=11) ** 3  # heavy-ish tails, short last bucket (150 = 2*64 + 22)
    var = _exact_variance(codec, x)
    trials = 400
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(trials):
        total += codec.decode(codec.encode(x, seed=seed), seed=seed).double()
    # The mean of `trials` independent roundings has standard deviation sqrt(var / trials);
    # 6 of them bound every one of 150 elements with probability > 1 - 150 * 2e-9.
    assert torch.all((total / trials - x.double()).abs() <= 6 * torch.sqrt(var / trials) + 1e-6)


@pytest.mark.parametrize("name", ["orq", "linear"])
def test_unbiased_monte_carlo_many_trials(name):
    # 20000 independent roundings at once: the stream of one seed over 20000 copies of the
    # tensor (counter = element index, so every copy gets its own uniforms).
    codec = get_codec(name, levels=6, bucket_size=64)
    x = sample_tensor((128,), seed=12) * torch.linspace(0.1, 3.0, 128)
    levels = codec.quantizer.select_levels(x)
    var = _exact_variance(codec, x)
    trials = 20000
    many = levels.repeat(trials, 1)
    idx = kernels.round_pack(x.repeat(trials).numpy(), many.numpy(), 64, np.uint64(7), False, 8)
    y = gather_levels(torch.from_numpy(idx), many, 64).view(trials, -1).double()
    mean = y.mean(0)
    assert torch.all((mean - x.double()).abs() <= 6 * torch.sqrt(var / trials) + 1e-7)
    # The empirical variance matches sum (hi - v)(v - lo) (relative sd of the estimate < 1 %).
    assert ((y - x.double()) ** 2).mean(0).sum().item() == pytest.approx(var.sum().item(), rel=0.05)


def test_values_on_the_levels_come_back_exactly():
    codec = get_codec("orq:levels=4,bucket_size=8")
    x = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 0.0, 5.0, 5.0])
    levels = codec.quantizer.select_levels(x)
    assert levels[0].tolist() == [0.0, 1.0, 2.0, 3.0]  # four distinct values, four levels
    for seed in range(5):
        assert torch.equal(codec.decode(codec.encode(x, seed=seed), seed=seed), x)


# ---------------------------------------------------------------- CPU kernels vs torch path
def _kernel_round_trip(x: torch.Tensor, levels: torch.Tensor, d: int, seed: int, nearest: bool = False):
    """Indices, packed bytes and decoded values of the numba kernels, each checked against the torch twin."""
    s = levels.shape[1]
    width = bit_width(s)
    args = (x.numpy(), levels.numpy(), d, kernel_key(seed), nearest)
    idx = kernels.round_pack(*args, 8)  # one byte per index: the symbols of the entropy coder
    expected = (nearest_of_two(x, levels, d) if nearest else random_round(x, levels, d, seed)).numpy()
    assert np.array_equal(idx, expected)
    packed = kernels.round_pack(*args, width)
    assert np.array_equal(packed, pack_bits(idx, width))
    flat = levels.reshape(-1).numpy()
    values, bad = kernels.unpack_gather(packed, x.numel(), flat, s, d, width)
    assert bad == 0 and torch.equal(torch.from_numpy(values), gather_levels(torch.from_numpy(idx), levels, d))
    values, bad = kernels.unpack_gather(idx, x.numel(), flat, s, d, 8)
    assert bad == 0 and torch.equal(torch.from_numpy(values), gather_levels(torch.from_numpy(idx), levels, d))
    return idx


@pytest.mark.parametrize("name", ["orq", "linear", "orq:refine=2"])
@pytest.mark.parametrize("s", [3, 8, 9, 33])
def test_numba_and_torch_select_the_same_levels_and_indices(name, s):
    codec = get_codec(name, levels=s, bucket_size=100)
    x = sample_tensor((1234,), seed=5) * torch.rand(1234, generator=torch.Generator().manual_seed(5))
    x[:50] = 0.0  # ties
    cpu = torch.from_numpy(codec.quantizer._levels_kernel(x.numpy()))
    assert torch.equal(cpu, codec.quantizer._levels_torch(x))
    _kernel_round_trip(x, cpu, 100, 9)


@pytest.mark.parametrize("name", ["orq", "linear"])
def test_parallel_kernels_equal_the_torch_path(name):
    n = PARALLEL_MIN + 1001  # parallel loops, short last bucket
    codec = get_codec(name, levels=8)
    x = sample_tensor((n,), seed=6)
    levels = codec.quantizer.select_levels(x)
    assert torch.equal(levels, codec.quantizer._levels_torch(x))
    _kernel_round_trip(x, levels, 512, 3)


@pytest.mark.parametrize("s", [2, 3, 5, 9, 17, 33, 65, 129, 256])
def test_every_index_width_packs_as_the_wire_packer(s):
    # Widths 1..8; 3 * CHUNK + 5 elements: several chunks, a partial last one, buckets across chunks.
    n = 3 * CHUNK + 5
    x = sample_tensor((n,), seed=s)
    levels = torch.sort(torch.randn(-(-n // 1000), s, generator=torch.Generator().manual_seed(s)), dim=1).values
    idx = _kernel_round_trip(x, levels, 1000, 4)
    assert idx.max() == s - 1 and idx.min() == 0


def test_serial_and_parallel_versions_agree():
    x = sample_tensor((5 * CHUNK + 77,), seed=7).numpy()
    levels = np.sort(np.random.default_rng(7).standard_normal((-(-x.size // 300), 5)).astype(np.float32), axis=1)
    args = (x, levels, 300, kernel_key(2), False)
    tree = tuple(np.array(a, np.int64) for a in zip(*L.level_schedule(9), strict=True))
    none = np.zeros(0, np.int64)
    for call in [
        (9, 0, *tree, 0),
        (9, 1, none, none, none, 0),
        (2, 2, none, none, none, 0),
        (2, 3, none, none, none, 20),
    ]:
        select = kernels.select_levels
        assert np.array_equal(select.parallel(x, 300, *call), select.serial(x, 300, *call)), call[1]
    outputs = {}
    for version in ("serial", "parallel"):
        packed = np.empty(packed_size(x.size, 3), np.uint8)
        getattr(kernels.round_pack_into, version)(*args, 3, packed, np.zeros((3, 0), np.int64))
        indices, counts = np.empty(x.size, np.uint8), np.zeros((3, 5), np.int64)
        getattr(kernels.round_pack_into, version)(*args, 8, indices, counts)
        assert np.array_equal(counts.sum(axis=0), np.bincount(indices, minlength=5))
        values = np.empty(x.size, np.float32)
        bad = getattr(kernels.unpack_gather_into, version)(packed, x.size, levels.reshape(-1), 5, 300, 3, values)
        outputs[version] = (packed, indices, values, bad)
    for serial, parallel in zip(outputs["serial"], outputs["parallel"], strict=True):
        assert np.array_equal(serial, parallel)


@pytest.mark.parametrize(
    ("n", "d", "s"),
    [(3 * PARALLEL_MIN + 5, 7, 5), (100003, 1, 2), (70001, 513, 9), (17, 3, 3), (200000, 100000, 4)],
)
def test_decode_kernel_gathers_the_right_bucket_row_and_counts_bad_indices(n, d, s):
    rng = np.random.default_rng(n)
    levels = rng.standard_normal((-(-n // d), s)).astype(np.float32)
    idx = rng.integers(0, s, n).astype(np.uint8)
    width = bit_width(s)
    expected = gather_levels(torch.from_numpy(idx), torch.from_numpy(levels), d).numpy()
    values, bad = kernels.unpack_gather(pack_bits(idx, width), n, levels.reshape(-1), s, d, width)
    assert bad == 0 and np.array_equal(values, expected)
    # Indices >= s decode to 0 and are counted: any byte from the entropy decoder's alphabet
    # check's point of view, and the unused codes of a fixed width (s = 5, 9, 3 here).
    spots = [0, n // 2, n - 1]
    forged = idx.copy()
    forged[spots] = 255
    values, bad = kernels.unpack_gather(forged, n, levels.reshape(-1), s, d, 8)
    assert bad == 3 and np.all(values[spots] == 0.0)
    assert np.array_equal(np.delete(values, spots), np.delete(expected, spots))
    if (1 << width) > s:
        forged[spots] = (1 << width) - 1
        values, bad = kernels.unpack_gather(pack_bits(forged, width), n, levels.reshape(-1), s, d, width)
        assert bad == 3 and np.array_equal(np.delete(values, spots), np.delete(expected, spots))


@pytest.mark.parametrize(
    "spec",
    [
        "orq",
        "orq:levels=8,refine=2,clip=2.5",
        "linear:levels=5,level_dtype=float16",
        "bingrad-b",
        "bingrad-pb",
        "orq:coding=entropy",
        "bingrad-b:coding=entropy",
    ],
)
def test_torch_path_end_to_end_gives_the_same_bytes(spec):
    # The path CUDA tensors take (batched torch levels, rounding and gather), run on the CPU.
    codec = get_codec(spec, bucket_size=300)
    x = sample_tensor((7, 1001), seed=12)
    expected = codec.encode(x, seed=5)
    values = codec.decode(expected, seed=5)
    codec.quantizer.force_torch = True
    assert codec.encode(x, seed=5) == expected
    assert torch.equal(codec.decode(expected, seed=5), values)


@cuda
@pytest.mark.parametrize("spec", ["orq", "linear:levels=5", "orq:levels=9,level_dtype=float16,clip=2.5"])
def test_cuda_encode_gives_the_cpu_bytes(spec):
    codec = get_codec(spec)
    x = sample_tensor((3, 1000), seed=8)
    assert codec.encode(x.cuda(), seed=4) == codec.encode(x, seed=4)


# ---------------------------------------------------------------- buckets, clipping, wire
@pytest.mark.parametrize("name", ["orq", "linear", "bingrad-b", "bingrad-pb"])
def test_short_last_bucket_uses_only_its_own_values(name):
    codec = get_codec(name, bucket_size=16)
    x = torch.cat([sample_tensor((32,), seed=1), torch.tensor([100.0, 101.0, 102.0])])
    for levels in (codec.quantizer.select_levels(x), codec.quantizer._levels_torch(x)):
        assert levels.shape[0] == 3
        assert levels[2].min() >= 100.0 and levels[2].max() <= 102.0


@pytest.mark.parametrize("spec", ["orq:levels=5", "linear:levels=16", "orq:levels=3,level_dtype=float16"])
def test_payload_size_is_levels_plus_packed_indices(spec):
    codec = get_codec(spec)
    x = sample_tensor((1000,), seed=2)
    body = read_payload(codec.encode(x, seed=1)).body
    per_level = 2 if codec.level_dtype == "float16" else 4
    assert body.nbytes == 2 * codec.levels * per_level + packed_size(1000, bit_width(codec.levels))


@pytest.mark.parametrize("name", ["orq", "linear", "bingrad-b", "bingrad-pb"])
def test_entropy_coding_decodes_the_same_values_in_fewer_bytes(name):
    x = sample_tensor((20000,), seed=3) ** 3  # peaked: the outer levels are rarely used
    levels = {"levels": 9} if name in ("orq", "linear") else {}
    fixed, coded = get_codec(name, **levels), get_codec(name, coding="entropy", **levels)
    a, b = fixed.encode(x, seed=2), coded.encode(x, seed=2)
    assert torch.equal(fixed.decode(a, seed=2), coded.decode(b, seed=2))
    if name in ("orq", "linear"):  # 9 levels in 4 bits leave room; 1-bit BinGrad indices barely compress
        assert len(b) < 0.95 * len(a)
    else:
        assert len(b) < len(a) + 64


@pytest.mark.parametrize("name", ["orq", "linear", "bingrad-b", "bingrad-pb"])
@pytest.mark.parametrize("shape", [(1,), (7, 100), (1500,)])
def test_entropy_coding_round_trips_onto_the_sent_levels(name, shape):
    # Every decoded value is one of its bucket's levels as they travel, and the index decoded is
    # the one the fixed-width payload of the same seed carries.
    codec = get_codec(name, bucket_size=64, coding="entropy", level_dtype="float16")
    x = sample_tensor(shape, seed=21)
    y = codec.decode(codec.encode(x, seed=4), seed=4)
    assert y.shape == x.shape and y.dtype == x.dtype
    fixed = get_codec(name, bucket_size=64, level_dtype="float16")
    assert torch.equal(y, fixed.decode(fixed.encode(x, seed=4), seed=4))
    levels = codec.quantizer.wire_levels(codec.quantizer.select_levels(x.reshape(-1)).numpy()).astype(np.float32)
    values = y.reshape(-1).numpy()
    for b, lv in enumerate(levels):
        assert np.isin(values[64 * b : 64 * (b + 1)], lv).all()


def test_float16_end_levels_round_outward_and_range_is_checked():
    codec = get_codec("orq:levels=5,level_dtype=float16")
    x = sample_tensor((4096,), seed=3) * 0.1234567
    wire = codec.quantizer.wire_levels(codec.quantizer.select_levels(x).numpy()).astype(np.float32)
    rows = x.view(-1, 512).numpy()
    assert np.all(wire[:, 0] <= rows.min(axis=1)) and np.all(wire[:, -1] >= rows.max(axis=1))
    assert np.all(np.diff(wire, axis=1) >= 0)
    with pytest.raises(ValueError, match="float16"):
        codec.encode(torch.tensor([1e5, -3.0, 2.0]))


def test_clip_bounds_the_levels_at_c_sigma():
    x = sample_tensor((4096,), seed=4)
    x[7] = 40.0
    bound = 2.5 * x.std(correction=0).item()
    for spec in ("orq:clip=2.5", "linear:clip=2.5"):
        y = get_codec(spec).decode(get_codec(spec).encode(x, seed=1), seed=1)
        assert y.abs().max().item() <= bound * (1 + 1e-6)
    assert get_codec("orq").decode(get_codec("orq").encode(x, seed=1), seed=1).max().item() == 40.0


def test_rejects_out_of_range_level_indices_even_with_a_valid_crc():
    codec = get_codec("orq:levels=5,bucket_size=8")  # 3-bit indices, so 5..7 are invalid
    x = sample_tensor((16,), seed=1)
    p = read_payload(codec.encode(x, seed=1))
    body = bytearray(p.body)
    body[2 * 5 * 4] |= 0b111  # first index := 7
    forged = write_payload(p.spec, p.dtype, p.shape, [bytes(body)])
    with pytest.raises(PayloadError, match="level indices"):
        codec.decode(forged, seed=1)


@pytest.mark.parametrize(
    "spec",
    [
        "orq:levels=5,level_dtype=float16,clip=2.5",
        "linear:levels=3,bucket_size=7",
        "orq:levels=200",
        "orq:coding=entropy",
        "linear:coding=entropy,levels=2",
        "bingrad-b:coding=entropy,level_dtype=float16",
        "bingrad-pb:coding=entropy,bucket_size=100",
    ],
)
@pytest.mark.parametrize(
    "check",
    [
        common.test_rejects_empty_truncated_and_extended,
        common.test_rejects_every_single_bit_flip_in_header_and_body,
        common.test_rejects_forged_bodies_of_wrong_length,
        common.test_rejects_wrong_shape_and_dtype,
        common.test_zeros_come_back_as_zeros,
        common.test_non_contiguous_input_equals_its_contiguous_copy,
    ],
    ids=lambda f: getattr(f, "__name__", str(f)),
)
def test_bad_input_contract_with_non_default_parameters(spec, check):
    check(get_codec(spec))
