"""ServerApp: FedAvg wrapped in ``QuantizedStrategy``; writes its history for the test to read.

With ``secagg = true`` the rounds are secure (SecAgg+ over summable updates, ``SecAggConfig``).
Client-side evaluation is off (each message starts a ClientApp process, which costs seconds);
the ServerApp measures the global loss itself. Besides fedquant's metrics it records, per round,
the bytes of Flower's own serialisation of the messages (``framed-*-bytes``: every object of the
message as the SuperLink stores and ships it, header and protobuf fields included), so the test
can reconcile fedquant's byte counts with the SuperLink's traffic counter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedquant.metrics import HistoryRecorder, message_bytes
from fedquant.secagg import SecAggConfig
from fedquant.strategies import QuantizedStrategy
from fq_deploy.task import global_loss, initial_arrays

NUM_NODES = 2
app = ServerApp()


def framed_bytes(message: Message) -> int:
    """Bytes of Flower's serialisation of ``message`` (fedquant's own count, reconciled with ``flwr ls``)."""
    return message_bytes(message)


class FramedBytesStrategy(QuantizedStrategy):
    """QuantizedStrategy that also records the framed size of the train messages and replies."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.framed: dict[int, dict[str, int]] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.framed[server_round] = {
            "framed-downlink-bytes": sum(framed_bytes(m) for m in messages),
            "train-messages": len(messages),
        }
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)  # measured before the wrapper decodes them in place
        self.framed[server_round].update(
            {"framed-uplink-bytes": sum(framed_bytes(m) for m in replies), "replies": len(replies)}
        )
        return super().aggregate_train(server_round, replies)


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    out_dir = Path(str(config["out-dir"]))
    recorder = HistoryRecorder(out_dir)
    secure = None
    if bool(config["secagg"]):
        secure = SecAggConfig(bits=int(config["secagg-bits"]), clip=float(config["secagg-clip"]))
    strategy = FramedBytesStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=NUM_NODES, min_train_nodes=NUM_NODES),
        codec=str(config["codec"]),
        seed=0,
        min_numel=int(config["min-numel"]),
        recorder=recorder,
        secure_aggregation=secure,
    )
    result = strategy.start(grid, initial_arrays(), num_rounds=int(config["num-server-rounds"]))
    summary = {
        "run-id": context.run_id,
        "initial-loss": global_loss(initial_arrays(), NUM_NODES),
        "final-loss": global_loss(result.arrays, NUM_NODES),
        "rounds": sorted(result.train_metrics_clientapp),
        "framed": strategy.framed,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary))
