"""The codec pipeline: every quantizer with every coding, transforms composed, the spec grammar."""

import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import Codec, available_codecs, available_transforms, codec_class, get_codec
from fedquant.codecs.quantizers.base import Quantizer
from fedquant.wire import read_payload
from tests.helpers import ef_codec_names

NUMEL = 3000  # a short last bucket at the default bucket sizes


def _x(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUMEL, generator=g) * 0.01


def _decode(codec: Codec, payload: bytes, seed: int, x: torch.Tensor) -> torch.Tensor:
    side = {"side_info": x + 1e-4} if codec.needs_side_info else {}
    return codec.decode(payload, seed, shape=x.shape, dtype=x.dtype, **side)


CASES = [(name, coding) for name in available_codecs() for coding in (codec_class(name).codings or (None,))]


def test_every_codec_is_a_quantizer_with_fixed_and_entropy_coding():
    for name in available_codecs():
        cls = codec_class(name)
        assert issubclass(cls, Quantizer), name
        if cls.codings:  # the float baselines have no symbol stream
            assert {"fixed", "entropy"} <= set(cls.codings), name


@pytest.mark.parametrize(("name", "coding"), CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_round_trip_with_every_coding(name, coding):
    params = {"coding": coding} if coding else {}
    codec = get_codec(name, **params)
    x = _x()
    payload = codec.encode(x, seed=5)
    assert payload == codec.encode(x, seed=5)  # deterministic in the seed
    y = _decode(codec, payload, 5, x)
    assert y.shape == x.shape and y.dtype == x.dtype and bool(torch.isfinite(y).all())
    # The coding changes how symbols travel, never the quantization: same values as fixed width.
    if coding not in (None, "fixed"):
        reference = get_codec(name, coding="fixed")
        torch.testing.assert_close(y, _decode(reference, reference.encode(x, seed=5), 5, x), rtol=0, atol=0)
    # A payload is bound to its spec: another coding's decoder rejects it.
    others = [c for c in codec_class(name).codings if c != coding]  # empty for the floats
    if others:
        with pytest.raises(PayloadError):
            _decode(get_codec(name, coding=others[0]), payload, 5, x)


@pytest.mark.parametrize("name", ef_codec_names())
def test_error_feedback_composes_with_every_codec(name):
    codec = get_codec(f"ef+{name}")
    assert codec.stateful and codec.spec.startswith("ef+") and not codec.unbiased
    x = _x(1)
    payload, state = codec.encode_stateful(x, 3, None)
    residual = state["ef"]
    assert residual.shape == x.shape
    # The residual is exactly what the decoder misses of what was encoded (x, no residual yet).
    decoded = codec.decode(payload, 3, **({"side_info": x} if codec.needs_side_info else {}))
    torch.testing.assert_close(residual, x - decoded, rtol=0, atol=0)
    # Round 2 encodes x + residual; the server decodes without any state.
    payload2, state2 = codec.encode_stateful(x, 4, state)
    p = x + residual
    decoded2 = codec.without_state().decode(payload2, 4, **({"side_info": p} if codec.needs_side_info else {}))
    torch.testing.assert_close(state2["ef"], p - decoded2, rtol=1e-6, atol=1e-9)
    # The payload names only what is on the wire: the quantizer's own decoder reads it.
    assert read_payload(payload2).spec == codec.without_state().spec


def test_stateless_encode_of_an_ef_codec_is_the_inner_codec():
    x = _x(2)
    assert get_codec("ef+qsgd").encode(x, 9) == get_codec("qsgd").encode(x, 9)


def test_spec_round_trips_and_keyword_overrides_keep_transforms():
    codec = get_codec("ef+qsgd:levels=7,coding=entropy")
    assert get_codec(codec.spec) == codec
    lower = get_codec(codec, levels=3)
    assert lower.spec.startswith("ef+qsgd:") and lower.levels == 3 and lower.coding == "entropy"
    assert get_codec(codec) is codec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ef+ef+qsgd", "twice"),
        ("nope+qsgd", "unknown transform"),
        ("ef+nope", "unknown codec"),
        ("EF +qsgd:levels=0", "levels"),
        ("qsgd:coding=zip", "coding"),
        ("fp32:coding=fixed", "unknown parameter"),
        ("1x+qsgd", "not a transform name"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


def test_transforms_registry_names_ef():
    assert "ef" in available_transforms()
