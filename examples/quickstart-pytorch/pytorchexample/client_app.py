"""pytorchexample: a Flower / PyTorch ClientApp whose uplink fedquant compresses."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedquant.clients import quantize_mod
from pytorchexample.task import Net, load_data, run_config
from pytorchexample.task import test as test_fn
from pytorchexample.task import train as train_fn

# Flower ClientApp. fedquant, line 1 of 2: the mod encodes each trained update with the codec
# the server names in the round's config.
app = ClientApp(mods=[quantize_mod])


def _model(msg: Message) -> tuple[Net, torch.device]:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return model.to(device), device


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model, device = _model(msg)
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader, _ = load_data(partition_id, num_partitions, run_config(context)["batch-size"])
    train_loss = train_fn(model, trainloader, run_config(context)["local-epochs"], msg.content["config"]["lr"], device)
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model, device = _model(msg)
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    _, valloader = load_data(partition_id, num_partitions, run_config(context)["batch-size"])
    eval_loss, eval_acc = test_fn(model, valloader, device)
    metrics = MetricRecord({"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
