"""SecAggConfig refuses absurd settings up front, naming the option; settings at the limits never overflow."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fedquant.codecs.summable import decode_sum, encode_update
from fedquant.secagg.config import (
    MAX_CLIP,
    MAX_GROWTH,
    MAX_NOISE_MULTIPLIER,
    MAX_QUANTIZER_BITS,
    MIN_WRAP_PROBABILITY,
    SecAggConfig,
    SecAggConfigError,
)
from simulations.settings import RunConfigError, SimSettings


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("noise_multiplier", 1e300), ("noise_multiplier", math.inf), ("noise_multiplier", -1.0),
        ("clip", 3e38), ("clip", 0.0), ("clip", math.nan),
        ("threshold", 1e308), ("threshold", 5000), ("threshold", 10**400), ("threshold", math.nan),
        ("threshold", 0.5), ("threshold", 1), ("threshold", True),
        ("bits", 25), ("bits", -1), ("bits", 2.0),
        ("neighbours", 1), ("neighbours", 5000), ("neighbours", True),
        ("delta", 0.0), ("delta", 1.0), ("delta", 1e-300),
        ("growth", math.inf), ("growth", 0.5), ("wrap_probability", 1e-300), ("wrap_probability", 1.0),
        ("rounding", "nearest"), ("max_examples", 0), ("max_examples", 1.5),
    ],
    ids=lambda v: repr(v)[:16],
)  # fmt: skip
def test_absurd_options_are_refused_with_the_option_named(option, value):
    with pytest.raises(SecAggConfigError) as err:
        SecAggConfig(**{option: value})
    assert err.value.option == option and option in str(err.value)


def test_signed_rounds_need_the_full_holder_set():
    with pytest.raises(SecAggConfigError, match="neighbours=None") as err:
        SecAggConfig(signed=True, neighbours=4)
    assert err.value.option == "signed"


def test_a_threshold_above_the_neighbourhood_is_refused():
    with pytest.raises(SecAggConfigError, match="exceeds the 5 share holders") as err:
        SecAggConfig(threshold=9, neighbours=4)
    assert err.value.option == "threshold"


def test_the_run_check_names_every_bad_secagg_key():
    with pytest.raises(RunConfigError) as err:
        SimSettings(secagg=True, secagg_noise_multiplier=1e300, secagg_clip=3e38, secagg_threshold=5000.0)
    problems = str(err.value).splitlines()
    for key in ("secagg-noise-multiplier=1e+300", "secagg-clip=3e+38", "secagg-threshold=5000.0"):
        assert any(key in p for p in problems), (key, problems)
    with pytest.raises(RunConfigError, match="secagg-threshold=1e"):
        SimSettings(secagg=True, secagg_threshold=1e308)


def test_configurations_at_the_limits_never_overflow():
    """Every corner of the allowed ranges: the grid builds or fails with a ValueError (the round
    then fails cleanly), and a grid that builds encodes and decodes to finite values."""
    update = torch.from_numpy(np.random.default_rng(0).standard_normal(700).astype(np.float32))
    built = 0
    for clip, z, q, growth, wrap in itertools.product(
        (1e-6, MAX_CLIP), (0.0, 1e-3, MAX_NOISE_MULTIPLIER), (0, MAX_QUANTIZER_BITS), (1.0, MAX_GROWTH),
        (MIN_WRAP_PROBABILITY, 0.5),
    ):
        config = SecAggConfig(clip=clip, noise_multiplier=z, bits=q, growth=growth, wrap_probability=wrap)
        for previous in (None, np.full(700, 1e-30), np.full(700, 1e30)):
            try:
                grid = config.scale_rule().grid(700, 2, 1, previous)
            except ValueError as err:
                assert "no modulus" in str(err)
                continue
            built += 1
            assert all(math.isfinite(s) and s > 0 for s in grid.steps) and math.isfinite(grid.noise_variance)
            encoded = [encode_update(update * scale, grid, 5 + i) for i, scale in enumerate((1.0, 1e30))]
            total = (encoded[0].values.astype(np.int64) + encoded[1].values) % grid.modulus
            mean = decode_sum(total.astype(np.uint32), grid, [5, 6], 2 * (1 << 16))
            assert torch.isfinite(mean).all()
    assert built > 20
