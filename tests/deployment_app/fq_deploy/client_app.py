"""ClientApp: plain Flower code plus ``quantize_mod``."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedquant.clients import quantize_mod
from fq_deploy.task import N_SAMPLES, loss, node_data, train

app = ClientApp(mods=[quantize_mod])


@app.train()
def _train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    x, y = node_data(int(context.node_config["partition-id"]))
    w, b = train(arrays["fc.weight"].numpy(), arrays["fc.bias"].numpy(), x, y)
    content = RecordDict(
        {
            "arrays": ArrayRecord({"fc.weight": Array(w), "fc.bias": Array(b)}),
            "metrics": MetricRecord({"num-examples": N_SAMPLES, "train-loss": loss(w, b, x, y)}),
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"]
    x, y = node_data(int(context.node_config["partition-id"]))
    value = loss(arrays["fc.weight"].numpy(), arrays["fc.bias"].numpy(), x, y)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": N_SAMPLES, "eval-loss": value})}), reply_to=msg)
