"""The wrapper and the mod through ``flwr.simulation.run_simulation`` (Ray backend).

Ray start-up costs tens of seconds, so one simulation runs everything: its ServerApp runs each
strategy, plain and wrapped, one after another on the same Grid and keeps the results in
``RESULTS`` for the tests below. One ClientApp (with ``quantize_mod``) serves every strategy,
which also shows that the mod leaves plain strategies alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx
from flwr.simulation import run_simulation

from fedquant.clients import quantize_mod
from fedquant.strategies import QuantizedStrategy
from tests.flower_fakes import MIN_NUMEL, global_loss, initial_arrays, make_client_app, raw_array_bytes, wait_for_nodes

pytestmark = pytest.mark.slow

NUM_NODES = 3
ROUNDS = 3
QSGD_SPEC = "qsgd:levels=4,bucket_size=256"
STRATEGIES = {
    "FedAvg": lambda: FedAvg(min_available_nodes=NUM_NODES),
    "FedProx": lambda: FedProx(proximal_mu=0.5, min_available_nodes=NUM_NODES),
    "FedAdam": lambda: FedAdam(min_available_nodes=NUM_NODES),
}


class RecordingGrid:
    """Delegates to the real Grid; counts the train traffic itself, before any strategy sees it."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.uplink: list[int] = []
        self.downlink: list[int] = []

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        replies = list(self._grid.send_and_receive(messages=messages, timeout=timeout))
        if messages and messages[0].metadata.message_type == "train":
            self.downlink.append(sum(raw_array_bytes(m) for m in messages))
            self.uplink.append(sum(raw_array_bytes(r) for r in replies))
        return replies


RESULTS: dict = {}
server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context) -> None:
    wait_for_nodes(grid, NUM_NODES)
    for name, make in STRATEGIES.items():
        RESULTS[name, "plain"] = make().start(grid, initial_arrays(), num_rounds=ROUNDS)
        wrapped = QuantizedStrategy(make(), "fp32", seed=3, min_numel=MIN_NUMEL)
        RESULTS[name, "fp32"] = wrapped.start(grid, initial_arrays(), num_rounds=ROUNDS)
    recording = RecordingGrid(grid)
    strategy = QuantizedStrategy(STRATEGIES["FedAvg"](), QSGD_SPEC, seed=3, min_numel=MIN_NUMEL)
    RESULTS["qsgd"] = strategy.start(recording, initial_arrays(), num_rounds=2)
    RESULTS["qsgd-grid"] = recording


@pytest.fixture(scope="module")
def results():
    RESULTS.clear()
    run_simulation(
        server_app,
        make_client_app([quantize_mod]),
        num_supernodes=NUM_NODES,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    assert "qsgd" in RESULTS, "the ServerApp did not finish"
    return RESULTS


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fp32_wrapper_gives_the_unwrapped_result(results, name):
    plain, wrapped = results[name, "plain"], results[name, "fp32"]
    assert list(plain.arrays.keys()) == list(wrapped.arrays.keys())
    for key in plain.arrays.keys():
        # received + (trained - received) in float32 equals trained up to one rounding of values
        # below 1 (2**-24) per round; replies arrive in a different order each run, so FedAvg's
        # sums may differ by as much again.
        np.testing.assert_allclose(wrapped.arrays[key].numpy(), plain.arrays[key].numpy(), rtol=0, atol=1e-6)
    assert global_loss(wrapped.arrays, NUM_NODES) < 0.95 * global_loss(initial_arrays(), NUM_NODES)
    assert wrapped.train_metrics_clientapp[ROUNDS]["rejected-replies"] == 0
    assert wrapped.train_metrics_clientapp[ROUNDS]["quantization-mse"] == 0.0
    assert "uplink-bytes" not in plain.train_metrics_clientapp[ROUNDS]


def test_qsgd_uplink_bytes_are_what_the_replies_carry(results):
    result, grid = results["qsgd"], results["qsgd-grid"]
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["uplink-bytes"] == grid.uplink[server_round - 1]
        assert metrics["downlink-bytes"] == grid.downlink[server_round - 1]
        assert metrics["compression-ratio"] == pytest.approx(metrics["uplink-bytes-dense"] / metrics["uplink-bytes"])
        assert metrics["rejected-replies"] == 0
        assert metrics["quantization-mse"] > 0
    # 4 levels + sign: 3 bits per weight plus a scale per bucket of 256, against 32 bits; the bias
    # (16 floats) and the .npy headers travel dense, so the ratio is below 32/3 but well above 5.
    assert 5 < result.train_metrics_clientapp[1]["compression-ratio"] < 32 / 3
    assert result.train_metrics_clientapp[2]["cumulative-uplink-bytes"] == sum(grid.uplink)
    assert global_loss(result.arrays, NUM_NODES) < global_loss(initial_arrays(), NUM_NODES)
