"""Data-parallel SGD (FedSGD) through Flower: the regime the three papers measure their codecs in.

Run config ``mode = "fedsgd"``. Each sampled client computes ONE minibatch gradient of the model
it received (:func:`simulations.task.minibatch_gradient_step`: ``batch-size`` examples of its
partition, drawn from the round's seed) and replies ``received - gradient``: the update
``quantize_mod`` encodes is then exactly minus the stochastic gradient, so the codecs quantize
gradients, as in QSGD, ORQ/BinGrad and (N)DQSG. The server (:class:`FedSGD`, the inner strategy
of the same ``QuantizedStrategy``) averages the decoded gradients and steps with SGD and momentum,
as the papers' parameter server does::

    v <- server_momentum * v + mean_g,   w <- w - learning_rate * v

Why a strategy and not FedAvg with one local step: FedAvg's server step is the mean model, so
its momentum would live on the clients, which are sampled afresh each round and keep no state
across rounds in a data-parallel run; the papers keep one momentum buffer, on the server.
``clients-per-round`` fixes the number of workers per step (0: ``fraction-train``; the papers use
all workers: ``fraction-train = 1``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedquant.rng import derive_seed
from simulations.server_app import SeededFedAvg


class FedSGD(SeededFedAvg):
    """Synchronous data-parallel SGD with server momentum, over replies ``w - g`` (see the module).

    Parameters
    ----------
    learning_rate : float
        The server's SGD step size.
    momentum : float
        Heavy-ball momentum in [0, 1) (PyTorch's SGD: ``v = m v + g``, ``w -= lr v``).
    parameter_names : iterable of str
        The model's trainable entries: they take the SGD step. Other entries (BatchNorm
        statistics, counters) take the clients' weighted mean, as FedAvg would.
    clients_per_round : int
        Clients sampled per step (seeded, as :class:`SeededFedAvg`); 0: ``fraction_train``.
    """

    def __init__(
        self,
        *args: Any,
        learning_rate: float,
        momentum: float = 0.9,
        parameter_names: Iterable[str] = (),
        clients_per_round: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not (np.isfinite(learning_rate) and learning_rate > 0):
            raise ValueError(f"learning_rate must be a number > 0, got {learning_rate!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if clients_per_round < 0:
            raise ValueError(f"clients_per_round must be >= 0, got {clients_per_round!r}")
        self.learning_rate = float(learning_rate)
        self.momentum = float(momentum)
        self.parameter_names = frozenset(parameter_names)
        self.clients_per_round = int(clients_per_round)
        self._current: dict[str, np.ndarray] = {}
        self._velocity: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return (
            f"FedSGD(learning_rate={self.learning_rate}, momentum={self.momentum}, "
            f"clients_per_round={self.clients_per_round or f'fraction {self.fraction_train}'})"
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample the step's workers and send them the current model (kept to take the step from)."""
        self._current = {name: array.numpy() for name, array in arrays.items()}
        if self.clients_per_round == 0:
            return super().configure_train(server_round, arrays, config, grid)
        all_nodes = self.directory.ordered_nodes(grid)
        rng = random.Random(derive_seed(self.seed, "sample-clients", server_round))
        node_ids = rng.sample(all_nodes, min(len(all_nodes), self.clients_per_round))
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(all_nodes))
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Mean of the replies ``w - g_i`` (FedAvg's weights), then one SGD-with-momentum step."""
        mean, metrics = super().aggregate_train(server_round, replies)
        if mean is None:
            return None, metrics
        stepped = ArrayRecord()
        for name, array in mean.items():
            value = array.numpy()
            current = self._current.get(name)
            if name not in self.parameter_names or current is None or current.shape != value.shape:
                stepped[name] = Array(np.ascontiguousarray(value))
                continue
            gradient = current.astype(np.float64) - value.astype(np.float64)
            velocity = self._velocity.get(name)
            velocity = gradient if velocity is None else self.momentum * velocity + gradient
            self._velocity[name] = velocity
            new = (current.astype(np.float64) - self.learning_rate * velocity).astype(current.dtype)
            stepped[name] = Array(np.ascontiguousarray(new))
        return stepped, metrics


__all__ = ["FedSGD"]
