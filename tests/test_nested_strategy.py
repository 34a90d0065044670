"""NDQSG's two-group scheme (``NestedDecodePlan``) through ``QuantizedStrategy`` and the real
``quantize_mod``, in-process (no Ray).

The clients of these tests send fixed, correlated updates ``x_p = y + sigma z_p`` (a shared
``y``, a small own part), so each decoded update can be compared with what the client meant to
send.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.codecs.nested_params import choose_rho_for_variance, optimal_alpha, spread_in_steps
from fedquant.protocol import KEY_CODEC, KEY_ROLE, KEY_SEED, payload_array
from fedquant.strategies import ClientAssignment, DecodedClient, DecodePlan, NestedDecodePlan, QuantizedStrategy
from fedquant.strategies.nested import (
    METRIC_ALPHA,
    METRIC_BITS_P1,
    METRIC_BITS_P2,
    METRIC_P1_DECODED,
    METRIC_P1_FAILED,
    METRIC_P2_DROPPED,
    METRIC_RHO,
    METRIC_RHO_RULE,
    METRIC_SPREAD,
    RULE_ESTIMATED,
    RULE_FIXED,
    RULE_INITIAL,
    SPREAD_MARGIN,
    empirical_rho,
)
from tests.flower_fakes import InProcessGrid

NUM_NODES = 8
SHAPE = (32, 512)  # "w": encoded (16384 elements, 32 buckets of 512)
MIN_NUMEL = 256  # "b" (16 elements) travels as is
SCALE_Y, SIGMA_Z = 0.01, 0.001  # spread ~0.1 fine steps at M = 3: rho = 3 once estimated
SEED = 5


def client_update(partition: int, sigma: float = SIGMA_Z) -> np.ndarray:
    """What client ``partition`` adds to the weights: the shared ``y`` plus its own ``sigma z_p``."""
    y = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32) * SCALE_Y
    z = np.random.default_rng(100 + partition).standard_normal(SHAPE).astype(np.float32)
    return y + sigma * z


def initial_arrays() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(SHAPE, np.float32)), "b": Array(np.zeros(16, np.float32))})


def make_app(sigma: float = SIGMA_Z) -> ClientApp:
    app = ClientApp(mods=[quantize_mod])

    @app.train()
    def train(msg: Message, context) -> Message:
        arrays = next(iter(msg.content.array_records.values()))
        partition = int(context.node_config["partition-id"])
        w = arrays["w"].numpy() + client_update(partition, sigma)
        b = arrays["b"].numpy() + 0.01
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(w.astype(np.float32)), "b": Array(b.astype(np.float32))}),
                "metrics": MetricRecord({"num-examples": 10}),
            }
        )
        return Message(content, reply_to=msg)

    return app


def _strategy(codec: str = "ndqsg:levels=3", **kw) -> QuantizedStrategy:
    inner = FedAvg(min_available_nodes=NUM_NODES, fraction_evaluate=0.0)
    return QuantizedStrategy(inner, codec, seed=SEED, min_numel=MIN_NUMEL, **kw)


class Recording(NestedDecodePlan):
    """The default nested plan that also keeps every accepted reply, per round."""

    def __init__(self, **kw):
        super().__init__(seed=SEED, **kw)
        self.seen: dict[int, list[DecodedClient]] = {}

    def accepted(self, server_round, reply):
        super().accepted(server_round, reply)
        self.seen.setdefault(server_round, []).append(reply)


def _fine_steps(x: torch.Tensor, levels: int = 3, bucket_size: int = 512) -> torch.Tensor:
    """Per element, the fine step ``max|bucket| / levels`` the client's codec used."""
    v = x.reshape(-1, bucket_size)
    return (v.abs().amax(1, keepdim=True) / levels).expand_as(v).reshape(x.shape)


# ---------------------------------------------------------------------------- groups and config
def test_group_split_fraction_at_least_one_and_deterministic():
    nodes = list(range(101, 109))
    plan = NestedDecodePlan(seed=3)
    p1, p2 = plan.groups(1, nodes)
    assert len(p1) == 4 and sorted(p1 + p2) == nodes
    renamed = [n + 1000 for n in nodes]  # node ids are random per simulation: only the order counts
    assert plan.groups(1, renamed) == ([n + 1000 for n in p1], [n + 1000 for n in p2])
    assert NestedDecodePlan(seed=3).groups(1, nodes) == (p1, p2)  # same seed and round, same split
    assert len({tuple(plan.groups(r, nodes)[0]) for r in range(1, 11)}) > 1  # roles rotate over rounds
    assert len(NestedDecodePlan(p1_fraction=0.01).groups(1, nodes)[0]) == 1  # at least one P1
    assert len(NestedDecodePlan(p1_fraction=0.25).groups(1, nodes)[0]) == 2
    assert NestedDecodePlan(p1_fraction=1.0).groups(1, nodes) == (nodes, [])
    assert NestedDecodePlan().groups(1, [7]) == ([7], [])
    for bad in ({"p1_fraction": 0}, {"rho": 4}, {"rho": 1}, {"alpha": 0.0}, {"alpha": "best"}, {"initial_rho": 2}):
        with pytest.raises(ValueError):
            NestedDecodePlan(**bad)


def test_ndqsg_codec_selects_the_nested_plan():
    plan = _strategy().decode_plan
    assert isinstance(plan, NestedDecodePlan) and plan.rho is None and plan.alpha == 1.0 and plan.seed == SEED
    fixed = _strategy("ndqsg:levels=3,rho=5,alpha=0.9").decode_plan
    assert fixed.rho == 5 and fixed.alpha == pytest.approx(0.9)
    assert type(_strategy("dqsg:levels=3").decode_plan) is DecodePlan
    assert _strategy(get_codec("ndqsg:levels=3")).decode_plan.rho == 3  # a Codec instance fixes its rho
    with pytest.raises(ValueError, match="ndqsg"):
        NestedDecodePlan().assign(1, [1, 2], get_codec("dqsg"))


def test_each_client_gets_its_role_codec_and_seed():
    strategy = _strategy("ndqsg:levels=3,bucket_size=512")
    grid = InProcessGrid(make_app(), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    p1, p2 = strategy.decode_plan.groups(1, [m.metadata.dst_node_id for m in messages])
    for message in messages:
        node, config = message.metadata.dst_node_id, message.content["config"]
        if node in p1:
            assert config[KEY_ROLE] == "p1" and config[KEY_CODEC] == get_codec("dqsg:levels=3").spec
        else:
            # round 1 has no spread estimate: the initial rho 2M+1 = 7 saves nothing, so P2 sends DQSG
            assert node in p2 and config[KEY_ROLE] == "p2"
            assert config[KEY_CODEC] == get_codec("dqsg:levels=3").spec
        assert isinstance(config[KEY_SEED], int)


# ---------------------------------------------------------------------------- whole rounds
def test_p2_decoded_against_p1_mean_reproduces_updates_within_the_quantization_error():
    plan = Recording()
    grid = InProcessGrid(make_app(), NUM_NODES)
    result = _strategy(decode_plan=plan).start(grid, initial_arrays(), num_rounds=2)
    for server_round in (1, 2):
        seen = plan.seen[server_round]
        roles = [r.assignment.config[KEY_ROLE] for r in seen]
        assert roles == ["p1"] * 4 + ["p2"] * 4  # P1 decoded first
        for reply in seen:
            x = torch.from_numpy(client_update(reply.node_id - 101))
            decoded = reply.updates["w"]
            # alpha = 1, no wrap: the error is the fine rounding error, |err| <= Delta1 / 2 per
            # coordinate (both groups: DQSG and NDQSG share the fine step); a wrap would add rho Delta1.
            # The slack covers float32 rounding of received + update - received on the client.
            bound = _fine_steps(x) / 2 * (1 + 1e-4) + 1e-7
            assert bool(((decoded - x).abs() <= bound).all()), (server_round, reply.node_id)
    m1, m2 = result.train_metrics_clientapp[1], result.train_metrics_clientapp[2]
    assert (m1[METRIC_RHO], m1[METRIC_RHO_RULE]) == (7, RULE_INITIAL)
    # round 2: rho from round 1's P1 spread (~0.1 fine steps): the authors' rho = 3
    assert (m2[METRIC_RHO], m2[METRIC_RHO_RULE]) == (3, RULE_ESTIMATED)
    assert m2["ndqsg-p2-nested"] == 1  # round 2's P2 replies were nested, decoded against the mean
    assert 0.03 < m1[METRIC_SPREAD] < 0.3


def test_round_metrics_and_group_bits():
    grid = InProcessGrid(make_app(), NUM_NODES)
    result = _strategy().start(grid, initial_arrays(), num_rounds=2)
    for server_round in (1, 2):
        m = result.train_metrics_clientapp[server_round]
        assert m[METRIC_P1_DECODED] == 4 and m[METRIC_P1_FAILED] == 0 and m[METRIC_P2_DROPPED] == 0
        assert m[METRIC_ALPHA] == 1.0 and m["rejected-replies"] == 0
        # every reply carries the same parameters: the overall rate is the mean of the groups'
        assert m["bits-per-param"] == pytest.approx((m[METRIC_BITS_P1] + m[METRIC_BITS_P2]) / 2)
    m1, m2 = result.train_metrics_clientapp[1], result.train_metrics_clientapp[2]
    # Round 1: rho = 2M+1 = 7 saves nothing, so P2 sends DQSG like P1: the same bits. Round 2:
    # rho = 3, 2 bits per index against 3: the P2 payload shrinks by 16384 bits = 2048 bytes per
    # reply (16400 parameters), less the longer spec string in its envelope.
    assert m1["ndqsg-p2-nested"] == 0 and m2["ndqsg-p2-nested"] == 1
    assert m1[METRIC_BITS_P2] == m1[METRIC_BITS_P1]
    assert m2[METRIC_BITS_P1] - m2[METRIC_BITS_P2] == pytest.approx(8 * (2048 - _spec_overhead(3)) / 16400)


def _spec_overhead(rho: int) -> int:
    """Bytes an NDQSG payload's envelope holds beyond a DQSG one's: the longer spec string."""
    return len(get_codec("ndqsg", levels=3, rho=rho).spec) - len(get_codec("dqsg", levels=3).spec)


def test_ndqsg_sends_fewer_bytes_than_dqsg_at_equal_error():
    exact = 2 * np.mean([client_update(p) for p in range(NUM_NODES)], axis=0)  # two rounds of the mean update
    errors, uplink = {}, {}
    for spec in ("dqsg:levels=3", "ndqsg:levels=3"):
        result = _strategy(spec).start(InProcessGrid(make_app(), NUM_NODES), initial_arrays(), num_rounds=2)
        errors[spec] = float(np.mean((result.arrays["w"].numpy() - exact) ** 2))
        uplink[spec] = [result.train_metrics_clientapp[r]["uplink-bytes"] for r in (1, 2)]
    # Same seeds, alpha = 1 and no wrap: an NDQSG client's estimate is exactly the DQSG estimate
    # of the same update and dither (the decoder recovers the fine index), so the errors agree up
    # to float rounding; a wrap (error ~ rho Delta1 ~ 3e-2 on one coordinate of 16384) alone
    # would move the MSE (~1e-6) by more than 4 %.
    assert errors["ndqsg:levels=3"] == pytest.approx(errors["dqsg:levels=3"], rel=0.01)
    assert 0 < errors["dqsg:levels=3"] < (SCALE_Y * 3.5 / 3) ** 2 / 12  # the mean of 8 clients' errors, 2 rounds
    # round 1: rho = 2M+1 = 7 saves nothing, P2 sends DQSG: the same bytes; round 2: 4 P2 clients,
    # 1 bit less per index (less the longer spec)
    assert uplink["ndqsg:levels=3"][0] == uplink["dqsg:levels=3"][0]
    assert uplink["dqsg:levels=3"][1] - uplink["ndqsg:levels=3"][1] == 4 * (2048 - _spec_overhead(3))


# ---------------------------------------------------------------------------- rho choice
def _p1_reply(node_id: int, updates: dict[str, torch.Tensor]) -> DecodedClient:
    return DecodedClient(node_id, ClientAssignment(get_codec("dqsg"), {KEY_ROLE: "p1"}, 0), updates, 100, 100)


@pytest.mark.parametrize("sigma", [0.02, 0.3, 1.0])
def test_rho_follows_the_spread_of_the_previous_rounds_p1(sigma):
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(8192, generator=gen)
    p1 = [y + sigma * torch.randn(8192, generator=gen) for _ in range(4)]
    wide = [y + 2 * sigma * torch.randn(1024, generator=gen).repeat(8) for _ in range(4)]
    codec = get_codec("ndqsg:levels=3")
    plan = NestedDecodePlan()
    plan.assign(1, list(range(8)), codec)
    for i in range(4):
        plan.accepted(1, _p1_reply(i, {"narrow": p1[i], "wide": wide[i]}))
    metrics = plan.round_metrics(1)
    narrow = spread_in_steps(p1, 3, 512, dqsg_levels=3)
    expected = max(narrow, spread_in_steps(wide, 3, 512, dqsg_levels=3))  # the widest tensor sets rho
    assert metrics[METRIC_SPREAD] == pytest.approx(expected) and expected > narrow
    assignments = plan.assign(2, list(range(8)), codec)
    p2 = next(a.codec for a in assignments.values() if a.config[KEY_ROLE] == "p2")
    round2 = plan.round_metrics(2)
    rho = round2[METRIC_RHO]
    gaussian = choose_rho_for_variance(SPREAD_MARGIN * expected, 1.0, 1.0, 0.01)
    assert rho == max(gaussian, empirical_rho(plan.tail, SPREAD_MARGIN * expected, 1.0, 0.01))
    # Gaussian spread: the empirical tail rule agrees with the Gaussian one or asks one odd step more
    # (the leave-one-out differences it reads include the P1 client's own quantization noise)
    assert rho in (gaussian, gaussian + 2)
    assert round2[METRIC_RHO_RULE] == RULE_ESTIMATED
    # P2 nests only where it saves bits (rho < 2M + 1 = 7), and sends DQSG otherwise
    assert (p2.name, round2["ndqsg-p2-nested"]) == (("ndqsg", 1) if rho < 7 else ("dqsg", 0))
    if rho < 7:
        assert p2.rho == rho


def _student_t3(n: int, gen: torch.Generator) -> torch.Tensor:
    """Student t with 3 degrees of freedom (heavy tails, like real client updates)."""
    chi2 = torch.randn(3, n, generator=gen).pow(2).sum(0)
    return torch.randn(n, generator=gen) / (chi2 / 3).sqrt()


def test_heavy_tailed_spread_gets_a_rho_that_keeps_the_mse():
    n, gen = 1 << 17, torch.Generator().manual_seed(3)
    y = torch.randn(n, generator=gen)
    dqsg = get_codec("dqsg:levels=3")
    p1 = [y + 0.1 * _student_t3(n, gen) for _ in range(4)]
    decoded = [dqsg.decode(dqsg.encode(x, 10 + i), 10 + i) for i, x in enumerate(p1)]
    plan = NestedDecodePlan()
    plan.learn({"w": decoded}, 3, 512)
    rho, gaussian = plan.parameters(3)[0], choose_rho_for_variance(SPREAD_MARGIN * plan.spread, 1.0, 1.0, 0.01)
    side = torch.stack(decoded).mean(0)
    p2 = [y + 0.1 * _student_t3(n, gen) for _ in range(4)]

    def mse_ratio(rho: int) -> float:  # NDQSG over DQSG on the same updates and dithers
        nd = get_codec("ndqsg", levels=3, rho=rho)
        nested = plain = 0.0
        for i, x in enumerate(p2):
            nested += float((nd.decode(nd.encode(x, 50 + i), 50 + i, side_info=side) - x).pow(2).sum())
            plain += float((dqsg.decode(dqsg.encode(x, 50 + i), 50 + i) - x).pow(2).sum())
        return nested / plain

    # Design: wraps add at most 1 % to the MSE. ~500 K coordinates: the rule's rho stays within
    # 3 %; the Gaussian rule's (smaller) rho wraps on the tails and adds more than 4 %.
    assert rho > gaussian
    assert mse_ratio(rho) < 1.03 and mse_ratio(gaussian) > 1.04


def test_rho_grows_with_the_spread_and_fixed_values_win():
    rhos = []
    for spread in (0.05, 0.5, 2.0):
        plan = NestedDecodePlan()
        plan.spread = spread
        rhos.append(plan.parameters(3)[0])
    assert rhos[0] == 3 and rhos[0] < rhos[1] < rhos[2]
    fixed = NestedDecodePlan(rho=9, alpha=0.8)
    fixed.spread = 2.0
    assert fixed.parameters(3) == (9, 0.8, RULE_FIXED)
    auto = NestedDecodePlan(alpha="auto")
    assert auto.parameters(3) == (7, 1.0, RULE_INITIAL)  # no estimate yet
    auto.spread = 0.5
    rho, alpha, _ = auto.parameters(3)
    assert alpha == round(optimal_alpha(SPREAD_MARGIN * 0.5, 1.0), 6) < 1
    assert rho == choose_rho_for_variance(SPREAD_MARGIN * 0.5, 1.0, alpha, 0.01)


# ---------------------------------------------------------------------------- fallback
def _truncated(reply: Message) -> Message:
    record = reply.content["arrays"]
    data = record["w"].data[:-9]
    bad = payload_array(data)
    reply.content["arrays"] = ArrayRecord({k: (bad if k == "w" else v) for k, v in record.items()})
    return reply


def test_all_p1_failing_drops_p2_and_keeps_the_model(flwr_log):
    strategy = _strategy("ndqsg:levels=3,rho=3")  # a fixed rho: P2 sends nested indices in round 1
    grid = InProcessGrid(make_app(), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    p1, p2 = strategy.decode_plan.groups(1, [m.metadata.dst_node_id for m in messages])
    grid.tamper = {n: _truncated for n in p1}
    replies = grid.send_and_receive(messages)
    arrays, m = strategy.aggregate_train(1, replies)
    assert arrays is None  # no reply survived: Strategy.start keeps the current model
    assert m[METRIC_P1_FAILED] == 1 and m[METRIC_P1_DECODED] == 0
    assert m[METRIC_P2_DROPPED] == len(p2) and m["rejected-replies"] == NUM_NODES
    assert m[METRIC_BITS_P1] == 0.0 and m[METRIC_BITS_P2] == 0.0 and METRIC_SPREAD not in m
    messages = [r.getMessage() for r in flwr_log]
    assert sum("no side information to decode" in t for t in messages) == len(p2)
    assert any("no P1 reply decoded" in t for t in messages)


def test_some_p1_failing_still_decodes_p2_against_the_rest():
    plan = Recording(rho=3)  # a fixed rho: P2 sends nested indices in round 1
    strategy = _strategy(decode_plan=plan)
    grid = InProcessGrid(make_app(), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    p1, _ = plan.groups(1, [m.metadata.dst_node_id for m in messages])
    grid.tamper = {p1[0]: _truncated}
    _, m = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert m[METRIC_P1_DECODED] == 3 and m[METRIC_P1_FAILED] == 0 and m[METRIC_P2_DROPPED] == 0
    assert m["rejected-replies"] == 1
    for reply in plan.seen[1]:
        x = torch.from_numpy(client_update(reply.node_id - 101))
        assert bool(((reply.updates["w"] - x).abs() <= _fine_steps(x) / 2 * (1 + 1e-4) + 1e-7).all())


def test_ndqsg_trains_the_fake_task_without_extra_arguments():
    """``codec="ndqsg"`` alone (what a ``flwr run`` config gives) trains the linear task of the fakes."""
    from tests import flower_fakes as fakes  # noqa: PLC0415

    grid = InProcessGrid(fakes.make_client_app([quantize_mod]), 4)
    strategy = QuantizedStrategy(FedAvg(min_available_nodes=4), "ndqsg", seed=1, min_numel=fakes.MIN_NUMEL)
    result = strategy.start(grid, fakes.initial_arrays(), num_rounds=3)
    for server_round in (1, 2, 3):
        m = result.train_metrics_clientapp[server_round]
        assert m["rejected-replies"] == 0 and m[METRIC_P1_DECODED] == 2 and m[METRIC_P2_DROPPED] == 0
    assert fakes.global_loss(result.arrays, 4) < 0.95 * fakes.global_loss(fakes.initial_arrays(), 4)


def test_p2_sends_dqsg_when_the_adaptive_rho_saves_nothing():
    plan = NestedDecodePlan(seed=3)
    codec = get_codec("ndqsg:levels=3")
    wide = plan.assign(1, list(range(1, 9)), codec)  # no estimate yet: rho = 2M + 1 = 7
    assert {a.codec.name for a in wide.values()} == {"dqsg"}
    assert plan.round_metrics(1)["ndqsg-p2-nested"] == 0
    plan.spread, plan.tail = 0.01, None  # a tiny spread: rho = 3, nesting pays
    narrow = plan.assign(2, list(range(1, 9)), codec)
    assert {a.codec.spec for a in narrow.values() if a.config[KEY_ROLE] == "p2"} == {
        get_codec("ndqsg:levels=3,rho=3,alpha=1.0").spec
    }
    assert plan.round_metrics(2)["ndqsg-p2-nested"] == 1
    fixed = NestedDecodePlan(rho=7).assign(1, list(range(1, 9)), codec)  # a user's rho is obeyed
    assert {a.codec.name for a in fixed.values() if a.config[KEY_ROLE] == "p2"} == {"ndqsg"}
