"""Specs as values: the grammar (transforms with parameters), immutable stages, derived variants."""

from __future__ import annotations

import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import Codec, codec_class, get_codec
from fedquant.codecs.params import parse_pipeline
from fedquant.codecs.transforms.rht import RandomizedHadamard
from fedquant.wire.payload import read_payload, split_stages, write_payload
from tests.helpers import ef_codec_names, sample_tensor

# The wire names every existing spec string keeps (a payload carries them: they are the format).
WIRE_SPECS = {
    "qsgd": "qsgd:bucket_size=512,coding=fixed,levels=16,norm=max",
    "ef+rht+qsgd:levels=7,coding=entropy": "rht+qsgd:bucket_size=512,coding=entropy,levels=7,norm=max",
    "eden:bits=2": "rht+eden:bits=2.0,bucket_size=512,coding=fixed",
    "rht+eden:bits=2": "rht+eden:bits=2.0,bucket_size=512,coding=fixed",
    "EF +fp16": "fp16",
    "ndqsg:rho=5": "ndqsg:alpha=1.0,bucket_size=512,coding=fixed,levels=3,rho=5",
    "rht:max_log2=9+fp32": "rht+fp32",  # the default layout keeps the plain name
}


@pytest.mark.parametrize(("spec", "wire"), WIRE_SPECS.items())
def test_existing_spec_strings_keep_their_wire_spec(spec, wire):
    codec = get_codec(spec)
    assert codec.wire_spec == wire
    assert get_codec(codec.spec) == codec  # the canonical spec parses back to the same codec


def test_transforms_take_parameters():
    codec = get_codec("rht:max_log2=12+qsgd:levels=7")
    assert codec.wire_transforms[0].max_log2 == 12 and codec.levels == 7
    assert codec.wire_spec == "rht:max_log2=12+qsgd:bucket_size=512,coding=fixed,levels=7,norm=max"
    assert codec.name == "rht+qsgd"
    assert get_codec(codec.spec) == codec
    x = sample_tensor((5000,), seed=1)
    payload = codec.encode(x, seed=3)
    assert read_payload(payload).spec == codec.wire_spec and read_payload(payload).codec_name == "rht+qsgd"
    y = codec.decode(payload, seed=3, shape=x.shape)
    assert float((y - x).norm() / x.norm()) < 0.2
    # Another layout is another codec: its decoder refuses the payload.
    with pytest.raises(PayloadError, match="encoded as"):
        get_codec("rht+qsgd:levels=7").decode(payload, seed=3)
    assert get_codec("ef+rht:max_log2=16,min_log2=4+dqsg").wire_transforms[0].min_log2 == 4


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rht:max_log2=0+qsgd", "max_log2"),
        ("rht:max_log2=8,min_log2=9+qsgd", "min_log2"),
        ("rht:colour=red+qsgd", "unknown parameter"),
        ("ef:decay=0.5+qsgd", "unknown parameter"),
        ("rht:max_log2+qsgd", "key=value"),
    ],
)
def test_bad_transform_parameters_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


def test_stage_split_keeps_values_with_plus_signs():
    assert split_stages("ef+rht:max_log2=12+qsgd:levels=7") == ["ef", "rht:max_log2=12", "qsgd:levels=7"]
    assert split_stages("qsgd:x=1e+20,levels=3") == ["qsgd:x=1e+20,levels=3"]
    assert parse_pipeline("eden:bits=1e+0") == [("eden", {"bits": "1e+0"})]
    assert get_codec("eden:bits=1e+0") == get_codec("eden:bits=1")


def test_a_forged_spec_is_rejected_stage_by_stage():
    forged = "a:b=c" + "+d" * 250 + "!"
    with pytest.raises(ValueError, match="cannot go in a payload header"):
        write_payload(forged, torch.float32, (1,), [b""])


def test_stages_are_immutable_values_with_derived_variants():
    codec = get_codec("ef+rht+qsgd:levels=8")
    with pytest.raises(AttributeError, match="with_params"):
        codec.quantizer.levels = 4
    with pytest.raises(AttributeError):
        RandomizedHadamard().max_log2 = 12
    with pytest.raises(TypeError):
        codec.quantizer.config["levels"] = 4
    lower = codec.with_params(levels=4, coding="entropy")
    assert codec.levels == 8 and lower.levels == 4 and lower.coding == "entropy"
    assert [t.name for t in lower.stateful_transforms + lower.wire_transforms] == ["ef", "rht"]
    assert codec.with_params() is codec and get_codec(codec) is codec
    dqsg = codec.with_quantizer(codec_class("dqsg")(levels=3))
    assert dqsg.spec == "ef+rht+" + get_codec("dqsg:levels=3").spec
    with pytest.raises(ValueError, match="levels"):
        codec.with_params(levels=0)


def test_a_side_information_quantizer_makes_a_side_information_codec():
    nd = get_codec("rht+ndqsg")
    assert type(nd).__name__ == "SideInfoCodec" and nd.needs_side_info
    assert type(nd.with_quantizer(codec_class("dqsg")())) is Codec  # the kind follows the quantizer
    assert type(get_codec("dqsg").with_quantizer(nd.quantizer)).__name__ == "SideInfoCodec"
    with pytest.raises(ValueError, match="takes no side_info"):
        get_codec("dqsg").decode(get_codec("dqsg").encode(torch.ones(10), 1), 1, torch.ones(10))


@pytest.mark.parametrize("name", ef_codec_names())
def test_every_rate_ladder_starts_at_the_codec_and_keeps_its_kind(name):
    codec = get_codec(f"ef+{name}")
    ladder = codec.rate_ladder()
    assert ladder[0] is codec
    assert all(type(c) is type(codec) and c.spec.startswith("ef+") for c in ladder)
    rates = [c.rate for c in ladder]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == len(rates)


@pytest.mark.parametrize("spec", ["ef+rht:max_log2=12+qsgd", "ndqsg:rho=5", "eden:bits=2"])
def test_codecs_survive_pickling_and_copies(spec):
    import copy
    import pickle

    codec = get_codec(spec)
    x = sample_tensor((700,), seed=2)
    for twin in (pickle.loads(pickle.dumps(codec)), copy.deepcopy(codec)):
        assert twin == codec and type(twin) is type(codec)
        assert twin.encode(x, 5) == codec.encode(x, 5)
