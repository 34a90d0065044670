"""A run a user can trust: what cannot train is refused before round 1, a run that applied no update
fails, interrupts and stops leave honest records, stored results are never replaced silently, and
the history counts the bytes of the messages beside their payload (issue 43).

The fast tests run the app's ServerApp and ClientApp on the in-process grid of
``tests.flower_fakes`` (no Ray); the slow ones run ``python -m simulations.sweep`` and
``python -m simulations.run`` as a user does.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.history import RunHistory, end_active_runs, load_history
from simulations.settings import CLIENT_KEYS, RunConfigError, SimSettings
from tests.flower_fakes import InProcessGrid

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"rounds": 2, "local_epochs": 1, "min_local_steps": 2, "model": "logreg"}


def _grid(nodes: int) -> InProcessGrid:
    from simulations.client_app import app as client_app

    return InProcessGrid(client_app, nodes)


def _trained(grid: InProcessGrid) -> list:
    return [m for m in grid.sent if m.metadata.message_type == "train"]


def test_check_refuses_a_secure_run_that_the_sampled_clients_cannot_complete(capsys):
    from simulations.run import main

    # Flower's default federation: 2 supernodes, 1 sampled per round, no second share holder.
    assert main(["--check", "-c", "secagg=true rounds=3"]) == 2
    err = capsys.readouterr().err
    assert "threshold 2 exceeds the 1 share holders" in err and "at least 4 supernodes" in err
    assert main(["--check", "-c", "secagg=true rounds=3", "--num-supernodes", "4"]) == 0
    assert main(["--check", "-c", "secagg=true secagg-threshold=5", "--num-supernodes", "8"]) == 2  # 4 sampled
    assert "threshold 5 exceeds the 4 share holders" in capsys.readouterr().err


def test_check_refuses_a_dataset_that_cannot_be_loaded_in_seconds(capsys, monkeypatch, tmp_path):
    from simulations.feasibility import dataset_problem
    from simulations.run import main

    t0 = time.perf_counter()
    assert main(["--check", "-c", 'dataset="hf:/nonexistent"']) == 2
    assert "there is no folder '/nonexistent'" in capsys.readouterr().err
    # A Hub name neither cached nor reachable: one answer, not the datasets library's retries.
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "not in the local Hugging Face cache" in dataset_problem("hf:someone/missing-dataset")
    assert time.perf_counter() - t0 < 10
    (tmp_path / "hub" / "datasets--someone--cached").mkdir(parents=True)
    assert dataset_problem("hf:someone/cached") is None
    assert dataset_problem("digits") is None and dataset_problem("synthetic") is None


@pytest.mark.parametrize(
    ("config", "reason"),
    [({"secagg": True}, "threshold 2 exceeds the 1 share holders"), ({"dataset": "hf:/nonexistent"}, "no folder")],
)
def test_the_server_refuses_before_round_1_and_the_folder_says_failed(tmp_path, config, reason):
    from simulations.server_app import RunRefused, run_server

    grid = _grid(2)
    with pytest.raises(RunRefused, match=reason):
        run_server(grid, config, out_dir=str(tmp_path), run_name="refused")
    assert not _trained(grid)
    saved = load_history(tmp_path / "refused")
    assert saved["status"] == "failed" and reason in saved["error"] and saved["last-round"] == 0


def test_a_run_that_applies_no_update_fails_with_the_reason(tmp_path, no_figures):
    from simulations.server_app import NoUpdateApplied, run_server

    # Every client drops after sharing its keys (fault injection): no secure round can finish.
    config = {"secagg": True, "fraction_train": 1.0, "secagg_dropouts": 4, **SMALL}
    with pytest.raises(NoUpdateApplied, match="no round applied an update"):
        run_server(_grid(4), {}, out_dir=str(tmp_path), run_name="none", **config)
    saved = load_history(tmp_path / "none")
    assert saved["status"] == "failed" and "round 1: secure aggregation failed" in saved["error"]
    assert saved["last-round"] == 2 and not (tmp_path / "none" / "model.pt").exists()


def test_rows_count_message_bytes_and_failures_clients_get_only_their_keys_and_the_model_is_saved(tmp_path, no_figures):
    import torch

    from simulations.server_app import run_server

    grid = _grid(4)
    history = run_server(grid, {"codec": "qsgd:levels=4"}, out_dir=str(tmp_path), run_name="bytes", **SMALL)
    for row in history.rounds[1:]:
        assert row["train-messages"] == 2 and row["node-failures"] == 0
        # Flower's serialisation carries the payload and more (metadata, configs, metrics, headers).
        assert row["uplink-bytes"] < row["message-bytes-up"] < row["uplink-bytes"] + 2 * 4096
        assert row["downlink-bytes"] < row["message-bytes-down"] < row["downlink-bytes"] + 2 * 4096
    sent = set(_trained(grid)[0].content.config_records["config"])
    assert sent - {k for k in sent if k.startswith("fedquant.")} == {*CLIENT_KEYS, "server-round", "federation-id"}
    state = torch.load(tmp_path / "bytes" / "model.pt")
    assert set(state) == {"fc.weight", "fc.bias"} or len(state) > 0
    assert all(torch.isfinite(v).all() for v in state.values())


class _WireGrid(InProcessGrid):
    """InProcessGrid that sizes every request and reply as it carries them (before anyone edits
    them in place): (round, stage, request bytes, reply bytes)."""

    def __init__(self, app, nodes: int) -> None:
        super().__init__(app, nodes)
        self.carried: list[tuple[int, str, int, int]] = []

    def send_and_receive(self, messages, *, timeout=None):
        from fedquant.metrics import message_bytes
        from fedquant.secagg.messages import RECORD

        messages = list(messages)
        # Messages outside a secure round (the app's partition query) have no protocol record.
        asked = [(dict(m.content.config_records.get(RECORD, {"round": 0, "stage": m.metadata.message_type})),
                  message_bytes(m)) for m in messages]  # fmt: skip
        replies = super().send_and_receive(messages, timeout=timeout)
        for (record, size), reply in zip(asked, replies):
            self.carried.append((int(record["round"]), record["stage"], size, message_bytes(reply)))
        return replies


def test_a_secure_round_counts_every_stage_s_messages_both_ways(tmp_path, no_figures):
    from simulations.client_app import app as client_app
    from simulations.server_app import run_server

    grid = _WireGrid(client_app, 5)
    config = {"secagg": True, "fraction_train": 1.0, "secagg_dropouts": 1, **SMALL}  # 1 error reply at collect
    history = run_server(grid, {}, out_dir=str(tmp_path), run_name="secure-bytes", **config)
    for row in history.rounds[1:]:
        carried = [c for c in grid.carried if c[0] == row["round"]]
        assert {stage for _, stage, _, _ in carried} == {"advertise", "share-keys", "collect", "unmask"}
        up = sum(reply for *_, reply in carried)  # every reply of every stage, error replies included
        down = sum(request for _, _, request, _ in carried)
        assert row["message-bytes-up"] == up > row["uplink-bytes"] > row["secagg-uplink-bytes-collect"]
        assert row["message-bytes-down"] == down > row["downlink-bytes"] + row["secagg-downlink-bytes"]
        for way, total in (("up", up), ("down", down)):
            split = [v for k, v in row.items() if k.startswith(f"secagg-message-bytes-{way}-")]
            assert len(split) == 4 and all(v > 0 for v in split) and sum(split) == total


def test_messages_bytes_counts_a_shared_model_once_per_message():
    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

    from fedquant.metrics import message_bytes, messages_bytes

    content = RecordDict({"arrays": ArrayRecord([np.ones(1000, np.float32)]), "config": ConfigRecord({"a": 1})})
    messages = [Message(content=content, dst_node_id=n, message_type="train") for n in (1, 2, 3)]
    assert messages_bytes(messages) == sum(message_bytes(m) for m in messages) > 3 * 4000


def test_overwrite_with_other_settings_refuses_and_keeps_the_folder(tmp_path):
    from simulations.server_app import run_server

    folder = tmp_path / "same-name"
    RunHistory(SimSettings(rounds=8), rounds=[{"round": 0, "accuracy": 0.1}]).write(folder)
    before = (folder / "history.json").read_bytes()

    class TwoNodes:
        def get_node_ids(self):
            return [1, 2]

    with pytest.raises(RunConfigError, match="rounds: 8 there, 4 now"):
        run_server(TwoNodes(), {"rounds": 4, "overwrite": True, "run-name": "same-name", "out-dir": str(tmp_path)})
    assert (folder / "history.json").read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_a_sweep_with_other_settings_refuses_before_ray_and_keeps_the_records(tmp_path):
    import ray

    from simulations.sweep import RunStore, arm_settings, run_sweep

    federation = {"num-supernodes": 4, "num-cpus": 1, "num-gpus": 0.0}
    base = SimSettings.from_run_config({}, out_dir=str(tmp_path / "runs"), **{**SMALL, "rounds": 8})
    store = RunStore(tmp_path)
    store.save("fp32", 0, arm_settings(base, "fp32", seed=0), federation, [{"round": 0, "accuracy": 0.1}], 1.0)
    before = store.path("fp32", 0).read_bytes()
    with pytest.raises(RunConfigError, match="rounds: 8 stored, 4 now"):
        run_sweep(["fp32"], out=tmp_path, seeds=(0,), num_supernodes=4, **{**SMALL, "rounds": 4})
    assert store.path("fp32", 0).read_bytes() == before and not ray.is_initialized()
    assert store.conflict("fp32", 0, arm_settings(base, "fp32", seed=0), federation) is None  # same: reused


def test_an_interrupt_records_interrupted_with_the_last_round(tmp_path):
    history = RunHistory(SimSettings(), folder=tmp_path / "run").track()
    finished = RunHistory(SimSettings(), folder=tmp_path / "done").track()
    for r in range(3):
        history.add_round({"round": r, "accuracy": 0.5})
    finished.finish("finished")
    assert end_active_runs("interrupted", "KeyboardInterrupt") == [history]
    saved = load_history(tmp_path / "run")
    assert (saved["status"], saved["last-round"]) == ("interrupted", 2)
    assert load_history(tmp_path / "done")["status"] == "finished"


STOPPED_BY_FLOWER = """
import os, signal, sys, time
from flwr.supercore.exit import register_signal_handlers
from flwr.supercore.telemetry import EventType
from simulations.history import RunHistory
from simulations.server_app import _record_stops_on_exit
from simulations.settings import SimSettings

register_signal_handlers(event_type=EventType.FLWR_SIMULATION_RUN_LEAVE, exit_message="Task stopped by user.")
history = RunHistory(SimSettings(), folder=sys.argv[1]).track()
for r in range(3):
    history.add_round({"round": r, "accuracy": 0.5})
history.save()
_record_stops_on_exit()
os.kill(os.getpid(), signal.SIGINT)  # what flwr 1.42's app process does when the SuperLink refuses a stopped run
time.sleep(30)
"""


@pytest.mark.slow  # a subprocess that imports flwr and torch: seconds
def test_flower_ending_the_process_records_stopped(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", STOPPED_BY_FLOWER, str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    saved = load_history(tmp_path / "run")
    assert (saved["status"], saved["last-round"]) == ("stopped", 2), done.stderr[-2000:]


@pytest.mark.slow
def test_one_ctrl_c_ends_a_sweep_at_once_and_the_rerun_replaces_the_interrupted_run(tmp_path):
    from tests.timeouts import scaled

    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDQUANT_KERNELS": "twin"}
    command = [sys.executable, "-m", "simulations.sweep", "--codecs", "fp32", "--num-supernodes", "2",
               "--rounds", "8", "--out", str(tmp_path), "--set", "model=logreg", "--set", "local-epochs=1",
               "--set", "min-local-steps=2"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    path = tmp_path / "runs" / "fp32_seed0" / "history.json"
    deadline = time.monotonic() + scaled(300)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and len(json.loads(path.read_text())["rounds"]) >= 2:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=scaled(60))
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and took < 10, (took, err[-2000:])
    saved = load_history(path.parent)
    assert saved["status"] == "interrupted" and 1 <= saved["last-round"] < 8
    # The same command again: the interrupted run's folder is replaced (not a -2 beside it) and finished.
    rerun = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "replacing the unfinished run" in rerun.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["fp32_seed0"]
    assert load_history(path.parent)["status"] == "finished"


@pytest.mark.slow
def test_python_m_simulations_run_exits_1_for_a_run_that_applied_no_update(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDQUANT_KERNELS": "twin"}
    config = (f'secagg=true fraction-train=1.0 secagg-dropouts=4 rounds=2 model="logreg" local-epochs=1 '
              f'min-local-steps=2 run-name="none" out-dir="{tmp_path}"')  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "simulations.run", "--num-supernodes", "4", "--num-cpus", "1",
                           "-c", config], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 1 and "no round applied an update" in done.stderr, done.stderr[-2000:]
    assert load_history(tmp_path / "none")["status"] == "failed"


def test_the_sweep_table_gives_message_bytes_beside_payload_and_an_honest_last_k(tmp_path):
    from simulations.sweep import write_results
    from simulations.sweep_stats import summarize_run

    rows = [{"round": 0, "accuracy": 0.1}]
    rows += [{"round": r, "accuracy": 0.5, "uplink-bytes": 1000, "message-bytes-up": 4000, "bits-per-param": 2.0}
             for r in (1, 2, 3)]  # fmt: skip
    run = summarize_run("fp32", 0, rows, last_k=5, target=None)
    assert run.message_bytes == 12000 and run.uplink_bytes == 3000
    text = write_results([run], {}, None, {}, tmp_path, title="t", last_k=5).paths["md"].read_text()
    assert "| uplink MB | uplink message MB |" in text and "| 0.003 | 0.012 |" in text
    assert "last-3 accuracy" in text and "last-5" not in text  # three rounds: a last-3 mean
    # A secure round stored before its other stages were counted: no message bytes, not a low one.
    secure = [{**r, "secagg-sampled": 2} for r in rows]
    assert math.isnan(summarize_run("secagg", 0, secure, last_k=5, target=None).message_bytes)
    counted = [{**r, "secagg-message-bytes-up-collect": 1} for r in secure]
    assert summarize_run("secagg", 0, counted, last_k=5, target=None).message_bytes == 12000


def test_log_axes_label_plain_numbers_that_do_not_collide():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from simulations.plots import readable_log_axis

    # (0.011, 0.09): matplotlib labels 10^-2 and four minor ticks, which collide
    for low, high in ((0.011, 0.09), (0.012, 0.036), (0.004, 0.9), (1e-3, 40.0)):
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        ax.plot([low, (low * high) ** 0.5, high], [0.1, 0.5, 0.9])
        ax.set_xscale("log")
        readable_log_axis(ax.xaxis)
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        labels = [t for t in ax.get_xticklabels(which="both") if t.get_text() and t.get_visible()]
        lo, hi = ax.get_xlim()
        labels = [t for t in labels if lo <= t.get_position()[0] <= hi]
        boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
        assert len(boxes) >= 2, (low, high)
        assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), (low, high, [t.get_text() for t in labels])
        assert all("10^" not in t.get_text() and "times" not in t.get_text() for t in labels)


def test_a_sweep_refuses_an_arm_that_cannot_train_on_its_federation_before_ray(tmp_path):
    import ray

    from simulations.sweep import run_sweep

    with pytest.raises(RunConfigError, match="threshold 2 exceeds the 1 share holders"):
        run_sweep(["fp32", "secagg"], out=tmp_path, seeds=(0,), num_supernodes=2, **SMALL)
    assert not ray.is_initialized() and not list(tmp_path.iterdir())
