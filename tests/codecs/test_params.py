import pytest

from fedquant.codecs import get_codec
from fedquant.codecs.params import parse_spec


def test_parse_spec():
    assert parse_spec("qsgd:levels=16, bucket_size=512") == ("qsgd", {"levels": "16", "bucket_size": "512"})
    assert parse_spec("fp32") == ("fp32", {})


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuch", "unknown codec 'nosuch'"),
        ("qsgd:levels", "key=value"),
        ("qsgd:levels=4,levels=5", "given twice"),
        ("qsgd:colour=red", "unknown parameter"),
        ("qsgd:levels=zero", "levels"),
        ("qsgd:levels=0", "levels"),
        ("qsgd:norm=l7", "norm"),
        ("qsgd:coding=gzip", "coding"),
        (":levels=3", "not a codec name"),
    ],
)
def test_bad_specs_fail_at_construction_naming_the_bad_part(spec, message):
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


def test_keyword_parameters_override_spec_and_spec_is_canonical():
    codec = get_codec("qsgd:levels=4", levels=8)
    assert codec.levels == 8
    assert get_codec(codec.spec) == codec
    assert codec.spec.startswith("qsgd:")


def test_fp32_spec_has_no_parameters():
    assert get_codec("fp32").spec == "fp32"
    with pytest.raises(ValueError, match="unknown parameter"):
        get_codec("fp32:levels=3")


def test_get_codec_accepts_codec_objects_including_error_feedback():
    ef = get_codec("ef+signsgd")
    assert get_codec(ef) is ef
    assert get_codec(ef, bucket_size=64).spec == "ef+" + get_codec("signsgd", bucket_size=64).spec
    plain = get_codec("qsgd")
    assert get_codec(plain) is plain
