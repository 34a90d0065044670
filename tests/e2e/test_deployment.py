"""A real deployment: ``flower-superlink`` + two ``flower-supernode`` on 127.0.0.1 (insecure), ``flwr run``.

The app in ``tests/deployment_app`` wraps FedAvg in ``QuantizedStrategy`` (QSGD) and adds
``quantize_mod`` to its ClientApp. The test runs it for two rounds, then checks the history the
ServerApp wrote, that training moved the model, and that fedquant's ``uplink-bytes`` and
``downlink-bytes`` reconcile with the SuperLink's own traffic counter for the run. Every wait has
a timeout and every process the test started (and their children: SuperExec, ServerApp and
ClientApp processes) is stopped by PID in ``finally``.

Environment: ``FLWR_HOME`` is a temporary directory (the test never touches ``~/.flwr``),
``PYTHONPATH`` puts this checkout's ``fedquant`` first, and
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` makes the SuperLink run the app in the installed
environment instead of ``uv sync``-ing its dependencies (no internet here). In flwr 1.42 the Fleet,
Control and Runtime APIs are served over HTTP on one SuperLink port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.local_processes import free_port, port_open, stop
from tests.timeouts import scaled, wait_while_progressing

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
APP_DIR = REPO / "tests" / "deployment_app"
BIN = Path(sys.executable).parent
NUM_NODES = 2
ROUNDS = 2
# Idle-machine limits; every wait scales them with the load (tests/timeouts.py).
START_TIMEOUT_S = 60
RUN_TIMEOUT_S = 300


def _reconcile_bytes(traffic: dict, framed: dict, rows: list[dict]) -> None:
    """fedquant's byte counts against the SuperLink's traffic counter of the run (``flwr ls --format json``).

    The SuperLink counts its Fleet API: inbound = every object the SuperNodes push (the replies,
    serialised by Flower) plus the PushMessages / PullMessages request protobufs; outbound = every
    object the SuperNodes pull (the train messages, once per node) plus the PullMessages /
    PushMessages response protobufs. fedquant's ``uplink-bytes`` / ``downlink-bytes`` count only
    the ArrayRecords' ``count_bytes()`` (array data with their ``.npy`` headers, plus keys). Between
    the two sits Flower's framing, which does not grow with the payload:

    - object framing (``framed-*-bytes - *link-bytes``): each object's ``type|children|length``
      header, the Message metadata, the RecordDict/ConfigRecord/MetricRecord objects (the train
      messages also carry fedquant's codec spec and seed), each Array's dtype/shape/stype fields;
      measured 1.28 kB per message in both directions;
    - RPC framing (``counter - framed-*-bytes``): message metadata and the object tree (64-hex
      object ids) in the request/response protobufs, session ids; measured 0.78 kB per reply
      (inbound) and 1.32 kB per train message (outbound).

    Tolerance: each framing at most 2 kB per message, and never negative (every payload byte is counted).
    """
    per_message = 2048
    replies = sum(f["replies"] for f in framed.values())
    sent = sum(f["train-messages"] for f in framed.values())
    uplink = sum(row["train/uplink-bytes"] for row in rows)
    downlink = sum(row["train/downlink-bytes"] for row in rows)
    framed_up = sum(f["framed-uplink-bytes"] for f in framed.values())
    framed_down = sum(f["framed-downlink-bytes"] for f in framed.values())
    assert replies == sent == NUM_NODES * ROUNDS
    assert 0 <= framed_up - uplink <= per_message * replies, (uplink, framed_up)
    assert 0 <= traffic["inbound-bytes"] - framed_up <= per_message * replies, (framed_up, traffic)
    assert 0 <= framed_down - downlink <= per_message * sent, (downlink, framed_down)
    assert 0 <= traffic["outbound-bytes"] - framed_down <= per_message * sent, (framed_down, traffic)


class Deployment:
    """A SuperLink and ``NUM_NODES`` SuperNodes on 127.0.0.1; :meth:`run` submits the app once."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.link_port = free_port()
        flwr_home = tmp_path / "flwr"
        flwr_home.mkdir()
        (flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "fq-test"\n\n[superlink.fq-test]\naddress = "127.0.0.1:{self.link_port}"\n'
            "insecure = true\n"
        )
        self.env = dict(os.environ)
        self.env.update(
            FLWR_HOME=str(flwr_home),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), self.env.get("PYTHONPATH")])),
            FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
            PATH=os.pathsep.join([str(BIN), self.env.get("PATH", "")]),
        )
        self.logs = {"superlink": tmp_path / "superlink.log"}
        self.processes: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str]) -> None:
        self.logs[name] = self.tmp_path / f"{name}.log"
        with self.logs[name].open("w") as log:
            self.processes.append(
                subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp_path)
            )

    def start(self) -> None:
        port = self.link_port
        self._start(
            "superlink", [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port)]
        )
        wait_while_progressing(lambda: port_open(port), START_TIMEOUT_S, "the SuperLink port", self.logs)
        for i in range(NUM_NODES):
            self._start(
                f"supernode-{i}",
                [
                    str(BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    f"partition-id={i} num-partitions={NUM_NODES}",
                ],
            )
        wait_while_progressing(
            lambda: self.logs["superlink"].read_text().count("Activated node_id") >= NUM_NODES,
            START_TIMEOUT_S,
            "both SuperNodes to connect",
            self.logs,
        )

    def flwr(self, *args: str) -> subprocess.CompletedProcess:
        """``flwr <args>`` against this SuperLink; fails the test on a non-zero exit."""
        done = subprocess.run(
            [str(BIN / "flwr"), *args],
            env=self.env,
            cwd=self.tmp_path,
            capture_output=True,
            text=True,
            timeout=scaled(START_TIMEOUT_S),
        )
        assert done.returncode == 0, f"flwr {args[0]} failed:\n{done.stdout}\n{done.stderr}"
        return done

    def run(self, name: str, run_config: str = "") -> tuple[dict, list[dict], Path]:
        """Submit the app, wait for its summary; the summary, the history rows and the out dir."""
        out_dir = self.tmp_path / name
        self.flwr("run", str(APP_DIR), "fq-test", "--run-config", f'out-dir="{out_dir}" {run_config}'.strip())
        summary_path = out_dir / "summary.json"
        wait_while_progressing(summary_path.exists, RUN_TIMEOUT_S, f"the {name} run to finish", self.logs)
        summary = json.loads(summary_path.read_text())
        rows = json.loads((out_dir / "history.json").read_text())
        assert summary["rounds"] == list(range(1, ROUNDS + 1))
        assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
        assert summary["final-loss"] < 0.95 * summary["initial-loss"], summary
        return summary, rows, out_dir

    def shutdown(self) -> None:
        stop(proc.pid for proc in self.processes)
        assert all(proc.poll() is not None for proc in self.processes)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One SuperLink and its SuperNodes for every test of this module (start-up costs tens of seconds)."""
    running = Deployment(tmp_path_factory.mktemp("deployment"))
    try:
        running.start()
        yield running
    finally:
        running.shutdown()


def test_two_rounds_over_a_real_superlink(deployment):
    summary, rows, out_dir = deployment.run("plain")
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
    listing = deployment.flwr("ls", "fq-test", "--run-id", str(summary["run-id"]), "--format", "json")
    traffic = json.loads(listing.stdout)["runs"][0]["network-traffic"]
    _reconcile_bytes(traffic, summary["framed"], rows)


def test_two_secure_rounds_over_a_real_superlink(deployment):
    """SecAgg+ over Flower's real transport: four message stages per round, client state in ``Context.state``."""
    summary, rows, _ = deployment.run("secure", "secagg=true")
    numel = 64 * 16 + 16  # fc.weight and fc.bias; rht's blocks (512, 512, 16) add no padding
    for row in rows:
        assert row["train/secagg-failed"] == 0, row
        assert row["train/secagg-survivors"] == NUM_NODES
        assert row["train/secagg-dropped"] == 0
        bits = row["train/secagg-bits"]
        assert bits >= 2 + 1  # quantizer bits + ceil(log2 2) at least
        # The masked input is ceil(D b / 8) bytes per client plus its record's keys and headers.
        masked = row["train/secagg-uplink-bytes-collect"] / NUM_NODES
        assert -(-numel * bits // 8) <= masked <= -(-numel * bits // 8) + 1024, (masked, bits)
        for stage in ("advertise", "share-keys", "unmask"):
            assert row[f"train/secagg-uplink-bytes-{stage}"] > 0, stage
    # Flower's loop sent one train message (the collect request) per node and round, and got one reply each.
    assert all(f["replies"] == f["train-messages"] == NUM_NODES for f in summary["framed"].values())


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_flwr_stop_leaves_the_simulation_apps_run_folder_stopped(deployment):
    """The repository's own app (simulations/) on the real SuperLink: ``flwr stop`` mid-run, then its folder."""
    out_dir = deployment.tmp_path / "stopped"
    config = (f'out-dir="{out_dir}" run-name="stop" rounds=500 model="logreg" codec="fp32" local-epochs=1 '
              "min-local-steps=2")  # fmt: skip
    done = deployment.flwr("run", str(REPO), "fq-test", "--format", "json", "--run-config", config)
    run_id = json.loads(done.stdout[done.stdout.index("{") :])["run-id"]
    history = out_dir / "stop" / "history.json"
    wait_while_progressing(lambda: (_read_json(history) or {}).get("last-round", 0) >= 1, RUN_TIMEOUT_S,
                           "the simulation app's first round", deployment.logs)  # fmt: skip
    deployment.flwr("stop", str(run_id), "fq-test")
    wait_while_progressing(lambda: (_read_json(history) or {}).get("status") != "running", START_TIMEOUT_S,
                           "the stopped run's folder to say so", deployment.logs)  # fmt: skip
    saved = _read_json(history)
    assert saved["status"] == "stopped" and 1 <= saved["last-round"] < 500, (saved["status"], saved["error"])
    listing = deployment.flwr("ls", "fq-test", "--run-id", str(run_id), "--format", "json")
    assert json.loads(listing.stdout)["runs"][0]["status"] == "finished:stopped"
