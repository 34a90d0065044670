"""The run config fails fast: every problem before any round, one line each, and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulations.settings import RunConfigError, SimSettings, check_run_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # The failures of issue 22, each once a 40-line traceback after ~55 s and exit status 0.
        ({"codec": "qsgd:levels=-3"}, ["codec='qsgd:levels=-3'", "'levels' must be >= 1", "got -3"]),
        ({"codec": "nonsense"}, ["codec='nonsense'", "unknown codec", "qsgd", "eden"]),
        ({"upload-deadline-seconds": 0.3}, ["upload-deadline-seconds=0.3", "needs an uplink profile", "uplink="]),
        ({"codecs": "fp32"}, ["unknown run-config key 'codecs'", "did you mean 'codec'?"]),
        ({"rounds": 3.5}, ["rounds=3.5", "not an int"]),
        ({"rounds": True}, ["rounds=True", "not an int"]),
        ({"codec": 16}, ["codec=16", "not a string"]),
        ({"downlink-codec": "ef+qsgd"}, ["downlink-codec='ef+qsgd'", "no 'ef+' downlink codec"]),
        ({"downlink-codec": "ndqsg"}, ["downlink-codec='ndqsg'", "side information"]),
        ({"uplink": "fixed:mbps=-1"}, ["uplink='fixed:mbps=-1'", "positive", "lognormal:median=M"]),
        ({"downlink": "warp:speed=1"}, ["downlink='warp:speed=1'", "unknown uplink profile"]),
        ({"dataset": "synthetic"}, ["model='cnn'", "feature vectors", "logreg or mlp"]),
        ({"learning-rate": float("nan")}, ["learning-rate", "not a finite number"]),
        ({"fraction-train": 0}, ["fraction-train=0.0", "(0, 1]"]),
    ],
)
def test_a_bad_config_names_the_key_the_value_and_what_is_allowed(config, expected):
    with pytest.raises(RunConfigError) as caught:
        check_run_config(config)
    (line,) = caught.value.problems  # one problem, on one line
    assert "\n" not in line
    for piece in expected:
        assert piece in line, (piece, line)


def test_every_problem_is_listed_at_once():
    with pytest.raises(RunConfigError) as caught:
        check_run_config({"codec": "nonsense", "rounds": 0, "uplink": "fixed", "model": "vgg"})
    assert [p.split("=")[0] for p in caught.value.problems] == ["codec", "model", "rounds", "uplink"]
    with pytest.raises(RunConfigError) as caught:
        check_run_config({"codecs": "fp32", "round": 3})
    assert len(caught.value.problems) == 2 and "did you mean 'rounds'?" in caught.value.problems[1]


def test_command_line_strings_are_read_as_the_keys_types():
    settings = check_run_config({}, rounds="7", learning_rate="0.1", overwrite="true", codec="fp32")
    assert (settings.rounds, settings.learning_rate, settings.overwrite) == (7, 0.1, True)
    assert settings.changed() == {"codec": "fp32", "rounds": 7, "learning-rate": 0.1, "overwrite": True}
    assert check_run_config({"rounds": 5.0}).rounds == 5  # an integral float is an int


def test_the_server_refuses_a_bad_config_before_loading_anything(tmp_path):
    from simulations.server_app import run_server

    class NoGrid:  # any use of the grid would fail the test
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) before the config was checked")

    with pytest.raises(RunConfigError, match="did you mean 'codec'"):
        run_server(NoGrid(), {"codecs": "fp32"}, out_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_runner_exits_2_with_one_line_per_problem_and_starts_nothing(capsys):
    import ray

    from simulations.run import main

    code = main(["--run-config", 'codec="qsgd:levels=-3" upload-deadline-seconds=0.3', "-c", 'codecs="fp32"'])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("simulations.run: invalid run config: ") for line in lines)
    assert not ray.is_initialized()


def test_the_runner_checks_a_good_config_and_names_its_folder(capsys):
    from simulations.run import main

    assert main(["--check", "--run-config", 'codec="fp32" rounds=3', "--num-supernodes", "5"]) == 0
    assert "results folder: results/fp32_digits_iid_seed0_rounds=3_5nodes" in capsys.readouterr().out


def test_the_runner_is_a_module_that_exits_with_mains_status():
    # The exit status itself, through the interpreter, as a script sees it.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "simulations.run", "--check", "-c", "rounds=0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2 and "rounds=0" in out.stderr


def test_pyproject_defaults_are_the_settings_defaults():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert config == SimSettings.defaults()
