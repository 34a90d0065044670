"""The norm and weight references follow the round: stale history never outvotes it, honest spread widens the bound.

Issue 23: on Flower's default federation (2 clients, 1 sampled per round) a client's honest update
after several rounds of the other client (which had converged on its own data: norm 0.029, the
other 1.7) was rejected against the history, and a round that admits nothing never refreshes it:
7 of 20 honest replies of the default run (seed 0) were lost.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.strategies import AdmissionRules, QuantizedStrategy
from fedquant.strategies.admission.references import MedianReference, Reference, weighted_median
from fedquant.strategies.admission.rules.norms import check_norm, verdict
from fedquant.strategies.admission.rules.weights import outlier
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app
from tests.strategies.test_attacks import SEED, _round, _scaled, _warned, _wrap

A, B = 101, 102


class ScheduledFedAvg(FedAvg):
    """FedAvg that samples one node per round, the one ``schedule[round]`` names."""

    def __init__(self, schedule: dict[int, int]) -> None:
        super().__init__(fraction_train=1.0, min_available_nodes=2, fraction_evaluate=1.0)
        self.schedule = schedule

    def configure_train(self, server_round, arrays, config, grid):
        messages = super().configure_train(server_round, arrays, config, grid)
        return [m for m in messages if m.metadata.dst_node_id == self.schedule[server_round]]


def _one_reply_rounds(schedule: dict[int, int], scale_of: dict[int, float]) -> list:
    """Rounds of one reply each; node ``n``'s update is scaled by ``scale_of[n]`` (a converged client)."""
    strategy = QuantizedStrategy(ScheduledFedAvg(schedule), "fp32", seed=SEED, min_numel=MIN_NUMEL)
    grid = InProcessGrid(make_client_app([quantize_mod]), 2)
    arrays, history = initial_arrays(), []
    for server_round in sorted(schedule):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        node = schedule[server_round]
        replies = _scaled({node}, scale_of.get(node, 1.0))(grid.send_and_receive(messages), messages)
        new, metrics = strategy.aggregate_train(server_round, replies)
        arrays = new if new is not None else arrays
        history.append(metrics)
    return history


def test_one_reply_per_round_is_not_rejected_against_another_clients_history():
    """A's updates at 1/50 of B's (A has converged) for three rounds, then B twice: on main B's first
    reply is 50 x the history's median (rejected), and since that round admits nothing, so is the next."""
    history = _one_reply_rounds({1: A, 2: A, 3: A, 4: B, 5: B, 6: A, 7: B}, {A: 0.02})
    assert [m["rejected-replies"] for m in history] == [0] * 7
    ratio = history[3]["update-norm-median"] / history[2]["update-norm-median"]
    assert ratio > 20  # the scales differ as in the default run (60 x), far above norm_factor


def test_the_default_runs_norm_sequence_is_admitted():
    """The norms of the default run's seed 0 (rounds 7-11: the sampled client changes at round 10)."""
    rules, ref = AdmissionRules(), MedianReference()
    for norm in (0.0386, 0.0288, 0.0233, 1.72, 1.75, 0.021, 1.8):
        assert check_norm(rules, norm, ref.reference([norm])) is None
        ref.end_round([norm])


def test_history_breaks_ties_but_cannot_outvote_a_round_that_agrees():
    ref = MedianReference()
    ref.end_round([1.0] * 10)
    assert ref.value([100.0] * 10) == 100.0  # the whole round moved: it wins
    assert ref.value([1.0] * 5 + [100.0] * 5) == 1.0  # exactly half: the history breaks the tie
    assert ref.value([1.0] * 3 + [100.0] * 7) == 1.0  # 7 of 10 < 3/4 of the round + history
    assert ref.value([1.0] * 2 + [100.0] * 8) == 100.0  # 8 of 10: above the stated tolerance
    with pytest.raises(ValueError, match="history_weight"):
        MedianReference(history_weight=1.0)


def test_weighted_median_is_numpys_median_for_equal_weights():
    rng = np.random.default_rng(0)
    for size in range(1, 12):
        values = rng.lognormal(size=size)
        assert weighted_median(values, np.ones(size)) == pytest.approx(float(np.median(values)))


def test_the_reject_bound_widens_with_honest_spread_only():
    """Honest log norms with sigma 1 (the spread of LEAF-sized clients): 10 x the median rejects 1.1%
    (P(z > ln 10) for sigma 1); the bound widened to exp(5 s) rejects about P(z > 5) (3e-7). With
    no spread (equal clients) the bound stays 10 x the median, and 100 x is rejected."""
    rng = np.random.default_rng(5)
    rules = AdmissionRules()
    norms = list(rng.lognormal(0.0, 1.0, size=2000))
    ref = MedianReference().reference(norms)
    assert ref.log_spread == pytest.approx(1.0, abs=0.08)
    widened = sum(check_norm(rules, n, ref) is not None for n in norms) / len(norms)
    fixed = sum(check_norm(rules, n, ref.value) is not None for n in norms) / len(norms)
    assert widened <= 0.005 < fixed
    tight = MedianReference().reference([1.0, 1.05, 0.95, 1.02, 0.98] * 2 + [100.0])
    assert tight.log_spread < 0.1 and check_norm(rules, 9.5, tight) is None
    assert "exceeds 10 x" in check_norm(rules, 100.0, tight)
    assert outlier(rules, 11.0, tight, "num-examples") is not None
    assert check_norm(AdmissionRules(norm_spread=None), 2 * math.exp(3), Reference(1.0, 1.0)) is not None
    assert check_norm(AdmissionRules(), 2 * math.exp(3), Reference(1.0, 1.0)) is None


# ---------------------------------------------------------------------------------------------- diagnostics
def test_a_rule_rejecting_more_than_5_percent_of_a_round_warns_and_is_reported(flwr_log):
    """1 of 10 at 100 x the honest norm: the norm rule rejects 10% of the round (above 5%, below the
    30% of ``warn_rejected_share``): a warning naming the rule, ``rejected-rule-max-share`` 0.1."""
    _, honest = _round(_wrap())
    assert honest["rejected-rule-max-share"] == 0.0 and not _warned(flwr_log, "rule rejected")
    _, metrics = _round(_wrap(), tamper=_scaled({101}, 100.0))
    assert metrics["rejected-update-norm"] == 1 and metrics["rejected-rule-max-share"] == pytest.approx(0.1)
    assert _warned(flwr_log, "the update-norm rule rejected 1 of 10 train replies")
    assert metrics["admission-warnings"] >= 1
    _, quiet = _round(_wrap(admission=AdmissionRules(warn_rule_share=0.2)), tamper=_scaled({101}, 100.0))
    assert quiet["admission-warnings"] == 0


def test_the_reject_bound_grows_with_the_replys_weight_but_the_clip_does_not():
    """Synthetic with LEAF sizes: most clients take one clipped SGD step (norm = lr, identical, so the
    norms have no spread), the largest 56 steps; 900 examples against a reference weight of 12 moved
    60 x the reference norm honestly. The bound follows the weight ratio; the clip stays c x r."""
    rules, reference = AdmissionRules(), Reference(0.053, 0.0)
    assert "exceeds 10 x" in verdict(rules, 60 * 0.053, reference)[0]
    problem, scale = verdict(rules, 60 * 0.053, reference, weight_ratio=900 / 12)
    assert problem is None and scale == pytest.approx(2 / 60)
    assert verdict(rules, 60 * 0.053, reference, weight_ratio=0.1)[0] is not None  # small weights: no tighter
    assert verdict(AdmissionRules(norm_per_weight=False), 3.18, reference, weight_ratio=75)[0] is not None
