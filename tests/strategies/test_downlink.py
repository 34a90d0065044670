"""Downlink compression: hand-built and in-process rounds (no Ray).

A counting mod placed before ``quantize_mod`` measures what each train message really carries; the
ClientApp records what it trained on, so the tests can check that it got float arrays and that the
server decoded every reply against the very model the client rebuilt.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.clients.downlink import DownlinkError, decode_train_message
from fedquant.codecs import get_codec
from fedquant.protocol import (
    KEY_DOWNLINK_BASE,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_REFERENCE,
    METRIC_DOWNLINK_REFERENCE,
    NO_REFERENCE,
    PAYLOAD_STYPE,
)
from fedquant.records import RecordCodec
from fedquant.strategies import QuantizedStrategy
from fedquant.strategies.downlink import DownlinkCompressor
from tests.flower_fakes import (
    MIN_NUMEL,
    InProcessGrid,
    global_loss,
    initial_arrays,
    raw_array_bytes,
    set_task_identity,
)
from tests.flower_fakes import train as task_train

NUM_NODES = 4
LEVELS = 16


class Recorder:
    """A counting mod (before ``quantize_mod``) and a ClientApp wrapper that records what it trained on."""

    def __init__(self) -> None:
        self.train_bytes: list[tuple[int, int]] = []  # (node id, bytes of the message's ArrayRecords)
        self.configs: list[tuple[int, dict]] = []
        self.seen: list[tuple[int, ArrayRecord, ArrayRecord]] = []  # (node, trained on, trained)

    def counting_mod(self, msg, ctxt, call_next):
        if msg.metadata.message_type == MessageType.TRAIN:
            self.train_bytes.append((ctxt.node_id, raw_array_bytes(msg)))
            self.configs.append((ctxt.node_id, dict(next(iter(msg.content.config_records.values())))))
        return call_next(msg, ctxt)


class ScheduledFedAvg(FedAvg):
    """FedAvg that trains the nodes ``schedule[round]`` (to make clients skip rounds on purpose)."""

    def __init__(self, schedule: dict[int, list[int]]) -> None:
        super().__init__(min_available_nodes=1)
        self.schedule = schedule

    def configure_train(self, server_round, arrays, config, grid):
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, self.schedule[server_round], MessageType.TRAIN)


def _wrap(strategy=None, codec="fp32", **kw) -> QuantizedStrategy:
    return QuantizedStrategy(
        strategy or FedAvg(min_available_nodes=NUM_NODES), codec, seed=5, min_numel=MIN_NUMEL, **kw
    )


def _make_grid(recorder: Recorder, num_nodes: int = NUM_NODES, tamper=None) -> InProcessGrid:
    """The fake task's ClientApp with [counting mod, quantize_mod]; it records what it trained on."""
    app = ClientApp(mods=[recorder.counting_mod, quantize_mod])

    @app.train()
    def _train(msg, ctxt):
        received = next(iter(msg.content.array_records.values()))
        reply = task_train(msg, ctxt)
        recorder.seen.append((ctxt.node_id, received, next(iter(reply.content.array_records.values()))))
        return reply

    return InProcessGrid(app, num_nodes, tamper)


def test_downlink_bytes_are_what_train_messages_carry_and_clients_train_on_floats():
    recorder = Recorder()
    grid = _make_grid(recorder)
    rounds = 4
    result = _wrap(downlink_codec=f"qsgd:levels={LEVELS}").start(grid, initial_arrays(), num_rounds=rounds)
    assert len(recorder.train_bytes) == rounds * NUM_NODES
    for server_round in range(1, rounds + 1):
        m = result.train_metrics_clientapp[server_round]
        counted = recorder.train_bytes[(server_round - 1) * NUM_NODES : server_round * NUM_NODES]
        assert m["downlink-bytes"] == sum(b for _, b in counted)
        assert m["downlink-bytes-dense"] == NUM_NODES * raw_array_bytes_dense()
        assert m["downlink-compression-ratio"] == pytest.approx(m["downlink-bytes-dense"] / m["downlink-bytes"])
        assert m["rejected-replies"] == 0
        if server_round == 1:  # nobody holds a model: fp16 of the model, a 2x saving on fc.weight
            assert 1.5 < m["downlink-compression-ratio"] < 2.0
            assert 0 < m["downlink-mse"] < 1e-7  # fp16 rounding of weights below 0.05
        else:  # differences at 16 levels: 6 bits per weight + a scale per 512
            assert m["downlink-compression-ratio"] >= 3.5
            assert m["downlink-mse"] > 0
    for _, received, _ in recorder.seen:
        for name, array in received.items():
            assert array.stype == "numpy.ndarray" and array.dtype == "float32", name
    assert global_loss(result.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)


def raw_array_bytes_dense() -> int:
    """Bytes of the fake model as float32 NumPy arrays (what an uncompressed train message carries)."""
    return sum(len(k) + len(a.data) for k, a in initial_arrays().items())


def test_replies_are_decoded_against_the_model_the_client_rebuilt():
    """fp32 uplink: the server's FedAvg must equal the mean of what the clients trained, exactly as they
    trained it from their (lossy) rebuilt models; a server decoding against its own model would be off by
    the downlink error."""
    recorder = Recorder()
    grid = _make_grid(recorder)
    strategy = _wrap(downlink_codec="qsgd:levels=2")  # coarse on purpose: a large downlink error
    arrays = initial_arrays()
    for server_round in (1, 2, 3):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        recorder.seen.clear()
        replies = grid.send_and_receive(messages)
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        for name in arrays.keys():
            expected = np.mean([trained[name].numpy() for _, _, trained in recorder.seen], axis=0)
            np.testing.assert_allclose(arrays[name].numpy(), expected, rtol=0, atol=1e-6)
        if server_round > 1:
            assert metrics["downlink-mse"] > 1e-6  # the clients did train on a model != the server's


def test_a_client_that_skipped_rounds_gets_a_correct_model():
    # Node 101 trains every round; 102 skips rounds 2-3 (its reference is still kept: a difference);
    # 103 skips rounds 2-5 (its reference was evicted, references=2: a full model again).
    schedule = {1: [101, 102, 103], 2: [101], 3: [101], 4: [101, 102], 5: [101], 6: [101, 103]}
    recorder = Recorder()
    grid = _make_grid(recorder, num_nodes=3)
    strategy = _wrap(ScheduledFedAvg(schedule), downlink_codec=f"qsgd:levels={LEVELS}", downlink_references=2)
    arrays = initial_arrays()
    for server_round in sorted(schedule):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        recorder.seen.clear()
        sent_configs = len(recorder.configs)
        replies = grid.send_and_receive(messages)
        bases = {node: cfg[KEY_DOWNLINK_BASE] for node, cfg in recorder.configs[sent_configs:]}
        for node, received, _ in recorder.seen:
            base = bases[node]
            for name in received.keys():
                got, want = received[name].numpy(), arrays[name].numpy()
                if base == NO_REFERENCE:  # fp16: relative error 2**-11
                    assert np.all(np.abs(got - want) <= 2.0**-11 * np.abs(want) + 1e-12), (server_round, node)
                elif name == "fc.weight":  # QSGD with s levels: |error| <= bucket max / s
                    reference = strategy.downlink._models[base]  # noqa: SLF001 - the server's copy
                    span = np.max(np.abs(want - reference[name].numpy()))
                    assert np.max(np.abs(got - want)) <= span / LEVELS + 1e-7, (server_round, node)
                else:  # fc.bias is under min_numel: it travels as is
                    np.testing.assert_array_equal(got, want)
        if server_round == 4:
            assert bases[101] != NO_REFERENCE and bases[102] != NO_REFERENCE and bases[102] != bases[101]
        if server_round == 6:
            assert bases[103] == NO_REFERENCE and bases[101] != NO_REFERENCE
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        assert metrics["rejected-replies"] == 0
        assert strategy.downlink.kept <= 2


@pytest.mark.parametrize("claim", ["forged-int", "float", "missing", "string-in-config"])
def test_a_forged_reference_claim_leads_to_a_full_send(claim):
    def tamper(reply: Message) -> Message:
        metrics = reply.content["metrics"]
        if claim == "forged-int":
            metrics[METRIC_DOWNLINK_REFERENCE] = int(metrics[METRIC_DOWNLINK_REFERENCE]) + 1
        elif claim == "float":
            metrics[METRIC_DOWNLINK_REFERENCE] = float(metrics[METRIC_DOWNLINK_REFERENCE])
        elif claim == "missing":
            del metrics[METRIC_DOWNLINK_REFERENCE]
        else:
            del metrics[METRIC_DOWNLINK_REFERENCE]
            reply.content["claim"] = ConfigRecord({METRIC_DOWNLINK_REFERENCE: "everything"})
        return reply

    recorder = Recorder()
    grid = _make_grid(recorder, tamper={102: tamper})
    result = _wrap(downlink_codec=f"qsgd:levels={LEVELS}").start(grid, initial_arrays(), num_rounds=3)
    later = [(node, cfg) for node, cfg in recorder.configs[NUM_NODES:]]
    assert all((cfg[KEY_DOWNLINK_BASE] == NO_REFERENCE) == (node == 102) for node, cfg in later)
    for server_round in (1, 2, 3):
        assert result.train_metrics_clientapp[server_round]["rejected-replies"] == 0
        assert METRIC_DOWNLINK_REFERENCE not in result.train_metrics_clientapp[server_round]
    assert global_loss(result.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)


def test_a_client_that_lost_its_model_errors_once_then_gets_the_full_model():
    recorder = Recorder()
    grid = _make_grid(recorder)
    strategy = _wrap(downlink_codec=f"qsgd:levels={LEVELS}")
    arrays = initial_arrays()
    arrays, _ = strategy.aggregate_train(
        1, grid.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    )
    grid.contexts[103].state = RecordDict()  # the device restarted and forgot its model
    replies = grid.send_and_receive(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    assert [r.metadata.src_node_id for r in replies if r.has_error()] == [103]
    assert "does not hold" in next(r for r in replies if r.has_error()).error.reason
    arrays, metrics = strategy.aggregate_train(2, replies)
    assert arrays is not None
    before = len(recorder.configs)
    strategy.aggregate_train(3, grid.send_and_receive(strategy.configure_train(3, arrays, ConfigRecord(), grid)))
    bases = dict((node, cfg[KEY_DOWNLINK_BASE]) for node, cfg in recorder.configs[before:])
    assert bases[103] == NO_REFERENCE and all(bases[n] != NO_REFERENCE for n in (101, 102, 104))


def test_same_reference_same_bytes_and_the_rebuild_is_the_clients():
    compressor = DownlinkCompressor("qsgd:levels=8", seed=3, min_numel=MIN_NUMEL)
    model = initial_arrays()
    first = [compressor.send(1, node, model) for node in (1, 2)]
    assert first[0] is first[1] and first[0].base == NO_REFERENCE  # one encode per group
    assert first[0].config[KEY_DOWNLINK_CODEC] == "fp16"
    assert first[0].wire["fc.weight"].stype == PAYLOAD_STYPE and first[0].wire["fc.bias"].stype != PAYLOAD_STYPE
    set_task_identity()
    replies = []
    for node in (1, 2):
        reply = Message(
            RecordDict({"m": MetricRecord({METRIC_DOWNLINK_REFERENCE: first[0].reference})}),
            dst_node_id=node,
            message_type=MessageType.TRAIN,
        )
        replies.append(_as_reply(reply, node))
    compressor.confirm(1, replies)
    assert compressor.held == {1: first[0].reference, 2: first[0].reference}
    moved = ArrayRecord({k: Array(a.numpy() + 0.01) for k, a in model.items()})
    second = compressor.send(2, 1, moved)
    assert (
        second.base == first[0].reference
        and second.config[KEY_DOWNLINK_CODEC] == "qsgd:bucket_size=512,coding=fixed,levels=8,norm=max"
    )
    rebuilt = (
        RecordCodec(get_codec(second.config[KEY_DOWNLINK_CODEC]))
        .decode(second.wire, second.config["fedquant.downlink-seed"], first[0].model)
        .arrays
    )
    for name in model.keys():
        np.testing.assert_array_equal(rebuilt[name].numpy(), second.model[name].numpy())


def _as_reply(message: Message, node: int) -> Message:
    """The reply of ``node`` to ``message`` (its ``src_node_id`` is the message's destination)."""
    return Message(message.content, reply_to=message)


def test_client_rejects_a_difference_to_a_model_it_does_not_hold():
    set_task_identity()
    config = ConfigRecord(
        {
            KEY_DOWNLINK_CODEC: "qsgd:levels=4",
            "fedquant.downlink-seed": 1,
            KEY_DOWNLINK_BASE: 77,
            KEY_DOWNLINK_REFERENCE: 78,
        }
    )
    msg = Message(
        RecordDict({"arrays": initial_arrays(), "config": config}), dst_node_id=1, message_type=MessageType.TRAIN
    )
    with pytest.raises(DownlinkError, match="does not hold"):
        decode_train_message(msg, config, RecordDict())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"downlink_codec": "ef+qsgd"}, "error feedback"),
        ({"downlink_codec": "ndqsg"}, "side information"),
        ({"downlink_codec": "nope"}, "unknown codec"),
        ({"downlink_codec": "fp16", "downlink_references": 0}, "downlink_references"),
        ({"downlink_codec": "fp16", "downlink_full_codec": "ef+fp16"}, "error feedback"),
    ],
)
def test_bad_downlink_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _wrap(**kwargs)


def test_without_a_downlink_codec_nothing_changes():
    recorder = Recorder()
    grid = _make_grid(recorder)
    m = _wrap().start(grid, initial_arrays(), num_rounds=1).train_metrics_clientapp[1]
    assert m["downlink-bytes"] == m["downlink-bytes-dense"] == NUM_NODES * raw_array_bytes_dense()
    assert m["downlink-compression-ratio"] == 1.0 and m["downlink-mse"] == 0.0
    assert all(KEY_DOWNLINK_CODEC not in cfg for _, cfg in recorder.configs)


def test_different_models_in_one_round_get_their_own_references():
    """A strategy that sends personalised models: clients holding no reference get different models."""
    compressor = DownlinkCompressor("qsgd:levels=8", min_numel=MIN_NUMEL)
    model = initial_arrays()
    other = ArrayRecord({k: Array(a.numpy() + 1.0) for k, a in model.items()})
    a, b = compressor.send(1, 1, model), compressor.send(1, 2, other)
    assert a.reference != b.reference and a.config["fedquant.downlink-seed"] != b.config["fedquant.downlink-seed"]
    for sent, want in ((a, model), (b, other)):
        kept = compressor._models[sent.reference]  # noqa: SLF001 - the server's copy
        np.testing.assert_allclose(kept["fc.weight"].numpy(), want["fc.weight"].numpy(), rtol=2.0**-10)
