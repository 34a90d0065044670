"""Models for the simulations: logistic regression, an MLP, a LeNet-style CNN, ResNet-20 and ResNet-18 for CIFAR.

Each takes the input shape and the class count, so one name works on digits (8x8), MNIST/FEMNIST
(28x28) and CIFAR (32x32). ``logreg`` and ``mlp`` take any input shape (they flatten it), so they
also fit the feature vectors of ``synthetic``; ``cnn``, ``resnet20`` and ``resnet18`` need images ``(C, H, W)``.

A model name may carry the dtype of its weights, ``"mlp:dtype=float16"`` (float16, float32 or
float64; default float32): the model is built, trained and sent in that dtype, as a user's
half-precision or double-precision model would be.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

MODEL_NAMES = ("logreg", "mlp", "cnn", "resnet20", "resnet18")
IMAGE_MODELS = ("cnn", "resnet20", "resnet18")
MODEL_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def parse_model(spec: str) -> tuple[str, torch.dtype]:
    """``(name, dtype)`` of a model spec ``"name"`` or ``"name:dtype=D"``.

    Raises
    ------
    ValueError
        For an unknown name, option or dtype (the message lists the allowed ones).
    """
    name, _, options = str(spec).partition(":")
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODEL_NAMES)}")
    dtype = torch.float32
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if key != "dtype" or value not in MODEL_DTYPES:
            raise ValueError(f"model option {option!r}: the only option is dtype={'|'.join(MODEL_DTYPES)}")
        dtype = MODEL_DTYPES[value]
    return name, dtype


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one linear layer on the flattened input (FedProx's Synthetic model).

    Starts at zero, as FedProx's and LEAF's logistic regression do: the loss is convex, and a
    random start was measured to persist (on Synthetic(0.5, 0.5), 40 rounds, three seeds ended
    1.2 points apart with random starts and 0.5 with zero), so the seed no longer changes it.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
        nn.init.zeros_(self.net[1].weight)
        nn.init.zeros_(self.net[1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MLP(nn.Module):
    """Two hidden layers with ReLU."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        numel = math.prod(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(numel, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNet(nn.Module):
    """LeNet-style CNN: two conv + max-pool blocks, two dense layers.

    5x5 kernels (LeNet-5) on inputs of 16 pixels and more; 3x3 kernels with padding on the 8x8
    digits, where 5x5 would leave nothing after two poolings.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        small = min(height, width) < 16
        k, pad = (3, 1) if small else (5, 0)
        c1, c2 = (16, 32) if small else (6, 16)
        self.conv1 = nn.Conv2d(channels, c1, k, padding=pad)
        self.conv2 = nn.Conv2d(c1, c2, k, padding=pad)
        h, w = height, width
        for _ in range(2):
            h, w = (h + 2 * pad - k + 1) // 2, (w + 2 * pad - k + 1) // 2
        self.fc1 = nn.Linear(c2 * h * w, 120 if not small else 64)
        self.fc2 = nn.Linear(self.fc1.out_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 of He et al. (2016) for CIFAR: 3 stages of 3 basic blocks, 16/32/64 channels (0.27 M params)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        c_in = 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet18(nn.Module):
    """ResNet-18 in its CIFAR form (3x3 stem, no max-pool; 4 stages of 2 basic blocks, 64-512
    channels; 11.17 M params): the BatchNorm-heavy model of federated vision benchmarks."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(64)
        blocks: list[nn.Module] = []
        c_in = 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            for i in range(2):
                blocks.append(_BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights.

    Parameters
    ----------
    name : str
        ``"logreg"``, ``"mlp"``, ``"cnn"`` (the LeNet-style CNN), ``"resnet20"`` or ``"resnet18"``, optionally with
        the weights' dtype: ``"cnn:dtype=float64"`` (:func:`parse_model`).
    input_shape : tuple
        Shape of one example: ``(C, H, W)`` (any model) or ``(F,)`` (``logreg``, ``mlp``).
    num_classes : int
        Output size.
    seed : int
        Seed of the initialisation (the global RNG state is restored afterwards).
    """
    classes = {"logreg": LogisticRegression, "mlp": MLP, "cnn": LeNet, "resnet20": ResNet20, "resnet18": ResNet18}
    name, dtype = parse_model(name)
    if name in IMAGE_MODELS and len(input_shape) != 3:
        raise ValueError(
            f"model {name!r} needs images (C, H, W), the dataset gives inputs of shape {tuple(input_shape)}: "
            "use logreg or mlp"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return classes[name](tuple(input_shape), int(num_classes)).to(dtype)
