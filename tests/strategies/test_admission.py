"""Admission rules: one client's valid-looking reply must not end the round nor poison the model.

Every case here was a crash or a poisoned model before the rules existed: a reply without
``num-examples`` aborted the round (``InconsistentMessageReplies``), weights summing to 0 raised
``ZeroDivisionError``, a NaN weight made the model NaN, and a valid payload of a 1e30 update was
averaged into the model. Rounds run in-process (``tests.flower_fakes.InProcessGrid``), forged
replies are built between the clients and ``aggregate_train``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    FedMedian,
    FedTrimmedAvg,
    Krum,
)

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.protocol import KEY_ROLE, payload_array, tensor_seed
from fedquant.rng import derive_seed
from fedquant.strategies import AdmissionRules, NestedDecodePlan, QuantizedStrategy
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

NUM_NODES = 4
SEED = 11
ATTACKER = 102
POISON = 1e30


def _wrap(strategy=None, codec="fp32", num_nodes=NUM_NODES, **kw) -> QuantizedStrategy:
    inner = strategy if strategy is not None else FedAvg(min_available_nodes=num_nodes)
    return QuantizedStrategy(inner, codec, seed=SEED, min_numel=MIN_NUMEL, **kw)


def _round(strategy: QuantizedStrategy, tamper=None, num_nodes: int = NUM_NODES, drop=()):
    """Round 1 with in-process clients; ``tamper(reply)`` rewrites the attacker's reply."""
    grid = InProcessGrid(make_client_app([quantize_mod]), num_nodes)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    replies = [r for r in grid.send_and_receive(messages) if r.metadata.src_node_id not in drop]
    if tamper is not None:
        replies = [tamper(r) if r.metadata.src_node_id == ATTACKER else r for r in replies]
    return strategy.aggregate_train(1, replies)


def _honest(strategy_factory, num_nodes: int = NUM_NODES):
    """The aggregate of the honest clients alone (the attacker's reply left out)."""
    return _round(strategy_factory(), num_nodes=num_nodes, drop=(ATTACKER,))[0]


def _metrics(reply: Message) -> MetricRecord:
    return reply.content["metrics"]


def _set_metric(key, value):
    def tamper(reply):
        _metrics(reply)[key] = value
        return reply

    return tamper


def _del_metric(key):
    def tamper(reply):
        del _metrics(reply)[key]
        return reply

    return tamper


def _assert_same(a: ArrayRecord, b: ArrayRecord, atol: float = 1e-6) -> None:
    assert a is not None and b is not None
    assert list(a.keys()) == list(b.keys())
    for key in a.keys():
        np.testing.assert_allclose(a[key].numpy(), b[key].numpy(), rtol=0, atol=atol)


# ---------------------------------------------------------------------------- metrics
WEIGHT_CASES = {
    "missing": _del_metric("num-examples"),
    "zero": _set_metric("num-examples", 0),
    "negative": _set_metric("num-examples", -2000),
    "nan": _set_metric("num-examples", math.nan),
    "inf": _set_metric("num-examples", math.inf),
    "huge": _set_metric("num-examples", 1e15),
    "list": _set_metric("num-examples", [96, 96]),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_bad_weight_rejects_that_reply_alone(case, flwr_log):
    arrays, metrics = _round(_wrap(), WEIGHT_CASES[case])
    assert metrics["rejected-replies"] == 1 and metrics["rejected-num-examples"] == 1
    _assert_same(arrays, _honest(_wrap))
    assert any(f"node {ATTACKER}" in r.getMessage() and "num-examples" in r.getMessage() for r in flwr_log)


def test_all_weights_zero_keeps_the_model_instead_of_dividing_by_zero():
    strategy = _wrap()
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    replies = grid.send_and_receive(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    for reply in replies:
        _metrics(reply)["num-examples"] = 0
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics["rejected-num-examples"] == NUM_NODES


@pytest.mark.parametrize(
    "tamper",
    [
        _set_metric("extra-key", 1.0),
        _del_metric("train-loss"),
        _set_metric("train-loss", math.nan),
        _set_metric("train-loss", [1.0, math.inf]),
    ],
    ids=["extra-key", "missing-key", "nan-metric", "inf-in-list"],
)
def test_inconsistent_or_nonfinite_metrics_reject_that_reply_alone(tamper):
    arrays, metrics = _round(_wrap(), tamper)
    assert metrics["rejected-replies"] == 1 and metrics["rejected-metrics"] == 1
    _assert_same(arrays, _honest(_wrap))
    assert math.isfinite(metrics["train-loss"])


def test_two_metric_records_reject_that_reply():
    def tamper(reply):
        reply.content["more"] = MetricRecord({"num-examples": 5})
        return reply

    _, metrics = _round(_wrap(), tamper)
    assert metrics["rejected-metrics"] == 1


def test_weight_cap_is_configurable_and_each_rule_can_be_off():
    huge = _set_metric("num-examples", 1e15)
    _, metrics = _round(_wrap(admission=AdmissionRules(max_weight=1e16, weight_reject_factor=None)), huge)
    assert metrics["rejected-replies"] == 0 and metrics["clipped-num-examples"] == 1
    _, metrics = _round(_wrap(admission=AdmissionRules(max_weight=50)), None)
    assert metrics["rejected-num-examples"] == NUM_NODES  # every client has 96 examples
    with pytest.raises(ValueError, match="norm_factor"):
        AdmissionRules(norm_factor=0.5)
    with pytest.raises(ValueError, match="max_weight"):
        AdmissionRules(max_weight=math.nan)
    with pytest.raises(ValueError, match="admission"):
        _wrap(admission={"norm_factor": 3})


def test_evaluate_replies_are_admitted_the_same_way():
    strategy = _wrap(FedAvg(min_available_nodes=NUM_NODES, fraction_evaluate=1.0))
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    messages = list(strategy.configure_evaluate(1, initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    del replies[0].content["metrics"]["num-examples"]
    replies[1].content["metrics"]["eval-loss"] = math.nan
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics["rejected-replies"] == 2
    assert math.isfinite(metrics["eval-loss"])


# ---------------------------------------------------------------------------- update norms
def _poisoned(codec_spec: str, scale: float = POISON):
    """The attacker sends a valid payload of a huge update, encoded with the round's seeds."""
    codec = get_codec(codec_spec)

    def tamper(reply):
        seed = tensor_seed(derive_seed(SEED, 1, reply.metadata.src_node_id), "fc.weight")
        update = torch.from_numpy(np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)) * scale
        payload = codec.encode(update, seed)
        record = reply.content["arrays"]
        array = payload_array(payload)
        reply.content["arrays"] = ArrayRecord({k: (array if k == "fc.weight" else v) for k, v in record.items()})
        return reply

    return tamper


@pytest.mark.parametrize("codec", ["fp32", "qsgd:levels=16", "signsgd", "orq", "dqsg"])
def test_a_huge_valid_update_is_rejected_and_the_model_stays_honest(codec):
    arrays, metrics = _round(_wrap(codec=codec), _poisoned(codec))
    assert metrics["rejected-replies"] == 1 and metrics["rejected-update-norm"] == 1
    honest = _honest(lambda: _wrap(codec=codec))
    _assert_same(arrays, honest, atol=1e-6)


def test_norm_factor_is_relative_to_the_round_median():
    """An update 3x the honest scale passes the default factor of 10 and fails a factor of 2."""
    honest = _round(_wrap(), None)[0]
    received = initial_arrays()["fc.weight"].numpy()
    scale = 3 * float(np.linalg.norm(honest["fc.weight"].numpy() - received)) / math.sqrt(16 * 64)
    _, metrics = _round(_wrap(), _poisoned("fp32", scale))
    assert metrics["rejected-replies"] == 0
    _, metrics = _round(_wrap(admission=AdmissionRules(norm_factor=2.0)), _poisoned("fp32", scale))
    assert metrics["rejected-update-norm"] == 1


def test_absolute_norm_bound_works_with_two_clients():
    """With two replies the median cannot tell who is off; ``max_update_norm`` still can."""
    rules = AdmissionRules(max_update_norm=1e3)
    arrays, metrics = _round(_wrap(admission=rules, num_nodes=2), _poisoned("fp32"), num_nodes=2)
    assert metrics["rejected-update-norm"] == 1
    assert np.isfinite(arrays["fc.weight"].numpy()).all() and np.abs(arrays["fc.weight"].numpy()).max() < 10


def test_rules_off_accept_the_poison_as_before():
    """The rules are what stops it: switched off, the 1e30 update goes into the average."""
    arrays, metrics = _round(_wrap(admission=AdmissionRules.off()), _poisoned("fp32"))
    assert metrics["rejected-replies"] == 0 and np.abs(arrays["fc.weight"].numpy()).max() > 1e28


def test_ndqsg_outlier_in_the_first_group_never_becomes_side_information():
    """P2 replies decode against P1's mean: an admitted P1 outlier would shift every P2 update."""
    num_nodes = 6

    class SortedFedAvg(FedAvg):  # FedAvg samples in random order; NDQSG's groups follow the order
        def configure_train(self, *args):
            return sorted(super().configure_train(*args), key=lambda m: m.metadata.dst_node_id)

    def make():
        plan = NestedDecodePlan(p1_fraction=0.5, rho=5)
        return _wrap(SortedFedAvg(min_available_nodes=num_nodes), codec="ndqsg", decode_plan=plan)

    strategy = make()
    grid = InProcessGrid(make_client_app([quantize_mod]), num_nodes)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    roles = {m.metadata.dst_node_id: m.content["config"][KEY_ROLE] for m in messages}
    attacker = min(node for node, role in roles.items() if role == "p1")
    replies = grid.send_and_receive(messages)
    p1_codec = strategy._rounds.peek("train", 1).assignments[attacker].codec.spec
    forged = [_poisoned(p1_codec)(r) if r.metadata.src_node_id == attacker else r for r in replies]
    arrays, metrics = strategy.aggregate_train(1, forged)
    assert metrics["rejected-update-norm"] == 1

    honest = make()
    messages = list(honest.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    replies = [r for r in grid.send_and_receive(messages) if r.metadata.src_node_id != attacker]
    reference, _ = honest.aggregate_train(1, replies)
    _assert_same(arrays, reference, atol=1e-6)


# ---------------------------------------------------------------------------- robust inner strategies
def _dense_replies_range(num_nodes: int):
    """Per coordinate, the min and max of the honest clients' trained weights (fp32: exact)."""
    grid = InProcessGrid(make_client_app([]), num_nodes)
    strategy = FedAvg(min_available_nodes=num_nodes)
    replies = grid.send_and_receive(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    honest = np.stack([r.content["arrays"]["fc.weight"].numpy() for r in replies if r.metadata.src_node_id != ATTACKER])
    return honest.min(axis=0), honest.max(axis=0), honest


ROBUST = {
    "FedMedian": lambda: FedMedian(min_available_nodes=NUM_NODES),
    "FedTrimmedAvg": lambda: FedTrimmedAvg(beta=0.25, min_available_nodes=NUM_NODES),
    "Krum": lambda: Krum(num_malicious_nodes=1, min_available_nodes=NUM_NODES),
}


@pytest.mark.parametrize("name", list(ROBUST))
@pytest.mark.parametrize("rules", ["off", "default"])
def test_robust_inner_strategies_keep_their_guarantee(name, rules):
    """With the wrapper's norm rule off, the inner strategy alone must contain a large-norm attacker."""
    admission = AdmissionRules.off() if rules == "off" else None
    arrays, _ = _round(_wrap(ROBUST[name](), codec="fp32", admission=admission), _poisoned("fp32", 1e4))
    low, high, honest = _dense_replies_range(NUM_NODES)
    weight = arrays["fc.weight"].numpy()
    tol = 1e-5
    if name == "Krum":  # Krum returns one honest client's model
        assert min(np.abs(weight - h).max() for h in honest) < tol
    else:
        assert (weight >= low - tol).all() and (weight <= high + tol).all()


def test_dp_fixed_clipping_bounds_the_attackers_contribution():
    clip = 0.5
    dp = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(min_available_nodes=NUM_NODES), noise_multiplier=0.0, clipping_norm=clip, num_sampled_clients=NUM_NODES
    )
    arrays, _ = _round(_wrap(dp, codec="qsgd:levels=16", admission=AdmissionRules.off()), _poisoned("qsgd", 1e4))
    start = initial_arrays()
    moved = math.sqrt(sum(float(np.sum((arrays[k].numpy() - start[k].numpy()) ** 2)) for k in start.keys()))
    assert 0 < moved <= clip * (1 + 1e-5)  # the mean of updates clipped to `clip` has norm <= clip


def test_round_reports_the_update_norms_it_admitted():
    """``update-norm-median`` / ``-max-ratio`` are those of the honest fp32 updates, not the attacker's."""
    _, metrics = _round(_wrap(), _poisoned("fp32"))
    start = initial_arrays()["fc.weight"].numpy().astype(np.float64)
    # fp32 replies are exact: recompute the honest updates of both tensors (fc.bias starts at 0).
    grid = InProcessGrid(make_client_app([]), NUM_NODES)
    replies = grid.send_and_receive(FedAvg().configure_train(1, initial_arrays(), ConfigRecord(), grid))
    norms = sorted(
        math.sqrt(
            float(np.sum((r.content["arrays"]["fc.weight"].numpy() - start) ** 2))
            + float(np.sum(r.content["arrays"]["fc.bias"].numpy().astype(np.float64) ** 2))
        )
        for r in replies
        if r.metadata.src_node_id != ATTACKER
    )
    assert len(norms) == NUM_NODES - 1
    assert metrics["update-norm-median"] == pytest.approx(norms[1], rel=1e-5)
    assert metrics["update-norm-max-ratio"] == pytest.approx(norms[-1] / norms[1], rel=1e-5)
