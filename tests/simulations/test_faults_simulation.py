"""Faulty clients in a real Flower simulation: one raises, one misses the round timeout.

The round must complete with the other clients and the whole run must end: the simulation runs
in a subprocess (``tests/fault_app.py``) under a time limit, so a hang fails this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedquant.metrics import dense_float32_bytes
from tests.fault_app import DONE_MARK, NUM_NODES, ROUND_TIMEOUT, ROUNDS
from tests.flower_fakes import initial_arrays
from tests.timeouts import scaled

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LIMIT_SECONDS = 300  # Ray start-up plus two rounds of at most ROUND_TIMEOUT, idle; scaled with the load


def test_a_raising_and_a_slow_client_do_not_stop_the_rounds():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fault_app"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(LIMIT_SECONDS),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(DONE_MARK)]
    output = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert lines, f"the ServerApp did not finish (exit {proc.returncode}):\n{output}"
    summary = json.loads(lines[-1][len(DONE_MARK) :])
    for server_round in range(1, ROUNDS + 1):
        metrics = summary["rounds"][str(server_round)]
        # The raising client's reply is an error (Flower's handling), the slow one never arrives:
        # the two others are aggregated and nothing is rejected.
        assert metrics["rejected-replies"] == 0
        assert metrics["uplink-bytes-dense"] == (NUM_NODES - 2) * dense_float32_bytes(initial_arrays())
    # Each round waits for the slow client no longer than the timeout (plus scheduling slack).
    assert summary["seconds"] < ROUNDS * (ROUND_TIMEOUT + scaled(10))
    assert summary["loss_after"] < summary["loss_before"]
