"""FedAvg's mean from the decoded updates (fedquant/strategies/fedavg_mean.py) against FedAvg on dense replies.

The wrapper takes the weighted mean itself only for an inner strategy whose ``aggregate_train``
is FedAvg's; a FedAvg subclass that overrides it (here one that only calls it) gets every reply
rebuilt as dense arrays, the path every other strategy takes. Both must give the same round:
same model to float32 rounding, same admission decisions, same metrics.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedMedian,
    FedProx,
    Krum,
)

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.codecs.quantizers.grid import GridValues
from fedquant.protocol import payload_array, tensor_seed
from fedquant.rng import derive_seed
from fedquant.strategies import AdmissionRules, QuantizedStrategy
from fedquant.strategies.admission.vote import VoteSums
from fedquant.strategies.fedavg_mean import aggregates_like_fedavg, weighted_mean
from fedquant.strategies.reply_decoder import DecodedReply
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

NUM_NODES = 6
SEED = 13
ATTACKER = 102


class SortedFedAvg(FedAvg):
    """FedAvg sampling every node in node-id order (both strategies see the replies in one order)."""

    def configure_train(self, *args):
        return sorted(super().configure_train(*args), key=lambda m: m.metadata.dst_node_id)


class DenseFedAvg(SortedFedAvg):
    """The same aggregation through an override: the wrapper must hand it every reply's dense arrays."""

    def aggregate_train(self, server_round, replies):
        return super().aggregate_train(server_round, replies)


def _scaled(codec_spec: str, scale: float):
    """The attacker sends a valid payload of ``scale`` x a random update (rejected or clipped by the norm rule)."""
    codec = get_codec(codec_spec)

    def tamper(reply: Message) -> Message:
        seed = tensor_seed(derive_seed(SEED, 1, reply.metadata.src_node_id), "fc.weight")
        update = torch.from_numpy(np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)) * scale
        record = reply.content["arrays"]
        array = payload_array(codec.encode(update, seed))
        reply.content["arrays"] = ArrayRecord({k: (array if k == "fc.weight" else v) for k, v in record.items()})
        return reply

    return tamper


def _heavy(reply: Message) -> Message:
    """The attacker claims 6x the examples (its weight is clipped)."""
    reply.content["metrics"]["num-examples"] = 6 * reply.content["metrics"]["num-examples"]
    return reply


def _small(codec_spec: str):
    """The attacker sends a small update of its own direction, of about the honest norm."""
    return _scaled(codec_spec, -0.01)


def _round(inner, codec: str, tamper=None):
    # without the cross-round rule: it lowers weights (and reads every update) on rounds this file
    # needs unclipped to see which path the mean takes; tests/strategies/test_drift.py tests it
    rules = AdmissionRules(cross_round=None)
    strategy = QuantizedStrategy(inner, codec, seed=SEED, min_numel=MIN_NUMEL, admission=rules)
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    if tamper is not None:
        replies = [tamper(r) if r.metadata.src_node_id == ATTACKER else r for r in replies]
    return strategy.aggregate_train(1, replies)


CASES = {
    "honest": lambda codec: None,
    "rejected norm": lambda codec: _scaled(codec, 1e6),
    "clipped norm": lambda codec: _scaled(codec, 0.04),
    "clipped weight": lambda codec: _heavy,
    "small update": _small,
}


#: The cases whose vote ends as its running sums assumed (nobody rejected or clipped): the mean
#: comes from the sums taken while decoding; the others sum the updates again.
FROM_RUNNING_SUMS = {"honest", "small update"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("codec", ["qsgd:levels=16", "eden:bits=2", "fp32"])
def test_the_mean_of_the_updates_is_fedavg_of_the_dense_replies(codec, case, monkeypatch):
    inner = dict(min_available_nodes=NUM_NODES, fraction_evaluate=0.0)
    taken = []
    weighted_sum_of = VoteSums.weighted_sum_of
    monkeypatch.setattr(
        VoteSums, "weighted_sum_of", lambda self, *a: taken.append(weighted_sum_of(self, *a)) or taken[-1]
    )
    deferred, written = [], []
    accumulate, materialize = GridValues.accumulate, GridValues.materialize
    monkeypatch.setattr(GridValues, "accumulate", lambda self, *a: deferred.append(self) or accumulate(self, *a))
    monkeypatch.setattr(GridValues, "materialize", lambda self: written.append(self) or materialize(self))
    fast, fast_metrics = _round(SortedFedAvg(**inner), codec, CASES[case](codec))
    assert len(taken) == 1 and (taken[0] is not None) == (case in FROM_RUNNING_SUMS)
    assert bool(deferred) == codec.startswith("qsgd")  # QSGD's updates are never written out in the vote
    if case in FROM_RUNNING_SUMS:
        assert not written  # ... nor afterwards, when the vote's sums stand
    dense, dense_metrics = _round(DenseFedAvg(**inner), codec, CASES[case](codec))
    assert list(fast.keys()) == list(dense.keys())
    for key in fast.keys():
        a, b = fast[key].numpy(), dense[key].numpy()
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.linalg.norm(a.astype(np.float64) - b) <= 1e-6 * np.linalg.norm(b.astype(np.float64)), key
    timings = {k for k in dense_metrics if "seconds" in k}
    assert set(fast_metrics) == set(dense_metrics)
    for key in set(dense_metrics) - timings:
        assert fast_metrics[key] == pytest.approx(dense_metrics[key], rel=1e-9, abs=1e-12), key
    if case in ("rejected norm",):
        assert fast_metrics["rejected-update-norm"] == 1
    if case == "clipped norm":
        assert fast_metrics["clipped-update-norm"] == 1 and fast_metrics["rejected-replies"] == 0
    if case == "clipped weight":
        assert fast_metrics["clipped-num-examples"] >= 1


def test_only_strategies_that_aggregate_as_fedavg_get_the_mean_of_the_updates():
    fedavg = FedAvg()
    assert aggregates_like_fedavg(fedavg) and aggregates_like_fedavg(FedProx(proximal_mu=0.1))
    assert aggregates_like_fedavg(SortedFedAvg()) and not aggregates_like_fedavg(DenseFedAvg())
    for other in (FedAdam(), FedMedian(), Krum(num_malicious_nodes=1)):
        assert not aggregates_like_fedavg(other)
    dp = DifferentialPrivacyServerSideFixedClipping(
        fedavg, noise_multiplier=0.0, clipping_norm=1.0, num_sampled_clients=2
    )
    assert not aggregates_like_fedavg(dp)


def _decoded(update: np.ndarray, plain: dict[str, np.ndarray]) -> DecodedReply:
    arrays = {name: Array(value) for name, value in plain.items()}
    return DecodedReply("arrays", arrays, dict(plain), {"w": torch.from_numpy(update)}, 0.0)


def test_weighted_mean_sums_every_received_model_and_keeps_fedavgs_dtypes():
    """Two received models (downlink compression), a float16 and an int64 entry travelling as they are."""
    rng = np.random.default_rng(3)
    models = [
        {"w": rng.standard_normal(5000).astype(np.float32), "h": np.zeros(3, np.float16), "n": np.array(4)}
        for _ in range(2)
    ]
    updates = [rng.standard_normal(5000).astype(np.float32) * 1e-2 for _ in range(3)]
    plains = [{"h": np.full(3, i + 0.5, np.float16), "n": np.array(4 + i)} for i in range(3)]
    received = [models[0], models[1], models[0]]
    weights = [1.0, 2.0, 5.0]
    shares = [w / sum(weights) for w in weights]
    mean = weighted_mean([_decoded(u, p) for u, p in zip(updates, plains, strict=True)], received, shares)
    expected_w = sum(s * (r["w"].astype(np.float64) + u) for s, r, u in zip(shares, received, updates, strict=True))
    np.testing.assert_allclose(mean["w"].numpy(), expected_w.astype(np.float32), rtol=1e-6)
    assert mean["w"].numpy().dtype == np.float32
    assert mean["h"].numpy().dtype == np.float16  # FedAvg: float16 x weight stays float16
    assert mean["n"].numpy().dtype == np.float64  # and an int64 entry becomes float64 (restore_dtypes rounds it)
    assert float(mean["n"].numpy()) == pytest.approx(sum(s * (4 + i) for i, s in enumerate(shares)))
    assert math.isclose(float(mean["h"].numpy()[0]), sum(s * (i + 0.5) for i, s in enumerate(shares)), rel_tol=1e-3)


def test_weighted_mean_writes_into_the_scratch_buffers_it_is_given():
    rng = np.random.default_rng(4)
    model = {"w": rng.standard_normal((50, 100)).astype(np.float32)}
    updates = [rng.standard_normal((50, 100)).astype(np.float32) for _ in range(3)]
    decoded = [_decoded(u, {}) for u in updates]
    shares = [0.2, 0.3, 0.5]
    fresh = weighted_mean(decoded, [model] * 3, shares)
    buffer = np.full((50, 100), np.nan)  # what the consensus left there must not count
    scratch = {"w": buffer, "other": np.zeros(3)}
    reused = weighted_mean(decoded, [model] * 3, shares, scratch)
    np.testing.assert_array_equal(reused["w"].numpy(), fresh["w"].numpy())
    assert "w" not in scratch and "other" in scratch and not np.isnan(buffer).any()
