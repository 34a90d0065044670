"""A real deployment: ``flower-superlink`` + two ``flower-supernode`` on 127.0.0.1 (insecure), ``flwr run``.

The app in ``tests/deployment_app`` wraps FedAvg in ``QuantizedStrategy`` (QSGD) and adds
``quantize_mod`` to its ClientApp. The test runs it for two rounds, then checks the history the
ServerApp wrote and that training moved the model. Every wait has a timeout and every process the
test started (and their children: SuperExec, ServerApp and ClientApp processes) is stopped by PID
in ``finally``.

Environment: ``FLWR_HOME`` is a temporary directory (the test never touches ``~/.flwr``),
``PYTHONPATH`` puts this checkout's ``fedquant`` first, and
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` makes the SuperLink run the app in the installed
environment instead of ``uv sync``-ing its dependencies (no internet here). In flwr 1.42 the Fleet,
Control and Runtime APIs are served over HTTP on one SuperLink port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
APP_DIR = REPO / "tests" / "deployment_app"
BIN = Path(sys.executable).parent
NUM_NODES = 2
ROUNDS = 2
START_TIMEOUT_S = 60
RUN_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(condition, timeout_s: float, what: str, logs: dict[str, Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}\n{_tails(logs)}")
        time.sleep(0.5)


def _tails(logs: dict[str, Path], lines: int = 15) -> str:
    parts = []
    for name, path in logs.items():
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        parts.append(f"--- {name} ---\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop(processes: list[subprocess.Popen]) -> None:
    """Terminate the processes and all their descendants by PID; kill what is left after 10 s."""
    targets: list[psutil.Process] = []
    for proc in processes:
        try:
            parent = psutil.Process(proc.pid)
            targets += parent.children(recursive=True) + [parent]
        except psutil.NoSuchProcess:
            pass
    for target in targets:
        try:
            target.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(targets, timeout=10)
    for target in alive:
        try:
            target.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def test_two_rounds_over_a_real_superlink(tmp_path):
    link_port = _free_port()
    flwr_home = tmp_path / "flwr"
    flwr_home.mkdir()
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "fq-test"\n\n[superlink.fq-test]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    out_dir = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(flwr_home),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]),
    )
    logs = {"superlink": tmp_path / "superlink.log"}
    processes: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> None:
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as log:
            processes.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))

    try:
        start(
            "superlink", [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link_port)]
        )
        _wait_for(lambda: _port_open(link_port), START_TIMEOUT_S, "the SuperLink port", logs)
        for i in range(NUM_NODES):
            start(
                f"supernode-{i}",
                [
                    str(BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{link_port}",
                    "--port",
                    str(_free_port()),
                    "--node-config",
                    f"partition-id={i} num-partitions={NUM_NODES}",
                ],
            )
        _wait_for(
            lambda: logs["superlink"].read_text().count("Activated node_id") >= NUM_NODES,
            START_TIMEOUT_S,
            "both SuperNodes to connect",
            logs,
        )
        submit = subprocess.run(
            [str(BIN / "flwr"), "run", str(APP_DIR), "fq-test", "--run-config", f'out-dir="{out_dir}"'],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        assert submit.returncode == 0, f"flwr run failed:\n{submit.stdout}\n{submit.stderr}"
        summary_path = out_dir / "summary.json"
        _wait_for(summary_path.exists, RUN_TIMEOUT_S, "the run to finish", logs)

        summary = json.loads(summary_path.read_text())
        rows = json.loads((out_dir / "history.json").read_text())
        assert summary["rounds"] == list(range(1, ROUNDS + 1))
        assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
        cumulative = 0
        for row in rows:
            uplink = row["train/uplink-bytes"]
            cumulative += uplink
            assert row["train/rejected-replies"] == 0
            assert row["train/cumulative-uplink-bytes"] == cumulative
            assert row["train/compression-ratio"] == pytest.approx(row["train/uplink-bytes-dense"] / uplink)
            # QSGD with 4 levels (3 bits a weight) on a model whose 1024 weights are encoded and
            # whose 16 biases are not: far below the dense float32 size.
            assert row["train/compression-ratio"] > 4
            assert row["train/quantization-mse"] > 0
            assert row["train/downlink-bytes"] == row["train/uplink-bytes-dense"]  # float32 model both ways
        assert (out_dir / "history.csv").read_text().startswith("round,")
        assert summary["final-loss"] < 0.95 * summary["initial-loss"], summary
    finally:
        _stop(processes)
    assert all(proc.poll() is not None for proc in processes)
