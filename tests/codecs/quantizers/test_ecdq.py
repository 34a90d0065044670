"""ECDQ (``ecdq:bits=B``): rate theory, exact error, unbiasedness, the two paths, the contexts, bad payloads.

The quantizer is tested with its rotation (the codec) and bare (``Codec(ECDQQuantizer(...))``)
where the claim does not depend on the rotation: the dithered error is uniform on the lattice's
cell and independent of the input, so its variance is known exactly (``G c**2`` times the squared
RMS) and the mean of independent decodes converges to the input at a rate fixed by it.
"""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import Codec, get_codec
from fedquant.codecs.kernels import e8
from fedquant.codecs.kernels.common import PARALLEL_MIN, kernel_key
from fedquant.codecs.quantizers import ecdq
from fedquant.codecs.quantizers.ecdq import ECDQQuantizer, gaussian_rate, step_constant
from fedquant.wire import read_payload, write_payload
from tests.helpers import cuda

LATTICES = ("z", "e8")


def gaussian(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def student_t3(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(3, n, generator=g, dtype=torch.float64).square().sum(0)
    return (z / (chi2 / 3).sqrt()).float()


def bare(**params) -> Codec:
    return Codec(ECDQQuantizer(**params))


def body(payload: bytes) -> bytes:
    return bytes(read_payload(payload).body)


def with_body(payload: bytes, new_body: bytes) -> bytes:
    p = read_payload(payload)
    return write_payload(p.spec, p.dtype, p.shape, [new_body])


# ---------------------------------------------------------------- rate theory
def test_gaussian_rate_has_the_high_and_low_rate_limits():
    # High rate: h(N(0, 1)) - log2 c = 0.5 log2(2 pi e) - log2 c.
    for c in (0.01, 0.02):
        assert gaussian_rate(c) == pytest.approx(0.5 * math.log2(2 * math.pi * math.e) - math.log2(c), abs=2e-4)
    # It lies between the Gaussian channel's 1/2 log2(1 + 12 / c^2) and that plus 1/2 log2(2 pi e / 12).
    for c in (0.3, 1.0, 2.5, 6.0):
        lower = 0.5 * math.log2(1 + 12 / c**2)
        assert lower < gaussian_rate(c) < lower + 0.5 * math.log2(2 * math.pi * math.e / 12) + 1e-9
    rates = [gaussian_rate(c) for c in (5.0, 10.0, 50.0)]
    assert rates[0] > rates[1] > rates[2] > 0 and rates[2] < 0.06  # slowly: a uniform cell has hard edges
    for b in (0.5, 1.0, 2.0, 4.0):
        assert gaussian_rate(step_constant(b)) == pytest.approx(b, abs=1e-6)


def test_the_rate_is_the_conditional_entropy_of_the_indices_given_the_dither():
    """Zamir–Feder: H(q | u) = I(X; X + cN); measured with the 64 fine dither bins on 2**20 draws."""
    n = 1 << 20
    x = gaussian(n, 3).double().numpy()
    for c in (0.5, 1.0, 2.5):
        u = torch.rand(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64).numpy() - 0.5
        q = np.rint(x / c + u).astype(np.int64)
        bins = np.floor((u + 0.5) * 64).astype(np.int64)
        joint = np.unique(bins * 10_000 + q, return_counts=True)[1]
        marginal = np.bincount(bins)
        h = (-(joint * np.log2(joint)).sum() + (marginal * np.log2(marginal[marginal > 0])).sum()) / n
        assert h == pytest.approx(gaussian_rate(c), abs=4e-3), c


def test_e8_rate_table_matches_a_fresh_measurement():
    from benchmarks.ecdq_calibration import e8_model_rate

    for c in (0.252053, 1.00492, 2.52672):  # 4, 2 and 1 bits; the table is measured on 2**21 coordinates
        assert e8_model_rate(c, 1 << 20, seed=5) == pytest.approx(ecdq.e8_rate(c), abs=0.008)


def test_auto_lattice_and_refused_settings():
    quantizer = get_codec("ecdq").quantizer
    assert quantizer.lattice_for(1 << 20) == quantizer.lattice_for(ecdq.E8_MIN_NUMEL) == "e8"
    assert quantizer.lattice_for(ecdq.E8_MIN_NUMEL - 8) == "z"
    assert get_codec("ecdq:bits=0.3").quantizer.lattice_for(1 << 20) == "z"
    assert get_codec("ecdq:lattice=e8").quantizer.lattice_for(8) == "e8"
    # auto quantizes exactly as the lattice it picks
    for n, lattice in [(ecdq.E8_MIN_NUMEL, "e8"), (ecdq.E8_MIN_NUMEL - 8, "z")]:
        x = gaussian(n, 1)
        auto, fixed = bare(bits=1.0), bare(bits=1.0, lattice=lattice)
        assert torch.equal(auto.decode(auto.encode(x, seed=3), seed=3), fixed.decode(fixed.encode(x, seed=3), seed=3))
    assert get_codec("ecdq").spec == "rht+ecdq:bits=1.0,coding=entropy,lattice=auto"
    for spec, message in [("ecdq:bits=0", "bits"), ("ecdq:bits=9", "bits"), ("ecdq:lattice=d4", "lattice")]:
        with pytest.raises(ValueError, match=message):
            get_codec(spec)
    with pytest.raises(ValueError, match="lattice=z"):
        get_codec("ecdq:bits=0.2,lattice=e8")


# ---------------------------------------------------------------- the E8 lattice
def _roots() -> np.ndarray:
    """The 240 minimal vectors of E8: the Voronoi-relevant vectors of the lattice."""
    out = []
    for i, j in itertools.combinations(range(8), 2):
        for si, sj in itertools.product((-1, 1), repeat=2):
            v = np.zeros(8)
            v[i], v[j] = si, sj
            out.append(v)
    for signs in itertools.product((-0.5, 0.5), repeat=8):
        if sum(s < 0 for s in signs) % 2 == 0:
            out.append(np.array(signs))
    return np.array(out)


@pytest.mark.parametrize("torch_path", [False, True])
def test_e8_points_are_nearest_and_in_the_lattice(torch_path):
    rng = np.random.default_rng(1)
    y = (rng.standard_normal(8 * 4000) * 3).astype(np.float32)
    key = kernel_key(9)
    if torch_path:
        z, _ = e8.torch_uniforms(9, y.size, "cpu")
        m, coset = e8.torch_lattice(torch.from_numpy(y), 1.0, z)
        m, coset, z = m.numpy(), coset.numpy(), z.numpy().reshape(-1, 8)
    else:
        m = np.empty(y.size, np.int16)
        coset = np.empty(y.size // 8, np.uint8)
        e8.lattice_counts(y, 1.0, key, 0, 0, 1, m, coset)
        m = e8.natural_order(m).reshape(-1, 8).astype(np.int64)
        z = e8.torch_uniforms(9, y.size, "cpu")[0].numpy().reshape(-1, 8)
    assert (m.sum(1) % 2 == 0).all()  # lambda - coset/2 is in D8
    lam = m + 0.5 * coset[:, None]
    t = y.reshape(-1, 8).astype(np.float64) + z
    best = ((t - lam) ** 2).sum(1)
    neighbours = ((t[:, None, :] - lam[:, None, :] - _roots()[None]) ** 2).sum(2)
    assert (best[:, None] <= neighbours + 1e-12).all()


def test_the_dither_makes_the_e8_error_uniform_on_the_cell():
    """Per-coordinate second moment G = 929/12960 of the cell, and uncorrelated with the input."""
    n = 1 << 18
    x = gaussian(n, 2) * 0.3
    codec = bare(bits=2.0, lattice="e8")
    err = (codec.decode(codec.encode(x, seed=1), seed=1) - x).double()
    step = float(np.frombuffer(body(codec.encode(x, seed=1))[:4], "<f4")[0])
    assert float(err.square().mean()) / step**2 == pytest.approx(e8.SECOND_MOMENT, rel=0.01)
    assert abs(float(torch.corrcoef(torch.stack([err, x.double()]))[0, 1])) < 0.01


# ---------------------------------------------------------------- error and rate of the codec
@pytest.mark.parametrize("lattice", LATTICES)
@pytest.mark.parametrize("source", ["gaussian", "student_t3", "spike"])
def test_vnmse_is_the_declared_variance_on_any_input(lattice, source):
    n = 1 << 16
    x = {"gaussian": gaussian(n, 1), "student_t3": student_t3(n, 1), "spike": torch.zeros(n)}[source]
    if source == "spike":
        x[:512] = gaussian(512, 3) * 100  # one rotation block holds all the energy
        x[1000] = 1.0
    codec = get_codec(f"ecdq:bits=1.5,lattice={lattice}")
    errs = []
    for seed in range(4):
        y = codec.decode(codec.encode(x, seed=seed), seed=seed)
        errs.append(float((y - x).double().square().sum() / x.double().square().sum()))
    assert np.mean(errs) == pytest.approx(codec.quantizer.vnmse(), rel=0.02)


@pytest.mark.parametrize("lattice", LATTICES)
@pytest.mark.parametrize("bits", [1.0, 2.0, 3.0])
def test_payload_bits_follow_the_target_on_gaussian_data(lattice, bits):
    n = 1 << 20
    x = gaussian(n, 8)
    codec = get_codec(f"ecdq:bits={bits},lattice={lattice}")
    measured = 8 * len(codec.encode(x, seed=2)) / n
    assert bits - 0.005 <= measured <= bits + 0.012, measured


def test_e8_beats_z_and_both_beat_eden_at_equal_payload_bits():
    n = 1 << 18
    x = gaussian(n, 6)

    def point(spec):
        codec = get_codec(spec)
        payload = codec.encode(x, seed=1)
        y = codec.decode(payload, seed=1)
        return 8 * len(payload) / n, float((y - x).square().sum() / x.square().sum())

    eden_bits, eden_err = point("eden:bits=2,coding=entropy")
    z_bits, z_err = point(f"ecdq:bits={eden_bits - 0.02:.4f},lattice=z")
    e8_bits, e8_err = point(f"ecdq:bits={eden_bits - 0.02:.4f},lattice=e8")
    assert z_bits <= eden_bits and e8_bits <= eden_bits
    assert e8_err < 0.9 * z_err and z_err < eden_err


@pytest.mark.parametrize("lattice", LATTICES)
def test_declared_error_is_exact_and_the_bound_holds(lattice):
    """``expected_error`` (given the input) and ``error_bound`` (omega, any input) against measurement."""
    n = 1 << 16
    quantizer = ECDQQuantizer(bits=1.5, lattice=lattice)
    codec = Codec(quantizer)
    for x in (gaussian(n, 4), student_t3(n, 4), torch.zeros(n).index_fill_(0, torch.tensor([3]), 1e4)):
        measured = np.mean(
            [float((codec.decode(codec.encode(x, seed=s), seed=s) - x).double().square().sum()) for s in range(4)]
        ) / float(x.double().square().sum())
        assert measured == pytest.approx(quantizer.expected_error(x), rel=0.05)
        assert measured <= 1.01 * quantizer.error_bound(n)  # a bound on the expectation; 4 draws scatter ~0.2%
    assert quantizer.error_bound(n) == pytest.approx(quantizer.vnmse(), rel=1e-5)


# ---------------------------------------------------------------- unbiasedness
def _mean_error_ratio(codec: Codec, x: torch.Tensor, trials: int) -> float:
    """``T ||mean - x||^2 / E||x_hat - x||^2``: 1 for an unbiased codec (chi-square, relative sd ~ sqrt(2 / n))."""
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(trials):
        total += codec.decode(codec.encode(x, seed=seed), seed=seed).double()
    expected = codec.quantizer.vnmse(x.numel()) * float(x.double().square().sum())
    return trials * float((total / trials - x.double()).square().sum()) / expected


@pytest.mark.parametrize("lattice", LATTICES)
@pytest.mark.parametrize("source", ["gaussian", "spike"])
def test_unbiased_by_averaging_seeded_decodes(lattice, source):
    n = 4096
    x = gaussian(n, 77)
    if source == "spike":  # EDEN's worst case behind the Hadamard rotation: one coordinate holds the energy
        x = x * 0.01
        x[5] = 30.0
    codec = get_codec(f"ecdq:bits=1.0,lattice={lattice}")
    ratio = _mean_error_ratio(codec, x, 300)
    # n = 4096 coordinates: the ratio's sd is about 0.03; a bias of 1% of the error's RMS per
    # coordinate would add 300 * 1e-4 = 0.03, a bias of 3% would add 0.27.
    assert 0.85 < ratio < 1.15, ratio


def test_the_unbiasedness_check_detects_a_small_bias():
    x = gaussian(4096, 77)
    codec = get_codec("ecdq:bits=1.0")

    class Shifted(Codec):
        def decode(self, payload, seed=0, side_info=None, **kw):
            y = super().decode(payload, seed, side_info, **kw)
            return y + 0.05 * math.sqrt(codec.quantizer.vnmse(x.numel())) * x.abs().mean()

    shifted = Shifted(codec.quantizer, codec.wire_transforms)
    assert _mean_error_ratio(shifted, x, 300) > 1.15


# ---------------------------------------------------------------- the two paths
SPECS = [
    "ecdq:bits=1.0",
    "ecdq:bits=3.0,coding=fixed",
    "ecdq:bits=0.4",
    "ecdq:bits=1.0,lattice=z",
    "ecdq:bits=4.0,lattice=z,coding=fixed",
    "ecdq:bits=8.0,lattice=e8",
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [0, 1, 5, 9, 3000, PARALLEL_MIN + 24])
def test_kernels_and_torch_twin_write_the_same_bytes_and_values(spec, n):
    x = student_t3(n, n + 1)
    kernel = get_codec(spec)
    twin = get_codec(spec)
    twin.force_torch = True
    payload = kernel.encode(x, seed=11)
    assert twin.encode(x, seed=11) == payload
    assert torch.equal(kernel.decode(payload, seed=11), twin.decode(payload, seed=11))


def test_e8_counts_again_when_its_histogram_bound_was_too_wide(monkeypatch):
    """The E8 encoder sizes its histogram from ``max |y| / step`` before it knows ``h``; when that bound
    is beyond ``HIST_MAX_H`` but ``h`` is not, it counts again, and writes the torch twin's bytes."""
    x = gaussian(PARALLEL_MIN + 24, 8)
    calls = []
    fused = e8.lattice_counts

    def counted(*args):
        calls.append(args[4])  # the histogram's width
        return fused(*args)

    monkeypatch.setattr(e8, "lattice_counts", counted)
    recounted = 0
    for bound in range(12, 30):
        monkeypatch.setitem(ecdq.HIST_MAX_H, "e8", bound)
        calls.clear()
        kernel, twin = get_codec("ecdq:bits=4.0,lattice=e8"), get_codec("ecdq:bits=4.0,lattice=e8")
        twin.force_torch = True
        assert kernel.encode(x, seed=4) == twin.encode(x, seed=4)
        recounted += len(calls) == 2 and calls[0] == 0 and calls[1] > 0
    assert recounted  # some bound fell between h and the a-priori bound


@pytest.mark.parametrize("spec", ["ecdq:bits=1.0", "ecdq:bits=2.0,lattice=z"])
def test_thread_count_does_not_change_the_bytes(spec):
    import numba

    x = gaussian(PARALLEL_MIN * 4, 2)
    codec = get_codec(spec)
    before = numba.get_num_threads()
    payloads = []
    try:
        for threads in (1, before):
            numba.set_num_threads(threads)
            payloads.append(codec.encode(x, seed=3))
    finally:
        numba.set_num_threads(before)
    assert payloads[0] == payloads[1]


@cuda
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_torch_path_writes_the_cpu_kernel_bytes(spec):
    x = student_t3(PARALLEL_MIN + 24, 5)
    codec = get_codec(spec)
    payload = codec.encode(x, seed=4)
    assert codec.encode(x.cuda(), seed=4) == payload
    torch.testing.assert_close(codec.decode(payload, seed=4, device="cuda").cpu(), codec.decode(payload, seed=4))


# ---------------------------------------------------------------- contexts
def test_contexts_grow_with_the_tensor_at_low_rates():
    def log2k(n, spec):
        return int(body(get_codec(spec).encode(gaussian(n, 1), seed=1))[6])

    assert log2k(64, "ecdq:bits=1.0,lattice=z") <= 1  # one table (K = 2 folds onto one)
    assert log2k(1 << 20, "ecdq:bits=1.0,lattice=z") >= 4
    assert log2k(1 << 20, "ecdq:bits=1.0") >= log2k(4096, "ecdq:bits=1.0")


@pytest.mark.parametrize("spec", ["ecdq:bits=1.0,lattice=z", "ecdq:bits=3.0,lattice=z"])
def test_the_context_cost_model_predicts_the_section_size(spec):
    """The encoder's estimate (information + count tables + lengths) against the bytes it writes."""
    n = 1 << 18
    codec = get_codec(spec)
    quantizer = codec.quantizer
    y = codec.wire_transforms[0].forward(gaussian(n, 3), 1).numpy()
    sumsq, top = ecdq.kernels.norm_and_max(y)
    _, inv = quantizer.step_for(float(sumsq), float(top), n)
    half = int(float(top) * inv) + 2
    h, _, hist = ecdq.kernels.scan(y, inv, kernel_key(1), half, 4)
    hist = hist[:, half - h : half + h + 1]
    log2k = ecdq.choose_contexts(hist, ecdq.SCALAR)
    estimate = ecdq.coded_bits(ecdq.SCALAR.folded(hist, log2k)) / 8
    section = len(body(codec.encode(gaussian(n, 3), seed=1))) - 7
    assert estimate == pytest.approx(section, rel=0.002)


# ---------------------------------------------------------------- edge inputs
@pytest.mark.parametrize("lattice", LATTICES)
@pytest.mark.parametrize("coding", ["entropy", "fixed"])
def test_zeros_empty_and_tiny_tensors(lattice, coding):
    codec = get_codec(f"ecdq:lattice={lattice},coding={coding}")
    for x in (torch.zeros(0), torch.zeros(3, 0), torch.zeros(1000), torch.ones(1), torch.tensor([2.0, -1.0, 0.5])):
        y = codec.decode(codec.encode(x, seed=2), seed=2, shape=x.shape)
        assert y.shape == x.shape and bool(torch.isfinite(y).all())
        if not x.any():
            assert torch.equal(y, torch.zeros_like(x))


@pytest.mark.parametrize("lattice", LATTICES)
def test_a_lone_spike_without_rotation_keeps_the_index_range(lattice):
    """One coordinate far above the RMS: the step floor keeps h <= H_MAX, the estimate stays unbiased."""
    x = torch.zeros(1 << 16)
    x[7] = 1e4
    x[100] = 1e-3
    codec = bare(bits=4.0, lattice=lattice)
    payload = codec.encode(x, seed=1)
    assert int(np.frombuffer(body(payload)[4:6], "<u2")[0]) <= ecdq.H_MAX
    mean = torch.stack([codec.decode(codec.encode(x, seed=s), seed=s) for s in range(50)]).double().mean(0)
    step = float(np.frombuffer(body(payload)[:4], "<f4")[0])
    assert abs(float(mean[7]) - 1e4) < 6 * step / math.sqrt(12 * 50)


def test_values_near_the_float32_range_are_refused_or_decode_finite():
    codec = bare(bits=1.0, lattice="z")
    with pytest.raises(ValueError, match="float32 range"):
        codec.encode(torch.tensor([3.4e38, -3.4e38] + [1.0] * 6))
    y = codec.decode(codec.encode(torch.tensor([1e37] * 8), seed=1), seed=1)
    assert bool(torch.isfinite(y).all())


# ---------------------------------------------------------------- bad payloads
def _forged_side(payload: bytes, offset: int, raw: bytes) -> bytes:
    b = bytearray(body(payload))
    b[offset : offset + len(raw)] = raw
    return with_body(payload, bytes(b))


@pytest.mark.parametrize("spec", ["ecdq:bits=1.0", "ecdq:bits=2.0,lattice=z", "ecdq:bits=2.0,coding=fixed"])
def test_forged_side_data_and_sections_are_payload_errors(spec):
    codec = get_codec(spec)
    x = gaussian(3000, 1)
    good = codec.encode(x, seed=4)
    forged = [
        _forged_side(good, 0, struct.pack("<f", -1.0)),
        _forged_side(good, 0, struct.pack("<f", float("nan"))),
        _forged_side(good, 0, struct.pack("<f", 3e38)),  # decodes to Inf
        _forged_side(good, 4, struct.pack("<H", ecdq.H_MAX + 1)),
        _forged_side(good, 4, struct.pack("<H", 0)),  # symbols beyond the declared range
        with_body(good, body(good)[:-1]),
        with_body(good, body(good) + b"\x00"),
    ]
    if "fixed" not in spec:
        forged.append(_forged_side(good, 6, bytes([7])))  # 2**7 contexts
        forged.append(_forged_side(good, 6, bytes([(body(good)[6] + 1) % 7])))  # other contexts, other tables
        forged.append(_forged_side(good, 7, struct.pack("<I", 2**32 - 1)))  # a section longer than the body
    for bad in forged:
        with pytest.raises(PayloadError):
            codec.decode(bad, seed=4)


def test_e8_blocks_of_odd_sum_are_refused():
    codec = get_codec("ecdq:bits=2.0,lattice=e8,coding=fixed")
    x = gaussian(512, 2)
    good = body(codec.encode(x, seed=4))
    h = int(np.frombuffer(good[4:6], "<u2")[0])
    width = (2 * h).bit_length()
    symbols_at = 6 + (512 // 8 + 7) // 8
    bits = np.unpackbits(np.frombuffer(good[symbols_at:], np.uint8), bitorder="little")
    bits[0] ^= 1  # the first symbol's lowest bit: the block's sum turns odd
    bad = good[:symbols_at] + np.packbits(bits, bitorder="little").tobytes()
    assert len(bad) == len(good) and width >= 1
    with pytest.raises(PayloadError, match="odd sum"):
        codec.decode(with_body(codec.encode(x, seed=4), bad), seed=4)


def test_decoding_with_another_seed_is_refused_or_wrong_but_finite():
    codec = get_codec("ecdq:bits=1.0")
    x = gaussian(4096, 1)
    payload = codec.encode(x, seed=1)
    try:
        y = codec.decode(payload, seed=2)
    except PayloadError:
        return
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("tables", [1, 7, 128])
def test_chunk_offsets_kernel_matches_its_twin(tables):
    from fedquant.codecs.kernels import ecdq as kernels

    rng = np.random.default_rng(tables)
    fine = rng.integers(0, 50, (37, 512))
    fine[:, rng.integers(0, 512, 40)] = 0  # contexts absent from every chunk
    table = rng.integers(0, tables, 512)
    got, want = kernels._offsets.kernel(fine, table, tables), kernels._offsets.twin(fine, table, tables)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert int(got[1].sum()) == int(fine.sum())


# ---------------------------------------------------------------- below one bit: the shared-seed subsample
def test_keep_one_writes_the_bytes_of_no_subsample():
    x = gaussian(5000, 3)
    for spec in ("ecdq:bits=0.5", "ecdq:bits=2.0,lattice=e8,coding=fixed"):
        plain, kept = get_codec(spec), get_codec(spec + ",keep=1")
        assert kept.spec == plain.spec and kept.encode(x, seed=2) == plain.encode(x, seed=2)
    assert get_codec("ecdq:keep=0.5").spec == "rht+ecdq:bits=1.0,coding=entropy,keep=0.5,lattice=auto"


def test_keep_sends_the_masked_coordinates_scaled_and_zeros_elsewhere():
    from fedquant.codecs.quantizers import subsample

    n, keep = 1 << 14, 0.3
    x = gaussian(n, 5)
    codec = bare(bits=0.6, keep=keep, lattice="z")
    y = codec.decode(codec.encode(x, seed=7), seed=7)
    mask = subsample.kept_mask(7, n, keep, kernel=False)
    assert torch.equal(mask, subsample.kept_mask(7, n, keep, kernel=True))
    assert abs(int(mask.sum()) - keep * n) < 4 * math.sqrt(n * keep * (1 - keep))
    assert not y[~mask].any() and bool(y[mask].any())
    # the kept values are ECDQ's at bits / keep, scaled: the same dither on the kept coordinates
    inner = bare(bits=0.6 / keep, lattice="z")
    want = inner.decode(inner.encode(x[mask], seed=7), seed=7) / subsample.probability(keep)
    torch.testing.assert_close(y[mask], want, rtol=1e-6, atol=0)
    # the mask's stream is not the dither's: another seed, another mask
    assert not torch.equal(mask, subsample.kept_mask(8, n, keep, kernel=False))


@pytest.mark.parametrize("spec", ["ecdq:bits=0.5,keep=0.65", "ecdq:bits=0.25,keep=0.4,lattice=z"])
def test_keep_vnmse_is_the_subsample_formula(spec):
    n = 1 << 16
    codec = get_codec(spec)
    quantizer = codec.quantizer
    x = student_t3(n, 2)
    errs = [float((codec.decode(codec.encode(x, seed=s), seed=s) - x).double().square().sum()) for s in range(4)]
    measured = np.mean(errs) / float(x.double().square().sum())
    inner = ECDQQuantizer(bits=quantizer.coded_bits, lattice=quantizer.lattice_for(quantizer.kept_count(n)))
    formula = (1 + inner.vnmse()) / quantizer.keep - 1
    assert quantizer.vnmse(n) == pytest.approx(formula, rel=1e-6)
    assert measured == pytest.approx(formula, rel=0.02)
    rotated = codec.wire_transforms[0].forward(x, 0)
    assert quantizer.expected_error(rotated) == pytest.approx(formula, rel=0.01)
    assert measured <= 1.02 * quantizer.error_bound(n)  # a bound on the expectation; the mask scatters ~0.5%
    big = 1 << 20  # where count tables are a small part (the size model's estimate holds to ~1%)
    sent = len(codec.encode(gaussian(big, 1), seed=1))
    assert quantizer.bits - 0.005 < 8 * sent / big < quantizer.bits + 0.02  # the whole tensor's rate
    assert codec.predict_bytes(big) == pytest.approx(sent, rel=0.01)


def test_keep_is_unbiased_by_averaging_seeded_decodes():
    x = gaussian(4096, 77)
    x[5] = 30.0
    assert 0.85 < _mean_error_ratio(get_codec("ecdq:bits=0.5,keep=0.5"), x, 300) < 1.15


@pytest.mark.parametrize("spec", ["ecdq:bits=0.5,keep=0.65", "ecdq:bits=1.0,keep=0.5,coding=fixed,lattice=e8"])
@pytest.mark.parametrize("n", [0, 1, 5, 9, 3000, PARALLEL_MIN + 24])
def test_keep_kernels_and_torch_twin_write_the_same_bytes_and_values(spec, n):
    test_kernels_and_torch_twin_write_the_same_bytes_and_values(spec, n)


@cuda
def test_keep_cuda_torch_path_writes_the_cpu_kernel_bytes():
    test_cuda_torch_path_writes_the_cpu_kernel_bytes("ecdq:bits=0.5,keep=0.65")


def test_keep_on_tiny_tensors_and_odd_shapes():
    codec = get_codec("ecdq:bits=0.2,keep=0.1")
    for x in (torch.zeros(0), torch.ones(1), torch.ones(3, 5, 7), torch.zeros(2, 0, 3), gaussian(9, 1).view(3, 3)):
        for seed in range(6):  # some keep no coordinate at all
            y = codec.decode(codec.encode(x, seed=seed), seed=seed, shape=x.shape)
            assert y.shape == x.shape and bool(torch.isfinite(y).all())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ecdq:keep=0", "keep"),
        ("ecdq:keep=-0.5", "keep"),
        ("ecdq:keep=1.5", "keep"),
        ("ecdq:keep=nan", "keep"),
        ("ecdq:keep=x", "keep"),
        ("ecdq:bits=2,keep=0.2", "keep"),  # 10 bits per kept coordinate
        ("ecdq:bits=0.3,keep=0.9,lattice=e8", "lattice=z"),
    ],
)
def test_bad_keep_values_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


def test_keep_in_a_forged_payload_spec_is_refused():
    codec = get_codec("ecdq:bits=0.5,keep=0.5")
    p = read_payload(codec.encode(gaussian(1000, 1), seed=1))
    for keep in ("0.25", "0", "2"):
        forged = write_payload(p.spec.replace("keep=0.5", f"keep={keep}"), p.dtype, p.shape, [bytes(p.body)])
        with pytest.raises(PayloadError):
            codec.decode(forged, seed=1)


def test_keep_refuses_values_that_would_overflow_once_scaled():
    codec = bare(bits=0.5, keep=0.5, lattice="z")
    with pytest.raises(ValueError, match="float32 range"):
        codec.encode(torch.full((64,), 2e38), seed=1)
