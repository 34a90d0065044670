"""ServerApp: FedAvg wrapped in ``QuantizedStrategy``; writes its history for the test to read.

Client-side evaluation is off (each message starts a ClientApp process, which costs seconds);
the ServerApp measures the global loss itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedquant.metrics import HistoryRecorder
from fedquant.strategies import QuantizedStrategy
from fq_deploy.task import global_loss, initial_arrays

NUM_NODES = 2
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    out_dir = Path(str(config["out-dir"]))
    recorder = HistoryRecorder(out_dir)
    strategy = QuantizedStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=NUM_NODES, min_train_nodes=NUM_NODES),
        codec=str(config["codec"]),
        seed=0,
        min_numel=int(config["min-numel"]),
        recorder=recorder,
    )
    result = strategy.start(grid, initial_arrays(), num_rounds=int(config["num-server-rounds"]))
    summary = {
        "initial-loss": global_loss(initial_arrays(), NUM_NODES),
        "final-loss": global_loss(result.arrays, NUM_NODES),
        "rounds": sorted(result.train_metrics_clientapp),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary))
