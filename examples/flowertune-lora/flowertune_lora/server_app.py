"""ServerApp: FedAvg over LoRA adapters, validation loss on held-out text after every round.

Client-side evaluation is off, as in FlowerTune; the server measures the global adapters' loss
on the validation text (the last tenth of every held-out topic). Traffic is counted both ways as
FlowerTune counts it (:mod:`flowertune_lora.traffic`), beside fedquant's own uplink metrics, and
the run's history goes to ``<out-dir>/<run-name>/history.json``. The one fedquant line is the
``QuantizedStrategy`` around FedAvg.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from fedquant.strategies import QuantizedStrategy
from flowertune_lora.dataset import validation_text, windows
from flowertune_lora.models import BaseSettings, LoraSettings, base_model, encoder_for, lora_model, mean_loss
from flowertune_lora.traffic import CountingGrid

app = ServerApp()

# fedquant's per-round train metrics copied into the history
FEDQUANT_KEYS = ("uplink-bytes", "uplink-bytes-dense", "compression-ratio", "bits-per-param",
                 "cumulative-uplink-bytes", "quantization-mse", "rejected-replies")  # fmt: skip


def get_evaluate_fn(model, validation):
    """Validation loss of the global adapters (nats per token)."""

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_peft_model_state_dict(model, arrays.to_torch_state_dict())
        return MetricRecord({"val-loss": mean_loss(model, validation)})

    return evaluate


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    base, lora = BaseSettings.from_run_config(config), LoraSettings.from_run_config(config)
    seed, codec, fraction = int(config["seed"]), str(config["codec"]), float(config["fraction-train"])
    model = lora_model(base_model(base), lora, seed=seed)
    validation = windows(validation_text(), encoder_for(base), base.seq_len)
    grid = CountingGrid(grid)

    strategy = QuantizedStrategy(FedAvg(fraction_train=fraction, fraction_evaluate=0.0), codec=codec, seed=seed)
    started = time.monotonic()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(get_peft_model_state_dict(model)),
        num_rounds=int(config["num-server-rounds"]),
        evaluate_fn=get_evaluate_fn(model, validation),
    )
    write_history(config, grid, result, time.monotonic() - started)


def default_run_name(config) -> str:
    """``<codec>_seed<seed>``, the codec's ``:`` and ``,`` made path-friendly."""
    return f"{str(config['codec']).replace(':', '-').replace(',', '_')}_seed{config['seed']}"


def write_history(config, grid: CountingGrid, result, seconds: float) -> Path:
    """One row per round: validation loss, FlowerTune's byte counts, fedquant's metrics."""
    rows, down_total, up_total = [], 0, 0
    traffic = grid.train_bytes()
    for server_round, metrics in sorted(result.evaluate_metrics_serverapp.items()):
        row = {"round": server_round, "val-loss": float(metrics["val-loss"])}
        if server_round > 0:
            down, up = traffic[server_round - 1]
            down_total, up_total = down_total + down, up_total + up
            row.update({"flowertune-downlink-bytes": down, "flowertune-uplink-bytes": up,
                        "flowertune-cumulative-bytes": down_total + up_total,
                        "flowertune-cumulative-uplink-bytes": up_total})  # fmt: skip
            train = result.train_metrics_clientapp.get(server_round, {})
            row.update({key: float(train[key]) for key in FEDQUANT_KEYS if key in train})
        rows.append(row)
    folder = Path(str(config["out-dir"])) / (str(config["run-name"]) or default_run_name(config))
    folder.mkdir(parents=True, exist_ok=True)
    history = {"run-config": dict(config), "seconds": seconds, "rounds": rows}
    (folder / "history.json").write_text(json.dumps(history, indent=1))
    print(f"history: {folder / 'history.json'}; final val-loss {rows[-1]['val-loss']:.4f}")
    return folder
