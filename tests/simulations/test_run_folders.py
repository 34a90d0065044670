"""Runs are never overwritten and never lost: one folder per run, the history rewritten every round."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.history import RunHistory, load_history, reserve_run_dir, run_dir_name
from simulations.settings import SimSettings

ROOT = Path(__file__).resolve().parents[2]
# Short runs on the in-process grid (real ClientApp, no Ray): logistic regression, a few steps.
QUICK = {"model": "logreg", "local_epochs": 1, "min_local_steps": 2, "codec": "fp32"}


@pytest.mark.parametrize(
    "change",
    [
        {"downlink_codec": "qsgd:levels=16"},
        {"uplink": "fixed:mbps=2"},
        {"uplink": "fixed:mbps=2", "upload_deadline_seconds": 0.3},
        {"rounds": 5},
        {"learning_rate": 0.1},
        {"min_numel": 1024},
    ],
)
def test_settings_that_once_shared_a_folder_get_their_own(change):
    # Once, only codec, dataset, partitioning and seed named the folder.
    base = SimSettings()
    assert run_dir_name(base.replace(**change)) != run_dir_name(base)


def test_the_federation_size_and_only_changed_settings_are_in_the_name():
    assert run_dir_name(SimSettings(), 2) == "eden-bits=2_digits_iid_seed0_2nodes"
    assert run_dir_name(SimSettings(), 20) != run_dir_name(SimSettings(), 2)
    assert run_dir_name(SimSettings(rounds=5, out_dir="elsewhere")) == "eden-bits=2_digits_iid_seed0_rounds=5"
    assert run_dir_name(SimSettings(run_name="mine")) == "mine"
    busy = SimSettings(
        codec="rht+dqsg:levels=6,coding=entropy",
        uplink="lognormal:median=2,sigma=1",
        downlink="lognormal:median=8,sigma=1",
        downlink_codec="qsgd:levels=16,coding=entropy",
        upload_deadline_seconds=0.25,
        learning_rate=0.02,
        rounds=40,
    )
    long = run_dir_name(busy)
    assert len(long) <= 150


def test_a_secure_run_is_named_by_what_its_replies_carry():
    # Under secure aggregation the uplink codec is unused; naming the run after it misleads.
    secure = SimSettings(secagg=True, secagg_dropouts=2)
    assert run_dir_name(secure, 20) == "secagg_digits_iid_seed0_secagg-dropouts=2_20nodes"
    assert secure.uplink_name == "secagg" and SimSettings().uplink_name == SimSettings().codec


def test_an_existing_folder_is_never_reused_unless_asked(tmp_path):
    first = reserve_run_dir(tmp_path, "run")
    (first / "history.json").write_text("{}")
    second, third = reserve_run_dir(tmp_path, "run"), reserve_run_dir(tmp_path, "run")
    assert [p.name for p in (first, second, third)] == ["run", "run-2", "run-3"]
    assert (first / "history.json").read_text() == "{}"
    assert reserve_run_dir(tmp_path, "run", overwrite=True) == first


def test_two_runs_with_the_same_settings_keep_both_histories(tmp_path, no_figures):
    from simulations.client_app import app as client_app
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    runs = [run_server(InProcessGrid(client_app, 2), {}, rounds=1, out_dir=str(tmp_path), **QUICK) for _ in range(2)]
    name = "fp32_digits_iid_seed0_model=logreg_rounds=1_local-epochs=1_min-local-steps=2_2nodes"
    assert [r.folder.name for r in runs] == [name, f"{name}-2"]
    for run in runs:
        saved = load_history(run.folder)
        assert saved["status"] == "finished" and saved["num-nodes"] == 2 and len(saved["rounds"]) == 2


def test_a_failed_run_keeps_its_finished_rounds_and_says_why(tmp_path):
    from simulations.client_app import app as client_app
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    class DiesInRound3(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if any(m.content.config_records.get("config", {}).get("server-round") == 3 for m in messages):
                raise ConnectionError("the SuperLink went away")
            return super().send_and_receive(messages, timeout=timeout)

    started = []
    with pytest.raises(ConnectionError):
        run_server(DiesInRound3(client_app, 2), {}, rounds=5, out_dir=str(tmp_path), on_start=started.append, **QUICK)
    saved = load_history(started[0].folder)
    assert saved["status"] == "failed" and "the SuperLink went away" in saved["error"]
    assert [r["round"] for r in saved["rounds"]] == [0, 1, 2]
    with (started[0].folder / "history.csv").open() as fh:
        assert [row["round"] for row in csv.DictReader(fh)] == ["0", "1", "2"]
    assert (started[0].folder / "history.png").stat().st_size > 0


KILLED_RUN = """
import sys
from pathlib import Path
import simulations.history
simulations.history.plot_run = lambda rows, path, title="": Path(path).write_bytes(b"figure")  # as no_figures
from simulations.client_app import app
from simulations.server_app import run_server
from tests.flower_fakes import InProcessGrid
run_server(InProcessGrid(app, 2), {}, rounds=200, out_dir=sys.argv[1], run_name="killed",
           model="logreg", local_epochs=1, min_local_steps=2, codec="qsgd")
"""


def test_a_killed_run_keeps_every_round_it_finished(tmp_path):
    # SIGKILL, as `flwr stop` or an out-of-memory kill leave a run: no handler runs.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(tmp_path)], cwd=ROOT, env=env)
    path = tmp_path / "killed" / "history.json"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and len(json.loads(path.read_text())["rounds"]) >= 4:  # never half a file
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    saved = load_history(tmp_path / "killed")
    assert saved["status"] == "running" and len(saved["rounds"]) >= 4
    with (tmp_path / "killed" / "history.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) >= len(saved["rounds"]) - 1 and rows[0]["round"] == "0"  # the CSV may be one round ahead
    assert {"round", "accuracy", "loss", "uplink-bytes", "compression-ratio"} <= set(rows[0])


def test_a_recorded_end_is_not_overwritten():
    history = RunHistory(SimSettings())
    history.finish("stopped", "KeyboardInterrupt")
    history.finish("failed", "late")
    assert (history.status, history.error) == ("stopped", "KeyboardInterrupt")
    with pytest.raises(ValueError):
        history.finish("done")


@pytest.mark.slow
def test_ctrl_c_interrupts_python_m_simulations_run_and_keeps_its_rounds(tmp_path):
    from tests.timeouts import scaled

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    config = 'rounds=100 model="logreg" codec="fp32" local-epochs=1 min-local-steps=2 run-name="ctrl-c"'
    config += f' out-dir="{tmp_path}"'
    proc = subprocess.Popen([sys.executable, "-m", "simulations.run", "--num-cpus", "1", "-c", config], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    path = tmp_path / "ctrl-c" / "history.json"
    deadline = time.monotonic() + scaled(300)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and len(json.loads(path.read_text())["rounds"]) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    saved = load_history(tmp_path / "ctrl-c")
    assert saved["status"] == "interrupted" and len(saved["rounds"]) >= 3
    assert saved["last-round"] == len(saved["rounds"]) - 1
    assert "interrupted (Ctrl-C)" in err and "says interrupted after round" in err
