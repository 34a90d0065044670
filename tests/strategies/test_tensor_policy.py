"""The tensor policy: BatchNorm statistics keep their invariants; users override by name pattern.

The BatchNorm test trains a real ``BatchNorm1d(1024)`` model (its ``running_var`` is encoded at the
default ``min_numel``) with one client per round under ``eden:bits=2``, in process: before the
policy, 2-bit noise on the statistics' update pushed hundreds of variances below zero and every
evaluation was NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.nn import functional as F

from fedquant.clients import quantize_mod
from fedquant.protocol import KEY_TENSOR_CODECS, parse_tensor_codecs
from fedquant.strategies import QuantizedStrategy, TensorPolicy
from tests.flower_fakes import InProcessGrid

WIDTH, FEATURES, CLASSES, SAMPLES = 1024, 8, 4, 64
ROUNDS = 3


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models: one torch thread (on a loaded 2-core machine two took 40x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _net() -> nn.Module:
    """Linear -> BatchNorm1d(1024) -> ReLU -> Linear; the channels' scales span 1e-2..10 (their
    variances 1e-4..100), as the features of a real network's wide layers do."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))
        with torch.no_grad():
            net[0].weight.mul_(torch.logspace(-2, 1, WIDTH)[torch.randperm(WIDTH)].unsqueeze(1))
        return net


def _data(node: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + node)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def _load(net: nn.Module, arrays: ArrayRecord) -> nn.Module:
    net.load_state_dict(arrays.to_torch_state_dict())
    return net


def _train(msg: Message, context) -> Message:
    net = _load(_net(), next(iter(msg.content.array_records.values())))
    x, y = _data(context.node_id)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.train()
    for start in range(0, SAMPLES, 16):
        opt.zero_grad()
        F.cross_entropy(net(x[start : start + 16]), y[start : start + 16]).backward()
        opt.step()
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": MetricRecord({"num-examples": SAMPLES})})
    return Message(content, reply_to=msg)


def _client_app() -> ClientApp:
    app = ClientApp(mods=[quantize_mod])
    app.train()(_train)
    return app


def _run(policy: TensorPolicy | None) -> tuple[list[dict], dict]:
    """``ROUNDS`` rounds, one client of two per round; per round: min variance, negatives, eval loss."""
    rows: list[dict] = []
    net = _net()
    x, y = _data(999)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        _load(net, arrays).eval()
        variance = arrays["1.running_var"].numpy()
        with torch.no_grad():
            loss = float(F.cross_entropy(net(x), y))
        rows.append({"round": server_round, "min-var": float(variance.min()), "negative": int((variance < 0).sum()),
                     "loss": loss})  # fmt: skip
        return MetricRecord({"loss": loss})

    inner = FedAvg(fraction_train=0.5, min_train_nodes=1, min_available_nodes=2, fraction_evaluate=0.0)
    strategy = QuantizedStrategy(inner, "eden:bits=2", seed=5, **({} if policy is None else {"tensor_policy": policy}))
    result = strategy.start(
        InProcessGrid(_client_app(), 2), ArrayRecord(_net().state_dict()), num_rounds=ROUNDS, evaluate_fn=evaluate_fn
    )
    return rows, result.train_metrics_clientapp


def test_batchnorm_statistics_stay_valid_under_two_bit_codec():
    rows, train = _run(None)  # the default policy
    assert [r["round"] for r in rows] == list(range(ROUNDS + 1))
    for row in rows:
        assert row["negative"] == 0 and row["min-var"] >= 0, row
        assert math.isfinite(row["loss"]), row
    assert all(train[r]["rejected-replies"] == 0 for r in range(1, ROUNDS + 1))


def test_without_the_policy_variances_go_negative():
    """The setting is one where quantized statistics break: the defaults are what keeps it valid."""
    rows, _ = _run(TensorPolicy(defaults=False))
    assert any(r["negative"] > 0 for r in rows)


def test_policy_codecs_reach_the_clients_and_bound_what_is_served():
    """The server names each statistic's codec in the client's config (it decodes with that codec)."""
    grid = InProcessGrid(_client_app(), 2)
    policy = TensorPolicy({"0.weight": "qsgd:levels=4"}, bounds={"3.bias": (-0.01, 0.01)})
    inner = FedAvg(fraction_train=1.0, min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    strategy = QuantizedStrategy(inner, "eden:bits=2", seed=5, min_numel=1, tensor_policy=policy)
    result = strategy.start(grid, ArrayRecord(_net().state_dict()), num_rounds=1)
    sent = grid.sent[0].content["config"]
    specs = parse_tensor_codecs(sent[KEY_TENSOR_CODECS])
    assert specs["1.running_var"] == "fp16" and specs["1.running_mean"] == "fp16"
    assert specs["0.weight"].startswith("qsgd") and "1.weight" not in specs
    assert np.abs(result.arrays["3.bias"].numpy()).max() <= 0.01
    assert result.train_metrics_clientapp[1]["policy-clamped-values"] > 0
    assert result.train_metrics_clientapp[1]["rejected-replies"] == 0


def test_a_client_cannot_send_another_codec_for_a_statistic():
    """A reply that encodes ``running_var`` with the strategy's codec instead of the policy's is rejected."""
    from fedquant.codecs import get_codec
    from fedquant.protocol import payload_array, tensor_seed
    from fedquant.rng import derive_seed

    def lie(reply: Message) -> Message:
        record = reply.content["arrays"]
        seed = tensor_seed(derive_seed(5, 1, reply.metadata.src_node_id), "1.running_var")
        forged = payload_array(get_codec("eden:bits=2").encode(torch.zeros(WIDTH), seed))
        reply.content["arrays"] = ArrayRecord({k: forged if k == "1.running_var" else v for k, v in record.items()})
        return reply

    grid = InProcessGrid(_client_app(), 2, tamper={101: lie})
    inner = FedAvg(fraction_train=1.0, min_train_nodes=2, min_available_nodes=2, fraction_evaluate=0.0)
    strategy = QuantizedStrategy(inner, "eden:bits=2", seed=5)
    result = strategy.start(grid, ArrayRecord(_net().state_dict()), num_rounds=1)
    assert result.train_metrics_clientapp[1]["rejected-replies"] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"codecs": {"*var": "nope"}}, "unknown codec"),
        ({"codecs": {"*var": "ndqsg"}}, "side information"),
        ({"bounds": {"*var": (1.0, 0.0)}}, "low or None"),
        ({"bounds": {"*var": (float("nan"), None)}}, "low or None"),
        ({"codecs": ["*var"]}, "mappings"),
    ],
)
def test_bad_policies_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TensorPolicy(**kwargs)


def test_user_rules_come_first_and_default_lifts_a_default():
    policy = TensorPolicy({"*running_mean": "default", "emb.*": "fp16"}, bounds={"*running_var": (None, None)})
    assert policy.codec_of("bn.running_mean") is None
    assert policy.codec_of("bn.running_var").spec == "fp16"
    assert policy.codec_of("emb.weight").spec == "fp16"
    assert policy.bound_of("bn.running_var") is None
    assert TensorPolicy(defaults=False).tensor_codecs(["bn.running_var"]) == {}
    record = ArrayRecord({"bn.running_var": Array(np.array([-1.0, 2.0], np.float16))})
    clamped, moved = TensorPolicy().constrain(record)
    assert moved == 1 and clamped["bn.running_var"].numpy().tolist() == [0.0, 2.0]
    assert clamped["bn.running_var"].numpy().dtype == np.float16
