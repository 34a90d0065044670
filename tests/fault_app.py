"""A simulation with faulty clients, run as ``python -m tests.fault_app`` by ``test_faults_simulation``.

Four clients with ``quantize_mod``, each on its own Ray actor. Once the train config says
``faults = 1``, partition 0 raises in ``train`` and partition 1 sleeps longer than the round
timeout; the others train normally. The ServerApp first runs one fault-free round with a long
timeout (actors start, import torch and compile the codec kernels: seconds on a busy machine),
then two rounds of the wrapped FedAvg with faults and a short timeout, and prints one JSON line
with what each of those rounds aggregated. It runs in a subprocess so that a hang fails the test
(by its time limit) instead of stalling the suite.
"""

from __future__ import annotations

import json
import time

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from fedquant.clients import quantize_mod
from fedquant.strategies import QuantizedStrategy
from tests.flower_fakes import MIN_NUMEL, evaluate, global_loss, initial_arrays, train, wait_for_nodes

NUM_NODES = 4
ROUNDS = 2
ROUND_TIMEOUT = 6.0
SLOW_SECONDS = 3 * ROUND_TIMEOUT
RAISING, SLOW = 0, 1
DONE_MARK = "FAULT-APP-RESULT "


def _faulty_train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    if not msg.content["config"].get("faults", 0):
        return train(msg, context)
    if partition == RAISING:
        raise RuntimeError("client 0 fails on purpose")
    if partition == SLOW:
        time.sleep(SLOW_SECONDS)
    return train(msg, context)


client_app = ClientApp(mods=[quantize_mod])
client_app.train()(_faulty_train)
client_app.evaluate()(evaluate)
server_app = ServerApp()


def _strategy() -> QuantizedStrategy:
    inner = FedAvg(min_available_nodes=NUM_NODES, fraction_evaluate=0.0)
    return QuantizedStrategy(inner, "qsgd:levels=16", seed=1, min_numel=MIN_NUMEL)


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    wait_for_nodes(grid, NUM_NODES)
    warm_up = _strategy().start(grid, initial_arrays(), num_rounds=1, train_config=ConfigRecord({"faults": 0}))
    started = time.monotonic()
    result = _strategy().start(
        grid, warm_up.arrays, num_rounds=ROUNDS, timeout=ROUND_TIMEOUT, train_config=ConfigRecord({"faults": 1})
    )
    rounds = {
        str(r): {key: float(value) for key, value in metrics.items()}
        for r, metrics in result.train_metrics_clientapp.items()
    }
    summary = {
        "rounds": rounds,
        "seconds": time.monotonic() - started,
        "loss_before": global_loss(warm_up.arrays, NUM_NODES),
        "loss_after": global_loss(result.arrays, NUM_NODES),
    }
    print(DONE_MARK + json.dumps(summary), flush=True)


if __name__ == "__main__":
    run_simulation(
        server_app,
        client_app,
        num_supernodes=NUM_NODES,
        # Half a CPU per client: four actors on two cores, so the sleeping client blocks only its own.
        backend_config={"client_resources": {"num_cpus": 0.5, "num_gpus": 0.0}},
    )
