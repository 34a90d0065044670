"""ClientApp: receive the global LoRA adapters, fine-tune them on this client's topics, send them back.

As in FlowerTune, only the adapters travel: ``get_peft_model_state_dict`` as an ArrayRecord up,
``set_peft_model_state_dict`` on the way down. The one fedquant line is the ``quantize_mod``.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from fedquant.clients import quantize_mod
from flowertune_lora.dataset import client_text, windows
from flowertune_lora.models import BaseSettings, LoraSettings, base_model, encoder_for, lora_model, train_steps

app = ClientApp(mods=[quantize_mod])

_models: dict[tuple, object] = {}  # per process: a simulation's worker serves many messages


def _model(base: BaseSettings, lora: LoraSettings):
    key = (base, lora)
    if key not in _models:
        _models.clear()
        _models[key] = lora_model(base_model(base), lora, seed=0)  # its adapters are overwritten by the server's
    return _models[key]


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local LoRA fine-tuning: ``local-steps`` AdamW steps on random windows of this client's topics."""
    config = context.run_config
    base, lora = BaseSettings.from_run_config(config), LoraSettings.from_run_config(config)
    model = _model(base, lora)
    set_peft_model_state_dict(model, msg.content["arrays"].to_torch_state_dict())

    partition, partitions = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    data = windows(client_text(partition, partitions), encoder_for(base), base.seq_len)
    server_round = int(msg.content["config"]["server-round"])
    generator = torch.Generator().manual_seed(int(config["seed"]) * 1_000_003 + server_round * 1_009 + partition)
    loss = train_steps(model, data, int(config["local-steps"]), int(config["batch-size"]),
                       float(config["learning-rate"]), generator)  # fmt: skip

    content = RecordDict({
        "arrays": ArrayRecord(get_peft_model_state_dict(model)),
        "metrics": MetricRecord({"train-loss": loss, "num-examples": len(data)}),
    })  # fmt: skip
    return Message(content=content, reply_to=msg)
