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
from fedquant.protocol import (
    KEY_CODEC,
    KEY_ROLE,
    KEY_SEED,
    KEY_TENSOR_CODECS,
    PAYLOAD_STYPE,
    parse_tensor_codecs,
    payload_array,
    tensor_codecs_entry,
)
from fedquant.strategies import ClientAssignment, DecodedClient, DecodePlan, NestedDecodePlan, QuantizedStrategy
from fedquant.strategies.nested import (
    METRIC_ALPHA,
    METRIC_BITS_P1,
    METRIC_BITS_P2,
    METRIC_NESTED_TENSORS,
    METRIC_P1_DECODED,
    METRIC_P1_FAILED,
    METRIC_P2_DROPPED,
    METRIC_RHO,
    METRIC_RHO_MAX,
    METRIC_RHO_MIN,
    METRIC_RHO_RULE,
    METRIC_SPREAD,
    RULE_ESTIMATED,
    RULE_FIXED,
    RULE_INITIAL,
)
from fedquant.strategies.nested_rules import (
    SPREAD_MARGIN,
    SpreadEstimate,
    choose_parameters,
    choose_rho_for_variance,
    empirical_rho,
    estimate_spread,
    spread_in_steps,
)
from fedquant.strategies.side_info import needs_side_info
from fedquant.wire import read_payload
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
    assert len(NestedDecodePlan(p1_fraction=0.01).groups(1, nodes)[0]) == 3  # at least min_p1 = 3
    assert len(NestedDecodePlan(p1_fraction=0.01, min_p1=1).groups(1, nodes)[0]) == 1
    assert len(NestedDecodePlan(p1_fraction=0.25, min_p1=1).groups(1, nodes)[0]) == 2
    assert len(NestedDecodePlan().groups(1, nodes[:4])[0]) == 3  # round(0.5 * 4) = 2 is raised to 3
    assert NestedDecodePlan(p1_fraction=1.0).groups(1, nodes) == (nodes, [])
    assert NestedDecodePlan().groups(1, [7]) == ([7], [])
    bad_values = (
        {"p1_fraction": 0},
        {"min_p1": 0},
        {"rho": 4},
        {"rho": 1},
        {"alpha": 0.0},
        {"alpha": "best"},
        {"initial_rho": 2},
    )
    for bad in (*bad_values, {"min_numel": 0}, {"rule": "fastest"}):
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
        assert isinstance(config[KEY_SEED], int) and KEY_TENSOR_CODECS not in config  # no per-tensor rho yet


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
    assert (m1[METRIC_RHO], m1[METRIC_RHO_RULE]) == (7, RULE_INITIAL) and METRIC_RHO_MAX not in m1
    # round 2: "w"'s rho from round 1's P1 spread of "w" (~0.1 fine steps): the authors' rho = 3
    assert (m2[METRIC_RHO_MIN], m2[METRIC_RHO_MAX], m2[METRIC_RHO_RULE]) == (3, 3, RULE_ESTIMATED)
    assert m2[METRIC_NESTED_TENSORS] == 1 and m2["ndqsg-p2-nested"] == 1  # "w" nested, decoded against the mean
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
def test_rho_per_tensor_from_its_own_spread_and_tiny_tensors_never_decide(sigma):
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(8192, generator=gen)
    p1 = [y + sigma * torch.randn(8192, generator=gen) for _ in range(4)]
    wide = [y + 2 * sigma * torch.randn(1024, generator=gen).repeat(8) for _ in range(4)]
    tiny = [10 * torch.randn(10, generator=gen) for _ in range(4)]  # a bias: 10 elements, far apart
    codec = get_codec("ndqsg:levels=3")
    plan = NestedDecodePlan()
    plan.assign(1, list(range(8)), codec)
    for i in range(4):
        plan.accepted(1, _p1_reply(i, {"narrow": p1[i], "wide": wide[i], "bias": tiny[i]}))
    metrics = plan.round_metrics(1)
    assert set(plan.estimates) == {"narrow", "wide"}  # under min_numel (1024): no estimate, no say
    narrow = spread_in_steps(p1, 3, 512, dqsg_levels=3)
    wide_spread = spread_in_steps(wide, 3, 512, dqsg_levels=3)
    assert metrics[METRIC_SPREAD] == pytest.approx(wide_spread) and wide_spread > narrow
    assert spread_in_steps(tiny, 3, 512, dqsg_levels=3) > wide_spread  # it would have set one global rho
    assignments = plan.assign(2, list(range(8)), codec)
    p2 = next(a for a in assignments.values() if a.config[KEY_ROLE] == "p2")
    p1_assignment = next(a for a in assignments.values() if a.config[KEY_ROLE] == "p1")
    assert p1_assignment.tensor_codecs == {}  # P1 sends DQSG everywhere
    round2 = plan.round_metrics(2)
    rhos = {}
    for name, updates in (("narrow", p1), ("wide", wide)):
        estimate = estimate_spread(updates, 3, 512, dqsg_levels=3)
        gaussian = choose_rho_for_variance(SPREAD_MARGIN * estimate.spread, 1.0, 1.0, 0.01)
        rhos[name] = max(gaussian, empirical_rho(estimate.tail, SPREAD_MARGIN * estimate.spread, 1.0, 0.01))
        assert plan.tensor_parameters()[name] == (rhos[name], 1.0)
        # Gaussian spread: the empirical tail rule agrees with the Gaussian one or asks one odd step more
        # (the leave-one-out differences it reads include the P1 client's own quantization noise)
        assert rhos[name] in (gaussian, gaussian + 2)
        # P2 nests a tensor only where it saves bits (rho < 2M + 1 = 7), and sends it as DQSG otherwise
        assert p2.codec_for(name) == (get_codec("ndqsg", levels=3, rho=rhos[name]) if rhos[name] < 7 else p2.codec)
    assert rhos["narrow"] <= rhos["wide"]
    assert p2.codec == get_codec("dqsg:levels=3") and p2.codec_for("bias") == p2.codec  # the default: no estimate
    assert (round2[METRIC_RHO_MIN], round2[METRIC_RHO_MAX]) == (rhos["narrow"], rhos["wide"])
    assert round2[METRIC_RHO_RULE] == RULE_ESTIMATED and round2[METRIC_RHO] == 7
    nested = sum(r < 7 for r in rhos.values())
    assert round2[METRIC_NESTED_TENSORS] == nested and round2["ndqsg-p2-nested"] == int(nested > 0)
    assert needs_side_info(p2.record_codec(1)) == (nested > 0)


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
    rho = plan.tensor_parameters()["w"][0]
    gaussian = choose_rho_for_variance(SPREAD_MARGIN * plan.spread, 1.0, 1.0, 0.01)
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


def _estimate(spread: float) -> SpreadEstimate:
    return SpreadEstimate(spread, np.zeros(16, dtype=np.int64), 4096)


def test_fixed_values_win_and_auto_alpha_is_per_tensor():
    fixed = NestedDecodePlan(rho=9, alpha=0.8)
    fixed.estimates = {"w": _estimate(2.0)}
    assert fixed.parameters(3) == (9, 0.8, RULE_FIXED) and fixed.tensor_parameters() == {}
    auto = NestedDecodePlan(alpha="auto")
    assert auto.parameters(3) == (7, 1.0, RULE_INITIAL)  # no estimate yet
    auto.estimates = {"w": _estimate(0.5), "v": _estimate(2.0)}
    chosen = auto.tensor_parameters()
    assert chosen == {"w": choose_parameters(_estimate(0.5), "auto"), "v": choose_parameters(_estimate(2.0), "auto")}
    assert chosen["w"][1] < chosen["v"][1] < 1 and chosen["w"][0] < chosen["v"][0]


def test_the_rate_rule_gets_the_codecs_levels_and_coding():
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(4096, generator=gen)
    dqsg = get_codec("dqsg:levels=3")
    p1 = [dqsg.decode(dqsg.encode(y + 0.3 * torch.randn(4096, generator=gen), i), i) for i in range(4)]
    plan = NestedDecodePlan(rule="rate", max_excess=100.0)
    plan.learn({"w": p1}, 3, 512)
    for coding in ("fixed", "entropy"):
        want = choose_parameters(plan.estimates["w"], 1.0, 100.0, 65535, "rate", 3, coding)
        assert plan.tensor_parameters(3, coding) == {"w": want}
        p2 = plan.assign(1, list(range(8)), get_codec(f"ndqsg:levels=3,coding={coding}"))
        codec = next(a for a in p2.values() if a.config[KEY_ROLE] == "p2").codec_for("w")
        assert codec.coding == coding and (codec.rho if codec.needs_side_info else 7) == want[0]
    assert "per tensor by rate" in repr(plan)


def test_the_authors_fixed_m_and_rho_nest_every_tensor_from_round_1():
    plan = NestedDecodePlan.authors(seed=3)
    assert (plan.rho, plan.alpha, plan.p1_fraction) == (3, 1.0, 0.5)
    plan.estimates = {"w": _estimate(5.0)}  # a spread that would need a large rho: ignored
    assignments = plan.assign(1, list(range(1, 9)), get_codec("ndqsg:levels=3,coding=entropy"))
    p2 = [a for a in assignments.values() if a.config[KEY_ROLE] == "p2"]
    assert len(p2) == 4
    for a in p2:
        assert a.codec == get_codec("ndqsg:levels=3,rho=3,alpha=1.0,coding=entropy") and a.tensor_codecs == {}
    metrics = plan.round_metrics(1)
    assert (metrics[METRIC_RHO], metrics[METRIC_RHO_RULE], metrics["ndqsg-p2-nested"]) == (3, RULE_FIXED, 1)


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
        # P1 holds min_p1 = 3 of the 4 clients (a group one attacker cannot outvote)
        assert m["rejected-replies"] == 0 and m[METRIC_P1_DECODED] == 3 and m[METRIC_P2_DROPPED] == 0
    assert fakes.global_loss(result.arrays, 4) < 0.95 * fakes.global_loss(fakes.initial_arrays(), 4)


def test_p2_sends_dqsg_when_the_adaptive_rho_saves_nothing():
    plan = NestedDecodePlan(seed=3)
    codec = get_codec("ndqsg:levels=3")
    wide = plan.assign(1, list(range(1, 9)), codec)  # no estimate yet: rho = 2M + 1 = 7
    assert {a.codec.name for a in wide.values()} == {"dqsg"}
    assert plan.round_metrics(1)["ndqsg-p2-nested"] == 0
    plan.estimates = {"w": _estimate(0.01), "v": _estimate(3.0)}  # "w" close (rho = 3, nesting pays), "v" far
    narrow = plan.assign(2, list(range(1, 9)), codec)
    for a in narrow.values():
        if a.config[KEY_ROLE] == "p2":
            assert a.codec == get_codec("dqsg:levels=3")
            assert a.tensor_codecs == {"w": get_codec("ndqsg:levels=3,rho=3,alpha=1.0")}  # "v" goes as the default
    assert plan.round_metrics(2)["ndqsg-p2-nested"] == 1
    fixed = NestedDecodePlan(rho=7).assign(1, list(range(1, 9)), codec)  # a user's rho is obeyed
    assert {a.codec.name for a in fixed.values() if a.config[KEY_ROLE] == "p2"} == {"ndqsg"}


# ---------------------------------------------------------------------------- per-tensor codecs on the wire
WIDE_SIGMA = 0.05  # "v": each client ~4 fine steps from the others: rho >= 2M + 1, sent as DQSG


def two_tensor_arrays() -> ArrayRecord:
    zeros = np.zeros(SHAPE, np.float32)
    return ArrayRecord({"w": Array(zeros), "v": Array(zeros.copy()), "b": Array(np.zeros(16, np.float32))})


def make_two_tensor_app() -> ClientApp:
    app = ClientApp(mods=[quantize_mod])

    @app.train()
    def train(msg: Message, context) -> Message:
        arrays = next(iter(msg.content.array_records.values()))
        partition = int(context.node_config["partition-id"])
        trained = {
            "w": arrays["w"].numpy() + client_update(partition),
            "v": arrays["v"].numpy() + client_update(partition, WIDE_SIGMA),
            "b": arrays["b"].numpy() + 0.01,
        }
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v.astype(np.float32)) for k, v in trained.items()}),
                "metrics": MetricRecord({"num-examples": 10}),
            }
        )
        return Message(content, reply_to=msg)

    return app


def _round_two(tamper=None):
    """Round 1 (estimates per tensor), then round 2's messages, the specs of its replies' payloads and result."""
    strategy = _strategy(decode_plan=Recording())
    grid = InProcessGrid(make_two_tensor_app(), NUM_NODES)
    messages = list(strategy.configure_train(1, two_tensor_arrays(), ConfigRecord(), grid))
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    p1, p2 = strategy.decode_plan.groups(2, [m.metadata.dst_node_id for m in messages])
    replies = {}

    def spy(node_id):
        def hook(reply: Message) -> Message:  # the server replaces payloads by dense arrays: read them now
            replies[node_id] = {k: read_payload(a.data).spec for k, a in reply.content["arrays"].items() if k != "b"}
            return tamper(reply) if tamper is not None and node_id == p2[0] else reply

        return hook

    grid.tamper = {n: spy(n) for n in p1 + p2}
    result = strategy.aggregate_train(2, grid.send_and_receive(messages))
    return strategy, messages, (p1, p2), replies, result


def test_each_tensor_travels_and_decodes_with_the_codec_the_server_assigned():
    strategy, messages, (p1, p2), replies, (_, metrics) = _round_two()
    nested, plain = get_codec("ndqsg:levels=3,rho=3,alpha=1.0"), get_codec("dqsg:levels=3")
    for message in messages:
        node, config = message.metadata.dst_node_id, message.content["config"]
        if node in p2:  # "w" nested at its own rho, "v" (wide) and "b" with the default
            assert parse_tensor_codecs(config[KEY_TENSOR_CODECS]) == {"w": nested.spec}
            assert config[KEY_CODEC] == plain.spec
        else:
            assert KEY_TENSOR_CODECS not in config and config[KEY_CODEC] == plain.spec
    assert set(replies) == set(p1 + p2)
    for node, specs in replies.items():
        assert specs == {"w": (nested if node in p2 else plain).spec, "v": plain.spec}
    assert metrics["rejected-replies"] == 0 and metrics[METRIC_NESTED_TENSORS] == 1
    assert metrics[METRIC_RHO_MIN] == 3 and metrics[METRIC_RHO_MAX] >= 7  # "v" would need 2M + 1 or more
    for reply in strategy.decode_plan.seen[2]:  # every tensor within its fine rounding error: no wrap
        for name, sigma in (("w", SIGMA_Z), ("v", WIDE_SIGMA)):
            x = torch.from_numpy(client_update(reply.node_id - 101, sigma))
            assert bool(((reply.updates[name] - x).abs() <= _fine_steps(x) / 2 * (1 + 1e-4) + 1e-7).all())


@pytest.mark.parametrize("wrong", ["dqsg:levels=3", "ndqsg:levels=3,rho=5"])
def test_a_reply_that_ignores_its_tensor_codec_is_rejected_alone(wrong, flwr_log):
    def swap_w(reply: Message) -> Message:  # a P2 client that sends "w" with another codec
        record = reply.content["arrays"]
        payload = get_codec(wrong).encode(torch.zeros(SHAPE), seed=0)
        bad = Array(dtype="uint8", shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)
        reply.content["arrays"] = ArrayRecord({k: (bad if k == "w" else v) for k, v in record.items()})
        return reply

    strategy, _, (p1, p2), _, (arrays, metrics) = _round_two(swap_w)
    assert metrics["rejected-replies"] == 1 and metrics["rejected-payload"] == 1
    assert metrics[METRIC_P1_DECODED] == len(p1) and arrays is not None
    assert {r.node_id for r in strategy.decode_plan.seen[2]} == set(p1 + p2) - {p2[0]}
    assert any(str(p2[0]) in r.getMessage() and "'w'" in r.getMessage() for r in flwr_log)


def test_tensor_codecs_entry_round_trips_and_rejects_what_is_not_a_name_to_spec_map():
    specs = {"conv.weight": "ndqsg:levels=3,rho=5", "fc,1": "dqsg:levels=3"}
    assert parse_tensor_codecs(tensor_codecs_entry(specs)) == specs
    for bad in ("[1, 2]", '{"w": 3}', "not json", 7):
        with pytest.raises(ValueError):
            parse_tensor_codecs(bad)


@pytest.mark.parametrize("transforms", ["rht+"])  # ef+ refuses ndqsg: tests/codecs/test_error_bounds.py
def test_both_groups_keep_the_codecs_transforms(transforms):
    codec = get_codec(transforms + "ndqsg:levels=3,rho=5")
    plan = NestedDecodePlan.from_spec(codec.spec)
    assignments = plan.assign(1, list(range(1, 9)), codec)
    specs = {a.codec.spec for a in assignments.values()}
    assert {s.removeprefix(transforms).split(":")[0] for s in specs} == {"dqsg", "ndqsg"}
    assert all(s.startswith(transforms) for s in specs)


def test_a_fixed_rho_reports_the_tensors_it_nests():
    # A fixed rho nests every encoded tensor of P2 (here fc.weight; fc.bias is under min_numel):
    # the metric must say so, not 0 (which the app's warning reads as "a DQSG run").
    strategy = _strategy("ndqsg:levels=3,rho=3")
    grid = InProcessGrid(make_app(), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    _, m = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert m["ndqsg-p2-nested"] == 1 and m[METRIC_NESTED_TENSORS] == 1
