"""Unit tests of ``QuantizedStrategy`` with hand-built and in-process rounds (no Ray).

``tests.flower_fakes.InProcessGrid`` runs the ClientApp (with ``quantize_mod``) in this process,
so whole ``Strategy.start`` runs take milliseconds. Bad replies are forged between the clients
and ``aggregate_train``.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx

import fedquant.codecs as codecs_module
from fedquant.clients import quantize_mod
from fedquant.codecs import buffers, get_codec
from fedquant.codecs.quantizers.base import Quantized, SideField
from fedquant.codecs.side_info import SideInfoQuantizer
from fedquant.metrics import HistoryRecorder, dense_float32_bytes, result_rows
from fedquant.protocol import (
    KEY_CLIENT_MSE,
    KEY_CODEC,
    KEY_MIN_NUMEL,
    KEY_ROLE,
    KEY_SEED,
    STATE_TRANSFORMS_KEY,
    payload_array,
    tensor_seed,
)
from fedquant.records import RecordCodec
from fedquant.rng import derive_seed
from fedquant.strategies import (
    ClientAssignment,
    DecodePlan,
    QuantizedStrategy,
    SideInfoPlan,
    SideInformation,
    default_plan_for,
)
from fedquant.strategies import decode_plan as decode_plan_module
from fedquant.strategies.reply_decoder import RejectedReply, decode_reply
from fedquant.strategies.stages.decoding import Decoding
from fedquant.wire.payload import write_payload
from tests.flower_fakes import (
    MIN_NUMEL,
    InProcessGrid,
    global_loss,
    initial_arrays,
    make_client_app,
    raw_array_bytes,
)

NUM_NODES = 4
METRIC_KEYS = {
    "uplink-bytes",
    "uplink-bytes-dense",
    "compression-ratio",
    "bits-per-param",
    "downlink-bytes",
    "cumulative-uplink-bytes",
    "quantization-mse",
    "rejected-replies",
}
NUM_PARAMS = 16 * 64 + 16


def _fedavg(**kw):
    return FedAvg(min_available_nodes=NUM_NODES, **kw)


def _wrap(strategy=None, codec="fp32", **kw) -> QuantizedStrategy:
    return QuantizedStrategy(strategy or _fedavg(), codec, seed=11, min_numel=MIN_NUMEL, **kw)


def _arrays_close(a: ArrayRecord, b: ArrayRecord, atol: float) -> bool:
    return list(a.keys()) == list(b.keys()) and all(
        np.allclose(a[k].numpy(), b[k].numpy(), rtol=0, atol=atol) for k in a.keys()
    )


# ---------------------------------------------------------------------------- construction
def test_constructor_validates_arguments():
    with pytest.raises(ValueError, match="unknown codec"):
        QuantizedStrategy(_fedavg(), "nope")
    with pytest.raises(ValueError, match="min_numel"):
        QuantizedStrategy(_fedavg(), "fp16", min_numel=0)
    with pytest.raises(ValueError, match="seed"):
        QuantizedStrategy(_fedavg(), "fp16", seed=-1)
    with pytest.raises(ValueError, match="Strategy"):
        QuantizedStrategy(object(), "fp16")
    assert QuantizedStrategy(_fedavg(), get_codec("fp16")).codec.spec == "fp16"


def test_repr_and_summary(flwr_log):
    strategy = _wrap(codec="fp16")
    assert "fp16" in repr(strategy)
    strategy.summary()
    text = "\n".join(r.getMessage() for r in flwr_log)
    assert "fedquant settings" in text and "Codec: fp16" in text
    assert "Weighted by" in text  # the inner FedAvg's summary follows


# ---------------------------------------------------------------------------- configure_train
def test_configure_train_gives_each_client_its_own_config():
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    user_config = ConfigRecord({"lr": 0.1})
    strategy = _wrap(codec="fp16")
    messages = list(strategy.configure_train(3, initial_arrays(), user_config, grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [101, 102, 103, 104]
    configs = [m.content["config"] for m in messages]
    assert len({id(c) for c in configs}) == NUM_NODES  # not one shared ConfigRecord
    for message, config in zip(messages, configs, strict=True):
        node_id = message.metadata.dst_node_id
        assert config[KEY_CODEC] == "fp16"
        assert config[KEY_SEED] == derive_seed(11, 3, node_id)
        assert config[KEY_MIN_NUMEL] == MIN_NUMEL
        assert config["lr"] == 0.1 and config["server-round"] == 3
    assert KEY_CODEC not in user_config  # the user's ConfigRecord is not modified by fedquant
    assert all(c[KEY_CLIENT_MSE] is True for c in configs)


def test_client_mse_off_leaves_the_metric_out():
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    metrics = _wrap(codec="fp16", client_mse=False).start(grid, initial_arrays(), 1).train_metrics_clientapp[1]
    assert "quantization-mse" not in metrics and metrics["encode-seconds"] > 0


# ---------------------------------------------------------------------------- whole rounds
@pytest.mark.parametrize(
    "make_strategy",
    [lambda: _fedavg(), lambda: FedProx(proximal_mu=0.5, min_available_nodes=NUM_NODES), lambda: FedAdam()],
    ids=["FedAvg", "FedProx", "FedAdam"],
)
def test_fp32_wrapper_matches_unwrapped_strategy(make_strategy):
    plain = make_strategy().start(InProcessGrid(make_client_app(), NUM_NODES), initial_arrays(), num_rounds=3)
    wrapped = _wrap(make_strategy()).start(
        InProcessGrid(make_client_app([quantize_mod]), NUM_NODES), initial_arrays(), num_rounds=3
    )
    # The server rebuilds received + (trained - received) in float32: exact up to one rounding
    # of values of magnitude < 1, i.e. |error| <= 2**-24 per round; 1e-6 covers three rounds.
    assert _arrays_close(plain.arrays, wrapped.arrays, atol=1e-6)
    assert global_loss(wrapped.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)
    # Client metrics are FedAvg's weighted mean clamped into the window of the clients' values
    # (admission.rules.metrics.clamp_metrics): with 4 skewed losses the mean can sit just outside [2nd, 3rd].
    assert wrapped.train_metrics_clientapp[3]["train-loss"] == pytest.approx(
        plain.train_metrics_clientapp[3]["train-loss"], rel=1e-2
    )
    assert dict(wrapped.evaluate_metrics_clientapp[3]).keys() == dict(plain.evaluate_metrics_clientapp[3]).keys()


def test_round_metrics_match_bytes_counted_independently():
    plain_grid = InProcessGrid(make_client_app(), NUM_NODES)
    _fedavg().start(plain_grid, initial_arrays(), num_rounds=2)
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    result = _wrap(codec="fp16").start(grid, initial_arrays(), num_rounds=2)

    cumulative = 0
    for server_round in (1, 2):
        m = result.train_metrics_clientapp[server_round]
        assert METRIC_KEYS <= set(m.keys())
        uplink = grid.train_reply_bytes[server_round - 1]
        cumulative += uplink
        assert m["uplink-bytes"] == uplink
        # Dense reference = what the same clients send without fedquant (float32 model).
        assert m["uplink-bytes-dense"] == plain_grid.train_reply_bytes[server_round - 1]
        assert m["compression-ratio"] == pytest.approx(m["uplink-bytes-dense"] / m["uplink-bytes"])
        assert m["bits-per-param"] == pytest.approx(8 * uplink / (NUM_NODES * NUM_PARAMS))
        assert m["cumulative-uplink-bytes"] == cumulative
        assert m["rejected-replies"] == 0
        train_sent = [msg for msg in grid.sent if msg.metadata.message_type == "train"]
        round_sent = train_sent[(server_round - 1) * NUM_NODES : server_round * NUM_NODES]
        assert m["downlink-bytes"] == sum(raw_array_bytes(msg) for msg in round_sent)
        assert 0 < m["quantization-mse"] < 1e-6  # fp16 rounding of updates of size < 1
        assert "fedquant.quantization-mse" not in m  # client entries do not reach the inner strategy
    # fp16 payloads: 2 bytes per weight + a small envelope; bias and keys as is.
    assert 1.8 < result.train_metrics_clientapp[1]["compression-ratio"] < 2.0


@pytest.mark.parametrize("spec", ["qsgd:levels=4,bucket_size=256", "ef+signsgd"])
def test_compressing_codecs_train_the_model(spec):
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    result = _wrap(codec=spec).start(grid, initial_arrays(), num_rounds=3)
    for server_round in (1, 2, 3):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["rejected-replies"] == 0
        assert metrics["uplink-bytes"] == grid.train_reply_bytes[server_round - 1]
        assert metrics["compression-ratio"] > 4 and metrics["quantization-mse"] > 0
    assert global_loss(result.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)
    if spec.startswith("ef+"):  # each client kept its residual for the encoded tensor
        keys = [list(c.state[STATE_TRANSFORMS_KEY].keys()) for c in grid.contexts.values()]
        assert keys == [["ef/fc.weight"]] * len(grid.contexts)


def test_rounds_decode_into_the_memory_of_the_round_before(monkeypatch):
    """From its second round on, the decoding stage lends the memory of the updates of the round
    before (the model's one encoded tensor is small here, so the pool takes every size), and
    every round's aggregate is, bit for bit, that of a strategy that allocates anew."""
    monkeypatch.setattr(buffers, "MIN_POOLED_BYTES", 0)
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    pooled, fresh = _wrap(codec="eden:bits=2"), _wrap(codec="eden:bits=2")
    (pool,) = [stage.buffers for stage in pooled.stages if isinstance(stage, Decoding)]
    (unused,) = [stage.buffers for stage in fresh.stages if isinstance(stage, Decoding)]
    monkeypatch.setattr(unused, "take", lambda numel, dtype=np.float32: np.empty(numel, dtype))
    taken = []  # the addresses lent (an array kept here would stay out of the pool)

    def take(*args, take=pool.take):
        array = take(*args)
        taken.append(array.__array_interface__["data"][0])
        return array

    monkeypatch.setattr(pool, "take", take)
    for server_round in (1, 2, 3):
        messages = list(pooled.configure_train(server_round, initial_arrays(), ConfigRecord(), grid))
        asked = fresh.configure_train(server_round, initial_arrays(), ConfigRecord(), grid)
        twins = {m.metadata.dst_node_id: m for m in asked}
        replies = grid.send_and_receive(messages)
        copies = [Message(RecordDict(dict(r.content.items())), reply_to=twins[r.metadata.src_node_id]) for r in replies]
        ours, theirs = pooled.aggregate_train(server_round, replies)[0], fresh.aggregate_train(server_round, copies)[0]
        assert _arrays_close(ours, theirs, atol=0), server_round
    assert len(taken) == 3 * NUM_NODES and len(set(taken[:NUM_NODES])) == NUM_NODES
    assert set(taken[NUM_NODES : 2 * NUM_NODES]) == set(taken[2 * NUM_NODES :]) == set(taken[:NUM_NODES])


def test_a_finished_run_keeps_no_decoded_update_memory(monkeypatch):
    """Between rounds the decoding stage holds the last round's update memory; when ``start``
    returns (every round done) it holds none, and ``release_buffers`` lets it go at any time."""
    monkeypatch.setattr(buffers, "MIN_POOLED_BYTES", 0)
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    strategy = _wrap(codec="eden:bits=2")
    (pool,) = [stage.buffers for stage in strategy.stages if isinstance(stage, Decoding)]
    held = []
    monkeypatch.setattr(pool, "reclaim", lambda reclaim=pool.reclaim: (reclaim(), held.append(pool.held_bytes)))
    result = strategy.start(grid, initial_arrays(), num_rounds=3)
    assert result.train_metrics_clientapp[3]["rejected-replies"] == 0
    assert held[1:] == [NUM_NODES * 16 * 64 * 4] * 2  # rounds 2 and 3 find the 4 KiB fc.weight updates of the last
    assert pool.held_bytes == 0
    _round(strategy)
    assert pool.held_bytes > 0
    strategy.release_buffers()
    assert pool.held_bytes == 0


def test_simulated_upload_seconds_is_the_slowest_client():
    bandwidth = {101: 1000.0, 102: 4000.0, 103: 500.0, 104: 2000.0}
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    result = _wrap(uplink_bandwidth=bandwidth.__getitem__).start(grid, initial_arrays(), num_rounds=1)
    per_reply = grid.train_reply_bytes[0] / NUM_NODES  # all replies have the same size here
    assert result.train_metrics_clientapp[1]["simulated-upload-seconds"] == pytest.approx(per_reply / 500.0)
    assert "simulated-upload-seconds" not in _wrap().start(grid, initial_arrays(), 1).train_metrics_clientapp[1]


def test_evaluation_passes_through():
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    strategy = _wrap()
    messages = list(strategy.configure_evaluate(1, initial_arrays(), ConfigRecord(), grid))
    assert all(m.metadata.message_type == "evaluate" and KEY_CODEC not in m.content["config"] for m in messages)
    replies = grid.send_and_receive(messages)
    assert strategy.aggregate_evaluate(1, replies)["eval-loss"] == pytest.approx(
        _fedavg().aggregate_evaluate(1, replies)["eval-loss"]
    )


# ---------------------------------------------------------------------------- untrusted replies
def _round(strategy, tamper=None, drop=()):
    """Configure round 1, run the clients, optionally tamper with the reply list, aggregate."""
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    replies = [r for r in replies if r.metadata.src_node_id not in drop]
    if tamper is not None:
        replies = tamper(replies)
    return strategy.aggregate_train(1, replies)


def _replace_entry(reply: Message, name: str, array: Array) -> Message:
    record = reply.content["arrays"]
    reply.content["arrays"] = ArrayRecord({k: (array if k == name else v) for k, v in record.items()})
    return reply


def _payload(reply: Message) -> bytes:
    return reply.content["arrays"]["fc.weight"].data


def _seed_of(reply: Message, name="fc.weight") -> int:
    return tensor_seed(derive_seed(11, 1, reply.metadata.src_node_id), name)


def _truncated(r):
    return _replace_entry(r, "fc.weight", payload_array(_payload(r)[:-9]))


def _corrupted(r):
    data = bytearray(_payload(r))
    data[len(data) // 2] ^= 0xFF
    return _replace_entry(r, "fc.weight", payload_array(bytes(data)))


def _other_codec(r):
    data = get_codec("fp16").encode(torch.zeros(16, 64), _seed_of(r))
    return _replace_entry(r, "fc.weight", payload_array(data))


def _other_shape(r):
    return _replace_entry(r, "fc.weight", payload_array(get_codec("fp32").encode(torch.zeros(64, 16), _seed_of(r))))


def _nan_values(r):
    body = np.full(16 * 64, np.nan, dtype="<f4").tobytes()
    return _replace_entry(r, "fc.weight", payload_array(write_payload("fp32", torch.float32, (16, 64), [body])))


def _dense_instead_of_payload(r):
    return _replace_entry(r, "fc.weight", Array(np.zeros((16, 64), dtype=np.float32)))


def _payload_for_plain_entry(r):
    return _replace_entry(r, "fc.bias", payload_array(get_codec("fp32").encode(torch.zeros(16), 1)))


def _plain_entry_nan(r):
    return _replace_entry(r, "fc.bias", Array(np.full(16, np.inf, dtype=np.float32)))


def _plain_entry_other_dtype(r):
    return _replace_entry(r, "fc.bias", Array(np.zeros(16, dtype=np.int32)))


def _plain_entry_other_shape(r):
    return _replace_entry(r, "fc.bias", Array(np.zeros(17, dtype=np.float32)))


def _plain_entry_forged_header(r):
    good = Array(np.zeros(16, dtype=np.float32))
    forged = good.data.replace(b"(16,)", b"(99,)")
    return _replace_entry(r, "fc.bias", Array(dtype="float32", shape=(16,), stype="numpy.ndarray", data=forged))


def _renamed_keys(r):
    record = r.content["arrays"]
    r.content["arrays"] = ArrayRecord({k.upper(): v for k, v in record.items()})
    return r


def _two_arrayrecords(r):
    r.content["extra"] = ArrayRecord({"x": Array(np.zeros(3, dtype=np.float32))})
    return r


BAD_REPLIES = {
    "truncated": _truncated,
    "corrupted": _corrupted,
    "other-codec": _other_codec,
    "other-shape": _other_shape,
    "decodes-to-nan": _nan_values,
    "dense-not-payload": _dense_instead_of_payload,
    "payload-for-small-tensor": _payload_for_plain_entry,
    "small-tensor-inf": _plain_entry_nan,
    "small-tensor-other-dtype": _plain_entry_other_dtype,
    "small-tensor-other-shape": _plain_entry_other_shape,
    "small-tensor-forged-npy-header": _plain_entry_forged_header,
    "other-keys": _renamed_keys,
    "two-arrayrecords": _two_arrayrecords,
}


@pytest.mark.parametrize("forge", BAD_REPLIES.values(), ids=BAD_REPLIES.keys())
def test_bad_reply_is_dropped_and_counted(forge, flwr_log):
    def tamper(replies):
        bad = next(r for r in replies if r.metadata.src_node_id == 102)
        forge(bad)
        return replies

    arrays, metrics = _round(_wrap(), tamper)
    reference, _ = _round(_wrap(), drop=(102,))
    # FedAvg sums in sampling order (random): the same replies agree to float32 rounding (values ~0.05);
    # keeping the bad reply in would move the average by far more than 1e-7.
    assert metrics["rejected-replies"] == 1
    assert arrays is not None and _arrays_close(arrays, reference, atol=1e-7)
    reasons = [r.getMessage() for r in flwr_log if "dropped the reply of node 102" in r.getMessage()]
    assert len(reasons) == 1


def test_update_that_overflows_the_model_dtype_is_rejected():
    received = {"w": np.zeros((4, 300), dtype=np.float16)}
    update = torch.full((4, 300), 1e5)  # finite in float32, beyond float16's 65504
    content = RecordDict(
        {"arrays": ArrayRecord({"w": payload_array(get_codec("fp32").encode(update, tensor_seed(5, "w")))})}
    )
    with pytest.raises(RejectedReply, match="overflows float16"):
        decode_reply(content, received, RecordCodec(get_codec("fp32"), min_numel=1), 5)


def test_unexpected_decoder_error_rejects_the_reply_not_the_round(monkeypatch):
    strategy = _wrap()
    real_decode = strategy.codec.decode

    def flaky(payload, seed, *args, **kwargs):
        if seed == tensor_seed(derive_seed(11, 1, 104), "fc.weight"):
            raise IndexError("kernel read past the end")
        return real_decode(payload, seed, *args, **kwargs)

    monkeypatch.setattr(strategy.codec, "decode", flaky)
    arrays, metrics = _round(strategy)
    assert metrics["rejected-replies"] == 1 and arrays is not None


def test_duplicate_and_unknown_replies_are_dropped():
    """Every copy of a duplicated node is dropped (the first may be the forged one), and strangers."""

    duplicated = 102

    def tamper(replies):
        first = next(r for r in replies if r.metadata.src_node_id == duplicated)
        duplicate = Message(first.content, reply_to=_fake_request(duplicated))
        stranger = Message(first.content, reply_to=_fake_request(999))
        return [*replies, duplicate, stranger]

    arrays, metrics = _round(_wrap(), tamper)
    assert metrics["rejected-replies"] == 3
    assert metrics["rejected-duplicate-node"] == 2 and metrics["rejected-unexpected-node"] == 1
    reference, _ = _round(_wrap(), drop=(duplicated,))
    assert _arrays_close(arrays, reference, atol=1e-7)


def _fake_request(node_id: int) -> Message:
    return Message(RecordDict(), dst_node_id=node_id, message_type="train")


def test_client_error_is_handled_as_flower_does():
    def tamper(replies):
        request = _fake_request(103)
        error = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="boom"), reply_to=request)
        return [error if r.metadata.src_node_id == 103 else r for r in replies]

    arrays, metrics = _round(_wrap(), tamper)
    reference, _ = _round(_wrap(), drop=(103,))
    assert metrics["rejected-replies"] == 0  # an error reply is Flower's failure, not a rejected payload
    assert _arrays_close(arrays, reference, atol=1e-7)


def test_no_surviving_reply_keeps_the_current_model():
    def tamper(replies):
        return [_truncated(r) for r in replies]

    arrays, metrics = _round(_wrap(), tamper)
    assert arrays is None
    assert metrics["rejected-replies"] == NUM_NODES and metrics["uplink-bytes"] > 0

    # Through Strategy.start: round 2 starts from the initial model again.
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES, tamper={n: _truncated for n in range(101, 105)})
    result = _wrap().start(grid, initial_arrays(), num_rounds=2)
    train_sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(_arrays_close(m.content["arrays"], initial_arrays(), atol=0) for m in train_sent)
    assert result.train_metrics_clientapp[2]["rejected-replies"] == NUM_NODES


# ---------------------------------------------------------------------------- decode hook
class FakeSideQuantizer(SideInfoQuantizer):
    """Sends x as float32; decodes to the values + side_info and logs the side information it got."""

    name = "fakeside"
    codings = ()
    seen: list[torch.Tensor] = []

    def num_symbols(self) -> int:
        return 0

    def side_fields(self, numel: int) -> list[SideField]:
        return [SideField("values", "<f4", numel)]

    def quantize(self, flat, seed, packed_width) -> Quantized:
        return Quantized([flat.cpu().numpy()])

    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        FakeSideQuantizer.seen.append(self.side_info.clone())
        return torch.from_numpy(side[0].astype(np.float32)) + self.side_info


class TwoGroups(SideInfoPlan):
    """Like NDQSG's Algorithm 2: the first half gets a plain codec (role p1, decoded first)."""

    def assign(self, server_round, node_ids, codec):
        half = len(node_ids) // 2
        first = sorted(node_ids)[:half]
        return {
            n: ClientAssignment(get_codec("fp32"), {KEY_ROLE: "p1"}, rank=0)
            if n in first
            else ClientAssignment(codec, {KEY_ROLE: "p2"}, rank=1)
            for n in node_ids
        }


class SpecPlan(DecodePlan):
    """A plan that remembers what it was built from."""

    @classmethod
    def from_spec(cls, spec, seed=0):
        plan = cls()
        plan.built_from = (spec, seed)
        return plan


class PlannedQuantizer(FakeSideQuantizer):
    """A quantizer with a default decode plan of its own."""

    name = "planned"


def test_a_plan_declares_the_codecs_it_is_the_default_of(monkeypatch):
    monkeypatch.setattr(decode_plan_module, "_DEFAULT_PLANS", dict(decode_plan_module._DEFAULT_PLANS))
    monkeypatch.setitem(codecs_module._QUANTIZERS, "planned", f"{__name__}:PlannedQuantizer")
    monkeypatch.setitem(codecs_module._QUANTIZERS, "fakeside", f"{__name__}:FakeSideQuantizer")
    default_plan_for(PlannedQuantizer)(SpecPlan)
    assert _wrap(codec=" planned ").decode_plan.built_from == (" planned ", 11)  # the spec as given, the seed
    codec = get_codec("planned")
    assert _wrap(codec=codec).decode_plan.built_from == (codec.spec, 11)
    assert type(_wrap(codec="fp16").decode_plan) is DecodePlan  # fp16's quantizer has none
    # A side-information quantizer without a plan of its own gets its kind's (the nearest base's).
    assert type(_wrap(codec="fakeside").decode_plan) is SideInfoPlan
    own = TwoGroups()
    assert _wrap(codec="planned", decode_plan=own).decode_plan is own  # an explicit plan wins
    with pytest.raises(TypeError, match="not a DecodePlan"):
        default_plan_for(PlannedQuantizer)(FakeSideQuantizer)


def test_side_information_is_the_running_mean_in_plan_order(monkeypatch):
    monkeypatch.setitem(codecs_module._QUANTIZERS, "fakeside", f"{__name__}:FakeSideQuantizer")
    FakeSideQuantizer.seen = []
    strategy = _wrap(codec="fakeside", decode_plan=TwoGroups())
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    roles = {m.metadata.dst_node_id: (m.content["config"][KEY_ROLE], m.content["config"][KEY_CODEC]) for m in messages}
    assert roles == {101: ("p1", "fp32"), 102: ("p1", "fp32"), 103: ("p2", "fakeside"), 104: ("p2", "fakeside")}
    replies = grid.send_and_receive(messages)
    sent = initial_arrays()["fc.weight"].numpy()
    updates = {r.metadata.src_node_id: r for r in replies}
    true_update = {}
    for node_id in updates:  # what each client meant to send, from a plain run of the same clients
        plain = make_client_app()(messages[0], grid.contexts[node_id])
        true_update[node_id] = plain.content["arrays"]["fc.weight"].numpy() - sent

    arrival = [updates[n] for n in (104, 103, 102, 101)]  # P2 arrives first, yet P1 is decoded first
    arrays, metrics = strategy.aggregate_train(1, arrival)
    assert metrics["rejected-replies"] == 0
    seen = [s.reshape(16, 64).numpy() for s in FakeSideQuantizer.seen]
    assert len(seen) == 2
    p1_mean = (true_update[101] + true_update[102]) / 2
    np.testing.assert_allclose(seen[0], p1_mean, atol=1e-6)  # 104 decoded against P1's mean
    decoded_104 = true_update[104] + p1_mean
    np.testing.assert_allclose(seen[1], (2 * p1_mean + decoded_104) / 3, atol=1e-6)  # 103: mean of three
    assert "quantization-mse" in metrics  # reported by the two P1 clients only


def test_side_information_ignores_rejected_replies():
    side = SideInformation()
    assert torch.equal(side.get("w", 3), torch.zeros(3))
    side.add({"w": torch.tensor([1.0, 2.0, 3.0])})
    side.add({"w": torch.tensor([3.0, 2.0, 1.0])})
    assert torch.equal(side.get("w", 3), torch.tensor([2.0, 2.0, 2.0]))
    assert side.count("w") == 2 and side.count("v") == 0


# ---------------------------------------------------------------------------- recorder
def test_recorder_writes_train_and_evaluate_rows(tmp_path):
    recorder = HistoryRecorder(tmp_path / "run")
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    result = _wrap(codec="fp16", recorder=recorder).start(grid, initial_arrays(), num_rounds=2)
    rows = HistoryRecorder.load(tmp_path / "run" / "history.json")
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/uplink-bytes"] == result.train_metrics_clientapp[row["round"]]["uplink-bytes"]
        assert row["evaluate/eval-loss"] == result.evaluate_metrics_clientapp[row["round"]]["eval-loss"]
    with (tmp_path / "run" / "history.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert [int(r["round"]) for r in table] == [1, 2]
    assert float(table[1]["train/compression-ratio"]) == pytest.approx(rows[1]["train/compression-ratio"])
    from_result = result_rows(result)
    assert from_result[1]["train/cumulative-uplink-bytes"] == rows[1]["train/cumulative-uplink-bytes"]


def test_recorder_turns_nonfinite_into_null(tmp_path):
    recorder = HistoryRecorder(tmp_path, name="h")
    recorder.record(1, {"a": math.nan, "b": [1.0, math.inf]}, prefix="x/")
    assert HistoryRecorder.load(tmp_path / "h.json") == [{"round": 1, "x/a": None, "x/b": [1.0, None]}]


def test_dense_bytes_equal_count_bytes_of_a_float32_record():
    record = ArrayRecord(
        {
            "a": Array(np.zeros((3, 5), dtype=np.float32)),
            "b": Array(np.zeros(7, dtype=np.float16)),
            "c": Array(np.zeros(2, dtype=np.int64)),
        }
    )
    as_float32 = ArrayRecord(
        {
            "a": Array(np.zeros((3, 5), dtype=np.float32)),
            "b": Array(np.zeros(7, dtype=np.float32)),
            "c": Array(np.zeros(2, dtype=np.int64)),
        }
    )
    assert dense_float32_bytes(record) == as_float32.count_bytes()


def test_metrics_without_replies_are_zero_not_nan():
    strategy = _wrap()
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid)
    arrays, metrics = strategy.aggregate_train(1, [])
    assert arrays is None
    assert metrics["uplink-bytes"] == 0 and metrics["compression-ratio"] == 0.0 and metrics["bits-per-param"] == 0.0
    assert isinstance(metrics, MetricRecord)
