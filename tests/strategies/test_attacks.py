"""Issue 17's attacks, each as a test: no client, and no minority, may crash the run or steer it.

Every attack here ended the run, owned the model or a metric, or starved the round on the code
before the relative admission rules (checked by running this file against that code: it imports
public names only). Rounds run in-process (``tests.flower_fakes``: a linear model, ``fc.weight``
encoded, ``fc.bias`` plain), forged replies are built between the clients and the strategy, with
valid payloads where the attack is "within the rules".
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.errors import PayloadError
from fedquant.protocol import KEY_ROLE, STATE_TRANSFORMS_KEY, payload_array, tensor_seed
from fedquant.records import RecordCodec
from fedquant.rng import derive_seed
from fedquant.strategies import AdmissionRules, NestedDecodePlan, QuantizedStrategy
from fedquant.strategies.drift import DriftRule
from fedquant.wire import payload as payload_module
from fedquant.wire.payload import read_payload, write_payload
from tests import flower_fakes as fakes
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

SEED = 17
N = 10


class SortedFedAvg(FedAvg):
    """FedAvg that samples every node in node-id order (NDQSG's groups follow the message order)."""

    def configure_train(self, *args):
        return sorted(super().configure_train(*args), key=lambda m: m.metadata.dst_node_id)


def _wrap(n: int = N, codec: str = "fp32", inner=None, **kw) -> QuantizedStrategy:
    inner = inner if inner is not None else SortedFedAvg(min_available_nodes=n, fraction_evaluate=1.0)
    return QuantizedStrategy(inner, codec, seed=SEED, min_numel=MIN_NUMEL, **kw)


def _honest_updates(n: int, arrays: ArrayRecord | None = None) -> dict[int, dict[str, np.ndarray]]:
    """Per node, the update ``trained - received`` its honest training gives (float64)."""
    arrays = arrays if arrays is not None else initial_arrays()
    grid = InProcessGrid(make_client_app([]), n)
    replies = grid.send_and_receive(FedAvg(min_available_nodes=n).configure_train(1, arrays, ConfigRecord(), grid))
    start = {k: a.numpy().astype(np.float64) for k, a in arrays.items()}
    return {
        r.metadata.src_node_id: {k: r.content["arrays"][k].numpy().astype(np.float64) - start[k] for k in start}
        for r in replies
    }


def _norm(update: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(v**2)) for v in update.values()))


def _received(messages) -> dict[str, np.ndarray]:
    return {k: a.numpy().astype(np.float64) for k, a in messages[0].content["arrays"].items()}


def _round_of(messages) -> int:
    return int(messages[0].content["config"]["server-round"])


def _forge(reply: Message, update: dict[str, np.ndarray], spec: str, messages) -> Message:
    """Make ``reply`` carry a valid payload of ``update`` (encoded with the node's round seed)."""
    node = reply.metadata.src_node_id
    seed = tensor_seed(derive_seed(SEED, _round_of(messages), node), "fc.weight")
    payload = get_codec(spec).encode(torch.from_numpy(update["fc.weight"].astype(np.float32)), seed)
    bias = Array((_received(messages)["fc.bias"] + update["fc.bias"]).astype(np.float32))
    reply.content["arrays"] = ArrayRecord({"fc.weight": payload_array(payload), "fc.bias": bias})
    return reply


def _update_of(reply: Message, messages) -> dict[str, np.ndarray]:
    """The update an fp32 reply carries (its payload decodes exactly)."""
    seed = tensor_seed(derive_seed(SEED, _round_of(messages), reply.metadata.src_node_id), "fc.weight")
    weight = get_codec("fp32").decode(reply.content["arrays"]["fc.weight"].data, seed).numpy().astype(np.float64)
    bias = reply.content["arrays"]["fc.bias"].numpy().astype(np.float64) - _received(messages)["fc.bias"]
    return {"fc.weight": weight, "fc.bias": bias}


def _scaled(nodes, scale):
    """Tamper: each of ``nodes`` sends its own (fp32) update times ``scale``."""

    def tamper(replies, messages):
        return [
            _forge(r, {k: scale * v for k, v in _update_of(r, messages).items()}, "fp32", messages)
            if r.metadata.src_node_id in nodes
            else r
            for r in replies
        ]

    return tamper


def _direction(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(99)
    d = {"fc.weight": rng.standard_normal((16, 64)), "fc.bias": rng.standard_normal(16)}
    return {k: v * scale / _norm(d) for k, v in d.items()}


def _round(strategy, n=N, tamper=None, server_round=1, arrays=None, app=None):
    """Configure, run the clients, let ``tamper(replies, messages)`` forge some, aggregate."""
    grid = InProcessGrid(app or make_client_app([quantize_mod]), n)
    arrays = arrays if arrays is not None else initial_arrays()
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    if tamper is not None:
        replies = tamper(replies, messages)
    return strategy.aggregate_train(server_round, replies)


def _by_node(nodes, change):
    def tamper(replies, _messages):
        return [change(r) if r.metadata.src_node_id in nodes else r for r in replies]

    return tamper


def _set(key, value):
    def change(reply):
        next(iter(reply.content.metric_records.values()))[key] = value
        return reply

    return change


def _distance(a: ArrayRecord, b: ArrayRecord) -> float:
    return math.sqrt(sum(float(np.sum((a[k].numpy().astype(np.float64) - b[k].numpy()) ** 2)) for k in b.keys()))


def _warned(records, text: str) -> bool:
    return any(r.levelno == logging.WARNING and text in r.getMessage() for r in records)


ATTACKER = 101


# ---------------------------------------------------------------------------------------------- crashes
def test_a_list_metric_in_a_train_reply_is_rejected_alone():
    """Any one client could end the run: FedAvg's metric average raised ``TypeError``."""
    arrays, metrics = _round(_wrap(), tamper=_by_node({ATTACKER}, _set("train-loss", [1.0, 2.0])))
    assert metrics["rejected-metrics"] == 1 and metrics["rejected-replies"] == 1
    honest, _ = _round(_wrap(), tamper=lambda replies, _m: [r for r in replies if r.metadata.src_node_id != ATTACKER])
    assert _distance(arrays, honest) < 1e-6
    assert isinstance(metrics["train-loss"], float)


def test_a_list_metric_in_an_evaluate_reply_is_rejected_alone():
    strategy = _wrap()
    grid = InProcessGrid(make_client_app([quantize_mod]), N)
    replies = grid.send_and_receive(strategy.configure_evaluate(1, initial_arrays(), ConfigRecord(), grid))
    replies[0].content["metrics"]["eval-loss"] = [1.0, 2.0]
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics["rejected-replies"] == 1 and isinstance(metrics["eval-loss"], float)


# ---------------------------------------------------------------------------------------------- influence
def _boost(weight: float, norm_scale: float):
    honest = _honest_updates(N)
    median = float(np.median([_norm(u) for u in honest.values()]))
    poison = _direction(norm_scale * median)

    def tamper(replies, messages):
        for r in replies:
            if r.metadata.src_node_id == ATTACKER:
                _set("num-examples", weight)(r)
                _forge(r, poison, "fp32", messages)
        return replies

    return honest, poison, tamper


def test_a_weight_of_1e9_is_rejected_relative_to_the_round():
    """9.5 x the median norm (inside the norm rule) and num-examples = 1e9 (inside the absolute cap): one
    client owned the model (the cap was absolute, not relative to the round's other clients)."""
    _, _, tamper = _boost(1e9, 9.5)
    arrays, metrics = _round(_wrap(), tamper=tamper)
    assert metrics["rejected-num-examples"] == 1 and metrics["rejected-replies"] == 1
    honest, _ = _round(_wrap(), tamper=lambda replies, _m: [r for r in replies if r.metadata.src_node_id != ATTACKER])
    assert _distance(arrays, honest) < 1e-6


def test_one_clients_influence_within_the_rules_is_weight_share_times_norm_bound():
    """Just inside every rule (9 x the median weight, 9.5 x the median norm) the client is clipped to
    3 x the weight and 2 x the reference norm: its term in the weighted mean is at most s x c x r."""
    honest, poison, tamper = _boost(9 * fakes.N_SAMPLES, 9.5)
    arrays, metrics = _round(_wrap(admission=AdmissionRules(cross_round=None)), tamper=tamper)  # per-round rules
    others = [u for node, u in honest.items() if node != ATTACKER]
    without = {k: np.mean([u[k] for u in others], axis=0) for k in poison}  # equal honest weights
    start = initial_arrays()
    moved = {k: arrays[k].numpy().astype(np.float64) - start[k].numpy() for k in poison}
    deviation = _norm({k: moved[k] - without[k] for k in poison})
    rules = AdmissionRules()
    share = rules.weight_factor / (rules.weight_factor + N - 1)  # 3 / 12: weight clipped to 3 x the median
    reference = float(np.median([_norm(u) for u in honest.values()] + [_norm(poison)]))  # round 1: no history
    bound = share * (rules.clip_factor * reference + _norm(without))
    assert deviation <= bound * (1 + 1e-6)
    assert deviation > 0.5 * share * rules.clip_factor * reference  # the bound is what it gets, not 0
    assert metrics["clipped-num-examples"] == 1 and metrics["clipped-update-norm"] == 1
    assert metrics["rejected-replies"] == 0
    # the cross-round rule (opt-in) lowers the weight further: its pull is at most 1.5 typical ones
    arrays, metrics = _round(_wrap(admission=AdmissionRules(cross_round=DriftRule())), tamper=tamper)
    moved = {k: arrays[k].numpy().astype(np.float64) - start[k].numpy() for k in poison}
    assert _norm({k: moved[k] - without[k] for k in poison}) < 0.5 * deviation
    assert metrics["clipped-drift"] == 1 and metrics["rejected-replies"] == 0


def test_reported_client_metrics_stay_in_the_honest_range():
    """quantization-mse = -1e300 and encode-seconds = 1e300 from one client set the round's metrics."""

    def lie(replies, _messages):
        record = next(r for r in replies if r.metadata.src_node_id == ATTACKER).content["metrics"]
        record["fedquant.quantization-mse"] = -1e300
        record["fedquant.encode-seconds"] = 1e300
        return replies

    _, honest = _round(_wrap(codec="qsgd:levels=4"))
    _, metrics = _round(_wrap(codec="qsgd:levels=4"), tamper=lie)
    assert 0 < metrics["quantization-mse"] < 10 * honest["quantization-mse"]
    assert 0 < metrics["encode-seconds"] < 10.0
    assert metrics["rejected-replies"] == 0  # fedquant's own entries are bounded, not held against the reply


@pytest.mark.parametrize("weight", [1e9, 9.0 * fakes.N_SAMPLES], ids=["rejected-weight", "clipped-weight"])
def test_an_evaluate_reply_cannot_set_the_aggregated_loss(weight):
    """eval-loss = -1e30 with num-examples = 1e9 set the aggregated loss to -1e30, without a warning."""
    strategy = _wrap()
    grid = InProcessGrid(make_client_app([quantize_mod]), N)
    replies = grid.send_and_receive(strategy.configure_evaluate(1, initial_arrays(), ConfigRecord(), grid))
    losses = [r.content["metrics"]["eval-loss"] for r in replies[1:]]
    replies[0].content["metrics"]["eval-loss"] = -1e30
    replies[0].content["metrics"]["num-examples"] = weight
    metrics = strategy.aggregate_evaluate(1, replies)
    assert min(losses) <= metrics["eval-loss"] <= max(losses)
    if weight > 1e6:
        assert metrics["rejected-replies"] == 1
    else:
        assert metrics["clipped-num-examples"] == 1 and metrics["rejected-replies"] == 0


def _without(nodes):
    return lambda replies, _m: [r for r in replies if r.metadata.src_node_id not in nodes]


SINGLE_ROUND_DIRECTION = AdmissionRules(reject_opposing=True)  # off by default: see test_direction.py


def test_a_sign_flipped_update_is_rejected():
    """One client sending its own update x -1 (honest norm and weight, inside every bound) pulled the
    model back by a tenth of a round's step, every round. The single-round rule rejects it in its
    first round; the default persistence rule from a later one (test_direction.py)."""
    arrays, metrics = _round(_wrap(admission=SINGLE_ROUND_DIRECTION), tamper=_scaled({ATTACKER}, -1.0))
    assert metrics["rejected-direction"] == 1 and metrics["rejected-replies"] == 1
    honest, _ = _round(_wrap(), tamper=_without({ATTACKER}))
    assert _distance(arrays, honest) < 1e-6


def test_sign_flips_are_rejected_up_to_a_minority_and_a_majority_sets_the_direction(flwr_log):
    """4 of 10 sign flips (a minority) are all rejected; 5 of 10 (exactly half) cancel the consensus and
    nobody is rejected (``rho (n - 2k + 1) > 1`` cannot hold); 6 of 10 turn it: the 4 honest updates are
    rejected and the round warns, as expected without an honest majority."""
    minority = {101, 102, 103, 104}
    _, metrics = _round(_wrap(admission=SINGLE_ROUND_DIRECTION), tamper=_scaled(minority, -1.0))
    assert metrics["rejected-direction"] == 4 and metrics["rejected-replies"] == 4
    _, metrics = _round(_wrap(admission=SINGLE_ROUND_DIRECTION), tamper=_scaled(minority | {105}, -1.0))
    assert metrics["rejected-direction"] == 0
    majority = {101, 102, 103, 104, 105, 106}
    _, metrics = _round(_wrap(admission=SINGLE_ROUND_DIRECTION), tamper=_scaled(majority, -1.0))
    assert metrics["rejected-direction"] == 4 and metrics["rejected-replies"] == 4
    assert _warned(flwr_log, "admission rejected 4 of 10 train replies")


# ---------------------------------------------------------------------------------------------- NDQSG
def _ndqsg(n: int, **plan) -> QuantizedStrategy:
    return _wrap(n, codec="ndqsg", decode_plan=NestedDecodePlan(p1_fraction=0.5, **plan))


def _roles(n: int, **plan) -> dict[int, str]:
    """Round 1's NDQSG role per node (the split depends only on the seed, the round and the nodes)."""
    grid = InProcessGrid(make_client_app([]), n)
    messages = _ndqsg(n, **plan).configure_train(1, initial_arrays(), ConfigRecord(), grid)
    return {m.metadata.dst_node_id: m.content["config"][KEY_ROLE] for m in messages}


def _p1_forger(strategy, nodes, make_update):
    """Tamper that gives each of ``nodes`` (P1 members) a valid DQSG payload of ``make_update(node)``."""

    def tamper(replies, messages):
        out = []
        for r in replies:
            node = r.metadata.src_node_id
            if node in nodes:
                spec = strategy._rounds.peek("train", 1).assignments[node].codec.spec
                r = _forge(r, make_update(node), spec, messages)
            out.append(r)
        return out

    return tamper


def test_ndqsg_one_attacker_in_a_small_first_group_is_rejected():
    """With 4 clients P1 had 2 members: one attacker was half of P1's own median and got 1000x in."""
    n = 4
    honest = _honest_updates(n)
    strategy = _ndqsg(n)
    roles = _roles(n)
    attacker = min(node for node, role in roles.items() if role == "p1")
    tamper = _p1_forger(strategy, {attacker}, lambda node: {k: 1000 * v for k, v in honest[node].items()})
    _, metrics = _round(strategy, n=n, tamper=tamper)
    assert metrics["rejected-update-norm"] == 1 and metrics["rejected-replies"] == 1


@pytest.mark.parametrize("attack", ["zero", "969x"])
def test_ndqsg_attackers_forming_p1s_majority_cannot_steer_the_round(attack):
    """10 clients, 3 attackers among P1's 5: zero updates got every honest reply rejected, 969x updates through."""
    honest = _honest_updates(N)
    strategy = _ndqsg(N)
    roles = _roles(N)
    attackers = sorted(node for node, role in roles.items() if role == "p1")[:3]
    scale = 0.0 if attack == "zero" else 969.0
    tamper = _p1_forger(strategy, set(attackers), lambda node: {k: scale * v for k, v in honest[node].items()})
    _, metrics = _round(strategy, tamper=tamper)
    if attack == "zero":
        assert metrics["rejected-replies"] == 0  # zeros are harmless updates; the 7 honest ones all pass
    else:
        assert metrics["rejected-update-norm"] == 3 and metrics["rejected-replies"] == 3


def test_ndqsg_two_junk_first_group_replies_do_not_drop_the_second_group():
    """With a fixed rho (P2 always nests) and 5 clients, P1 had 2 members: 2 junk replies dropped every P2 reply."""
    n = 5
    strategy = _ndqsg(n, rho=5)
    roles = _roles(n, rho=5)
    junk = sorted(node for node, role in roles.items() if role == "p1")[:2]

    def tamper(replies, _messages):
        for r in replies:
            if r.metadata.src_node_id in junk:
                r.content["arrays"]["fc.weight"] = payload_array(b"FQ" + bytes(range(200)))
        return replies

    arrays, metrics = _round(strategy, n=n, tamper=tamper)
    assert metrics["rejected-payload"] == 2 and metrics["ndqsg-p2-dropped"] == 0
    assert metrics["rejected-replies"] == 2 and arrays is not None


# ---------------------------------------------------------------------------------------------- majorities
def test_half_of_the_clients_with_an_extra_key_get_nobody_rejected():
    """Ties went to the larger key set: 5 of 10 sending an extra key got the 5 honest replies rejected."""
    attackers = {101, 102, 103, 104, 105}
    arrays, metrics = _round(_wrap(), tamper=_by_node(attackers, _set("extra-key", 1.0)))
    assert metrics["rejected-replies"] == 0 and "extra-key" not in metrics
    assert np.isfinite(metrics["train-loss"])


def test_a_strict_majority_sets_the_key_set_and_the_round_warns(flwr_log):
    """Above the tolerance (6 of 10) the majority wins, as it must; the user is told."""
    attackers = {101, 102, 103, 104, 105, 106}
    _, metrics = _round(_wrap(), tamper=_by_node(attackers, _set("extra-key", 1.0)))
    assert _warned(flwr_log, "admission rejected 4 of 10 train replies")
    assert metrics["rejected-metrics"] == 4 and metrics["rejected-share"] == pytest.approx(0.4)


def _run(strategy, rounds: int, tamper_of_round, n: int = N):
    """``rounds`` rounds on the fake task; ``tamper_of_round(r)`` gives round r's tamper (or None)."""
    arrays, history = initial_arrays(), []
    grid = InProcessGrid(make_client_app([quantize_mod]), n)
    for server_round in range(1, rounds + 1):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        replies = grid.send_and_receive(messages)
        tamper = tamper_of_round(server_round)
        if tamper is not None:
            replies = tamper(replies, messages)
        new, metrics = strategy.aggregate_train(server_round, replies)
        arrays = new if new is not None else arrays
        history.append(metrics)
    return arrays, history


def test_norm_reference_withstands_half_of_the_round():
    """5 of 10 colluders at 100x raised the median and were all accepted. From round 2 on (the
    first round gives the reference its history) exactly half cannot move it: all 5 are rejected."""
    attackers = {101, 102, 103, 104, 105}
    _, history = _run(_wrap(), 3, lambda r: _scaled(attackers, 100.0) if r >= 2 else None)
    for metrics in history[1:]:
        assert metrics["rejected-update-norm"] == 5 and metrics["rejected-replies"] == 5


def test_a_majority_of_zero_updates_wins_above_the_tolerance_and_the_round_warns(flwr_log):
    """6 of 10 zero updates (above half) pull the reference to 0 once they are in its history: the
    honest updates are rejected, as expected of a median without an honest majority, and the user is told."""
    attackers = {101, 102, 103, 104, 105, 106}
    _, history = _run(_wrap(), 3, lambda r: _scaled(attackers, 0.0))
    assert history[-1]["rejected-update-norm"] == 4
    assert _warned(flwr_log, "admission rejected 4 of 10 train replies")


def test_first_round_colluders_at_half_are_reported(flwr_log):
    """In the first round (no history) 5 of 10 at 100x split the norms in two groups: the rule cannot
    tell which half is honest; it says so."""
    attackers = {101, 102, 103, 104, 105}
    _, history = _run(_wrap(), 1, lambda r: _scaled(attackers, 100.0))
    assert _warned(flwr_log, "update norms split")
    assert history[0]["admission-warnings"] >= 1


# ---------------------------------------------------------------------------------------------- budget
def test_the_budget_controller_learns_only_from_admitted_replies():
    """A client adding a 1 MiB junk ArrayRecord was rejected every round, yet its size entered the
    correction: every client's setting fell from 16 levels to 1 within 8 rounds."""
    n = 3
    size = RecordCodec(get_codec("qsgd:levels=16"), MIN_NUMEL).predict_bytes(initial_arrays())  # exact: fixed width
    bandwidth = dict.fromkeys(range(101, 101 + n), size / 2.0 * 1.5)
    strategy = QuantizedStrategy(
        SortedFedAvg(min_available_nodes=n), "qsgd:levels=16", seed=SEED, min_numel=MIN_NUMEL,
        uplink_bandwidth=bandwidth.__getitem__, upload_deadline_seconds=2.0,
    )  # fmt: skip

    def junk(replies, _messages):
        for r in replies:
            if r.metadata.src_node_id == 101:
                r.content["junk"] = ArrayRecord({"x": Array(np.zeros(1 << 18, np.float32))})
        return replies

    _, history = _run(strategy, 8, lambda r: junk, n=n)
    for metrics in history:
        assert metrics["rejected-payload"] == 1
    assert history[-1]["chosen-setting-min"] == 16


# ---------------------------------------------------------------------------------------------- payload size
def test_a_large_crc_valid_payload_is_rejected_before_its_checksum(monkeypatch):
    """A CRC-valid 256 MiB payload for a 2,048-element tensor cost ~1 s of CRC before the size check.
    (16 MiB here: what counts is that no byte of the body is hashed.)"""
    codec = get_codec("qsgd:levels=16")
    honest = read_payload(codec.encode(torch.randn(2048, generator=torch.Generator().manual_seed(0)), seed=1))
    big = write_payload(honest.spec, honest.dtype, honest.shape, [honest.body, bytes(16 << 20)])  # CRC valid
    hashed: list[int] = []
    real_crc = payload_module.crc32

    def counting_crc(data, *args):
        hashed.append(memoryview(data).nbytes)
        return real_crc(data, *args)

    monkeypatch.setattr(payload_module, "crc32", counting_crc)
    with pytest.raises(PayloadError) as err:
        codec.decode(big, seed=1, shape=(2048,), dtype=torch.float32)
    assert max(hashed, default=0) < 1 << 20
    assert "more than" in str(err.value)


# ---------------------------------------------------------------------------------------------- non-float tensors
STEPS = "fc.steps"
MASK = "fc.mask"


def _arrays_with_counters() -> ArrayRecord:
    base = dict(initial_arrays().items())
    base[STEPS] = Array(np.array(0, dtype=np.int64))
    base[MASK] = Array(np.arange(16) % 2 == 0)
    return ArrayRecord(base)


def _counting_app():
    """The fake task, plus an int64 step counter (+LOCAL_STEPS per round) and a bool mask left as is."""
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=[quantize_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        received = msg.content["arrays"]
        reply = fakes.train(msg, context)
        arrays = dict(reply.content["arrays"].items())
        arrays[STEPS] = Array(np.asarray(received[STEPS].numpy() + fakes.LOCAL_STEPS))
        arrays[MASK] = received[MASK]
        reply.content["arrays"] = ArrayRecord(arrays)
        return reply

    return app


def _set_array(name, value):
    def change(reply):
        arrays = dict(reply.content["arrays"].items())
        arrays[name] = Array(value)
        reply.content["arrays"] = ArrayRecord(arrays)
        return reply

    return change


def test_an_integer_counter_set_to_a_huge_value_is_rejected():
    """An int64 counter set to 4.6e18 by one client of four became 1.15e18 in the global model."""
    n = 4
    tamper = _by_node({ATTACKER}, _set_array(STEPS, np.array(4_600_000_000_000_000_000, dtype=np.int64)))
    arrays, metrics = _round(_wrap(n), n=n, tamper=tamper, arrays=_arrays_with_counters(), app=_counting_app())
    steps = arrays[STEPS].numpy()
    assert float(steps) == fakes.LOCAL_STEPS
    assert steps.dtype == np.int64  # it stays an int64 (Flower's mean makes it float64)
    assert metrics["rejected-non-float"] == 1


def test_bool_entries_must_match_the_majority():
    n = 4
    flipped = ~(np.arange(16) % 2 == 0)
    arrays, metrics = _round(
        _wrap(n), n=n, tamper=_by_node({ATTACKER}, _set_array(MASK, flipped)), arrays=_arrays_with_counters(),
        app=_counting_app(),
    )  # fmt: skip
    assert (arrays[MASK].numpy() == (np.arange(16) % 2 == 0)).all() and arrays[MASK].numpy().dtype == np.bool_
    assert metrics["rejected-non-float"] == 1


# ---------------------------------------------------------------------------------------------- client
def test_the_client_resets_a_non_finite_error_feedback_residual():
    """A client whose ef+ residual went NaN sent an error reply every round from then on."""
    n = 2
    strategy = _wrap(n, codec="ef+qsgd:levels=4")
    grid = InProcessGrid(make_client_app([quantize_mod]), n)
    arrays, errors, resets, history = initial_arrays(), [], [], []
    for server_round in (1, 2, 3):
        if server_round == 2:
            state = grid.contexts[101].state[STATE_TRANSFORMS_KEY]
            state["ef/fc.weight"] = Array(np.full((16, 64), np.nan, dtype=np.float32))
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        replies = grid.send_and_receive(messages)
        errors.append(sum(r.has_error() for r in replies))
        resets.append(sum(r.content["metrics"].get("fedquant.state-resets", 0) for r in replies if not r.has_error()))
        new, metrics = strategy.aggregate_train(server_round, replies)
        arrays = new if new is not None else arrays
        history.append(metrics)
    assert errors == [0, 0, 0]
    assert resets == [0, 1, 0]
    assert [m["client-state-resets"] for m in history] == [0, 1, 0]
    assert all(m["rejected-replies"] == 0 for m in history)


# ---------------------------------------------------------------------------------------------- fuzz
FUZZ_VALUES = [
    0, -1, 2**62, 10**400, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf, True, None, "x", b"\x00", [],
    [1.0], [1, 2.0], [[1.0]], [math.nan], list(range(100_000)), [True], {"a": 1}, (1.0, 2.0), np.float64(3.0),
    np.int64(3), np.array([1.0]), object(),
]  # fmt: skip


def _poke(record: MetricRecord, key, value) -> None:
    """Set a value bypassing MetricRecord's own type checks (as a deserializer bug or a custom path could)."""
    record.__dict__["_data"][key] = value


@pytest.mark.parametrize("kind", ["train", "evaluate"])
def test_fuzzed_metric_records_never_raise(kind):
    rng = np.random.default_rng(0)
    keys = ["train-loss" if kind == "train" else "eval-loss", "num-examples", "a.b", "", "x/y", "fedquant.x", 7,
            "fedquant.quantization-mse", "fedquant.encode-seconds", "fedquant.state-resets"]  # fmt: skip
    for case in range(60):
        strategy = _wrap(4)
        grid = InProcessGrid(make_client_app([quantize_mod]), 4)
        if kind == "train":
            messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
        else:
            messages = list(strategy.configure_evaluate(1, initial_arrays(), ConfigRecord(), grid))
        replies = grid.send_and_receive(messages)
        for reply in replies[: 1 + case % 3]:  # one to three liars of four
            record = reply.content["metrics"]
            for _ in range(1 + case % 4):
                _poke(record, keys[rng.integers(len(keys))], FUZZ_VALUES[rng.integers(len(FUZZ_VALUES))])
            if case % 7 == 0:
                for i in range(2000):
                    _poke(record, f"k{i}", float(i))
        if kind == "train":
            arrays, metrics = strategy.aggregate_train(1, replies)
        else:
            metrics = strategy.aggregate_evaluate(1, replies)
        for key, value in (metrics or {}).items():
            assert isinstance(key, str)
            values = value if isinstance(value, list) else [value]
            assert all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def test_the_budget_correction_is_one_value_per_round():
    """The correction window kept the last 3 replies per setting, not rounds: one large admitted reply
    among ten (an entropy-coded outlier, or a liar within the rules) set everyone's correction."""
    from fedquant.strategies.budget import UploadBudget
    from fedquant.strategies.decode_plan import ClientAssignment

    codec = get_codec("qsgd:levels=16")
    model = initial_arrays()
    budget = UploadBudget(bytes_budget=10**9, min_numel=MIN_NUMEL)
    nodes = list(range(101, 111))
    choice = budget.choose({n: ClientAssignment(codec) for n in nodes}, model)
    prior = RecordCodec(codec, MIN_NUMEL).predict_bytes(model)
    sizes = {n: prior for n in nodes}
    sizes[nodes[-1]] = 5 * prior  # the last to arrive
    budget.observe(choice, sizes)
    assert budget.predict(codec, model) == pytest.approx(prior)
