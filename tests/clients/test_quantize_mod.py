"""Unit tests of ``quantize_mod`` with hand-built Messages (as Flower's own mod tests do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from fedquant.clients import quantize_mod
from fedquant.codecs import get_codec
from fedquant.protocol import (
    CLIENT_METRICRECORD_NAME,
    KEY_CLIENT_MSE,
    KEY_CODEC,
    KEY_MIN_NUMEL,
    KEY_SEED,
    METRIC_CLIENT_ENCODE_SECONDS,
    METRIC_CLIENT_MSE,
    PAYLOAD_STYPE,
    STATE_TRANSFORMS_KEY,
)
from fedquant.rng import derive_seed
from tests.flower_fakes import set_task_identity

CLIENT_SEED = 4242
NODE_ID = 7


def _received() -> ArrayRecord:
    gen = np.random.default_rng(0)
    return ArrayRecord(
        {
            "w": Array(gen.standard_normal((32, 16)).astype(np.float32)),  # 512 elements: encoded
            "b": Array(gen.standard_normal(16).astype(np.float32)),  # small: as is
            "steps": Array(np.array([3, 4], dtype=np.int64)),  # not float: as is
            "w64": Array(gen.standard_normal((20, 20))),  # float64, 400 elements: encoded
        }
    )


def _train_message(config: dict | None, message_type: str = MessageType.TRAIN) -> Message:
    set_task_identity()
    content = RecordDict({"arrays": _received(), "config": ConfigRecord(config or {"lr": 0.1})})
    return Message(content, dst_node_id=NODE_ID, message_type=message_type)


def _fq_config(codec: str = "fp16", min_numel: int = 100) -> dict:
    return {"lr": 0.1, KEY_CODEC: codec, KEY_SEED: CLIENT_SEED, KEY_MIN_NUMEL: min_numel}


def _context() -> Context:
    return Context(run_id=1, node_id=NODE_ID, node_config={}, state=RecordDict(), run_config={})


def _trained(received: ArrayRecord, step: float = 0.25) -> ArrayRecord:
    """What a ClientApp sends back: every float tensor moved by a deterministic amount."""
    out = {}
    for name, array in received.items():
        value = array.numpy()
        if value.dtype.kind == "f":
            value = value + step * np.cos(np.arange(value.size)).reshape(value.shape).astype(value.dtype)
        else:
            value = value + 1
        out[name] = Array(value)
    return ArrayRecord(out)


def _app(with_metrics: bool = True, step: float = 0.25):
    """A ClientApp callable; records what it was called with."""
    calls = []

    def app(msg: Message, ctxt: Context) -> Message:
        calls.append(msg)
        records = {"arrays": _trained(next(iter(msg.content.array_records.values())), step)}
        if with_metrics:
            records["metrics"] = MetricRecord({"num-examples": 10, "train-loss": 1.5})
        return Message(RecordDict(records), reply_to=msg)

    app.calls = calls
    return app


def test_non_train_message_passes_untouched():
    msg = _train_message(_fq_config(), message_type=MessageType.EVALUATE)
    app = _app()
    reply = quantize_mod(msg, _context(), app)
    assert app.calls == [msg]
    for array in reply.content["arrays"].values():
        assert array.stype == "numpy.ndarray"
    assert METRIC_CLIENT_MSE not in reply.content["metrics"]


def test_train_message_without_fedquant_config_passes_untouched():
    msg = _train_message(None)
    expected = _app()(msg, _context()).content["arrays"]
    reply = quantize_mod(msg, _context(), _app())
    assert {k: a.data for k, a in reply.content["arrays"].items()} == {k: a.data for k, a in expected.items()}
    assert dict(reply.content["metrics"]) == {"num-examples": 10, "train-loss": 1.5}


@pytest.mark.parametrize("spec", ["fp32", "fp16"])
def test_encodes_large_float_tensors_as_payloads_of_the_update(spec):
    msg = _train_message(_fq_config(spec))
    received = _received()
    trained = _trained(received)
    reply = quantize_mod(msg, _context(), _app())
    record = reply.content["arrays"]
    assert list(record.keys()) == ["w", "b", "steps", "w64"]
    codec = get_codec(spec)
    for name in ("w", "w64"):
        array = record[name]
        assert array.stype == PAYLOAD_STYPE and array.dtype == "uint8" and array.shape == (len(array.data),)
        update = trained[name].numpy().astype(np.float32) - received[name].numpy().astype(np.float32)
        decoded = codec.decode(
            array.data, derive_seed(CLIENT_SEED, name), shape=update.shape, dtype=torch.float32
        ).numpy()
        tol = 0 if spec == "fp32" else 1e-3  # fp16 keeps 11 significant bits; |update| <= 0.25
        np.testing.assert_allclose(decoded, update, rtol=0, atol=tol)
    # Small and non-float tensors are the ClientApp's trained values, byte for byte.
    for name in ("b", "steps"):
        assert record[name].stype == "numpy.ndarray"
        np.testing.assert_array_equal(record[name].numpy(), trained[name].numpy())
    # count_bytes counts payload bytes plus keys: what the message really carries.
    expected = sum(len(k) + len(a.data) for k, a in record.items())
    assert record.count_bytes() == expected
    assert record.count_bytes() < trained.count_bytes()


def test_reports_client_mse_and_encode_time():
    msg = _train_message(_fq_config("fp16"))
    received, trained = _received(), _trained(_received())
    reply = quantize_mod(msg, _context(), _app())
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == 10 and metrics["train-loss"] == 1.5
    # The MSE the mod reports is that of fp16 rounding of the updates, over the encoded elements.
    errors = []
    for name in ("w", "w64"):
        update = trained[name].numpy().astype(np.float32) - received[name].numpy().astype(np.float32)
        errors.append((update.astype(np.float16).astype(np.float32) - update).ravel() ** 2)
    expected = float(np.concatenate(errors).astype(np.float64).mean())
    assert metrics[METRIC_CLIENT_MSE] == pytest.approx(expected, rel=1e-6)
    assert expected > 0
    assert metrics[METRIC_CLIENT_ENCODE_SECONDS] > 0


def test_reply_without_metricrecord_gets_fedquant_record():
    reply = quantize_mod(_train_message(_fq_config("fp32")), _context(), _app(with_metrics=False))
    record = reply.content.metric_records[CLIENT_METRICRECORD_NAME]
    assert record[METRIC_CLIENT_MSE] == 0.0


def test_client_mse_can_be_switched_off():
    config = _fq_config("fp16")
    config[KEY_CLIENT_MSE] = False
    metrics = quantize_mod(_train_message(config), _context(), _app()).content["metrics"]
    assert METRIC_CLIENT_MSE not in metrics and metrics[METRIC_CLIENT_ENCODE_SECONDS] > 0


def test_min_numel_threshold_is_inclusive():
    reply = quantize_mod(_train_message(_fq_config("fp32", min_numel=512)), _context(), _app())
    record = reply.content["arrays"]
    assert record["w"].stype == PAYLOAD_STYPE  # exactly 512 elements
    assert record["w64"].stype == "numpy.ndarray"  # 400 elements


def test_same_seed_gives_identical_bytes():
    a = quantize_mod(_train_message(_fq_config("fp16")), _context(), _app()).content["arrays"]
    b = quantize_mod(_train_message(_fq_config("fp16")), _context(), _app()).content["arrays"]
    assert all(a[k].data == b[k].data for k in a.keys())


def test_client_error_reply_is_passed_through():
    msg = _train_message(_fq_config())

    def failing(m, c):
        from flwr.app import Error

        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="boom"), reply_to=m)

    reply = quantize_mod(msg, _context(), failing)
    assert reply.has_error() and reply.error.reason == "boom"


def test_reply_with_two_arrayrecords_is_an_error():
    msg = _train_message(_fq_config())

    def two_records(m, c):
        arrays = _trained(m.content["arrays"])
        return Message(RecordDict({"a": arrays, "b": arrays}), reply_to=m)

    reply = quantize_mod(msg, _context(), two_records)
    assert reply.has_error()
    assert reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "exactly one ArrayRecord" in reply.error.reason


def test_reply_with_other_keys_is_an_error():
    msg = _train_message(_fq_config())

    def renamed(m, c):
        arrays = _trained(m.content["arrays"])
        return Message(RecordDict({"arrays": ArrayRecord({"x" + k: v for k, v in arrays.items()})}), reply_to=m)

    reply = quantize_mod(msg, _context(), renamed)
    assert reply.has_error() and "keys" in reply.error.reason


def test_bad_config_is_an_error():
    config = _fq_config()
    config[KEY_CODEC] = "nope"
    reply = quantize_mod(_train_message(config), _context(), _app())
    assert reply.has_error() and "fedquant config" in reply.error.reason


def test_error_feedback_residual_lives_in_context_state():
    # ErrorFeedback (ef+fp16): send C(update + residual), keep residual' = (update + residual) - C(...).
    fp16, context = get_codec("fp16"), _context()
    received = _received()
    first = quantize_mod(_train_message(_fq_config("ef+fp16")), context, _app(step=0.3))
    stored = context.state.array_records[STATE_TRANSFORMS_KEY]
    assert list(stored.keys()) == ["ef/w", "ef/w64"]  # per transform and tensor
    residual1 = {}
    for name in ("w", "w64"):
        update = _trained(received, 0.3)[name].numpy().astype(np.float32) - received[name].numpy().astype(np.float32)
        seed = derive_seed(CLIENT_SEED, name)
        assert first.content["arrays"][name].data == fp16.encode(torch.from_numpy(update), seed)  # no residual yet
        sent = fp16.decode(first.content["arrays"][name].data, seed, shape=update.shape, dtype=torch.float32)
        residual1[name] = update - sent.numpy()
        np.testing.assert_array_equal(stored[f"ef/{name}"].numpy(), residual1[name])
        assert np.abs(residual1[name]).max() > 0  # fp16 rounding left something to feed back
    assert first.content["metrics"][METRIC_CLIENT_MSE] == pytest.approx(
        float(np.mean(np.concatenate([r.ravel() for r in residual1.values()]).astype(np.float64) ** 2)), rel=1e-6
    )

    second = quantize_mod(_train_message(_fq_config("ef+fp16")), context, _app(step=0.5))
    for name in ("w", "w64"):
        update = _trained(received, 0.5)[name].numpy().astype(np.float32) - received[name].numpy().astype(np.float32)
        corrected = torch.from_numpy(update + residual1[name])
        # Round 2 encodes update + the residual stored in round 1: byte-identical to doing it by hand.
        assert second.content["arrays"][name].data == fp16.encode(corrected, derive_seed(CLIENT_SEED, name))


def test_encode_device_is_the_clients_gpu_when_it_has_one(monkeypatch):
    from fedquant.clients.quantize_mod import encode_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert encode_device().type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert encode_device().type == "cuda"


# Records which fedquant modules import server code: flwr's own package __init__ loads
# flwr.serverapp for everyone, so sys.modules alone cannot tell; the import statements can.
_IMPORT_SPY = """
import builtins, json, sys

real_import = builtins.__import__
server_imports = set()

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    wanted = [name] + [name + "." + item for item in fromlist or ()]
    if importer.startswith("fedquant") and any(w.startswith("flwr.serverapp") for w in wanted):
        server_imports.add(importer)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = spy

def snapshot():
    strategies = sorted(m for m in sys.modules if m.startswith("fedquant.strategies"))
    return {"strategies": strategies, "server_imports": sorted(server_imports)}

import fedquant.records
records = snapshot()
import fedquant.clients
client = snapshot()
import fedquant.strategies
print(json.dumps({"records": records, "client": client, "server": snapshot()}))
"""


def test_importing_the_client_or_the_record_codec_loads_no_server_code():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _IMPORT_SPY], capture_output=True, check=True, env=env, cwd=root)
    seen = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert seen["records"] == {"strategies": [], "server_imports": []}  # both halves use the record codec
    assert seen["client"] == {"strategies": [], "server_imports": []}
    # The spy sees the server's imports once it is loaded (so the empty lists above mean something).
    assert "fedquant.strategies.quantized" in seen["server"]["strategies"]
    assert "fedquant.strategies.quantized" in seen["server"]["server_imports"]
