"""Parameter rules of nested dithered quantization (``nested_rules``), checked by algebra and by Monte Carlo."""

import math

import numpy as np
import pytest
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.kernels.dither import dither, nested_quantize, nested_reconstruct
from fedquant.strategies.nested_rules import (
    AUTHORS_LEVELS,
    AUTHORS_RHO,
    SPREAD_MARGIN,
    TAIL_BIN,
    SpreadEstimate,
    cheapest_bits_at,
    choose_parameters,
    choose_rho,
    choose_rho_for_variance,
    empirical_rho,
    entropy_bits,
    estimate_spread,
    folded,
    index_distribution,
    leave_one_out_steps,
    nested_mse,
    nesting_saves_bits,
    optimal_alpha,
    rate_rho,
    spread_in_steps,
    wrap_excess,
    wrap_probability,
)
from fedquant.strategies.side_info import SideInformation


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


# ------------------------------------------------------------------ running mean (side information)
def test_side_information_is_the_authors_running_mean_in_any_order():
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(3, 5, generator=gen) for _ in range(7)]
    side = SideInformation()
    assert torch.equal(side.get("w", 15), torch.zeros(15))
    authors = None
    for cnt, x in enumerate(xs, start=1):  # the authors' AggregationNode: g <- g / cnt + (1 - 1/cnt) g_prev
        side.add({"w": x})
        authors = x.double() if authors is None else x.double() / cnt + (1 - 1 / cnt) * authors
        assert torch.allclose(side.get("w", 15).double(), authors.reshape(-1), atol=1e-6)
    assert side.count("w") == 7 and side.replies == 7 and side.get("w", 15).dtype == torch.float32
    other = SideInformation()
    for x in reversed(xs):
        other.add({"w": x})
    assert torch.allclose(other.get("w", 15), side.get("w", 15), atol=1e-6)


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
    mean = SideInformation()
    for g in decoded_p1:
        mean.add({"g": g})
    for i, g in enumerate(p2):
        x_hat = nd.decode(nd.encode(g, seed=200 + i), seed=200 + i, side_info=mean.get("g", n))
        err = (x_hat - g).double()
        step = torch.nn.functional.pad(g, (0, (-n) % 512)).view(-1, 512).abs().amax(1) / levels
        dqsg_var = float((step.double() ** 2 / 12).repeat_interleave(512)[:n].mean())
        # uniform errors: relative sd of the sample MSE sqrt(4/5 / n) = 0.35 %; 5 sd
        assert abs(err.pow(2).mean().item() / dqsg_var - 1) < 5 * math.sqrt(0.8 / n)
        assert err.abs().max() <= step.max() / 2 + 1e-5  # no wrap-around
        mean.add({"g": x_hat})
    assert mean.count("g") == 8
    # the aggregate is the plain mean of unbiased estimates: error variance ~ DQSG variance / 8
    agg_err = (mean.get("g", n).double() - torch.stack(updates).double().mean(0)).pow(2).mean().item()
    assert agg_err < 1.2 * dqsg_var / 8


# ------------------------------------------------------------------ per-tensor parameters
def _estimate(spread: float, numel: int = 4096) -> SpreadEstimate:
    """An estimate with an empty tail: only the Gaussian rule speaks."""
    return SpreadEstimate(spread, np.zeros(16, dtype=np.int64), numel)


def test_choose_parameters_grows_with_the_spread_and_uses_the_margin():
    rhos = [choose_parameters(_estimate(s))[0] for s in (0.05, 0.5, 2.0)]
    assert rhos[0] == 3 and rhos[0] < rhos[1] < rhos[2]
    assert rhos[1] == choose_rho_for_variance(SPREAD_MARGIN * 0.5, 1.0, 1.0, 0.01)
    assert choose_parameters(None) == (None, 1.0)
    assert choose_parameters(None, "auto") == (None, 1.0)  # no estimate: conditionally unbiased
    rho, alpha = choose_parameters(_estimate(0.5), "auto")
    assert alpha == round(optimal_alpha(SPREAD_MARGIN * 0.5, 1.0), 6) < 1
    assert rho == choose_rho_for_variance(SPREAD_MARGIN * 0.5, 1.0, alpha, 0.01)
    assert choose_parameters(_estimate(50.0), max_rho=9)[0] == 9


def test_choose_parameters_follows_a_heavy_tail_beyond_the_gaussian_rule():
    # same spread, but 1 % of the coordinates 6 fine steps away: the tail rule asks for more
    tail = np.zeros(int(8 / TAIL_BIN), dtype=np.int64)
    tail[int(0.2 / TAIL_BIN)] = 99
    tail[int(6.0 / TAIL_BIN)] = 1
    heavy = SpreadEstimate(0.3, tail, 4096)
    gaussian = choose_parameters(_estimate(0.3))[0]
    rho = choose_parameters(heavy)[0]
    assert rho > gaussian
    assert rho == empirical_rho(tail, SPREAD_MARGIN * 0.3, 1.0, 0.01)
    # the largest bin needs alpha r + 1/2 <= rho / 2 for no wrap at all: the rule never goes beyond it
    assert rho <= 2 * math.ceil(6.0 + 1) + 1


def test_estimate_spread_is_the_spread_and_the_tail_of_one_tensor():
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(2048, generator=gen)
    updates = [y + 0.1 * torch.randn(2048, generator=gen) for _ in range(4)]
    est = estimate_spread(updates, 3, 512, dqsg_levels=3)
    assert est.spread == pytest.approx(spread_in_steps(updates, 3, 512, dqsg_levels=3))
    assert est.numel == 2048 and int(est.tail.sum()) == 4 * 2048
    ratios = leave_one_out_steps(updates, 3, 512).abs()
    assert int(est.tail[: int(1 / TAIL_BIN)].sum()) == int((ratios < 1).sum())  # bins of TAIL_BIN from 0
    assert estimate_spread(updates[:1], 3, 512) is None
    assert estimate_spread([torch.zeros(8), torch.zeros(8)], 3, 512) is None  # every step 0: nothing to say
    assert estimate_spread(updates, 3, 0).numel == 2048  # bucket_size 0: one bucket


def test_nesting_saves_bits_only_below_2m_plus_1_and_the_authors_setting():
    assert nesting_saves_bits(5, 3) and not nesting_saves_bits(7, 3) and not nesting_saves_bits(9, 3)
    assert (AUTHORS_LEVELS, AUTHORS_RHO) == (3, 3) and nesting_saves_bits(AUTHORS_RHO, AUTHORS_LEVELS)


# ------------------------------------------------------------------ the rate rule (bits at equal MSE)
def test_wrap_excess_counts_the_coordinates_beyond_half_a_coarse_step():
    tail = np.zeros(int(4 / TAIL_BIN), dtype=np.int64)
    tail[int(1.0 / TAIL_BIN)] = 90  # |r| in [1, 1 + 1/64): inside rho = 3's half-width 1.5
    tail[int(2.0 / TAIL_BIN)] = 10  # |r| ~ 2: wraps at rho = 3, not at rho = 5
    assert wrap_excess(tail, 3) == pytest.approx(0.10 * 9)  # P(wrap) (alpha rho)^2
    assert wrap_excess(tail, 5) == 0.0
    assert wrap_excess(tail, 3, alpha=0.5) == 0.0  # alpha |r| = 1 < 1.5
    assert wrap_excess(np.zeros(4, dtype=np.int64), 3) == 0.0


def test_index_distribution_folding_and_entropy():
    levels = 3
    bins = int(round(2 * (levels + 1) / TAIL_BIN))
    at = lambda v: int((v + levels + 1) / TAIL_BIN)  # noqa: E731
    values = np.zeros(bins, dtype=np.int64)
    values[at(0.0)] = 1  # v in [0, 1/64): q = 0 almost surely
    p = index_distribution(values, levels)
    assert p.sum() == pytest.approx(1.0) and p[p.size // 2] > 0.99
    values[:] = 0
    values[at(0.5) - 1] = values[at(0.5)] = 1  # v around 1/2: q = 0 or 1, half each
    p = index_distribution(values, levels)
    assert p[p.size // 2] == pytest.approx(0.5, abs=0.02) and p[p.size // 2 + 1] == pytest.approx(0.5, abs=0.02)
    assert entropy_bits(p) == pytest.approx(1.0, abs=0.01)
    uniform = np.full(7, 1 / 7)  # q on -3..3
    f = folded(uniform, 3)  # -3, 0, 3 -> 0; -2, 1 -> 1; -1, 2 -> -1
    assert f.tolist() == pytest.approx([2 / 7, 3 / 7, 2 / 7])
    assert entropy_bits(f) < entropy_bits(uniform)  # a function of q never has more entropy
    assert folded(uniform, 7).tolist() == pytest.approx(uniform.tolist())  # rho = 2M + 1: the DQSG index


def test_cheapest_bits_at_mixes_settings_on_the_lower_hull():
    fixed = [(2.0, 9.0), (3.0, 2.25), (3.0, 1.0), (4.0, 0.5)]  # DQSG M = 1, 2, 3, (7) at fixed width
    assert cheapest_bits_at(fixed, 1.0) == pytest.approx(3.0)
    assert cheapest_bits_at(fixed, 2.0) == pytest.approx(3 - 1 / 8)  # M = 2 is never worth its 3 bits
    assert cheapest_bits_at(fixed, 0.75) == pytest.approx(3.5)
    assert cheapest_bits_at(fixed, 17.0) == pytest.approx(1.0)  # beyond the coarsest: the first segment extended
    assert cheapest_bits_at([(2.0, 1.0)], 5.0) == 2.0


def _synthetic_estimate(sigma: float, n: int = 1 << 15, clients: int = 4, levels: int = 3):
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(n, generator=gen)
    dq = get_codec("dqsg", levels=levels)
    p1 = [dq.decode(dq.encode(y + sigma * torch.randn(n, generator=gen), 20 + i), 20 + i) for i in range(clients)]
    return estimate_spread(p1, levels, 512, dqsg_levels=levels), y, gen


@pytest.mark.parametrize("coding", ["fixed", "entropy"])
def test_rate_rule_nests_close_updates_and_saves_bits_at_equal_mse(coding):
    levels, n = 3, 1 << 15
    estimate, y, gen = _synthetic_estimate(0.03, n)
    rho, alpha = choose_parameters(estimate, rule="rate", levels=levels, coding=coding, max_excess=0.25)
    assert alpha == 1.0 and rho == 3 and rate_rho(estimate, levels, coding, 1.0, 0.25) == 3
    # measured with the real codecs on fresh clients: NDQSG's bits against DQSG's curve at NDQSG's MSE
    xs = [y + 0.03 * torch.randn(n, generator=gen) for _ in range(2)]
    side = y  # a close estimate of every client's update

    def tally(codec, decode_side):
        bits = sq = 0.0
        for i, x in enumerate(xs):
            payload = codec.encode(x, 40 + i)
            kwargs = {"side_info": side} if decode_side else {}
            bits += 8 * len(payload)
            sq += float((codec.decode(payload, 40 + i, **kwargs) - x).double().pow(2).sum())
        return bits / (2 * n), sq / (2 * n)

    nested_bits, nested_mse_ = tally(get_codec("ndqsg", levels=levels, rho=rho, coding=coding), True)
    curve = [tally(get_codec("dqsg", levels=k, coding=coding), False) for k in (1, 2, 3, 4)]
    assert nested_mse_ <= 1.01 * curve[2][1]  # no wraps here: DQSG's error at M = 3
    assert nested_bits < 0.97 * cheapest_bits_at(curve, nested_mse_)


def test_rate_rule_sends_dqsg_when_nothing_is_saved_and_obeys_the_wrap_cap():
    wide, _, _ = _synthetic_estimate(3.0)  # clients far apart: every rho < 2M + 1 wraps a lot
    assert choose_parameters(wide, rule="rate", levels=3, coding="entropy", max_excess=0.25)[0] == 7
    close, _, _ = _synthetic_estimate(0.3)
    free = rate_rho(close, 3, "fixed", 1.0, max_excess=100.0)
    assert free == 3 and wrap_excess(close.tail, 3) > 0  # wraps accepted where the bits pay for them
    assert rate_rho(close, 3, "fixed", 1.0, max_excess=12 * wrap_excess(close.tail, 3) / 2) == 7  # capped out
    with pytest.raises(ValueError, match="rule"):
        choose_parameters(close, rule="best")
    with pytest.raises(ValueError, match="levels"):
        choose_parameters(close, rule="rate")
