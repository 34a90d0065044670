"""How the benchmarks read ``--codecs`` / ``--families`` lists (:func:`benchmarks.specs.parse_codec_list`)."""

import pytest

from benchmarks.specs import parse_codec_list


@pytest.mark.parametrize(
    ("text", "specs"),
    [
        ("fp32,qsgd:levels=1,bucket_size=128,terngrad", ["fp32", "qsgd:levels=1,bucket_size=128", "terngrad"]),
        # a chained stage after a continued key: one spec, not two
        (
            "rht:max_log2=12,min_log2=4+qsgd:coding=fixed,eden:bits=1.5",
            ["rht:max_log2=12,min_log2=4+qsgd:coding=fixed", "eden:bits=1.5"],
        ),
        ("eden:coding=fixed;rht+ndqsg:coding=fixed", ["eden:coding=fixed", "rht+ndqsg:coding=fixed"]),
        ("", None),
    ],
)
def test_codec_lists_split_into_whole_specs(text, specs):
    assert parse_codec_list(text) == specs
