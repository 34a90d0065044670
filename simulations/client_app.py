"""The ClientApp: local training on this node's partition; ``quantize_mod`` encodes the update.

The node's partition comes from its node config (``partition-id``, ``num-partitions``, set by the
simulation engine, or by ``flower-supernode --node-config`` in a deployment); everything else
(dataset, partitioning, model, epochs, ...) from the round config the server sends.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedquant.clients import quantize_mod
from fedquant.clients.quantize_mod import encode_device
from fedquant.protocol import STATE_TRANSFORMS_KEY
from fedquant.rng import derive_seed
from fedquant.secagg.messages import RECORD as SECAGG_RECORD
from simulations import vce_dispatch
from simulations.data import TensorData, load_partition
from simulations.loopback import ray_loopback_only
from simulations.models import build_model
from simulations.node_directory import is_partition_query, partition_answer
from simulations.placement import worker_identity
from simulations.settings import CLIENT_INFO_KEY, FEDERATION_KEY
from simulations.task import evaluate, limit_threads, minibatch_gradient_step, pick_device, train

# `flwr run` (local simulation federation): Flower's simulation process loads this module before
# it starts Ray, so Ray listens on loopback only there too (see simulations/loopback.py).
ray_loopback_only()


def secagg_dropout_mod(msg: Message, context: Context, call_next) -> Message:
    """FAULT INJECTION (run config ``secagg-dropouts = k``): partitions ``0..k-1`` drop after key sharing.

    At the collect stage of a secure round they answer with an error reply instead of their masked
    input, as a client that crashed after sharing its keys; the server removes their masks.
    """
    record = msg.content.config_records.get(SECAGG_RECORD)
    if record is not None and record.get("stage") == "collect":
        cfg = msg.content.config_records.get("config")
        k = int(cfg.get("secagg-dropouts", 0)) if cfg is not None else 0
        if int(context.node_config.get("partition-id", -1)) < k:
            return Message(Error(code=0, reason="secagg-dropouts: fault injection"), reply_to=msg)
    return call_next(msg, context)


app = ClientApp(mods=[secagg_dropout_mod, quantize_mod])
FEDERATION_STATE = "fedquant-federation"  # ConfigRecord in context.state: the federation last trained for
# In the simulation engine's process (loaded there before it dispatches): dispatch messages in time
# independent of the number of registered nodes. A no-op in Ray workers and SuperNodes.
vce_dispatch.install()


def _partition(msg: Message, context: Context) -> tuple[int, TensorData, Any]:
    cfg = msg.content.config_records["config"]
    pid = int(context.node_config["partition-id"])
    data = load_partition(
        str(cfg["dataset"]),
        pid,
        int(context.node_config["num-partitions"]),
        str(cfg["partitioning"]),
        float(cfg["dirichlet-alpha"]),
        int(cfg["seed"]),
    )
    return pid, data, cfg


def _model(cfg: Any, data: TensorData, arrays: ArrayRecord) -> Any:
    model = build_model(str(cfg["model"]), data.input_shape, data.num_classes)
    model.load_state_dict(arrays.to_torch_state_dict())
    return model


def _forget_other_federations(cfg: Any, context: Context) -> None:
    """Drop the transforms' state (error-feedback residuals) this node kept from another federation.

    A sweep runs several federations on the same nodes, and a node may first be sampled in any
    round of the next one: the server names each federation (``federation-id``), and a node
    that sees a new name starts afresh. Without a name (another server), round 1 starts afresh.
    """
    federation = str(cfg.get(FEDERATION_KEY, ""))
    seen = context.state.config_records.get(FEDERATION_STATE)
    if federation:
        new = seen is None or seen.get("id") != federation
        context.state[FEDERATION_STATE] = ConfigRecord({"id": federation})
    else:
        new = int(cfg.get("server-round", 0)) == 1
    if new and STATE_TRANSFORMS_KEY in context.state:
        del context.state[STATE_TRANSFORMS_KEY]


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    """Train the received model for ``local-epochs`` on this node's partition."""
    limit_threads()
    pid, data, cfg = _partition(msg, context)
    device = pick_device()
    model = _model(cfg, data, msg.content.array_records["arrays"])
    server_round = int(cfg.get("server-round", 0))
    _forget_other_federations(cfg, context)
    if str(cfg.get("mode", "fedavg")) == "fedsgd":  # one minibatch gradient (simulations.fedsgd)
        state, loss, examples = minibatch_gradient_step(
            model, data, batch_size=int(cfg["batch-size"]), device=device, clip_norm=float(cfg["clip-norm"]),
            seed=derive_seed(int(cfg["seed"]), "batches", server_round, pid),
        )  # fmt: skip
        return _reply(msg, state, loss, examples, pid, data, cfg, device)
    loss = train(
        model,
        data,
        epochs=int(cfg["local-epochs"]),
        batch_size=int(cfg["batch-size"]),
        lr=float(cfg["learning-rate"]),
        seed=derive_seed(int(cfg["seed"]), "batches", server_round, pid),
        device=device,
        clip_norm=float(cfg["clip-norm"]),
        min_steps=int(cfg["min-local-steps"]),
    )
    return _reply(msg, model.state_dict(), loss, len(data), pid, data, cfg, device)


def _reply(msg: Message, state: Any, loss: float, examples: int, pid: int, data: TensorData, cfg: Any,
           device: Any) -> Message:  # fmt: skip
    """The train reply: the model's arrays, loss and example count, and what the client reports about itself."""
    info = ConfigRecord(
        {
            "partition-id": pid,
            "dataset": str(cfg["dataset"]),
            "partitioning": str(cfg["partitioning"]),
            "codec": str(cfg["codec"]),
            "device": str(device),
            "encode-device": str(encode_device()),
            "distinct-labels": int(data.y.unique().numel()),
            **worker_identity(),  # host, pid, Ray node: which machine ran this client
        }
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(state),
            "metrics": MetricRecord({"train-loss": loss, "num-examples": examples}),
            CLIENT_INFO_KEY: info,
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Score the received model on this node's partition (used when fraction-evaluate > 0)."""
    _, data, cfg = _partition(msg, context)
    model = _model(cfg, data, msg.content.array_records["arrays"])
    loss, accuracy = evaluate(model, data, device=pick_device())
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": accuracy, "num-examples": len(data)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.query()
def query_fn(msg: Message, context: Context) -> Message:
    """Answer the server's question for this node's partition id (see ``simulations.node_directory``)."""
    if not is_partition_query(msg):
        raise ValueError("unknown query: this ClientApp answers only the partition-id query")
    return Message(content=partition_answer(dict(context.node_config)), reply_to=msg)
