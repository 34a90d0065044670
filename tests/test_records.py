"""The record codec: one per-tensor policy for both directions (unit tests, no Flower round)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedquant.codecs import get_codec
from fedquant.protocol import (
    KEY_CLIENT_MSE,
    KEY_CODEC,
    KEY_MIN_NUMEL,
    KEY_SEED,
    KEY_TENSOR_CODECS,
    PAYLOAD_STYPE,
    payload_array,
    tensor_seed,
)
from fedquant.records import RecordCodec, RecordError, _rebuilt, check_plain_entry, npy_header, numpy_array

SEED = 77


def _base() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {
            "w": Array(rng.standard_normal((32, 16)).astype(np.float32)),  # 512 elements: encoded
            "b": Array(rng.standard_normal(16).astype(np.float32)),  # small: as is
            "steps": Array(np.array([3, 4], dtype=np.int64)),  # not float: as is
            "w64": Array(rng.standard_normal((20, 20))),  # float64, 400 elements: encoded
            "empty": Array(np.zeros((0, 5), np.float32)),  # no elements: as is
        }
    )


def _trained(base: ArrayRecord, step: float = 0.01) -> ArrayRecord:
    out = {}
    for name, array in base.items():
        value = array.numpy()
        out[name] = Array(value + step if value.dtype.kind == "f" else value.copy())
    return ArrayRecord(out)


def test_the_policy_selects_float_tensors_of_min_numel_elements():
    codec = RecordCodec(get_codec("fp16"), min_numel=100)
    assert [n for n, a in _base().items() if codec.encodes(a)] == ["w", "w64"]
    assert codec.encodes(np.zeros(100, np.float16)) and not codec.encodes(np.zeros(99, np.float32))
    per_tensor = RecordCodec(get_codec("fp16"), 100, {"w": get_codec("qsgd")})
    assert per_tensor.codec_for("w") == get_codec("qsgd") and per_tensor.codec_for("w64") == get_codec("fp16")


@pytest.mark.parametrize("spec", ["qsgd:levels=4", "ef+signsgd", "rht+dqsg:coding=entropy", "eden:bits=2"])
def test_uplink_encode_then_decode_against_the_base(spec):
    base = _base()
    codec = RecordCodec(get_codec(spec), min_numel=100, tensor_codecs={"w64": get_codec("fp32")})
    trained = _trained(base)
    encoded = codec.encode(trained, SEED, base)
    wire = encoded.arrays
    assert list(wire.keys()) == list(base.keys())
    assert [n for n, a in wire.items() if a.stype == PAYLOAD_STYPE] == ["w", "w64"]
    for name in ("b", "steps", "empty"):
        assert wire[name].data == trained[name].data  # plain entries travel as the trained value
    # Each payload is its tensor's codec on trained - base (float32) at the tensor's seed.
    update = torch.from_numpy(trained["w"].numpy() - base["w"].numpy())
    assert wire["w"].data == get_codec(spec).encode(update, tensor_seed(SEED, "w"))
    assert wire["w64"].data == get_codec("fp32").encode(
        torch.from_numpy(trained["w64"].numpy().astype(np.float32) - base["w64"].numpy().astype(np.float32)),
        tensor_seed(SEED, "w64"),
    )
    received = {name: array.numpy() for name, array in base.items()}
    plain = codec.check_layout(wire, received)
    assert sorted(plain) == ["b", "empty", "steps"]
    decoded = codec.decode(wire, SEED, received)
    assert sorted(decoded.updates) == ["w", "w64"]
    assert decoded.arrays["w64"].numpy().dtype == np.float64  # rebuilt in the base's dtype
    np.testing.assert_allclose(decoded.arrays["w64"].numpy(), trained["w64"].numpy(), atol=1e-6)
    assert decoded.arrays["b"].data == wire["b"].data


def test_downlink_without_a_base_sends_the_values_themselves():
    model = _base()
    codec = RecordCodec(get_codec("fp32"), min_numel=100)
    wire = codec.encode(model, SEED).arrays
    assert wire["w"].data == get_codec("fp32").encode(torch.from_numpy(model["w"].numpy()), tensor_seed(SEED, "w"))
    rebuilt = codec.decode(wire, SEED).arrays
    for name in ("w", "b", "steps", "empty"):
        np.testing.assert_array_equal(rebuilt[name].numpy(), model[name].numpy())
    assert rebuilt["w64"].numpy().dtype == np.float64  # fp32 on the wire, the model's dtype back
    np.testing.assert_allclose(rebuilt["w64"].numpy(), model["w64"].numpy(), rtol=1e-6)


def test_stateful_codecs_load_and_return_state_and_measure_their_error():
    base, trained = _base(), _trained(_base(), 0.3)
    loaded = []

    def load(name, shape, transforms):
        loaded.append((name, shape, list(transforms)))
        return {}

    codec = RecordCodec(get_codec("ef+signsgd"), min_numel=100)
    encoded = codec.encode(trained, SEED, base, state=load, measure=True)
    assert loaded == [("w", (32, 16), ["ef"]), ("w64", (20, 20), ["ef"])]
    assert sorted(encoded.state) == ["w", "w64"]
    residuals = torch.cat([encoded.state[n]["ef"].reshape(-1).double() for n in ("w", "w64")])
    assert encoded.measured_numel == 912
    assert encoded.squared_error == pytest.approx(float((residuals**2).sum()), rel=1e-12)  # the error is the residual
    stateless = RecordCodec(get_codec("signsgd"), min_numel=100).encode(trained, SEED, base, measure=True)
    assert stateless.squared_error == pytest.approx(encoded.squared_error, rel=1e-6)  # no residual yet: the same
    assert not stateless.state
    unmeasured = RecordCodec(get_codec("ndqsg"), min_numel=100).encode(trained, SEED, base, measure=True)
    assert unmeasured.measured_numel == 0  # its decoder needs side information the client does not have


def test_predict_bytes_is_what_the_encoded_record_holds():
    base = _base()
    for spec, exact in (("qsgd:levels=4", True), ("ef+rht+dqsg", True), ("qsgd:coding=entropy", False)):
        codec = RecordCodec(get_codec(spec), min_numel=100)
        wire = codec.encode(_trained(base), SEED, base).arrays
        held = sum(len(name) + len(array.data) for name, array in wire.items())
        predicted = codec.predict_bytes(base)
        assert predicted == held if exact else held <= predicted


def test_check_layout_rejects_what_the_policy_does_not_allow():
    base = _base()
    received = {name: array.numpy() for name, array in base.items()}
    codec = RecordCodec(get_codec("fp16"), min_numel=100)
    wire = dict(codec.encode(_trained(base), SEED, base).arrays.items())

    def check(**changes):
        codec.check_layout(ArrayRecord({**wire, **changes}), received)

    with pytest.raises(RecordError, match="must carry a fedquant payload"):
        check(w=Array(np.zeros((32, 16), np.float32)))
    with pytest.raises(RecordError, match="must travel as a NumPy array"):
        check(b=payload_array(get_codec("fp16").encode(torch.zeros(16), 1)))
    with pytest.raises(RecordError, match="expected float32"):
        check(b=Array(np.zeros(17, np.float32)))
    with pytest.raises(RecordError, match="NaN or Inf"):
        check(b=Array(np.full(16, np.nan, np.float32)))
    with pytest.raises(RecordError, match="expected int64"):
        check(steps=Array(np.zeros(2, np.int32)))
    check(b=Array(np.zeros(16, np.float64)))  # another float dtype is allowed
    with pytest.raises(RecordError, match="keys"):
        codec.check_layout(ArrayRecord(dict(reversed(list(wire.items())))), received)


def test_decode_errors_name_the_tensor():
    base = _base()
    received = {name: array.numpy() for name, array in base.items()}
    codec = RecordCodec(get_codec("fp32"), min_numel=100)
    wire = dict(codec.encode(_trained(base), SEED, base).arrays.items())
    truncated = ArrayRecord({**wire, "w64": payload_array(wire["w64"].data[:-3])})
    with pytest.raises(RecordError, match="'w64'"):
        codec.decode(truncated, SEED, received)
    huge = payload_array(get_codec("fp32").encode(torch.full((16,), 1e5), tensor_seed(SEED, "h")))
    with pytest.raises(RecordError, match="overflows float16"):
        codec.decode(ArrayRecord({"h": huge}), SEED, {"h": np.zeros(16, np.float16)})
    with pytest.raises(RecordError, match="'w': the reference model has no such tensor"):
        codec.decode(ArrayRecord(wire), SEED, {})
    with pytest.raises(RecordError, match="came back as"):
        codec.encode({"w": Array(np.zeros((16, 32), np.float32))}, SEED, {"w": base["w"]})


def test_config_entries_round_trip_in_order():
    codec = RecordCodec(get_codec("ndqsg:rho=5"), 64, {"w": get_codec("dqsg")})
    entries = codec.config_entries(seed=9, measure=False)
    assert list(entries) == [KEY_CODEC, KEY_SEED, KEY_MIN_NUMEL, KEY_CLIENT_MSE, KEY_TENSOR_CODECS]
    again, seed, measure = RecordCodec.from_config(ConfigRecord(entries))
    assert (again, seed, measure) == (codec, 9, False)
    plain, _, measure = RecordCodec.from_config({KEY_CODEC: "fp16", KEY_SEED: 1, KEY_MIN_NUMEL: 5})
    assert plain == RecordCodec(get_codec("fp16"), 5) and measure  # absent: measure
    assert KEY_TENSOR_CODECS not in plain.config_entries(1, True)
    for bad in ({KEY_CODEC: "fp16", KEY_SEED: 1}, {**entries, KEY_TENSOR_CODECS: "[1]"}, {**entries, KEY_CODEC: "no"}):
        with pytest.raises((KeyError, ValueError)):
            RecordCodec.from_config(bad)


@pytest.mark.parametrize("spec", ["qsgd:levels=16", "eden:bits=2", "rht+dqsg:levels=6,coding=entropy"])
def test_decode_rebuilds_the_float32_sum_and_the_float64_squared_norm(spec):
    """The fused rebuild gives ``received + update`` bit for bit, the bytes np.save writes, and
    ``sum(update**2)`` within 1e-12 of the float64 computation it replaces."""
    rng = np.random.default_rng(5)
    base = ArrayRecord({"w": Array(rng.standard_normal((300, 17)).astype(np.float32) * 1e4)})
    trained = ArrayRecord({"w": Array(base["w"].numpy() + rng.standard_normal((300, 17)).astype(np.float32))})
    codec = RecordCodec(get_codec(spec), min_numel=100)
    wire = codec.encode(trained, SEED, base).arrays
    received = {"w": base["w"].numpy()}
    decoded = codec.decode(wire, SEED, received)
    update = decoded.updates["w"].numpy()
    expected = received["w"] + update
    assert decoded.arrays["w"].data == Array(expected).data
    float64_norm = float(torch.linalg.vector_norm(decoded.updates["w"], dtype=torch.float64)) ** 2
    assert decoded.squared_norms["w"] == pytest.approx(float64_norm, rel=1e-12)


def test_decode_rejects_a_float32_sum_that_overflows():
    codec = RecordCodec(get_codec("fp32"), min_numel=4)
    huge = payload_array(get_codec("fp32").encode(torch.full((16,), 3e38), tensor_seed(SEED, "h")))
    with pytest.raises(RecordError, match="'h': received \\+ update overflows float32 to Inf"):
        codec.decode(ArrayRecord({"h": huge}), SEED, {"h": np.full(16, 3e38, np.float32)})


@pytest.mark.parametrize(
    "value",
    [
        np.zeros((3, 4), np.float32),
        np.array(1.5, np.float32),
        np.arange(10, dtype=np.int64),
        np.ones((2, 0)),
        np.array([True, False]),
        np.arange(6, dtype=">f4").reshape(2, 3),
        np.asfortranarray(np.ones((3, 2), np.float16)),
    ],
)
def test_numpy_array_holds_the_bytes_np_save_writes(value):
    fast, flower = numpy_array(value), Array(np.require(value, requirements="C"))
    assert (fast.data, fast.dtype, fast.shape, fast.stype) == (flower.data, flower.dtype, flower.shape, flower.stype)
    np.testing.assert_array_equal(fast.numpy(), value)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_an_update_of_another_length_than_the_received_tensor_is_refused_before_the_kernel(dtype):
    # The codecs check the decoded length, but the fused rebuild kernel indexes the received tensor
    # by the update's length without bounds checks: the seam refuses a mismatch itself.
    received = np.zeros((4, 8), dtype)
    for length in (31, 33):
        with pytest.raises(RecordError, match="elements"):
            _rebuilt("w", received, np.ones(length, np.float32))
    array, squares = _rebuilt("w", received, np.ones((4, 8), np.float32))
    assert squares == 32.0 and array.numpy().shape == (4, 8)


@pytest.mark.parametrize("value", [np.arange(16, dtype=np.float32), np.zeros((3, 4), np.float16), np.array(2.5)])
def test_a_plain_entry_is_read_as_np_load_reads_it_whichever_way_its_bytes_are_parsed(value):
    """Bytes that are exactly np.save's are read without parsing the header; anything else goes
    through Array.numpy (np.load) and its checks, so both readers give the same value or error."""
    array = Array(value)
    got = check_plain_entry("x", array, value)
    assert got.dtype == value.dtype and got.flags.writeable
    np.testing.assert_array_equal(got, value)
    header = npy_header(value.dtype, value.shape)
    assert array.data.startswith(header)
    body = array.data[len(header) :]
    # the same header padded otherwise (np.load parses it), trailing bytes: np.load's value
    padded = header[:-2] + b"\t\n"
    for data in (padded + body, array.data + b"\0" * value.dtype.itemsize):
        other = Array(dtype=array.dtype, shape=array.shape, stype=array.stype, data=data)
        np.testing.assert_array_equal(check_plain_entry("x", other, value), other.numpy())
    short = Array(dtype=array.dtype, shape=array.shape, stype=array.stype, data=array.data[:-1])
    with pytest.raises(RecordError, match="not a valid NumPy array"):
        check_plain_entry("x", short, value)
