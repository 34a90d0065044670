"""The pieces of bounded influence on their own: windows, schema votes, references, shares, dtypes, body sizes.

Each rule states what fraction of liars it tolerates; the tests check it at that fraction and one above.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord

from fedquant.codecs import available_codecs, get_codec
from fedquant.codecs.coders.layout import max_body_bytes
from fedquant.metrics.robust import bounded_mean, describe, trim_count, window
from fedquant.strategies import AdmissionRules
from fedquant.strategies.admission.cosines import consensus_cosine
from fedquant.strategies.admission.references import MedianReference
from fedquant.strategies.admission.rules import weights
from fedquant.strategies.admission.rules.metrics import check_record, clamp_metrics, conform, vote_schema
from fedquant.strategies.admission.rules.weights import cap_shares
from fedquant.strategies.dtypes import restore_dtypes
from fedquant.wire.payload import read_payload

RULES = AdmissionRules()
W = "num-examples"


# ---------------------------------------------------------------------------------------------- windows
@pytest.mark.parametrize("n", [3, 4, 5, 10, 21])
def test_the_window_holds_with_t_liars_and_breaks_with_t_plus_one(n):
    t = trim_count(n, RULES.metric_trim)
    assert t == max(1, math.floor(0.25 * n)) and t <= (n - 1) // 2
    honest = list(np.linspace(1.0, 2.0, n - t))
    for sign in (1, -1):
        lo, hi = window(honest + [sign * 1e30] * t, RULES.metric_trim)
        assert 1.0 <= lo <= hi <= 2.0  # t liars: both ends are honest values
        if t + 1 <= (n - 1) // 2 or n - t - 1 >= 1:
            lo, hi = window(honest[: n - t - 1] + [sign * 1e30] * (t + 1), RULES.metric_trim)
            assert max(abs(lo), abs(hi)) == 1e30  # t + 1 liars own an end of the window


def test_bounded_mean_is_the_mean_when_it_lies_in_the_window():
    assert bounded_mean([1.0, 2.0, 3.0, 4.0], 0.25) == 2.5
    assert bounded_mean([1.0, 1.1, 1.2, 9.0], 0.25) == 1.2  # the mean (3.075) is clamped to the 3rd value
    assert bounded_mean([], 0.25) is None
    assert bounded_mean([5.0, -1e300], 0.25) == pytest.approx(-5e299)  # two values: nothing to tell apart


def test_clamp_metrics_keeps_the_inner_strategys_own_keys_and_fixes_bad_values():
    records = [MetricRecord({W: 10, "loss": v, "hist": [v, 2 * v]}) for v in (1.0, 2.0, 3.0, 4.0)]
    schema = vote_schema(records, W, AdmissionRules(list_metrics=frozenset({"hist"})))
    out = MetricRecord({"loss": -1e30, "hist": [math.nan, 100.0], "own": 7.0})
    clamp_metrics(out, records, schema, 0.25, W)
    assert out["loss"] == 2.0 and out["hist"] == [2.5, 6.0] and out["own"] == 7.0


def test_describe_never_prints_a_huge_int():
    assert describe(10**5000).startswith("an int of") and describe(1.5) == "1.5" and describe("x") == "str"


# ---------------------------------------------------------------------------------------------- schema votes
def _records(sets: list[dict]) -> list[MetricRecord]:
    return [MetricRecord(d) for d in sets]


def test_key_set_needs_a_strict_majority():
    honest = {W: 5, "loss": 1.0}
    five = _records([honest] * 5 + [{**honest, "x": 1.0}] * 5)
    schema = vote_schema(five, W, RULES)
    assert not schema.strict and schema.keys == {W, "loss"}
    assert all(check_record(r, schema, W, RULES) is None for r in five)  # nobody rejected at exactly half
    conform(five[-1], schema)
    assert set(five[-1].keys()) == {W, "loss"}
    six = _records([honest] * 4 + [{**honest, "x": 1.0}] * 6)
    schema = vote_schema(six, W, RULES)
    assert schema.strict and schema.keys == {W, "loss", "x"}
    assert [check_record(r, schema, W, RULES) is not None for r in six] == [True] * 4 + [False] * 6


def test_declared_keys_win_without_a_majority():
    honest = {W: 5, "loss": 1.0}
    records = _records([honest] * 5 + [{W: 5}] * 5)  # half drop "loss"
    assert vote_schema(records, W, RULES).keys == {W}  # undeclared: the key is stripped, nobody rejected
    declared = AdmissionRules(metric_keys=frozenset({"loss"}))
    schema = vote_schema(records, W, declared)
    assert [check_record(r, schema, W, declared) is None for r in records] == [True] * 5 + [False] * 5


def test_value_types_follow_the_round():
    rules = AdmissionRules(list_metrics=frozenset({"hist"}), max_list_length=3)
    records = _records([{W: 5, "loss": 1.0, "hist": [1.0, 2.0]}] * 3 + [{W: 5, "loss": [1.0], "hist": [1.0]}])
    schema = vote_schema(records, W, rules)
    assert schema.lists == {"hist": 2}
    assert check_record(records[0], schema, W, rules) is None
    assert "must be a number" in check_record(records[3], schema, W, rules)[1]
    long = _records([{W: 5, "loss": 1.0, "hist": [1.0] * 4}] * 3)
    assert "max_list_length" in check_record(long[0], vote_schema(long, W, rules), W, rules)[1]
    undeclared = _records([{W: 5, "loss": [1.0, 2.0]}] * 3)  # lists only where declared
    assert "must be a number" in check_record(undeclared[0], vote_schema(undeclared, W, RULES), W, RULES)[1]


# ---------------------------------------------------------------------------------------------- references
def test_median_reference_withstands_half_of_the_pool_with_history():
    ref = MedianReference()
    honest = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98, 1.01, 0.99]
    ref.end_round(honest)  # an honest first round
    for attack in (0.0, 100.0):
        r = MedianReference()
        r.end_round(honest)
        for _ in range(5):  # 5 of 10 attack every round; admitted values join the history
            value = r.value(honest[:5] + [attack] * 5)
            assert 0.9 <= value <= 1.1
            r.end_round(honest[:5] + [min(attack, 2 * value)] * 5)  # high ones come back clipped


def test_median_reference_falls_to_a_majority_that_stays():
    r = MedianReference()
    r.end_round([1.0] * 10)
    values = []
    for _ in range(3):  # 6 of 10 zeros, admitted every round
        values.append(r.value([1.0] * 4 + [0.0] * 6))
        r.end_round([1.0] * 4 + [0.0] * 6)
    assert values[0] > 0 and values[-1] == 0.0


def test_cap_shares_water_fills():
    weights = [100.0, 10.0, 10.0, 10.0]
    capped = cap_shares(weights, 0.5)
    assert capped[0] / sum(capped) == pytest.approx(0.5) and capped[1:] == weights[1:]
    assert cap_shares([1.0, 2.0, 3.0], 0.2) == [1.0, 1.0, 1.0]  # 0.2 * 3 < 1: equal shares
    rng = np.random.default_rng(0)
    for _ in range(200):
        w = list(rng.lognormal(0, 2, size=rng.integers(2, 12)))
        share = float(rng.uniform(1 / len(w) + 1e-3, 1.0))
        out = cap_shares(w, share)
        assert max(out) / sum(out) <= share * (1 + 1e-9) and all(o <= x * (1 + 1e-12) for o, x in zip(out, w))


def test_bound_weights_clips_to_the_factor_and_the_share():
    rules = AdmissionRules()
    assert weights.bounded(rules, [96, 96, 96, 96], 96.0) == [96, 96, 96, 96]  # untouched, types kept
    out = weights.bounded(rules, [96, 96, 96, 900], 96.0)
    assert out[:3] == [96, 96, 96] and out[3] == pytest.approx(3 * 96)
    assert weights.outlier(rules, 11 * 96, 96.0, W) is not None and weights.outlier(rules, 9 * 96, 96.0, W) is None


# ---------------------------------------------------------------------------------------------- dtypes
def test_restore_dtypes_rounds_integers_and_votes_bools():
    sent = {"steps": np.dtype(np.int64), "mask": np.dtype(np.bool_), "w": np.dtype(np.float32)}
    aggregated = ArrayRecord(
        {"steps": Array(np.array(29.6)), "mask": Array(np.array([0.2, 0.7])), "w": Array(np.ones(2, np.float32))}
    )
    out = restore_dtypes(aggregated, sent)
    assert out["steps"].numpy().dtype == np.int64 and int(out["steps"].numpy()) == 30
    assert out["mask"].numpy().tolist() == [False, True] and out["w"].numpy().dtype == np.float32
    huge = restore_dtypes(ArrayRecord({"steps": Array(np.array(1e30))}), sent)
    assert int(huge["steps"].numpy()) == np.iinfo(np.int64).max - 1023  # clipped into range, no overflow


# ---------------------------------------------------------------------------------------------- direction
def test_consensus_cosine_counts_the_update_itself():
    """A reply outside the first vote is judged against the vote's sum plus itself: an update orthogonal
    to the consensus (noise) gets a positive cosine, a flipped one smaller than the consensus a negative one."""
    consensus = {"w": np.array([3.0, 0.0])}
    assert consensus_cosine({"w": np.array([0.0, 1.0])}, consensus, self_weight=1) > 0
    assert consensus_cosine({"w": np.array([0.0, 1.0])}, consensus, self_weight=0) == 0
    assert consensus_cosine({"w": np.array([-1.0, 0.0])}, consensus, self_weight=1) == pytest.approx(-1.0)
    assert consensus_cosine({"w": np.array([-1.0, 0.0])}, consensus, self_weight=0) == pytest.approx(-1.0)
    # an update larger than the consensus outweighs it (the norm rule bounds it to clip_factor x the reference)
    assert consensus_cosine({"w": np.array([-4.0, 0.0])}, consensus, self_weight=1) == pytest.approx(1.0)
    assert consensus_cosine({"w": np.zeros(2)}, consensus, self_weight=1) is None
    assert consensus_cosine({"other": np.ones(2)}, consensus, self_weight=0) is None


def test_both_cosines_of_an_update_come_from_one_pass_over_it(monkeypatch):
    """With ``reject_opposing`` the direction rules ask two cosines of one update (leave-one-out for the
    CUSUM, with itself for the rejection): from precomputed terms they are the same numbers, and
    ``opposition`` reads the update once."""
    import fedquant.strategies.admission.cosines as bounds

    rng = np.random.default_rng(4)
    update = {"w": rng.standard_normal((30, 7)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    consensus = {k: (3 * v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in update.items()}
    squares = bounds.squares_of(consensus)
    terms = bounds.consensus_terms(update, consensus)
    for weight in (-1, 0, 1):
        assert bounds.consensus_cosine(update, consensus, weight, squares, terms) == bounds.consensus_cosine(
            update, consensus, weight, squares
        )
    passes = []
    real = bounds.dot_terms
    monkeypatch.setattr(bounds, "dot_terms", lambda u, c: passes.append(u.size) or real(u, c))
    from fedquant.strategies.admission import Admission, AdmissionRules, Vote
    from fedquant.strategies.admission.vote import Ballot
    from fedquant.strategies.reply_decoder import DecodedReply

    admission = Admission(AdmissionRules(reject_opposing=True), "num-examples")
    names = [type(rule).__name__ for rule in admission.rules]
    assert "Persistence" in names and "Direction" in names  # the CUSUM's cosine and the rejection's: two asked
    vote = Vote(consensus=consensus, voters=5, squares=squares)
    updates = {k: torch.from_numpy(v.reshape(-1)) for k, v in update.items()}
    reply = DecodedReply(record_name="r", plain={}, plain_values={}, updates=updates, update_norm=1.0)
    admission.oppose(Ballot(vote, 3, reply, {k: np.zeros_like(v) for k, v in update.items()}, in_vote=True))
    assert sorted(passes) == sorted(v.size for v in update.values())  # once per entry, not twice


def test_a_votes_inner_products_come_from_one_pass_over_the_consensus(monkeypatch):
    """consensus_terms_many gives each update what consensus_terms gives it alone (to float64
    rounding), for plain arrays, an EDEN update its sums' pass wrote out (read with the others, in
    one pass over the consensus) and a QSGD one that is never written (its own pass, from its
    packed symbols); entries the consensus lacks, or of another size, are left out as there."""
    import fedquant.strategies.admission.cosines as bounds

    n = 50_000
    rng = np.random.default_rng(8)
    consensus = {"w": rng.standard_normal(n).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    updates = []
    for i, spec in enumerate(["eden:bits=2", "qsgd:levels=16", None]):
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        if spec is None:
            w = x.numpy()
        else:
            codec = get_codec(spec)
            w = codec.decode_deferred(codec.encode(x, seed=i), seed=i, shape=(n,))
            w.accumulate(np.zeros(n, np.float32), np.zeros(0, np.float32), np.zeros(0), 1.0, 0.0)
        updates.append({"b": rng.standard_normal(7).astype(np.float32), "w": w, "extra": np.ones(3, np.float32)})
    assert updates[0]["w"].written() is not None and updates[1]["w"].written() is None
    updates.append({"w": np.ones(n - 1, np.float32)})  # another size: no terms
    batched = []
    real = bounds.dot_terms_many
    monkeypatch.setattr(bounds, "dot_terms_many", lambda us, c: batched.append(len(us)) or real(us, c))
    many = bounds.consensus_terms_many(updates, consensus)
    assert sorted(batched) == [2, 3]  # "w": the EDEN values and the plain array; "b": all three
    for update, terms in zip(updates, many, strict=True):
        alone = bounds.consensus_terms(update, consensus)
        assert list(terms) == list(alone)  # the same entries, in the update's order
        for k, (dot, own) in terms.items():
            assert dot == pytest.approx(alone[k][0], rel=1e-12, abs=1e-9) and own == pytest.approx(
                alone[k][1], rel=1e-12
            )


# ---------------------------------------------------------------------------------------------- body sizes
@pytest.mark.parametrize(
    "spec",
    [*available_codecs(), "qsgd:coding=elias", "qsgd:coding=entropy,levels=300", "ecdq:lattice=e8", "ecdq:coding=fixed",
     "ecdq:lattice=e8,coding=fixed,bits=3"],
)  # fmt: skip
@pytest.mark.parametrize("numel", [1, 7, 2048, 5000])
def test_every_valid_payload_fits_its_body_bound(spec, numel):
    """The pre-checksum size check must never reject what an encoder writes (fixed width: exactly)."""
    codec = get_codec(spec)
    for scale in (1e-3, 1.0, 1e3):
        x = scale * torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        side = x + 0.01 if codec.needs_side_info else None
        payload = codec.encode(x, seed=3)
        body = read_payload(payload).body.nbytes
        size = numel
        for t in codec.wire_transforms:
            size = t.output_numel(size)
        bound = max_body_bytes(codec.quantizer, size)
        assert body <= bound
        if getattr(codec.quantizer, "coding", "fixed") == "fixed" and not codec.quantizer.own_stream:
            assert body == bound  # ECDQ's fixed width follows the tensor's index range: a bound only
        codec.decode(payload, seed=3, side_info=side, shape=(numel,), dtype=torch.float32)


def test_rules_off_accept_replies_without_a_metric_record(flwr_log):
    """``AdmissionRules.off()`` keeps only the payload checks: no metric record is needed, nothing raises."""
    from flwr.app import ConfigRecord
    from flwr.serverapp.exception import InconsistentMessageReplies
    from flwr.serverapp.strategy import FedMedian

    from fedquant.clients import quantize_mod
    from fedquant.strategies import QuantizedStrategy
    from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

    strategy = QuantizedStrategy(
        FedMedian(min_available_nodes=3), "fp32", min_numel=MIN_NUMEL, admission=AdmissionRules.off()
    )
    grid = InProcessGrid(make_client_app([quantize_mod]), 3)
    replies = grid.send_and_receive(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    del replies[0].content["metrics"]
    # Flower's own check refuses the round; the inner guard (always on) logs it and keeps the model.
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["aggregation-failed"] == 1
    assert any(isinstance(r.exc_info[1], InconsistentMessageReplies) for r in flwr_log if r.exc_info)
