"""Linear regression on synthetic data: each node's data from its own generator."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

N_IN, N_OUT, N_SAMPLES, LR, LOCAL_STEPS = 64, 16, 96, 0.05, 5


def initial_arrays() -> ArrayRecord:
    weight = (np.arange(N_OUT * N_IN, dtype=np.float32).reshape(N_OUT, N_IN) % 7 - 3.0) * 0.01
    return ArrayRecord({"fc.weight": Array(weight), "fc.bias": Array(np.zeros(N_OUT, dtype=np.float32))})


def node_data(partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + partition_id)
    true_w = np.random.default_rng(7).standard_normal((N_OUT, N_IN)).astype(np.float32) * 0.3
    x = rng.standard_normal((N_SAMPLES, N_IN)).astype(np.float32)
    return x, x @ true_w.T + 0.1 * rng.standard_normal((N_SAMPLES, N_OUT)).astype(np.float32)


def loss(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((x @ w.T + b - y) ** 2))


def train(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w, b = w.copy(), b.copy()
    for _ in range(LOCAL_STEPS):
        err = (x @ w.T + b - y) * (2.0 / y.size)
        w -= LR * (err.T @ x)
        b -= LR * err.sum(axis=0)
    return w.astype(np.float32), b.astype(np.float32)


def global_loss(arrays: ArrayRecord, num_nodes: int) -> float:
    w, b = arrays["fc.weight"].numpy(), arrays["fc.bias"].numpy()
    return float(np.mean([loss(w, b, *node_data(p)) for p in range(num_nodes)]))
