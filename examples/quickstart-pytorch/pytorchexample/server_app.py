"""pytorchexample: a Flower / PyTorch ServerApp whose strategy fedquant wraps."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedquant.strategies import QuantizedStrategy
from pytorchexample.task import Net, load_centralized_dataset, run_config, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_evaluate: float = run_config(context)["fraction-evaluate"]
    num_rounds: int = run_config(context)["num-server-rounds"]
    lr: float = run_config(context)["learning-rate"]

    arrays = ArrayRecord(Net().state_dict())

    # fedquant, line 2 of 2: wrap the strategy; it decodes, checks and meters every reply.
    strategy = QuantizedStrategy(FedAvg(fraction_evaluate=fraction_evaluate), codec=run_config(context)["codec"])

    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    for server_round, metrics in sorted(result.train_metrics_clientapp.items()):
        print(f"round {server_round}: {metrics['uplink-bytes']} uplink bytes, {metrics['compression-ratio']:.1f}x")
    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the model on the server's data."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    test_loss, test_acc = test(model.to(device), load_centralized_dataset(), device)
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
