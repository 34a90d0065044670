"""Local training and evaluation loops (plain PyTorch, no Flower)."""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.nn import functional as F

from fedquant.codecs.threads import set_kernel_threads
from simulations.data import TensorData


def limit_threads(default: int = 1) -> int:
    """Cap torch's and numba's threads for this thread at the CPUs this client was given.

    Ray sets ``OMP_NUM_THREADS`` to a client's ``num-cpus``. Simulated clients run side by side,
    so threads beyond that only oversubscribe the cores: on a busy 2-core machine numba's
    parallel kernels ran ~50x slower with 2 threads than with 1 on a 14 k-parameter model.
    """
    n = max(1, int(float(os.environ.get("OMP_NUM_THREADS") or default)))
    # numba first: starting its OpenMP layer resets the process's OpenMP thread count, torch's
    # included, so the first training of a process ran on every core and its float sums came
    # out differently from the next ones (a run did not repeat bit for bit).
    set_kernel_threads(n)  # per calling thread
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def pick_device() -> torch.device:
    """CUDA when this process sees a GPU (Ray hides it from clients given ``num-gpus = 0``), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def train(
    model: nn.Module,
    data: TensorData,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    device: torch.device | str = "cpu",
    momentum: float = 0.9,
    clip_norm: float = 0.0,
    min_steps: int = 0,
) -> float:
    """Local SGD (with momentum); returns the mean training loss of the last pass.

    Parameters
    ----------
    epochs : int
        Passes over ``data``; more when that is needed to take ``min_steps`` steps.
    clip_norm : float
        Clip each step's gradient to this global L2 norm (0: no clipping).
    min_steps : int
        At least this many SGD steps: a client holding one batch or less still trains (a
        federation of many small clients otherwise barely moves in a round).

    The batch order comes from a generator seeded with ``seed`` (no global RNG).
    """
    device = torch.device(device)
    model.to(device).train()
    x, y = data.x.to(device, _float_dtype(model)), data.y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    gen = torch.Generator().manual_seed(seed)
    n = len(data)
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    epochs = max(epochs, math.ceil(min_steps / steps_per_epoch))
    total = torch.zeros((), device=device)
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(device)
        total = torch.zeros((), device=device)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip_norm > 0:
                nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            opt.step()
            total += loss.detach() * len(idx)
    return float(total) / max(n, 1)


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's float weights (inputs are cast to it: a float16 model takes float16 images)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def minibatch_gradient_step(
    model: nn.Module,
    data: TensorData,
    *,
    batch_size: int,
    seed: int,
    device: torch.device | str = "cpu",
    clip_norm: float = 0.0,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """One stochastic gradient of ``model`` on a minibatch of ``data``, as the model ``w - g``.

    Returns ``(state_dict, loss, examples)``: the parameters are ``w - g`` (``g`` the mean
    gradient over ``min(batch_size, len(data))`` examples drawn without replacement from a
    generator seeded with ``seed``, clipped to L2 norm ``clip_norm`` when > 0), the buffers
    (BatchNorm statistics) as the forward pass left them. ``model`` is not changed otherwise.
    """
    device = torch.device(device)
    model.to(device).train()
    n = len(data)
    take = min(batch_size, n)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:take]
    x, y = data.x[idx].to(device, _float_dtype(model)), data.y[idx].to(device)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if clip_norm > 0:
        nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(p.grad)
    model.zero_grad(set_to_none=True)
    return model.state_dict(), float(loss.detach()), take


@torch.no_grad()
def evaluate(
    model: nn.Module, data: TensorData, *, batch_size: int = 512, device: torch.device | str = "cpu"
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``data``."""
    device = torch.device(device)
    model.to(device).eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        xb = data.x[start : start + batch_size].to(device, _float_dtype(model))
        yb = data.y[start : start + batch_size].to(device)
        logits = model(xb)
        loss_sum += float(F.cross_entropy(logits.float(), yb, reduction="sum"))
        correct += int((logits.argmax(1) == yb).sum())
    n = max(len(data), 1)
    return loss_sum / n, correct / n
