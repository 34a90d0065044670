"""Every float dtype and rank trains under every codec: ``quantize_mod`` -> ``QuantizedStrategy``, in process.

A model of float16, float32 or float64 tensors of ranks 0 to 4 (every one encoded, ``min_numel=1``)
goes through whole rounds: the clients' ``quantize_mod`` encodes ``trained - received``, the
server decodes, the default admission rules vote (their running sums take the deferred decode of
the scaled-grid codecs, where float16/float64 replies were once all rejected) and FedAvg's fast
path (or, for a FedAvg subclass, the dense replies) makes the next model. No honest reply may be
rejected, and the model must come back in its own dtype and shapes, moved by the update.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.codecs import available_codecs
from fedquant.strategies import QuantizedStrategy
from tests.flower_fakes import InProcessGrid

NUM_NODES = 3
SHAPES = {"scalar": (), "bias": (24,), "weight": (6, 8), "conv": (2, 3, 4), "kernel": (2, 2, 3, 2)}
# every registered codec at its defaults, the app's default codec, the transforms, the other coders
SPECS = [*available_codecs(), "eden:bits=2", "ef+qsgd", "rht+qsgd", "qsgd:coding=entropy", "qsgd:coding=elias"]
DTYPES = ["float16", "float32", "float64"]


def _initial(dtype: str) -> ArrayRecord:
    arrays = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        size = int(np.prod(shape))
        arrays[name] = Array((np.cos(np.arange(size) + i + 0.5) * 0.5).reshape(shape).astype(dtype))
    return ArrayRecord(arrays)


def _train(msg: Message, context) -> Message:
    """One step towards a client's target, computed in the tensor's own dtype (as a model trains)."""
    arrays = next(iter(msg.content.array_records.values()))
    rng = np.random.default_rng(context.node_id)
    out = {}
    for name, array in arrays.items():
        value = array.numpy()
        target = rng.standard_normal(value.shape).astype(value.dtype)
        out[name] = Array(np.asarray(value + value.dtype.type(0.3) * (target - value), dtype=value.dtype))
    metrics = MetricRecord({"num-examples": 10 + context.node_id % 7})
    return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg)


def _evaluate(msg: Message, context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "loss": 0.0})}), reply_to=msg)


def _client_app() -> ClientApp:
    app = ClientApp(mods=[quantize_mod])
    app.train()(_train)
    app.evaluate()(_evaluate)
    return app


class DenseFedAvg(FedAvg):
    """FedAvg through an override: the wrapper hands it every reply's dense arrays (no fast path)."""

    def aggregate_train(self, server_round, replies):
        return super().aggregate_train(server_round, replies)


def _run(spec: str, dtype: str, inner=FedAvg, rounds: int = 2, nodes: int = NUM_NODES):
    strategy = QuantizedStrategy(
        inner(min_available_nodes=nodes, min_train_nodes=nodes, fraction_evaluate=0.0), spec, seed=3, min_numel=1
    )
    initial = _initial(dtype)
    result = strategy.start(InProcessGrid(_client_app(), nodes), initial, num_rounds=rounds)
    return initial, result


def _check(spec: str, dtype: str, initial: ArrayRecord, result, rounds: int) -> None:
    for r in range(1, rounds + 1):
        metrics = result.train_metrics_clientapp[r]
        assert metrics["rejected-replies"] == 0, f"{spec} {dtype} round {r}: {dict(metrics)}"
    for name, shape in SHAPES.items():
        served = result.arrays[name].numpy()
        assert served.dtype == np.dtype(dtype) and served.shape == shape, f"{name}: {served.dtype}{served.shape}"
        assert np.isfinite(served).all()
        start = initial[name].numpy()
        assert not np.array_equal(served, start), f"{spec} {dtype}: '{name}' never moved"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS)
def test_every_dtype_and_rank_trains_under_every_codec(spec, dtype, flwr_log):
    initial, result = _run(spec, dtype)
    _check(spec, dtype, initial, result, rounds=2)
    assert not [r.getMessage() for r in flwr_log if "dropped the reply" in r.getMessage()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["eden:bits=2", "qsgd", "fp16"])
def test_dense_path_keeps_the_dtype(spec, dtype):
    """Without FedAvg's fast path (every reply rebuilt as dense arrays) the same holds."""
    initial, result = _run(spec, dtype, inner=DenseFedAvg, rounds=1)
    _check(spec, dtype, initial, result, rounds=1)


@pytest.mark.parametrize("inner", [FedAvg, DenseFedAvg])
@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_lossless_codec_serves_the_trained_model_in_its_dtype(dtype, inner):
    """One client, fp32 (lossless on a float16 update): the served model is the client's trained
    model, bit for bit in float16; a float64 model is not rounded to float32 on the way (its update
    is, once)."""
    _, result = _run("fp32", dtype, inner=inner, rounds=1, nodes=1)
    plain = FedAvg(min_available_nodes=1, min_train_nodes=1, fraction_evaluate=0.0)
    expected = plain.start(InProcessGrid(_plain_app(), 1), _initial(dtype), num_rounds=1).arrays
    for name in SHAPES:
        got, want = result.arrays[name].numpy(), expected[name].numpy()
        assert got.dtype == want.dtype
        if dtype == "float16":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
            assert not np.array_equal(got.astype(np.float32).astype(np.float64), got), f"'{name}' went through float32"


def _plain_app() -> ClientApp:
    app = ClientApp()
    app.train()(_train)
    app.evaluate()(_evaluate)
    return app
