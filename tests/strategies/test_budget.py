"""The upload deadline / byte budget controller, in in-process rounds (no Ray)."""

from __future__ import annotations

import pytest
from flwr.app import MessageType
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.protocol import KEY_CODEC
from fedquant.records import RecordCodec
from fedquant.strategies import QuantizedStrategy
from fedquant.strategies.budget import BudgetChoice, UploadBudget
from fedquant.strategies.decode_plan import ClientAssignment
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, global_loss, initial_arrays, make_client_app

NUM_NODES = 4
DEADLINE = 2.0


def _levels(ladder) -> list[float]:
    return [c.rate for c in ladder]


def rate_ladder(codec):
    return codec.rate_ladder()


def predicted_reply_bytes(codec, model, min_numel):
    return RecordCodec(codec, min_numel).predict_bytes(model)


def test_rate_ladders():
    assert _levels(rate_ladder(get_codec("qsgd:levels=16"))) == [16, 15, 8, 7, 4, 3, 2, 1]
    assert _levels(rate_ladder(get_codec("orq:levels=9"))) == [9, 8, 7, 4, 3]  # ORQ needs >= 3 levels
    assert [c.spec for c in rate_ladder(get_codec("fp32"))] == ["fp32", "fp16"]
    assert [c.spec for c in rate_ladder(get_codec("ef+fp32"))] == ["ef+fp32", "ef+fp16"]  # transforms kept
    assert _levels(rate_ladder(get_codec("ef+fp32"))) == [32, 16]
    assert [c.spec for c in rate_ladder(get_codec("signsgd"))] == [get_codec("signsgd").spec]
    # EDEN (the default codec) steps down in bits; entropy coding takes whole bits only. rht+ is kept.
    assert _levels(rate_ladder(get_codec("eden:bits=2"))) == [2, 1.5, 1, 0.5, 0.25]
    assert _levels(rate_ladder(get_codec("eden:bits=3,coding=entropy"))) == [3, 2, 1]
    assert all(c.spec.startswith("rht+eden:") for c in rate_ladder(get_codec("eden:bits=2")))
    assert [c.spec for c in rate_ladder(get_codec("ndqsg"))] == [get_codec("ndqsg").spec]  # its plan tunes it
    # ECDQ's bits are real at either coding; its E8 lattice stops at its least rate (0.41 bits).
    assert _levels(rate_ladder(get_codec("ecdq:bits=2"))) == [2, 1.5, 1, 0.5, 0.25]
    assert _levels(rate_ladder(get_codec("ecdq:bits=1,lattice=e8"))) == [1, 0.5]
    assert all(c.spec.startswith("rht+ecdq:") for c in rate_ladder(get_codec("ecdq:bits=2")))
    ef = rate_ladder(get_codec("ef+qsgd:levels=4"))
    assert [c.spec for c in ef] == [f"ef+{get_codec('qsgd', levels=v).spec}" for v in (4, 3, 2, 1)]
    # The rest of the spec is kept.
    assert all(c.config["bucket_size"] == 128 for c in rate_ladder(get_codec("qsgd:levels=8,bucket_size=128")))


class CodecLog:
    """A mod before ``quantize_mod`` that records each node's assigned codec."""

    def __init__(self) -> None:
        self.specs: list[dict[int, str]] = []

    def mod(self, msg, ctxt, call_next):
        if msg.metadata.message_type == MessageType.TRAIN:
            if not self.specs or ctxt.node_id in self.specs[-1]:
                self.specs.append({})
            self.specs[-1][ctxt.node_id] = str(next(iter(msg.content.config_records.values()))[KEY_CODEC])
        return call_next(msg, ctxt)


def _grid(log: CodecLog) -> InProcessGrid:
    return InProcessGrid(make_client_app([log.mod, quantize_mod]), NUM_NODES)


@pytest.mark.parametrize("spec", [c.spec for c in rate_ladder(get_codec("qsgd:levels=16"))] + ["fp32", "fp16"])
def test_size_model_predicts_the_reply_bytes_of_fixed_width_codecs(spec):
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    strategy = QuantizedStrategy(FedAvg(min_available_nodes=NUM_NODES), spec, seed=1, min_numel=MIN_NUMEL)
    strategy.start(grid, initial_arrays(), num_rounds=1)
    assert grid.train_reply_bytes[0] == NUM_NODES * predicted_reply_bytes(get_codec(spec), initial_arrays(), MIN_NUMEL)


def _deadline_strategy(bandwidth: dict[int, float]) -> QuantizedStrategy:
    return QuantizedStrategy(
        FedAvg(min_available_nodes=NUM_NODES),
        "qsgd:levels=16",
        seed=1,
        min_numel=MIN_NUMEL,
        uplink_bandwidth=bandwidth.__getitem__,
        upload_deadline_seconds=DEADLINE,
    )


def test_deadline_gives_each_client_the_finest_setting_its_link_allows():
    ladder = rate_ladder(get_codec("qsgd:levels=16"))
    size = {c.rate: predicted_reply_bytes(c, initial_arrays(), MIN_NUMEL) for c in ladder}
    # Node 101 can send 16 levels in time, 102 only 8, 103 only 2; 104 not even 1 level.
    bandwidth = {
        101: size[16] / DEADLINE * 1.01,
        102: size[8] / DEADLINE * 1.01,
        103: size[2] / DEADLINE * 1.01,
        104: size[1] / DEADLINE * 0.9,
    }
    log = CodecLog()
    strategy = _deadline_strategy(bandwidth)
    result = strategy.start(_grid(log), initial_arrays(), num_rounds=3)
    for server_round in (1, 2, 3):
        chosen = {n: get_codec(s).config["levels"] for n, s in log.specs[server_round - 1].items()}
        # 2s+1 signed levels in fixed width: 8 and 15 levels both take 5 bits, 2 and 3 levels 3 bits,
        # so the finer of each pair fits the same link.
        assert chosen == {101: 16, 102: 15, 103: 3, 104: 1}
        m = result.train_metrics_clientapp[server_round]
        assert m["deadline-met-fraction"] == 0.75  # all but 104, whose link is too slow for any setting
        assert m["chosen-setting-min"] == 1 and m["chosen-setting-max"] == 16
        assert m["chosen-setting-mean"] == pytest.approx((16 + 15 + 3 + 1) / 4)
        assert m["chosen-coarsest-fraction"] == 0.25
        assert m["predicted-uplink-bytes"] == pytest.approx(m["uplink-bytes"])  # fixed width: exact
        assert m["rejected-replies"] == 0
    assert global_loss(result.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)


def test_byte_budget_caps_the_round_total():
    ladder = rate_ladder(get_codec("qsgd:levels=16"))
    size = {c.rate: predicted_reply_bytes(c, initial_arrays(), MIN_NUMEL) for c in ladder}
    budget = 2 * size[8] + 2 * size[7] + 10  # room for two clients at 8 levels and two at 7
    log = CodecLog()
    strategy = QuantizedStrategy(
        FedAvg(min_available_nodes=NUM_NODES), "qsgd:levels=16", seed=1, min_numel=MIN_NUMEL, uplink_bytes_budget=budget
    )
    result = strategy.start(_grid(log), initial_arrays(), num_rounds=2)
    for server_round in (1, 2):
        m = result.train_metrics_clientapp[server_round]
        assert m["uplink-bytes"] <= budget and m["uplink-budget-met"] == 1.0
        levels = sorted(get_codec(s).config["levels"] for s in log.specs[server_round - 1].values())
        assert levels == [7, 7, 8, 8]  # coarsened one step at a time, largest first: nobody is starved
    assert "deadline-met-fraction" not in result.train_metrics_clientapp[1]


def test_observed_bytes_refine_the_size_model():
    budget = UploadBudget(bytes_budget=10**9)
    codec = get_codec("qsgd:levels=4")
    prior = budget.predict(codec, initial_arrays())
    budget.observe(BudgetChoice({7: ClientAssignment(codec)}, {7: prior}, {7: False}), {7: int(prior * 1.5)})
    assert budget.predict(codec, initial_arrays()) == pytest.approx(int(prior * 1.5), rel=1e-6)


@pytest.mark.parametrize("spec", ["ecdq:bits=2", "eden:bits=3,coding=entropy"])
def test_byte_budget_with_a_size_model_that_is_not_exact(spec):
    """EDEN's entropy-coded size is a bound: the budget holds in every round. ECDQ's is an estimate on
    Gaussian data: the correction learned from the replies removes its bias, and what is left, the
    spread between clients' replies, may overshoot the budget by a fraction of a percent."""
    ladder = rate_ladder(get_codec(spec))
    size = {c.rate: predicted_reply_bytes(c, initial_arrays(), MIN_NUMEL) for c in ladder}
    budget = 2 * size[ladder[1].rate] + 2 * size[ladder[2].rate] + 10  # two clients a step down, two two steps
    log = CodecLog()
    strategy = QuantizedStrategy(
        FedAvg(min_available_nodes=NUM_NODES), spec, seed=1, min_numel=MIN_NUMEL, uplink_bytes_budget=budget
    )
    result = strategy.start(_grid(log), initial_arrays(), num_rounds=3)
    bound = get_codec(spec).quantizer.size_model == "bound"
    first = result.train_metrics_clientapp[1]
    if bound:
        assert first["uplink-bytes"] <= first["predicted-uplink-bytes"] <= budget
    else:
        assert 0.8 <= first["uplink-bytes"] / first["predicted-uplink-bytes"] <= 1.25  # ESTIMATE_GAUSSIAN
    for server_round in (2, 3):
        m = result.train_metrics_clientapp[server_round]
        if bound:
            assert m["uplink-bytes"] <= budget and m["uplink-budget-met"] == 1.0, server_round
        else:
            assert m["uplink-bytes"] <= 1.01 * budget, server_round
        rates = sorted(get_codec(s).quantizer.rate for s in log.specs[server_round - 1].values())
        assert set(rates) <= {c.rate for c in ladder[1:3]}  # a step or two down: the budget is used, not starved
        assert m["rejected-replies"] == 0
    assert global_loss(result.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"upload_deadline_seconds": 1.0}, "needs uplink_bandwidth"),
        ({"upload_deadline_seconds": -1.0, "uplink_bandwidth": lambda n: 1.0}, "positive"),
        ({"upload_deadline_seconds": float("inf"), "uplink_bandwidth": lambda n: 1.0}, "positive"),
        ({"uplink_bytes_budget": 0}, "positive"),
    ],
)
def test_bad_budget_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantizedStrategy(FedAvg(), "qsgd", **kwargs)


def test_a_dead_or_unknown_link_gets_the_coarsest_setting_and_misses_the_deadline():
    bandwidth = {101: 0.0, 102: 1e9, 103: float("nan"), 104: 1e9}  # 0 and NaN: infinite upload time
    log = CodecLog()
    strategy = _deadline_strategy(bandwidth)
    m = strategy.start(_grid(log), initial_arrays(), num_rounds=1).train_metrics_clientapp[1]
    assert {n: get_codec(s).config["levels"] for n, s in log.specs[0].items()} == {101: 1, 102: 16, 103: 1, 104: 16}
    assert m["deadline-met-fraction"] == 0.5 and m["rejected-replies"] == 0
