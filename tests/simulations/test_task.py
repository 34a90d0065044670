"""Local training: the minimum number of steps and gradient-norm clipping."""

from __future__ import annotations

import torch

from simulations.data import load_partition
from simulations.models import build_model
from simulations.task import train


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _steps(data, **kwargs) -> int:
    model = build_model("mlp", data.input_shape, data.num_classes)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    train(model, data, batch_size=16, lr=0.01, seed=0, **kwargs)
    return len(calls)


def test_a_small_partition_trains_at_least_min_steps():
    data = load_partition("digits", 0, 100)  # 14 or 15 examples: one batch per epoch
    assert _steps(data, epochs=3) == 3
    assert _steps(data, epochs=3, min_steps=30) == 30
    big = load_partition("digits", 0, 2)  # 719 examples: 45 batches per epoch, already > 30
    assert _steps(big, epochs=1, min_steps=30) == 45


def test_clipping_bounds_each_step():
    data = load_partition("digits", 0, 100)
    start = build_model("cnn", data.input_shape, data.num_classes, seed=0)
    moves = {}
    for clip in (0.0, 1e-3):
        model = build_model("cnn", data.input_shape, data.num_classes, seed=0)
        train(model, data, epochs=1, batch_size=16, lr=0.5, seed=0, momentum=0.0, clip_norm=clip)
        moves[clip] = float(torch.linalg.vector_norm(_flat(model) - _flat(start)))
    # One plain SGD step moves the weights by lr * |clipped gradient| <= 0.5 * 1e-3.
    assert moves[1e-3] <= 0.5 * 1e-3 * (1 + 1e-5)
    assert moves[0.0] > 10 * moves[1e-3]
