"""End to end: the simulation app on the default dataset, through Flower's simulation engine."""

from __future__ import annotations

import csv
import json

import pytest

from fedquant.metrics import (
    BITS_PER_PARAM,
    COMPRESSION_RATIO,
    CUMULATIVE_UPLINK_BYTES,
    DOWNLINK_BYTES,
    QUANTIZATION_MSE,
    REJECTED_REPLIES,
    SIMULATED_UPLOAD_SECONDS,
    UPLINK_BYTES,
    UPLINK_BYTES_DENSE,
)

FEDQUANT_KEYS = [UPLINK_BYTES, UPLINK_BYTES_DENSE, COMPRESSION_RATIO, BITS_PER_PARAM, DOWNLINK_BYTES,
                 CUMULATIVE_UPLINK_BYTES, QUANTIZATION_MSE, REJECTED_REPLIES, SIMULATED_UPLOAD_SECONDS]  # fmt: skip
CODEC = "qsgd:levels=4"
NUM_CLIENTS = 4


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.server_app import make_server_app

    out = tmp_path_factory.mktemp("e2e")
    server_app = make_server_app(
        codec=CODEC, partitioning="dirichlet", dirichlet_alpha=0.3, rounds=2, fraction_train=1.0,
        uplink="fixed:mbps=1", out_dir=str(out), run_name="e2e",
    )  # fmt: skip
    run_simulation(server_app, client_app, num_supernodes=NUM_CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})  # fmt: skip
    return out / "e2e"


@pytest.mark.slow
def test_history_files_hold_every_round_and_metric(run_folder):
    history = json.loads((run_folder / "history.json").read_text())
    rounds = history["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]  # 0: the initial model
    for row in rounds[1:]:
        for key in ["accuracy", "loss", *FEDQUANT_KEYS]:
            assert row[key] is not None, key
        assert row[REJECTED_REPLIES] == 0
        # 2 bits per level index + sign per element at 4 levels: far below float32.
        assert row[BITS_PER_PARAM] < 8 and row[UPLINK_BYTES] * 4 < row[UPLINK_BYTES_DENSE]
        # One fixed 1 Mbit/s link: the slowest client's upload is its bytes / 125000 B/s, and
        # every client sends the same model, so it is the round's bytes / clients / 125000.
        assert row[SIMULATED_UPLOAD_SECONDS] == pytest.approx(row[UPLINK_BYTES] / NUM_CLIENTS / 125_000, rel=0.01)
    assert rounds[2][CUMULATIVE_UPLINK_BYTES] == rounds[1][UPLINK_BYTES] + rounds[2][UPLINK_BYTES]
    with (run_folder / "history.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 3 and {"accuracy", "loss", *FEDQUANT_KEYS} <= set(table[0])
    assert (run_folder / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_model_learns(run_folder):
    rounds = json.loads((run_folder / "history.json").read_text())["rounds"]
    # 10 classes: chance is 0.1; the binomial sd of accuracy on 359 test digits at p = 0.1 is 0.016,
    # so 0.3 cannot be reached by guessing. The initial model is at chance.
    assert rounds[0]["accuracy"] < 0.2
    assert rounds[-1]["accuracy"] > 0.3
    assert rounds[-1]["loss"] < rounds[0]["loss"]


@pytest.mark.slow
def test_run_config_reaches_the_clients(run_folder):
    history = json.loads((run_folder / "history.json").read_text())
    assert history["settings"]["codec"] == CODEC and history["settings"]["partitioning"] == "dirichlet"
    clients = history["clients"]
    assert len(clients) == 2 * NUM_CLIENTS  # every client, both rounds
    assert {c["codec"] for c in clients} == {CODEC}
    assert {c["dataset"] for c in clients} == {"digits"}
    assert {c["partitioning"] for c in clients} == {"dirichlet"}
    assert {c["device"] for c in clients} == {"cpu"}
    assert sorted({c["partition-id"] for c in clients}) == list(range(NUM_CLIENTS))
    # Dirichlet(0.3) over 4 clients: some client misses some digit classes (iid clients hold all 10).
    assert min(c["distinct-labels"] for c in clients) < 10
