"""A tiny Flower task (linear regression on synthetic data) and an in-process Grid for tests.

The ClientApp here is what a user writes; fedquant only adds ``quantize_mod`` to its mods.
The in-process Grid runs the ClientApp in this process (no Ray), so unit tests can run whole
rounds of ``Strategy.start`` in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity

N_IN, N_OUT, N_SAMPLES = 64, 16, 96
LR, LOCAL_STEPS = 0.05, 5
MIN_NUMEL = 256  # fc.weight (1024 elements) is encoded, fc.bias (16) travels as is


def initial_arrays() -> ArrayRecord:
    """The global model: a linear layer, fixed values (no RNG involved)."""
    weight = (np.arange(N_OUT * N_IN, dtype=np.float32).reshape(N_OUT, N_IN) % 7 - 3.0) * 0.01
    return ArrayRecord({"fc.weight": Array(weight), "fc.bias": Array(np.zeros(N_OUT, dtype=np.float32))})


def node_data(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic regression data of one client (its own generator, seeded by the partition)."""
    rng = np.random.default_rng(1000 + partition_id)
    true_w = np.random.default_rng(7).standard_normal((N_OUT, N_IN)).astype(np.float32) * 0.3
    x = rng.standard_normal((N_SAMPLES, N_IN)).astype(np.float32)
    y = x @ true_w.T + 0.1 * rng.standard_normal((N_SAMPLES, N_OUT)).astype(np.float32)
    return x, y


def _partition(context: Context) -> int:
    return int(context.node_config.get("partition-id", context.node_id))


def _loss(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((x @ w.T + b - y) ** 2))


def train(msg: Message, context: Context) -> Message:
    """Full-batch gradient descent (with FedProx's proximal term when the config asks for it)."""
    arrays = next(iter(msg.content.array_records.values()))
    config = next(iter(msg.content.config_records.values()), {})
    mu = float(config.get("proximal-mu", 0.0))
    w0, b0 = arrays["fc.weight"].numpy(), arrays["fc.bias"].numpy()
    w, b = w0.copy(), b0.copy()
    x, y = node_data(_partition(context))
    for _ in range(LOCAL_STEPS):
        err = (x @ w.T + b - y) * (2.0 / y.size)
        w -= LR * (err.T @ x + mu * (w - w0))
        b -= LR * (err.sum(axis=0) + mu * (b - b0))
    content = RecordDict(
        {
            "arrays": ArrayRecord({"fc.weight": Array(w.astype(np.float32)), "fc.bias": Array(b.astype(np.float32))}),
            "metrics": MetricRecord({"num-examples": N_SAMPLES, "train-loss": _loss(w, b, x, y)}),
        }
    )
    return Message(content, reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    """Loss of the received model on the client's data."""
    arrays = next(iter(msg.content.array_records.values()))
    x, y = node_data(_partition(context))
    loss = _loss(arrays["fc.weight"].numpy(), arrays["fc.bias"].numpy(), x, y)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": N_SAMPLES, "eval-loss": loss})}), reply_to=msg)


def make_client_app(mods: list | None = None) -> ClientApp:
    """The task's ClientApp with the given mods."""
    app = ClientApp(mods=mods or [])
    app.train()(train)
    app.evaluate()(evaluate)
    return app


def global_loss(arrays: ArrayRecord, num_nodes: int) -> float:
    """Mean loss of a model over the data of ``num_nodes`` clients."""
    w, b = arrays["fc.weight"].numpy(), arrays["fc.bias"].numpy()
    return float(np.mean([_loss(w, b, *node_data(p)) for p in range(num_nodes)]))


Tamper = Callable[[Message], Message]
SERVER_NODE_ID = 1


def set_task_identity() -> None:
    """Give this process the identity a ServerApp has, so ``Message(...)`` can be built outside a run."""
    for attr, value in (("run_id", 1), ("node_id", SERVER_NODE_ID), ("task_id", 1)):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:
            setattr(TaskIdentity, attr, value)


class InProcessGrid:
    """Just enough of ``flwr.serverapp.Grid`` for ``Strategy.start``: runs the ClientApp in-process.

    Parameters
    ----------
    app : ClientApp
        Called as ``app(message, context)`` per message; an exception becomes an error reply.
    num_nodes : int
        Node ids are ``101, 102, ...``; partition ids ``0, 1, ...``.
    tamper : dict of int to callable, optional
        Per node id, a function applied to the node's train replies (to forge bad replies).
    """

    def __init__(self, app: ClientApp, num_nodes: int, tamper: dict[int, Tamper] | None = None) -> None:
        set_task_identity()
        self.app = app
        self.contexts = {
            101 + i: Context(
                run_id=1,
                node_id=101 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self.tamper = tamper or {}
        self.sent: list[Message] = []
        self.train_reply_bytes: list[int] = []  # per round, counted here before the strategy sees them

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            node_id = message.metadata.dst_node_id
            try:
                reply = self.app(message, self.contexts[node_id])
            except Exception as err:  # Flower turns an exception into an error reply
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)), reply_to=message)
            if message.metadata.message_type == "train" and node_id in self.tamper:
                reply = self.tamper[node_id](reply)
            replies.append(reply)
        if any(m.metadata.message_type == "train" for m in self.sent[-len(replies) :] if replies):
            self.train_reply_bytes.append(sum(raw_array_bytes(r) for r in replies))
        return replies


def raw_array_bytes(message: Message) -> int:
    """Bytes of a message's ArrayRecords, counted without Flower's ``count_bytes``."""
    if message.has_error():
        return 0
    records = message.content.array_records.values()
    return sum(len(key) + len(array.data) for record in records for key, array in record.items())


def wait_for_nodes(grid, count: int, limit_s: float = 120.0) -> None:
    """All nodes must be connected before sampling, or round 1 samples fewer of them."""
    deadline = time.monotonic() + limit_s
    while len(list(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(grid.get_node_ids()))} of {count} nodes connected")
        time.sleep(0.2)
