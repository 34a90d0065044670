"""The run-config keys of the secure options (``secagg-keep``, ``secagg-groups``, ``secagg-signed``):
a bad value is refused before round 1 with its key named, a good one reaches the strategy's
``SecAggConfig`` and changes what the round does.

The app's ServerApp and ClientApp run on the in-process grid of ``tests.flower_fakes`` (no Ray).
"""

from __future__ import annotations

import pytest

from fedquant.secagg.wiring import GRID_PREFIX, GRID_RECORD
from simulations.settings import RunConfigError, SimSettings
from tests.flower_fakes import InProcessGrid

SMALL = {"rounds": 2, "local_epochs": 1, "min_local_steps": 2, "model": "logreg", "fraction_train": 1.0}


def _grid(nodes: int) -> InProcessGrid:
    from simulations.client_app import app as client_app

    return InProcessGrid(client_app, nodes)


BAD = [
    ("secagg-keep", 0.0, "keep must be a float in [0.001, 1]"),
    ("secagg-keep", 1.5, "keep must be a float in [0.001, 1]"),
    ("secagg-keep", "most", "not a number"),
    ("secagg-groups", 0, "groups must be an int in 1..1024"),
    ("secagg-groups", 5000, "groups must be an int in 1..1024"),
    ("secagg-groups", 2.5, "not an int"),
    ("secagg-signed", "yes", "not a boolean"),
]


@pytest.mark.parametrize(("key", "value", "why"), BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_a_bad_value_is_refused_by_the_check_naming_the_key(key, value, why, capsys):
    from simulations.run import main

    text = f'{key}="{value}"' if isinstance(value, str) else f"{key}={value}"
    assert main(["--check", "--num-supernodes", "20", "-c", f"secagg=true fraction-train=1.0 {text}"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if f"{key}=" in line)
    assert why in line, err


NUMBERS = BAD[:2] + BAD[3:5]  # values of the right type, out of range


@pytest.mark.parametrize(("key", "value", "why"), NUMBERS, ids=[f"{k}={v}" for k, v, _ in NUMBERS])
def test_a_bad_value_is_refused_by_the_server_before_round_1(key, value, why, tmp_path):
    from simulations.server_app import run_server

    grid = _grid(6)
    with pytest.raises(RunConfigError, match=key) as err:
        run_server(grid, {"secagg": True, key: value, **{k.replace("_", "-"): v for k, v in SMALL.items()}},
                   out_dir=str(tmp_path))  # fmt: skip
    assert any(why in p for p in err.value.problems)
    assert not grid.sent  # nothing reached a client


def test_signed_with_a_neighbourhood_is_refused_naming_both_keys():
    with pytest.raises(RunConfigError) as err:
        SimSettings(secagg=True, secagg_signed=True, secagg_neighbours=4)
    (problem,) = err.value.problems
    assert problem.startswith("secagg-signed=True:") and "secagg-neighbours=0" in problem


def test_signed_rounds_are_refused_in_the_simulation_engine_before_ray(tmp_path, capsys):
    import ray

    from simulations.run import main
    from simulations.sweep import run_sweep

    assert main(["--check", "--num-supernodes", "20", "-c", "secagg=true secagg-signed=true"]) == 2
    assert "secagg-signed=True: signed rounds need every SuperNode" in capsys.readouterr().err
    with pytest.raises(RunConfigError, match="secagg-identity-file"):
        run_sweep(["fp32", "secagg:signed=true"], out=tmp_path, seeds=(0,), num_supernodes=6, **SMALL)
    assert not ray.is_initialized() and not list(tmp_path.iterdir())


def test_groups_too_small_for_the_threshold_are_refused_before_round_1(capsys):
    from simulations.run import main

    # 6 sampled clients: one group of 6 holders meets a threshold of 4, two groups of 3 do not.
    assert main(["--check", "--num-supernodes", "6", "-c", "secagg=true fraction-train=1.0 secagg-threshold=4"]) == 0
    capsys.readouterr()
    code = main(["--check", "--num-supernodes", "6", "-c",
                 "secagg=true fraction-train=1.0 secagg-threshold=4 secagg-groups=2"])  # fmt: skip
    assert code == 2 and "threshold 4 exceeds the 3 share holders" in capsys.readouterr().err


def test_good_values_reach_the_strategys_config_and_change_the_round(tmp_path, monkeypatch, no_figures):
    import simulations.server_app as server_app

    used = []

    class Spy(server_app.RecordingStrategy):
        def __init__(self, *args, **kwargs):
            used.append(kwargs["secure_aggregation"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(server_app, "RecordingStrategy", Spy)
    grid = _grid(6)
    config = {"secagg": True, "secagg-keep": 0.4, "secagg-groups": 2}
    history = server_app.run_server(grid, config, out_dir=str(tmp_path), **SMALL)
    (secure,) = used
    assert (secure.keep, secure.groups, secure.signed) == (0.4, 2, False)
    collect = [m.content.config_records[GRID_RECORD] for m in grid.sent if GRID_RECORD in m.content.config_records]
    assert len(collect) == 2 * 6 and {c[GRID_PREFIX + "keep"] for c in collect} == {0.4}
    for row in history.rounds[1:]:
        assert row["secagg-failed"] == 0 and row["secagg-groups"] == 2 and row["secagg-survivors"] == 6


def test_signed_rounds_run_through_the_app_where_nodes_hold_identities(tmp_path, no_figures):
    from fedquant.clients.secure import DIRECTORY_FILE, IDENTITY_FILE
    from fedquant.secagg.crypto import identity_public
    from simulations.server_app import run_server

    grid = _grid(4)  # a deployment's nodes, each started with its identity and the directory
    keys = {node: bytes([node % 256]) * 32 for node in grid.contexts}
    directory = tmp_path / "directory.txt"
    directory.write_text("".join(f"{n} {identity_public(k).hex()}\n" for n, k in keys.items()))
    for node, context in grid.contexts.items():
        (tmp_path / f"{node}.key").write_text(keys[node].hex())
        context.node_config.update({IDENTITY_FILE: str(tmp_path / f"{node}.key"), DIRECTORY_FILE: str(directory)})
    history = run_server(grid, {"secagg": True, "secagg-signed": True}, out_dir=str(tmp_path / "runs"), **SMALL)
    for row in history.rounds[1:]:
        assert row["secagg-failed"] == 0 and row["secagg-survivors"] == 4
        assert row["secagg-uplink-bytes-consistency"] > 0  # the signed round's extra stage ran
