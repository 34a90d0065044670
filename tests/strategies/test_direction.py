"""The persistent-opposition rule: a per-client CUSUM of leave-one-out cosines across rounds.

The rule on its own with fixed-seed synthetic cosines, then a sign flip through the real
:class:`~fedquant.strategies.QuantizedStrategy` over several rounds (``tests.flower_fakes``' task).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedquant.clients import quantize_mod
from fedquant.strategies import AdmissionRules, QuantizedStrategy
from fedquant.strategies.direction import DirectionHistory, PersistenceRule
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app
from tests.strategies.test_attacks import SEED, SortedFedAvg, _scaled

RULE = PersistenceRule(allowance=0.1, threshold=1.0)


# ---------------------------------------------------------------------------------------------- the rule
def _rounds_to_flag(history: DirectionHistory, node: int, cosine: float, limit: int = 100) -> int:
    for t in range(1, limit + 1):
        history.observe(node, cosine)
        if history.persistent(node):
            return t
    return limit + 1


def test_a_constant_opposition_is_flagged_after_threshold_over_its_drift():
    """``S_t = t (c - allowance)`` for a constant cosine ``-c``: flagged at the first ``t`` with ``S_t > threshold``."""
    for c in (0.17, 0.33, 0.9):  # no exact multiples (rounding)
        expected = math.floor(RULE.threshold / (c - RULE.allowance)) + 1
        assert _rounds_to_flag(DirectionHistory(RULE), 1, -c) == expected
    assert _rounds_to_flag(DirectionHistory(RULE), 1, -0.05) == 101  # inside the allowance: never


def test_honest_rounds_bank_no_credit():
    """Ten agreeing rounds first do not delay the flag of a client that turns (the sum is floored at 0)."""
    history = DirectionHistory(RULE)
    for _ in range(10):
        history.observe(7, 0.9)
    assert history.sum_of(7) == 0.0
    assert _rounds_to_flag(history, 7, -0.3) == _rounds_to_flag(DirectionHistory(RULE), 7, -0.3)


def test_skipping_rounds_does_not_reset_the_sum_and_memory_is_bounded():
    history = DirectionHistory(PersistenceRule(allowance=0.1, threshold=1.0, max_clients=3))
    history.observe(1, -0.9)
    for node in (2, 3):  # node 1 absent for two rounds: its sum stays
        history.observe(node, 0.2)
    assert history.sum_of(1) == pytest.approx(0.8)
    history.observe(1, -0.9)
    assert history.persistent(1)
    history.observe(4, 0.0)  # a fourth node: the least recently seen (2) is forgotten
    assert len(history) == 3 and history.sum_of(2) == 0.0 and history.persistent(1)


@pytest.mark.parametrize("cosine", [math.nan, math.inf, -math.inf, -5.0])
def test_a_non_finite_or_out_of_range_cosine_counts_as_full_opposition(cosine):
    history = DirectionHistory(RULE)
    history.observe(1, 0.0)
    assert history.observe(1, cosine) == pytest.approx(1.0 - RULE.allowance)


@pytest.mark.parametrize(
    "kwargs", [{"allowance": 1.0}, {"allowance": math.nan}, {"threshold": 0.0}, {"threshold": math.inf},
               {"max_clients": 0}, {"max_clients": True}]  # fmt: skip
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        PersistenceRule(**kwargs)
    with pytest.raises(ValueError):
        AdmissionRules(persistent_opposition=0.5)


def test_honest_noise_stays_below_the_threshold_with_the_bound_a_union_over_windows_gives():
    """Honest late-training cosines, modelled as N(0, sigma) with sigma = 0.1 (digits IID: within
    +-0.13): ``S_t > h`` needs a window of rounds whose sum of ``-cos - a`` exceeds ``h``; a window of
    length L does so with probability ``Q((h + L a) / (sigma sqrt L))``, so over T rounds a client is
    flagged with probability at most the sum of that over the ``T (T + 1) / 2`` windows. 2,000
    synthetic clients x 20 rounds (fixed seed) stay within 3 x that expectation + 3."""
    rule, sigma, rounds, clients = RULE, 0.1, 20, 2000
    tail = statistics.NormalDist()
    bound = sum(
        (rounds - length + 1) * (1 - tail.cdf((rule.threshold + length * rule.allowance) / (sigma * math.sqrt(length))))
        for length in range(1, rounds + 1)
    )
    rng = np.random.default_rng(17)
    history = DirectionHistory(rule)
    flagged = 0
    for node in range(clients):
        for cosine in rng.normal(0.0, sigma, rounds):
            history.observe(node, float(cosine))
        flagged += history.persistent(node)
    assert bound < 1e-3  # the chosen rule is far from the honest noise
    assert flagged <= 3 * bound * clients + 3
    # the same noise around -0.3 (a flip) is flagged, every client, within the 20 rounds
    history = DirectionHistory(rule)
    assert all(
        any(history.observe(node, float(c)) > rule.threshold for c in rng.normal(-0.3, sigma, rounds))
        for node in range(200)
    )


# ---------------------------------------------------------------------------------------------- through the strategy
ATTACKER, N = 101, 10


def _strategy(persistent: PersistenceRule | None) -> QuantizedStrategy:
    rules = AdmissionRules(reject_opposing=False, persistent_opposition=persistent)
    inner = SortedFedAvg(min_available_nodes=N, fraction_evaluate=1.0)
    return QuantizedStrategy(inner, "fp32", seed=SEED, min_numel=MIN_NUMEL, admission=rules)


def _run(strategy: QuantizedStrategy, plan: list[str]) -> list[dict]:
    """One round per entry of ``plan``: the attacker flips (``flip``), is honest (``honest``) or is away (``away``)."""
    grid = InProcessGrid(make_client_app([quantize_mod]), N)
    arrays = initial_arrays()
    flip = _scaled({ATTACKER}, -1.0)
    metrics = []
    for server_round, action in enumerate(plan, start=1):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        replies = grid.send_and_receive(messages)
        if action == "flip":
            replies = flip(replies, messages)
        elif action == "away":
            replies = [r for r in replies if r.metadata.src_node_id != ATTACKER]
        new, round_metrics = strategy.aggregate_train(server_round, replies)
        arrays = new if new is not None else arrays
        metrics.append(dict(round_metrics))
    return metrics


def test_a_persistent_sign_flip_is_rejected_from_the_second_round_and_staying_away_does_not_reset_it():
    """Without the single-round rule, the flip's first round (cosine near -1 against the others:
    sum 0.9 - allowance < threshold) is admitted; the second is rejected; after two rounds away it
    is rejected at once; an honest round brings the sum back down."""
    rule = PersistenceRule(allowance=0.1, threshold=1.0)
    metrics = _run(_strategy(rule), ["flip", "flip", "away", "away", "flip", "honest", "honest"])
    rejected = [m.get("rejected-direction", 0) for m in metrics]
    assert rejected == [0, 1, 0, 0, 1, 1, 0]  # round 6: honest but still above the threshold
    assert all(m.get("rejected-replies", 0) == r for m, r in zip(metrics, rejected, strict=True))
    off = _run(_strategy(None), ["flip", "flip"])
    assert [m.get("rejected-direction", 0) for m in off] == [0, 0]
