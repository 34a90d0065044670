"""DQSG and NDQSG: the paper's worked example, error statistics, wire sizes, seeds, bad input.

Statistical tests use fixed seeds; each bound is a number of standard deviations of the
estimator, derived in a comment, so that a wrong quantizer (no subtraction of the dither, a
different dither than the encoder's, a wrong step) fails them by a wide margin.
"""

import math
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import get_codec
from fedquant.codecs.kernels.dither import dither, nested_quantize, nested_reconstruct
from fedquant.strategies.nested_rules import choose_rho
from fedquant.wire import packed_size, read_payload, write_payload
from fedquant.wire.bitpack import pack_bits
from tests.helpers import cuda, reseal, sample_tensor


def _steps(x: torch.Tensor, levels: int, bucket_size: int) -> torch.Tensor:
    """Per-element step max|bucket| / levels, as the encoders compute it (reference)."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % bucket_size
    b = torch.cat([flat, flat.new_zeros(pad)]).view(-1, bucket_size)
    return (b.abs().amax(1, keepdim=True) / levels).expand_as(b).reshape(-1)[:n]


# ------------------------------------------------------------------ the paper's worked example
def test_worked_example_of_the_paper():
    # Delta1 = 1, Delta2 = 3, x = -4.2, u = 0.3, alpha = 1 -> s = -1; with y = -3.4, x^ = -4.3
    x = torch.tensor([-4.2], dtype=torch.float64)
    step1 = torch.tensor([1.0], dtype=torch.float64)
    u = torch.tensor([0.3], dtype=torch.float64)
    s = nested_quantize(x, step1, u, rho=3, alpha=1.0)
    assert s.tolist() == [-1.0]
    x_hat = nested_reconstruct(s, step1, u, rho=3, alpha=1.0, y=torch.tensor([-3.4], dtype=torch.float64))
    assert x_hat.item() == pytest.approx(-4.3, abs=1e-12)
    # the other values consistent with s = -1 are -4.3 + 3k; the decoder returns the one in y's coarse
    # cell. (The paper's list "-4.3, -1.3, 2.7" has a slip: 2.7 + 0.3 = 3 gives s = 0; 1.7 is meant.)
    for y, expected in ((-1.0, -1.3), (2.0, 1.7), (5.1, 4.7)):
        out = nested_reconstruct(s, step1, u, 3, 1.0, torch.tensor([y], dtype=torch.float64))
        assert out.item() == pytest.approx(expected, abs=1e-12)


def test_nested_indices_stay_in_the_coset_range():
    v = torch.linspace(-50, 50, 10001)
    u = dither(3, v.numel())
    for rho in (3, 5, 7, 9):
        s = nested_quantize(v, torch.ones(1), u, rho, 1.0)
        assert s.min() == -(rho // 2) and s.max() == rho // 2


# ------------------------------------------------------------------ DQSG statistics
def test_dqsg_error_is_uniform_and_independent_of_the_input():
    n, levels, d = 1 << 18, 3, 512
    x = sample_tensor((n,), seed=11)
    codec = get_codec("dqsg", levels=levels, bucket_size=d)
    e = ((codec.decode(codec.encode(x, seed=5), seed=5) - x) / _steps(x, levels, d)).double()
    # e ~ U[-1/2, 1/2]: mean sd = sqrt(1/12 / n); sample-variance sd = sqrt((1/80 - 1/144) / n)
    assert e.abs().max() <= 0.5 + 1e-5
    assert abs(e.mean().item()) < 5 * math.sqrt(1 / 12 / n)
    assert abs(e.pow(2).mean().item() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    # Kolmogorov-Smirnov distance to U[-1/2, 1/2]; 1.95 / sqrt(n) is the 0.1 % critical value
    sorted_e = torch.sort(e).values + 0.5
    ecdf = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert (ecdf - sorted_e).abs().max().item() < 1.95 / math.sqrt(n)
    # uncorrelated with g: sample correlation of independent variables has sd 1/sqrt(n)
    assert abs(torch.corrcoef(torch.stack([e, x.double()]))[0, 1].item()) < 5 / math.sqrt(n)
    # independent of where x sits between two levels: without subtracting the dither the error
    # variance would be d(1-d) (0 near a level, 1/4 half-way); here every bin has 1/12
    frac = torch.frac((x / _steps(x, levels, d)).abs()).double()
    for lo in (0.0, 0.25, 0.5, 0.75):
        sel = e[(frac >= lo) & (frac < lo + 0.25)]
        assert abs(sel.pow(2).mean().item() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / sel.numel())


def test_dqsg_is_unbiased_with_variance_kappa_delta_squared_over_12():
    levels, d, seeds = 2, 16, 1000
    x = sample_tensor((64,), seed=12)
    codec = get_codec("dqsg", levels=levels, bucket_size=d)
    outs = torch.stack([codec.decode(codec.encode(x, seed=s), seed=s) for s in range(seeds)]).double()
    var = (_steps(x, levels, d) ** 2 / 12).double()  # kappa^2 Delta^2 / 12 with Delta = 1/M
    # mean over seeds: sd sqrt(var / seeds) per coordinate; 5 sd with 64 coordinates
    assert ((outs.mean(0) - x.double()).abs() <= 5 * (var / seeds).sqrt()).all()
    # per-coordinate variance over seeds: relative sd sqrt(2 * 4/5 / seeds) (uniform kurtosis 9/5)
    ratio = outs.var(0) / var
    assert (ratio - 1).abs().max().item() < 5 * math.sqrt(1.6 / seeds)
    assert abs(ratio.mean().item() - 1) < 5 * math.sqrt(1.6 / seeds / 64)


def test_dqsg_payload_size_and_index_range():
    x = sample_tensor((3, 700), seed=1)
    for levels, width in ((1, 2), (3, 3), (7, 4), (8, 5)):
        codec = get_codec("dqsg", levels=levels, bucket_size=256)
        body = read_payload(codec.encode(x, seed=2)).body
        assert body.nbytes == 4 * math.ceil(2100 / 256) + packed_size(2100, width)
        y = codec.decode(codec.encode(x, seed=2), seed=2)
        assert ((y - x).abs() <= _steps(x, levels, 256).reshape(3, 700) / 2 * (1 + 1e-5)).all()


def test_zero_bucket_decodes_to_exact_zero_next_to_others():
    x = torch.cat([torch.zeros(512), sample_tensor((300,), seed=3)])
    for codec, kwargs in ((get_codec("dqsg"), {}), (get_codec("ndqsg"), {"side_info": x + 0.01})):
        y = codec.decode(codec.encode(x, seed=4), seed=4, **kwargs)
        assert torch.equal(y[:512], torch.zeros(512))
        assert ((y[512:] - x[512:]).abs() <= x[512:].abs().max() / 3 / 2 + 1e-5).all()


def test_decoding_with_another_seed_is_wrong():
    x = sample_tensor((4096,), seed=5)
    codec = get_codec("dqsg", levels=3)
    data = codec.encode(x, seed=10)
    right = (codec.decode(data, seed=10) - x).pow(2).mean()
    wrong = (codec.decode(data, seed=11) - x).pow(2).mean()
    # right: step^2/12; wrong seed: the error is q-step rounding plus an unrelated dither, ~ step^2/4
    assert wrong > 2.5 * right


# ------------------------------------------------------------------ NDQSG statistics
def _correlated(n, sigma_z, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    z = sigma_z * torch.randn(n, generator=gen, dtype=torch.float64)
    return (y + z).float(), y.float()


@pytest.mark.parametrize("alpha", [1.0, 0.9, 0.6])
def test_ndqsg_mse_matches_theory_without_wrap_around(alpha):
    n, levels, d, sigma_z = 1 << 18, 6, 512, 0.25
    x, y = _correlated(n, sigma_z, seed=21)
    steps = _steps(x, levels, d).double()
    rho = choose_rho(sigma_z, steps.min().item(), alpha, k=7.0)  # a margin of 7 sd: no wraps in 2^18
    codec = get_codec("ndqsg", levels=levels, rho=rho, alpha=alpha, bucket_size=d)
    err = (codec.decode(codec.encode(x, seed=7), seed=7, side_info=y) - x).double()
    z = (x - y).double()
    theory = ((1 - alpha**2) ** 2 * z.pow(2) + alpha**2 * steps.pow(2) / 12).mean().item()
    # e = (alpha^2 - 1) z + alpha Delta1 eps is a sum of a Gaussian and a uniform: kurtosis <= 3,
    # so the sample MSE has relative sd <= sqrt(2 / n) = 0.28 %; 5 sd
    assert abs(err.pow(2).mean().item() / theory - 1) < 5 * math.sqrt(2 / n)
    assert err.abs().max() < (1 - alpha**2) * 7 * sigma_z + alpha * steps.max() / 2 + 1e-3  # no jump by Delta2


def test_ndqsg_with_alpha_one_matches_dqsg_variance_with_fewer_bits():
    n, levels, d, sigma_z = 1 << 18, 8, 512, 0.05
    x, y = _correlated(n, sigma_z, seed=22)
    rho = choose_rho(sigma_z, _steps(x, levels, d).min().item())
    assert rho == 3
    dq = get_codec("dqsg", levels=levels, bucket_size=d)
    nd = get_codec("ndqsg", levels=levels, rho=rho, bucket_size=d)
    p_dq, p_nd = dq.encode(x, seed=8), nd.encode(x, seed=9)
    mse_dq = (dq.decode(p_dq, seed=8) - x).double().pow(2).mean().item()
    mse_nd = (nd.decode(p_nd, seed=9, side_info=y) - x).double().pow(2).mean().item()
    # both are mean(Delta1^2)/12 with independent dithers: each sample MSE has relative sd
    # sqrt(4/5 / n) (uniform errors), the difference sqrt(2) times that; 5 sd
    assert abs(mse_nd / mse_dq - 1) < 5 * math.sqrt(1.6 / n)
    nb = math.ceil(n / d)
    assert len(read_payload(p_dq).body) == 4 * nb + packed_size(n, 5)  # 17 levels: 5 bits
    assert len(read_payload(p_nd).body) == 4 * nb + packed_size(n, 2)  # rho = 3: 2 bits
    # the symbols themselves carry log2(3) bits: all three cosets are about equally likely
    s = _symbols(p_nd, n, 2)
    freq = np.bincount(s, minlength=3) / n
    assert np.abs(freq - 1 / 3).max() < 0.01


def _symbols(payload, n, width):
    from fedquant.wire import unpack_bits

    body = bytes(read_payload(payload).body)
    nb = math.ceil(n / 512)
    return unpack_bits(np.frombuffer(body[4 * nb :], np.uint8), width, n).astype(np.int64)


def test_ndqsg_alpha_one_estimate_does_not_depend_on_side_info_inside_the_cell():
    x, y = _correlated(5000, 0.02, seed=23)
    codec = get_codec("ndqsg", levels=4, rho=5)
    data = codec.encode(x, seed=3)
    a = codec.decode(data, seed=3, side_info=y)
    b = codec.decode(data, seed=3, side_info=y + 0.03 * sample_tensor((5000,), seed=4))
    assert torch.allclose(a, b, atol=1e-5)


def test_ndqsg_wraps_when_side_info_is_too_far():
    x = sample_tensor((2048,), seed=6)
    codec = get_codec("ndqsg", levels=3, rho=3)
    data = codec.encode(x, seed=1)
    step1 = _steps(x, 3, 512)
    far = codec.decode(data, seed=1, side_info=x + 2 * 3 * step1)  # two coarse cells off
    # the decoder returns the value consistent with s that lies in y's coarse cell: x + 2 Delta2
    assert ((far - x - 2 * 3 * step1).abs() <= step1 / 2 + 1e-5).all()


# ------------------------------------------------------------------ seeds across processes
def test_payload_encoded_in_another_process_decodes_here():
    code = (
        "import sys, torch\n"
        "from fedquant.codecs import get_codec\n"
        "from tests.helpers import sample_tensor\n"
        "x = sample_tensor((3000,), seed=31)\n"
        "sys.stdout.buffer.write(get_codec('ndqsg', levels=5, rho=5).encode(x, seed=2**62 + 17))\n"
        "sys.stdout.buffer.write(get_codec('dqsg', levels=5).encode(x, seed=2**62 + 17))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True).stdout
    x = sample_tensor((3000,), seed=31)
    nd, dq = get_codec("ndqsg", levels=5, rho=5), get_codec("dqsg", levels=5)
    p_nd, p_dq = nd.encode(x, seed=2**62 + 17), dq.encode(x, seed=2**62 + 17)
    assert out == p_nd + p_dq
    step = _steps(x, 5, 512)
    assert ((dq.decode(out[len(p_nd) :], seed=2**62 + 17) - x).abs() <= step / 2 * (1 + 1e-5)).all()
    y = x + 0.1 * step * sample_tensor((3000,), seed=32)
    assert ((nd.decode(out[: len(p_nd)], seed=2**62 + 17, side_info=y) - x).abs() <= step / 2 + 1e-5).all()


# ------------------------------------------------------------------ parameters and bad input
@pytest.mark.parametrize("force_torch", [False, True])
def test_ndqsg_without_side_info_says_what_is_missing(force_torch):
    codec = get_codec("ndqsg")
    codec.quantizer.force_torch = force_torch
    data = codec.encode(torch.ones(10))
    with pytest.raises(ValueError, match="side_info"):
        codec.decode(data)
    with pytest.raises(PayloadError, match="declares 10 elements, its side_info has 9"):
        codec.decode(data, side_info=torch.ones(9))
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.decode(data, side_info=torch.full((10,), float("nan")))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ndqsg:rho=4", "odd"),
        ("ndqsg:rho=1", ">= 3"),
        ("ndqsg:alpha=0", r"\(0, 1\]"),
        ("ndqsg:alpha=1.5", "<= 1.0"),
        ("dqsg:levels=0", ">= 1"),
        ("dqsg:levels=40000", "<="),
        ("dqsg:bucket_size=-1", ">= 0"),
        ("ndqsg:coding=gzip", "fixed, elias, entropy"),
    ],
)
def test_bad_parameters_fail_at_construction(spec, message):
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


def _forge(codec, steps, symbols, width, numel):
    body = np.asarray(steps, "<f4").tobytes() + pack_bits(np.asarray(symbols), width).tobytes()
    return write_payload(codec.spec, torch.float32, (numel,), [body])


@pytest.mark.parametrize("force_torch", [False, True])
def test_rejects_indices_outside_the_alphabet(force_torch):
    dq = get_codec("dqsg", levels=2)  # 5 symbols at 3 bits: 5, 6, 7 are invalid
    nd = get_codec("ndqsg")  # rho = 3 at 2 bits: 3 is invalid
    dq.quantizer.force_torch = nd.quantizer.force_torch = force_torch
    assert dq.decode(_forge(dq, [1.0], [0, 4, 2], 3, 3)).tolist() != []
    with pytest.raises(PayloadError, match="symbol 5 outside 0..4"):
        dq.decode(_forge(dq, [1.0], [0, 5, 2], 3, 3))
    with pytest.raises(PayloadError, match="symbol 3 outside 0..2"):
        nd.decode(_forge(nd, [1.0], [0, 3, 2], 2, 3), side_info=torch.zeros(3))


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_rejects_negative_or_non_finite_steps(bad):
    dq = get_codec("dqsg")
    with pytest.raises(PayloadError, match="step"):
        dq.decode(_forge(dq, [bad], [0, 1, 2], 3, 3))
    tampered = bytearray(dq.encode(torch.ones(3)))
    offset = len(tampered) - 4 - len(read_payload(bytes(tampered)).body)
    tampered[offset : offset + 4] = struct.pack("<f", bad)
    with pytest.raises(PayloadError, match="step"):
        dq.decode(reseal(tampered))


# ------------------------------------------------------------------ CUDA (skipped without a GPU)
@pytest.mark.cuda
@cuda
def test_cuda_dither_and_payloads_match_cpu():
    assert torch.equal(dither(2**40 + 3, 100_000, "cuda").cpu(), dither(2**40 + 3, 100_000))
    x = sample_tensor((257, 129), seed=41)
    y = x + 0.01 * sample_tensor((257, 129), seed=42)
    for codec, kwargs in ((get_codec("dqsg", levels=4), {}), (get_codec("ndqsg", levels=4, rho=3), {"side_info": y})):
        on_gpu = codec.encode(x.cuda(), seed=77)
        assert on_gpu == codec.encode(x, seed=77)  # same IEEE float ops on both devices
        err = codec.decode(on_gpu, seed=77, **kwargs) - x  # decoded on the CPU
        assert (err.abs() <= _steps(x, 4, 512).reshape(x.shape) / 2 + 1e-5).all()
        y_dev = codec.decode(on_gpu, seed=77, device="cuda", **{k: v.cuda() for k, v in kwargs.items()})
        assert y_dev.is_cuda and torch.allclose(y_dev.cpu(), x + err, atol=1e-6)


# ------------------------------------------------------------------ entropy coding
@pytest.mark.parametrize("spec", ["dqsg:levels=7", "ndqsg:levels=7,rho=5", "dqsg:levels=2,bucket_size=0"])
def test_entropy_coding_decodes_to_the_same_values_in_fewer_bytes(spec):
    x = sample_tensor((20000,), seed=51)
    kwargs = {"side_info": x + 0.01} if spec.startswith("ndqsg") else {}
    fixed, entropy = get_codec(spec), get_codec(spec + ",coding=entropy")
    p_fixed, p_entropy = fixed.encode(x, seed=3), entropy.encode(x, seed=3)
    assert torch.equal(fixed.decode(p_fixed, seed=3, **kwargs), entropy.decode(p_entropy, seed=3, **kwargs))
    assert len(p_entropy) < len(p_fixed)
    # the coded indices take at most the empirical entropy plus the count table (a few bytes per symbol)
    width = 3 if "levels=2" in spec else 4 if spec.startswith("dqsg") else 3
    steps = 4 * (1 if "bucket_size=0" in spec else math.ceil(20000 / 512))
    symbols = _unpack_all(p_fixed, 20000, width, steps)
    probs = np.bincount(symbols) / 20000
    probs = probs[probs > 0]
    entropy_bytes = -(probs * np.log2(probs)).sum() * 20000 / 8
    coded = len(read_payload(p_entropy).body) - steps
    assert entropy_bytes <= coded + 1 <= entropy_bytes + 8 + 4 * probs.size + 1


def _unpack_all(payload, n, width, offset):
    from fedquant.wire import unpack_bits

    body = bytes(read_payload(payload).body)
    return unpack_bits(np.frombuffer(body[offset:], np.uint8), width, n).astype(np.int64)


@pytest.mark.parametrize("spec", ["dqsg:coding=entropy", "ndqsg:coding=entropy"])
def test_entropy_coded_bodies_of_wrong_length_are_rejected(spec):
    codec = get_codec(spec)
    x = sample_tensor((3000,), seed=52)
    kwargs = {"side_info": x} if codec.needs_side_info else {}
    p = read_payload(codec.encode(x, seed=1))
    body = bytes(p.body)
    for bad in (body[:-1], body[:-4], body + b"\x00\x00\x00\x00", body[: 4 * 6]):
        with pytest.raises(PayloadError):
            codec.decode(write_payload(p.spec, p.dtype, p.shape, [bad]), seed=1, **kwargs)


# ------------------------------------------------------------------ Elias coding (symmetric alphabets)
@pytest.mark.parametrize(
    ("spec", "width", "half"),
    [("dqsg:levels=7", 4, 7), ("dqsg:levels=1,bucket_size=0", 2, 1), ("ndqsg:levels=7,rho=5", 3, 2)],
)
def test_elias_payload_is_the_shorter_code_s_of_the_signed_indices_and_decodes_like_fixed(spec, width, half):
    from fedquant.wire.elias import elias_omega_lengths

    n = 20000
    x = sample_tensor((n,), seed=53)
    kwargs = {"side_info": x + 0.01} if spec.startswith("ndqsg") else {}
    fixed, elias = get_codec(spec), get_codec(spec + ",coding=elias")
    p_fixed, p_elias = fixed.encode(x, seed=3), elias.encode(x, seed=3)
    assert torch.equal(fixed.decode(p_fixed, seed=3, **kwargs), elias.decode(p_elias, seed=3, **kwargs))
    steps = 4 * (1 if "bucket_size=0" in spec else math.ceil(n / 512))
    q = _unpack_all(p_fixed, n, width, steps) - half  # the signed indices the fixed stream carries
    nz = np.flatnonzero(q)
    gaps = np.diff(nz, prepend=-1)
    sparse_bits = int(elias_omega_lengths(gaps).sum() + nz.size + elias_omega_lengths(np.abs(q[nz])).sum())
    dense_bits = int(elias_omega_lengths(np.abs(q) + 1).sum() + nz.size)
    body = read_payload(p_elias).body
    assert len(body) == steps + 1 + math.ceil(min(sparse_bits, dense_bits) / 8)
    assert body[steps] == (0 if sparse_bits <= dense_bits else 1)


@pytest.mark.parametrize("spec", ["dqsg:levels=2,coding=elias", "ndqsg:rho=3,coding=elias"])
def test_elias_rejects_unknown_variant_indices_beyond_the_alphabet_and_trailing_bytes(spec):
    from fedquant.wire.elias import code_s_encode

    codec = get_codec(spec)
    x = sample_tensor((1000,), seed=54)
    kwargs = {"side_info": x} if codec.needs_side_info else {}
    p = read_payload(codec.encode(x, seed=2))
    body = bytes(p.body)
    steps = 4 * 2  # two buckets of 512
    assert codec.decode(write_payload(p.spec, p.dtype, p.shape, [body]), seed=2, **kwargs).shape == (1000,)
    beyond, _ = code_s_encode(np.array([0, 5, 0, -1] * 250, np.int8))  # |index| 5 beyond both alphabets
    for bad in (
        body[:steps] + b"\x07" + body[steps + 1 :],  # unknown variant
        body[:steps] + b"\x00" + beyond.tobytes(),
        body + b"\x00",  # a gap past the end of the vector
        body + b"\xff",  # a codeword cut off
    ):
        with pytest.raises(PayloadError):
            codec.decode(write_payload(p.spec, p.dtype, p.shape, [bad]), seed=2, **kwargs)


@pytest.mark.parametrize("coding", ["elias", "entropy"])
@pytest.mark.parametrize("spec", ["dqsg:levels=5", "ndqsg:levels=5,rho=7,alpha=0.8"])
def test_coded_round_trips_on_both_paths_and_with_error_feedback(spec, coding):
    x = sample_tensor((7, 300), seed=55)
    y = x + 0.02 * sample_tensor((7, 300), seed=56)
    kwargs = {"side_info": y} if spec.startswith("ndqsg") else {}
    kernel, reference = get_codec(f"{spec},coding={coding}"), get_codec(f"{spec},coding={coding}")
    reference.quantizer.force_torch = True
    payload = kernel.encode(x, seed=9)
    assert payload == reference.encode(x, seed=9)
    out = kernel.decode(payload, seed=9, **kwargs)
    assert out.shape == x.shape and torch.equal(out, reference.decode(payload, seed=9, **kwargs))
    step = _steps(x, 5, 512).reshape(x.shape)
    assert ((out - x).abs() <= step / 2 + 1e-5).all()  # no wrap-around: y is well inside the coarse cell
    # ef+ in front: DQSG is scaled by 1 / (1 + omega) (error_feedback.py), the residual is what the
    # codec failed to send; NDQSG's decoded value depends on the server's side information: refused.
    if spec.startswith("ndqsg"):
        with pytest.raises(ValueError, match="ndqsg"):
            get_codec(f"ef+{spec},coding={coding}")
        return
    ef = get_codec(f"ef+{spec},coding={coding}")
    sent, state = ef.encode_stateful(x, 9, None)
    gamma = 1 / (1 + kernel.expected_error(x.reshape(-1)))
    assert 0.9 < gamma < 1 and sent == kernel.encode(x * gamma, seed=9)
    assert torch.equal(state["ef"], x - ef.decode(sent, seed=9))
