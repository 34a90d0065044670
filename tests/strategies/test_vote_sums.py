"""The first vote's running sums (fedquant/strategies/admission/vote.py): what they hold and when they stand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedquant.records import RecordError
from fedquant.strategies.admission.cosines import consensus_cosine
from fedquant.strategies.admission.vote import Vote, VoteSums
from fedquant.strategies.reply_decoder import DecodedReply, float_update

SHAPE = (40, 30)


def _reply(update: np.ndarray, bias: np.ndarray) -> DecodedReply:
    """A decoded reply: ``w`` encoded (its update), ``b`` a plain float entry (the trained value)."""
    return DecodedReply("arrays", {}, {"b": bias}, {"w": torch.from_numpy(update)}, 0.0)


def _vote(sums: VoteSums, received: dict, updates: list[np.ndarray], weights: list[float]) -> list[DecodedReply]:
    """Each update checked and added through the hook, as ``RecordCodec.decode`` calls it."""
    replies = []
    for k, (update, weight) in enumerate(zip(updates, weights, strict=True)):
        hook = sums.squares(weight)
        squares = hook("w", received["w"], update)
        assert squares == pytest.approx(float(np.sum(update.astype(np.float64) ** 2)), rel=1e-12)
        reply = _reply(update, received["b"] + np.float32(k + 1))
        sums.joined(reply)
        replies.append(reply)
    return replies


def _setting(n: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    received = {"w": rng.standard_normal(SHAPE).astype(np.float32), "b": np.zeros(3, np.float32)}
    updates = [rng.standard_normal(SHAPE).astype(np.float32) * np.float32(0.01) for _ in range(n)]
    weights = [float(w) for w in rng.integers(1, 50, n)]
    return received, updates, weights


def test_the_sums_are_the_consensus_and_the_weighted_sum_of_the_updates():
    received, updates, weights = _setting()
    sums = VoteSums(consensus=True, weighted=True)
    replies = _vote(sums, received, updates, weights)
    exact = sum(u.astype(np.float64) for u in updates).reshape(-1)
    np.testing.assert_allclose(sums.consensus["w"], exact, rtol=1e-5, atol=1e-7)
    weighted = sum(w * u.astype(np.float64) for w, u in zip(weights, updates, strict=True)).reshape(-1)
    assert sums.holds_exactly(replies) and not sums.holds_exactly(replies[::-1]) and not sums.holds_exactly(replies[1:])
    # the weighted sum does not depend on the order FedAvg sees the replies in, only on who and how heavy
    summed, total = sums.weighted_sum_of(replies[::-1], weights[::-1])
    assert total == sum(weights)
    np.testing.assert_allclose(summed["w"], weighted, rtol=1e-6)
    assert sums.weighted_sum_of(replies[1:], weights[1:]) is None  # one reply left out (rejected later)
    assert sums.weighted_sum_of(replies, [*weights[:-1], weights[-1] / 2]) is None  # a weight clipped later
    clipped = DecodedReply("arrays", {}, replies[0].plain_values, {"w": replies[0].updates["w"] * 0.5}, 0.0)
    assert sums.weighted_sum_of([clipped, *replies[1:]], weights) is None  # an update clipped later


def test_a_reply_refused_halfway_spoils_the_sums_and_an_overflow_is_refused():
    received, updates, weights = _setting(3)
    sums = VoteSums(consensus=True, weighted=True)
    replies = _vote(sums, received, updates[:2], weights[:2])
    huge = np.full(SHAPE, np.finfo(np.float32).max, np.float32)
    hook = sums.squares(1.0)
    with pytest.raises(RecordError, match="overflows"):
        hook("w", np.abs(received["w"]) + np.float32(1e38), huge)
    sums.failed()
    assert not sums.holds_exactly(replies) and sums.weighted_sum_of(replies, weights[:2]) is None
    # a failure without a pending hook changes nothing
    fresh = VoteSums(consensus=True, weighted=False)
    fresh.failed()
    assert fresh.intact and fresh.weighted_sum_of([], []) is None  # the weighted sum is not kept


def test_the_consensus_from_the_running_sums_is_the_consensus_summed_again():
    received, updates, weights = _setting(6, seed=3)
    sums = VoteSums(consensus=True, weighted=False)
    fast, slow = Vote(sums=sums), Vote()
    replies = _vote(sums, received, updates, weights)
    fast.set_consensus(replies, [received] * len(replies))
    slow.set_consensus(replies, [received] * len(replies))
    assert fast.consensus["w"].dtype == np.float32 and slow.consensus["w"].dtype == np.float64
    assert set(fast.consensus) == set(slow.consensus) == {"w", "b"}
    for name in ("w", "b"):
        assert fast.consensus[name].shape == slow.consensus[name].shape
        np.testing.assert_allclose(fast.consensus[name], slow.consensus[name], rtol=1e-5, atol=1e-6)
    for reply in replies:  # the direction rules read the same leave-one-out cosines from either
        update = float_update(reply, received)
        got = [consensus_cosine(update, vote.consensus, self_weight=-1) for vote in (fast, slow)]
        assert got[0] == pytest.approx(got[1], abs=1e-6)
    # a vote that lost a reply to the norm rule is summed again, without it
    lost = Vote(sums=sums)
    lost.set_consensus(replies[1:], [received] * 5)
    want = sum(float_update(r, received)["w"].astype(np.float64) for r in replies[1:])
    np.testing.assert_allclose(lost.consensus["w"], want, rtol=1e-12)


def test_equal_weights_keep_one_sum_and_another_weight_starts_the_weighted_one():
    received, updates, _ = _setting(6, seed=4)
    equal = VoteSums(consensus=False, weighted=True)
    replies = _vote(equal, received, updates, [7.0] * 6)
    assert equal.weighted is None  # 7 x the plain sum: not kept apart
    summed, total = equal.weighted_sum_of(replies, [7.0] * 6)
    assert total == 6 and summed is equal.consensus  # sum / 6 is the mean
    exact = sum(u.astype(np.float64) for u in updates).reshape(-1)
    np.testing.assert_allclose(summed["w"], exact, rtol=1e-5, atol=1e-7)  # float32 sums of 6 terms of ~0.01
    weights = [7.0, 7.0, 7.0, 2.0, 7.0, 3.0]
    mixed = VoteSums(consensus=False, weighted=True)
    replies = _vote(mixed, received, updates, weights)
    assert mixed.weighted is not None
    summed, total = mixed.weighted_sum_of(replies, weights)
    want = sum(w * u.astype(np.float64) for w, u in zip(weights, updates, strict=True)).reshape(-1)
    assert total == sum(weights)
    np.testing.assert_allclose(summed["w"], want, rtol=1e-5, atol=1e-6)  # the first three summed in float32
