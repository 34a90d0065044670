"""benchmarks.codec_floor: the stages a floor sums do the codec's work, and the verdict's rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import codec_floor
from fedquant.codecs import get_codec

COPY = 1.0


@pytest.mark.parametrize("spec", ["ecdq:bits=1", "ecdq:bits=0.5", "orq", "bingrad-pb"])
def test_every_stage_runs_and_encode_stages_come_with_their_kind(spec):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    stages = codec_floor.stages_for(spec, x)
    assert stages
    for encode, decode in stages.values():
        encode()
        if decode is not None:
            decode()
    has_decode = any(decode is not None for _, decode in stages.values())
    assert has_decode == (codec_floor.family(spec) == "ecdq")


def test_codecs_without_a_floor_get_no_stages():
    assert codec_floor.stages_for("qsgd", torch.randn(1024)) == {}
    assert codec_floor.family("eden:bits=2") is None


def test_the_floor_codes_the_codecs_own_symbols_losslessly():
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(5))
    symbols = (np.abs(x.numpy()) * 3).astype(np.uint8)
    (encode, decode), size = codec_floor._coded(symbols, int(symbols.max()) + 1)
    assert np.array_equal(decode(), symbols)
    assert size == encode().size


def test_the_e8_points_of_the_floor_are_the_codecs_points():
    """The floor's lattice pass finds what the encoder's fused pass finds (same m, cosets)."""
    from fedquant.codecs.kernels import e8
    from fedquant.codecs.kernels.common import kernel_key

    y = np.random.default_rng(0).standard_normal(1 << 15).astype(np.float32)
    key = kernel_key(1)
    m0, c0 = np.empty(y.size, np.int16), np.empty(y.size // 8, np.uint8)
    m1, c1 = np.empty_like(m0), np.empty_like(c0)
    top0 = codec_floor._e8_points(y, 2.5, key, m0, c0)
    top1, _, _ = e8.lattice_counts(y, 2.5, key, 8, 0, 1, m1, c1)
    assert top0 == top1
    assert np.array_equal(m0, m1) and np.array_equal(c0, c1)


def test_level_selection_rounds_at_the_codecs_index_width():
    x = torch.randn(4096)
    assert "qsgd:levels=7" in "".join(codec_floor.level_selection_stages("orq", x))
    assert "qsgd:levels=1" in "".join(codec_floor.level_selection_stages("bingrad-b", x))
    assert get_codec("qsgd:levels=7").quantizer.levels == 7


@pytest.mark.parametrize(
    ("enc", "dec", "dec_floor", "ok"),
    [
        (7.0, 7.0, 20.0, True),  # the copy target met
        ("0.9 margin", 7.0, 20.0, True),  # above the target, within the margin of its floor
        ("1.1 margin", 7.0, 20.0, False),  # beyond the margin
        (7.0, "1.1 margin", 20.0, False),
        (7.0, 9.0, 0.0, False),  # no decode floor: the copy target holds
    ],
)
def test_a_codec_passes_on_its_target_or_within_its_margin_of_the_floor(enc, dec, dec_floor, ok):
    floor = (20.0, dec_floor)
    margin = codec_floor.MARGIN["ecdq"]

    def time(value, k):
        return float(value.split()[0]) * margin[k] * floor[k] if isinstance(value, str) else value

    passed, why = codec_floor.verdict("ecdq:bits=1", (time(enc, 0), time(dec, 1)), floor, (8.0, 8.0), COPY)
    assert passed is ok
    assert bool(why) is not ok


def test_a_codec_without_a_floor_is_held_to_its_copy_target():
    assert codec_floor.verdict("eden:bits=2", (5.0, 5.0), (0.0, 0.0), (6.0, 6.0), COPY) == (True, "")
    passed, why = codec_floor.verdict("eden:bits=2", (7.0, 5.0), (0.0, 0.0), (6.0, 6.0), COPY)
    assert not passed and "encode" in why
