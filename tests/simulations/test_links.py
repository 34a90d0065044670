"""Uplink speed profiles and the run settings."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from simulations.links import parse_uplink
from simulations.settings import SimSettings


def test_no_profile():
    assert parse_uplink("none") is None and parse_uplink("") is None


def test_fixed_speed_in_bytes_per_second():
    profile = parse_uplink("fixed:mbps=2")
    assert profile(123) == 2e6 / 8 == profile(456)


def test_uniform_draws_are_per_client_seeded_and_in_range():
    profile = parse_uplink("uniform:low=1,high=3", seed=7)
    speeds = [profile.mbps(k) for k in range(500)]
    assert all(1 <= s < 3 for s in speeds)
    assert speeds == [parse_uplink("uniform:low=1,high=3", seed=7).mbps(k) for k in range(500)]
    assert speeds != [parse_uplink("uniform:low=1,high=3", seed=8).mbps(k) for k in range(500)]
    # Mean of 500 U(1,3): sd of the mean = (2/sqrt(12))/sqrt(500) = 0.026; 0.13 is 5 sd.
    assert abs(np.mean(speeds) - 2) < 0.13


def test_partition_id_keys_the_draw_when_known():
    profile = parse_uplink("lognormal:median=2,sigma=1", seed=1)
    profile.client_keys[999] = 5
    assert profile(999) == profile.mbps(5) * 1e6 / 8


def test_lognormal_median():
    profile = parse_uplink("lognormal:median=2,sigma=1", seed=3)
    logs = np.log([profile.mbps(k) for k in range(2001)])
    # The sample median of n normal draws has sd sqrt(pi/2)*sigma/sqrt(n) = 0.028; 0.14 is 5 sd.
    assert abs(np.median(logs) - math.log(2)) < 0.14
    assert 0.9 < np.std(logs) < 1.1  # sd of the sample sd ~ sigma/sqrt(2n) = 0.016


@pytest.mark.parametrize(
    "spec", ["fixed", "fixed:mbps=0", "fixed:speed=3", "uniform:low=3,high=1", "lognormal:median=1", "warp:mbps=1"]
)
def test_bad_profiles(spec):
    with pytest.raises(ValueError):
        parse_uplink(spec)


def test_pyproject_run_config_matches_the_settings_defaults():
    config = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert SimSettings.from_run_config(config) == SimSettings()
    assert sorted(config) == sorted(SimSettings.keys())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"nope": 1}, "unknown run-config key"),
        ({"rounds": 0}, "rounds"),
        ({"fraction-train": 1.5}, "fraction-train"),
        ({"model": "vgg"}, "unknown model"),
        ({"dataset": "imagenet"}, "unknown dataset"),
        ({"rounds": "many"}, "not an int"),
        ({"clip-norm": -1.0}, "clip-norm"),
        ({"min-local-steps": -1}, "min-local-steps"),
    ],
)
def test_bad_settings(config, message):
    with pytest.raises(ValueError, match=message):
        SimSettings.from_run_config(config)
