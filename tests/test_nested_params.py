"""Parameter rules of nested dithered quantization, checked by algebra and by Monte Carlo."""

import math

import pytest
import torch

from fedquant.codecs.kernels.dither import dither, nested_quantize, nested_reconstruct
from fedquant.codecs.nested_params import (
    RunningMean,
    choose_rho,
    choose_rho_for_variance,
    nested_mse,
    optimal_alpha,
    spread_in_steps,
    wrap_probability,
)


def _monte_carlo(alpha, sigma_z, rho, n=1 << 18, seed=0):
    """Nested quantization of x = y + z with Delta1 = 1: errors and the wrap indicator."""
    gen = torch.Generator().manual_seed(seed)
    y = 3 * torch.randn(n, generator=gen, dtype=torch.float64)
    z = sigma_z * torch.randn(n, generator=gen, dtype=torch.float64)
    x = y + z
    step1 = torch.ones(1, dtype=torch.float64)
    u = dither(seed + 100, n).double()
    x_hat = nested_reconstruct(nested_quantize(x, step1, u, rho, alpha), step1, u, rho, alpha, y)
    err = x_hat - x
    # without a wrap the error is (alpha^2 - 1) z + alpha eps with |eps| <= 1/2; a wrap adds alpha*rho
    wrapped = (err - (alpha**2 - 1) * z).abs() > alpha * 0.5 + 1e-9
    return err, wrapped, z


# ------------------------------------------------------------------ choose_rho
@pytest.mark.parametrize(
    ("sigma_z", "delta1", "alpha", "k", "rho"),
    [
        (0.0, 1.0, 1.0, 3.0, 3),
        (0.1, 1.0, 1.0, 3.0, 3),  # 2*0.3 + 1 = 1.6 -> at least 3
        (1 / 3, 1.0, 1.0, 3.0, 3),  # exactly 3: Delta2/2 = 1.5 = 1 + 0.5
        (0.5, 1.0, 1.0, 3.0, 5),  # 4 -> next odd
        (1.0, 1.0, 1.0, 3.0, 7),  # exactly 7
        (1.0, 1.0, 0.5, 3.0, 5),  # alpha halves the spread
        (2.0, 4.0, 1.0, 4.0, 5),  # only the ratio matters
        (1.0, 1.0, 1.0, 4.0, 9),
    ],
)
def test_choose_rho_examples(sigma_z, delta1, alpha, k, rho):
    assert choose_rho(sigma_z, delta1, alpha, k) == rho


def test_choose_rho_is_the_smallest_odd_value_meeting_the_margin():
    for sigma_z in torch.linspace(0, 5, 101).tolist():
        for alpha in (0.3, 0.7, 1.0):
            rho = choose_rho(sigma_z, 0.8, alpha, k=3.0)
            assert rho % 2 == 1 and rho >= 3
            need = alpha * 3.0 * sigma_z + 0.8 / 2
            assert rho * 0.8 / 2 >= need - 1e-9
            assert rho == 3 or (rho - 2) * 0.8 / 2 < need


@pytest.mark.parametrize("bad", [(-1.0, 1.0), (1.0, 0.0), (float("nan"), 1.0), (1.0, float("inf"))])
def test_choose_rho_rejects_bad_numbers(bad):
    with pytest.raises(ValueError):
        choose_rho(*bad)
    with pytest.raises(ValueError, match="alpha"):
        choose_rho(1.0, 1.0, alpha=0.0)
    with pytest.raises(ValueError, match="k"):
        choose_rho(1.0, 1.0, k=0.0)


# ------------------------------------------------------------------ MSE, alpha, wrap-around
@pytest.mark.parametrize("alpha", [1.0, 0.95, 0.8, "optimal"])
def test_nested_mse_matches_monte_carlo(alpha):
    sigma_z = 0.6
    if alpha == "optimal":
        alpha = optimal_alpha(sigma_z, 1.0)
    rho = choose_rho(sigma_z, 1.0, alpha, k=7.0)  # no wraps in 2^18 draws
    err, wrapped, z = _monte_carlo(alpha, sigma_z, rho)
    assert not wrapped.any()
    # theory with the sampled z (removes its sampling noise); the uniform part has relative sd
    # sqrt(4/5 / n) = 0.17 %; 5 sd plus the z-cross term, which is far smaller
    theory = (1 - alpha**2) ** 2 * z.pow(2).mean().item() + alpha**2 / 12
    assert abs(err.pow(2).mean().item() / theory - 1) < 5 * math.sqrt(0.8 / err.numel()) + 1e-3
    assert nested_mse(alpha, sigma_z, 1.0) == pytest.approx((1 - alpha**2) ** 2 * sigma_z**2 + alpha**2 / 12)


def test_paper_remark_two_alphas_give_the_dithered_variance():
    # "setting alpha = 1 or alpha = sqrt(1 - Delta1^2 / 12 sigma_z^2) results in the same
    # quantization variance as dithered quantization with step-size Delta1"
    for sigma_z, delta1 in ((1.0, 1.0), (0.5, 0.3), (3.0, 2.0)):
        a2 = math.sqrt(1 - delta1**2 / (12 * sigma_z**2))
        assert nested_mse(1.0, sigma_z, delta1) == pytest.approx(delta1**2 / 12)
        assert nested_mse(a2, sigma_z, delta1) == pytest.approx(delta1**2 / 12)


def test_optimal_alpha_minimizes_the_mse():
    for sigma_z, delta1 in ((1.0, 1.0), (0.4, 1.0), (2.0, 0.5)):
        best = optimal_alpha(sigma_z, delta1)
        grid = [i / 1000 for i in range(1, 1001)]
        assert nested_mse(best, sigma_z, delta1) <= min(nested_mse(a, sigma_z, delta1) for a in grid) + 1e-12
        assert nested_mse(best, sigma_z, delta1) == pytest.approx(delta1**2 / 12 - delta1**4 / (576 * sigma_z**2))


def test_optimal_alpha_edges():
    assert optimal_alpha(0.0, 1.0) == 1e-3
    assert optimal_alpha(0.1, 1.0) == 1e-3  # sigma_z < Delta1/sqrt(24): the side information wins
    assert optimal_alpha(0.1, 1.0, min_alpha=0.2) == 0.2
    assert optimal_alpha(1e6, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        optimal_alpha(1.0, 1.0, min_alpha=0.0)


@pytest.mark.parametrize(("alpha", "sigma_z", "rho"), [(1.0, 1.0, 3), (1.0, 1.0, 5), (1.0, 0.5, 3), (0.8, 1.2, 5)])
def test_wrap_probability_matches_monte_carlo(alpha, sigma_z, rho):
    _, wrapped, _ = _monte_carlo(alpha, sigma_z, rho, seed=3)
    p = wrap_probability(alpha, sigma_z, 1.0, rho)
    n = wrapped.numel()
    # binomial proportion: sd sqrt(p (1 - p) / n); 5 sd
    assert abs(wrapped.double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-6


def test_wrap_probability_matches_the_reference_table():
    # algorithms.md §5.5 [CHECK] (alpha = 1, Delta1 = 1): sigma 1.0 -> 15 %, 1.7 %, 0.07 %. Its 4e-5 for
    # sigma 0.3, rho 3 came from a small sample: 3.4e7 draws of _monte_carlo gave 6.57e-5 +- 0.14e-5.
    assert wrap_probability(1.0, 1.0, 1.0, 3) == pytest.approx(0.15, abs=0.01)
    assert wrap_probability(1.0, 1.0, 1.0, 5) == pytest.approx(0.017, abs=0.001)
    assert wrap_probability(1.0, 1.0, 1.0, 7) == pytest.approx(0.0007, abs=0.0001)
    assert wrap_probability(1.0, 0.3, 1.0, 3) == pytest.approx(6.57e-5, rel=0.07)
    assert wrap_probability(1.0, 0.0, 1.0, 3) == 0.0


# ------------------------------------------------------------------ spread estimate
def _spread_reference(updates, levels, bucket_size, dqsg_levels=None):
    """Loop version of spread_in_steps, written from its docstring."""
    m = len(updates)
    total, count = 0.0, 0
    for p in range(m):
        others = sum(updates[q] for q in range(m) if q != p) / (m - 1)
        for start in range(0, updates[p].numel(), bucket_size):
            g = updates[p][start : start + bucket_size].double()
            step = g.abs().max().item() / levels
            if step > 0:
                total += (((g - others[start : start + bucket_size].double()) / step) ** 2).sum().item()
                count += g.numel()
    s2_qv = total / count * (m - 1) / m
    qv = (levels / dqsg_levels) ** 2 / 12 if dqsg_levels else 0.0
    return math.sqrt(max(s2_qv - qv, 0) + s2_qv / m)


def test_spread_in_steps_matches_its_definition_and_is_scale_free():
    gen = torch.Generator().manual_seed(5)
    common = torch.randn(1000, generator=gen)
    updates = [common + 0.2 * torch.randn(1000, generator=gen) for _ in range(4)]
    updates[2][:100] = 0  # a bucket of zeros in one client is skipped
    got = spread_in_steps(updates, levels=3, bucket_size=100)
    assert got == pytest.approx(_spread_reference(updates, 3, 100), rel=1e-6)  # reference mean in float32
    assert spread_in_steps([5 * u for u in updates], 3, 100) == pytest.approx(got, rel=1e-6)
    # sigma 0.2 * sqrt(1 + 1/4) over steps of about max|N(0, 1.04)| / 3 ~ 0.9
    assert 0.15 < got < 0.45
    with_q = spread_in_steps(updates, 3, 100, dqsg_levels=6)
    assert with_q == pytest.approx(_spread_reference(updates, 3, 100, 6), rel=1e-6) and with_q < got
    with pytest.raises(ValueError, match="at least 2"):
        spread_in_steps(updates[:1], 3, 100)


# ------------------------------------------------------------------ running mean
def test_running_mean_is_the_mean_in_any_order_and_matches_the_authors_recursion():
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(3, 5, generator=gen) for _ in range(7)]
    rm = RunningMean()
    assert rm.mean is None and torch.equal(rm.side_info(xs[0]), torch.zeros(3, 5))
    authors = None
    for cnt, x in enumerate(xs, start=1):
        rm.add(x)
        authors = x.double() if authors is None else x.double() / cnt + (1 - 1 / cnt) * authors
        assert torch.allclose(rm.mean, authors, atol=1e-12)
    assert rm.count == 7
    assert torch.allclose(rm.side_info(xs[0]), torch.stack(xs).mean(0), atol=1e-6)
    assert rm.side_info(xs[0]).dtype == torch.float32
    other = RunningMean()
    for x in reversed(xs):
        other.add(x)
    assert torch.allclose(other.mean, rm.mean, atol=1e-12)
    with pytest.raises(ValueError, match="shape"):
        rm.add(torch.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        rm.side_info(torch.zeros(4))
    rm.reset()
    assert rm.count == 0 and rm.mean is None


def test_choose_rho_for_variance_keeps_the_dithered_variance_where_k3_does_not():
    # sigma_z = Delta1: the k = 3 rule gives rho = 7 and wraps inflate the MSE (algorithms.md §5.5
    # measured 0.12 against 1/12); the variance-targeted rule keeps the excess below 1 %
    assert choose_rho(1.0, 1.0) == 7
    rho = choose_rho_for_variance(1.0, 1.0, max_excess=0.01)
    assert rho > 7 and rho % 2 == 1
    err_k3, _, _ = _monte_carlo(1.0, 1.0, 7, seed=8)
    err_var, _, _ = _monte_carlo(1.0, 1.0, rho, seed=9)
    assert err_k3.pow(2).mean().item() > 1.2 / 12
    # 1 % excess allowed, plus 5 sd of the uniform error's sample MSE (relative sd sqrt(0.8 / n))
    assert err_var.pow(2).mean().item() < (1 / 12) * (1.01 + 5 * math.sqrt(0.8 / err_var.numel()))
    assert choose_rho_for_variance(0.05, 1.0) == 3
    with pytest.raises(ValueError, match="max_excess"):
        choose_rho_for_variance(1.0, 1.0, max_excess=0.0)


def test_two_group_decoding_as_in_algorithm_2():
    """One tensor through Algorithm 2 with the pure pieces (what the server wrapper will do).

    P1 clients send DQSG; their decoded mean seeds a RunningMean; rho comes from their spread;
    each P2 client's NDQSG payload is decoded against the running mean of everything decoded
    before it, then folded in. Each P2 client should get DQSG's error variance (alpha = 1).
    """
    from fedquant.codecs import get_codec

    n, levels, sigma = 1 << 16, 3, 0.05
    gen = torch.Generator().manual_seed(7)
    true = torch.randn(n, generator=gen)
    updates = [true + sigma * torch.randn(n, generator=gen) for _ in range(8)]
    p1, p2 = updates[:4], updates[4:]
    dq = get_codec("dqsg", levels=levels)
    decoded_p1 = [dq.decode(dq.encode(g, seed=100 + i), seed=100 + i) for i, g in enumerate(p1)]
    spread = spread_in_steps(decoded_p1, levels, 512, dqsg_levels=levels)
    # sigma_z^2 = s2 + (s2 + 1/12) / 4 in fine steps, s = 0.05 / Delta1 with Delta1 ~ 3.6 / 3
    assert 0.13 < spread < 0.18
    rho = choose_rho_for_variance(spread, 1.0)
    assert rho == 3
    nd = get_codec("ndqsg", levels=levels, rho=rho)
    mean = RunningMean()
    for g in decoded_p1:
        mean.add(g)
    for i, g in enumerate(p2):
        x_hat = nd.decode(nd.encode(g, seed=200 + i), seed=200 + i, side_info=mean.side_info(g))
        err = (x_hat - g).double()
        step = torch.nn.functional.pad(g, (0, (-n) % 512)).view(-1, 512).abs().amax(1) / levels
        dqsg_var = float((step.double() ** 2 / 12).repeat_interleave(512)[:n].mean())
        # uniform errors: relative sd of the sample MSE sqrt(4/5 / n) = 0.35 %; 5 sd
        assert abs(err.pow(2).mean().item() / dqsg_var - 1) < 5 * math.sqrt(0.8 / n)
        assert err.abs().max() <= step.max() / 2 + 1e-5  # no wrap-around
        mean.add(x_hat)
    assert mean.count == 8
    # the aggregate is the plain mean of unbiased estimates: error variance ~ DQSG variance / 8
    agg_err = (mean.mean - torch.stack(updates).double().mean(0)).pow(2).mean().item()
    assert agg_err < 1.2 * dqsg_var / 8
