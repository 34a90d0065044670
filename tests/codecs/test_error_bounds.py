"""Each quantizer's declared error (``error_bound``, ``expected_error``) and error feedback built on it.

Error feedback needs a contractive compressor; ``ef+`` scales unbiased codecs by
``1 / (1 + omega)`` and refuses biased ones whose bound exceeds 1. These tests check the
declarations against Monte Carlo and adversarial inputs, and that ``ef+`` with ``omega > 1``
keeps its residual at the steady state theory predicts while plain error feedback explodes.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedquant.codecs import available_codecs, get_codec
from fedquant.codecs.quantizers.eden import eden_vnmse

# Unbiased quantizers whose expected error has a closed form given the input.
EXACT = ["qsgd", "qsgd:norm=l2,levels=4", "qsgd:levels=1", "terngrad", "dqsg", "dqsg:levels=12", "orq:levels=4",
         "linear:levels=8", "orq:level_dtype=float16", "ecdq:bits=1", "ecdq:bits=0.5"]  # fmt: skip
BIASED = ["signsgd", "signsgd:bucket_size=0", "bingrad-b", "bingrad-b:level_dtype=float16", "bingrad-pb", "fp16"]


def _inputs(d: int = 2048) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    spike = torch.zeros(d)
    spike[7] = 3.0
    t = 1 / (math.sqrt(512) + 1)  # TernGrad's worst bucket: (1, t, .., t)
    worst = torch.full((d,), t)
    worst[::512] = 1.0
    return {
        "gaussian": torch.randn(d, generator=g),
        "cauchy": torch.tan(math.pi * (torch.rand(d, generator=g, dtype=torch.float64) - 0.5)).float().clamp(-1e4, 1e4),
        "positive": torch.rand(d, generator=g) + 0.5,
        "spike": spike,
        "terngrad worst": worst,
        "tiny": 1e-9 * torch.randn(d, generator=g),
        "constant": torch.full((d,), -0.25),
    }


def _squared_errors(spec: str, x: torch.Tensor, seeds: int) -> torch.Tensor:
    codec = get_codec(spec)
    return torch.tensor([float((codec.decode(codec.encode(x, seed=s), seed=s) - x).double().square().sum())
                         for s in range(seeds)], dtype=torch.float64)  # fmt: skip


def test_every_registered_quantizer_declares_its_error():
    undeclared = [n for n in available_codecs() if get_codec(n).quantizer.error_bound(4096) is None]
    assert undeclared == ["ndqsg"]  # on purpose: see NDQSGQuantizer.error_bound


@pytest.mark.parametrize("spec", EXACT)
def test_expected_error_is_the_monte_carlo_error(spec):
    # The mean of N independent squared errors is within 5 standard errors of its expectation (CLT).
    x = _inputs()["gaussian"]
    errors = _squared_errors(spec, x, seeds=200)
    expected = get_codec(spec).expected_error(x) * float(x.double().square().sum())
    assert abs(errors.mean() - expected) <= 5 * errors.std() / math.sqrt(len(errors)) + 1e-9 * expected


@pytest.mark.parametrize("spec", EXACT)
def test_the_exact_error_stays_within_the_declared_bound(spec):
    quantizer = get_codec(spec).quantizer
    for name, x in _inputs().items():
        assert quantizer.expected_error(x) <= quantizer.error_bound(x.numel()) * (1 + 1e-6), name


def test_terngrad_bound_is_reached_on_its_worst_input():
    quantizer = get_codec("terngrad").quantizer
    x = _inputs()["terngrad worst"]
    assert quantizer.expected_error(x) == pytest.approx(quantizer.error_bound(x.numel()), rel=1e-3)
    assert quantizer.error_bound(4096) == pytest.approx((math.sqrt(512) - 1) / 2)


@pytest.mark.parametrize("spec", BIASED)
def test_biased_codecs_never_err_beyond_their_bound(spec):
    quantizer = get_codec(spec).quantizer
    for name, x in _inputs().items():
        errors = _squared_errors(spec, x, seeds=3)  # bingrad-pb rounds at random inside its levels
        ratio = float(errors.max()) / float(x.double().square().sum())
        assert ratio <= quantizer.error_bound(x.numel()) * (1 + 1e-5) + 1e-12, name
    assert quantizer.error_bound(4096) <= 1.0


@pytest.mark.parametrize("bits", [0.5, 1.0, 2.0])
def test_eden_declares_its_vnmse(bits):
    # 8 rotated blocks of 2048 Gaussian coordinates: the measured vNMSE is within 10 % of the asymptote.
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(2))
    errors = _squared_errors(f"eden:bits={bits}", x, seeds=20)
    measured = float(errors.mean()) / float(x.double().square().sum())
    assert get_codec(f"eden:bits={bits}").quantizer.error_bound(x.numel()) == eden_vnmse(bits)
    assert measured == pytest.approx(eden_vnmse(bits), rel=0.1)


# ---------------------------------------------------------------- error feedback on top of it


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("ef+terngrad:clip=2.5", ["terngrad", "biased", "omega = 10.8"]),
        ("ef+bingrad-b:clip=2.5", ["bingrad-b", "declares no error bound"]),
        ("ef+orq:clip=2", ["orq", "declares no error bound"]),
        ("ef+ndqsg", ["ndqsg", "ef+dqsg"]),
    ],
)
def test_ef_refuses_codecs_it_could_diverge_with(spec, words):
    with pytest.raises(ValueError) as err:
        get_codec(spec)
    assert all(w in str(err.value) for w in words)


def _residual_energy(spec: str, rounds: int, scaled: bool = True) -> list[float]:
    """``||e_t||^2 / G^2`` over rounds of i.i.d. Gaussian updates of energy G^2 (d = 4096)."""
    codec = get_codec(spec)
    plain = codec.without_state()
    g = torch.Generator().manual_seed(11)
    residual: torch.Tensor | None = None
    out = []
    for t in range(rounds):
        x = torch.randn(4096, generator=g)
        if scaled:
            _, state = codec.encode_stateful(x, t, {"ef": residual})
            residual = state["ef"]
        else:  # error feedback as it was: e' = p - C(p)
            p = x if residual is None else x + residual
            residual = p - plain.decode(plain.encode(p, seed=t), seed=t)
        out.append(float(residual.double().square().sum()) / float(x.double().square().sum()))
        if not math.isfinite(out[-1]) or out[-1] > 1e12:
            break
    return out


@pytest.mark.parametrize(
    "spec", ["ef+eden:bits=0.5", "ef+ecdq:bits=0.5", "ef+terngrad", "ef+qsgd:levels=1,bucket_size=4096"]
)
def test_ef_with_omega_above_one_keeps_the_residual_theory_predicts(spec):
    # Scaled by gamma = 1/(1+omega), E||e'||^2 = omega/(1+omega) E||x + e||^2; with i.i.d. zero-mean x the
    # steady state is E||e||^2 = omega G^2. Unscaled, E||e'||^2 = omega (G^2 + E||e||^2) grows by omega a round.
    codec = get_codec(spec)
    omega = codec.expected_error(torch.randn(4096, generator=torch.Generator().manual_seed(1)))
    assert omega > 1
    energy = _residual_energy(spec, rounds=120)
    steady = sum(energy[40:]) / len(energy[40:])
    assert steady == pytest.approx(omega, rel=0.25)
    assert max(energy) < 3 * omega
    exploding = _residual_energy(spec, rounds=120, scaled=False)
    assert max(exploding) > 10 * max(energy)  # the same loop without the scaling: it grows far beyond


def test_ef_with_a_large_omega_still_sends_the_sum_of_the_updates():
    # Telescoping: sum_t decoded_t = T x + e_0 - e_T, so the running mean of what the server got tends to x.
    codec = get_codec("ef+eden:bits=0.5")
    x = torch.randn(2048, generator=torch.Generator().manual_seed(3))
    state: dict = {}
    total = torch.zeros_like(x, dtype=torch.float64)
    rounds = 300
    for t in range(rounds):
        payload, state = codec.encode_stateful(x, t, state)
        total += codec.decode(payload, seed=t).double()
    assert float((total / rounds - x).norm() / x.norm()) < 0.05


def test_accurate_codecs_are_hardly_scaled():
    # qsgd:levels=16 on a Gaussian update: omega ~ 0.006, so ef+ sends 0.994 x on the first round.
    codec = get_codec("ef+qsgd")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    payload, _ = codec.encode_stateful(x, 1, None)
    sent = codec.decode(payload, seed=1)
    assert float(sent @ x / (x @ x)) == pytest.approx(1 / (1 + codec.expected_error(x)), abs=0.01)
    assert codec.expected_error(x) < 0.01
