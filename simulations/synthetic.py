"""Synthetic(alpha, beta): the federated dataset of FedProx (Li et al., MLSys 2020), as in LEAF.

Every client ``k`` has its own softmax-regression teacher and its own feature distribution:

- ``u_k ~ N(0, alpha)``, ``W_k ~ N(u_k, 1)`` (60 x 10), ``b_k ~ N(u_k, 1)`` (10);
- ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)`` (60), ``x ~ N(v_k, Sigma)`` with
  ``Sigma = diag(j ** -1.2)``, ``j = 1..60``;
- ``y = argmax(softmax(x W_k + b_k))``.

As in the authors' generator (and LEAF's), ``alpha`` and ``beta`` are the standard deviations
passed to ``numpy``'s ``normal``. ``alpha`` controls how much the clients' teachers differ,
``beta`` how much their features do; ``synthetic:alpha=0,beta=0`` still differs across clients
through ``W_k ~ N(0, 1)``.

Client sizes follow LEAF's ``get_num_samples``: ``min(floor(lognormal(3, 2)) + 5, 1000)``, a
heavy (power-law-like) tail, median about 25. Each client keeps the first 90 % (``int(0.9 n)``,
as FedProx's generator) for training and holds out the rest.

Scale: a client's data is drawn from a generator seeded with ``(seed, partition id)`` alone
(``seed`` is the dataset's, ``synthetic:seed=3``, default 0; not the run's seed), so
any one client is generated in O(its size) time and memory, whatever the number of clients; no
client's data is ever materialised for another. The server's test set pools the held-out 10 %
of the fixed clients ``0 .. TEST_CLIENTS - 1`` (with fewer registered clients, the clients
beyond those registered are unseen ones of the same population).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

PREFIX = "synthetic"
NUM_FEATURES = 60
NUM_CLASSES = 10
TRAIN_FRACTION = 0.9
TEST_CLIENTS = 100
# LEAF's get_num_samples: lognormal(3, 2) rounded down, plus 5, at most 1000.
SIZE_LOG_MEAN, SIZE_LOG_SIGMA, MIN_SAMPLES, MAX_SAMPLES = 3.0, 2.0, 5, 1000
_STREAM_TAG = 0x5EED_F00D  # separates this generator's streams from any other use of (seed, pid)


def feature_variances() -> np.ndarray:
    """The diagonal of Sigma: ``j ** -1.2`` for features ``j = 1..60``."""
    return np.arange(1, NUM_FEATURES + 1, dtype=np.float64) ** -1.2


@dataclass(frozen=True)
class SyntheticSpec:
    """Synthetic(alpha, beta) with the seed of its client population.

    ``alpha``, ``beta``: heterogeneity of the teachers and of the features (finite, >= 0).
    ``seed``: which population; the dataset is fixed by it, as a generated LEAF dataset is, and
    does not change with the run's seed (that one samples clients, initialises the model, ...).
    """

    alpha: float = 1.0
    beta: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"synthetic {name} must be a finite number >= 0, got {value}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"synthetic seed must be in [0, 2**63), got {self.seed}")


def is_synthetic(name: str) -> bool:
    """Whether a dataset name is ``synthetic`` or ``synthetic:<options>``."""
    return name == PREFIX or name.startswith(PREFIX + ":")


def parse_spec(name: str) -> SyntheticSpec:
    """``"synthetic"`` -> alpha = beta = 1, seed 0; ``"synthetic:alpha=0.5,beta=0.5,seed=3"`` -> those.

    Raises ``ValueError`` naming the problem for any other option, a repeated one, or a value out
    of range.
    """
    if not is_synthetic(name):
        raise ValueError(f"{name!r} is not a synthetic dataset name (synthetic or synthetic:alpha=..,beta=..)")
    options = name[len(PREFIX) + 1 :]
    kinds = {"alpha": float, "beta": float, "seed": int}
    values: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in kinds:
            raise ValueError(f"synthetic dataset option {item!r}: use alpha=<number>, beta=<number>, seed=<int>")
        if key in values:
            raise ValueError(f"synthetic dataset option {key!r} given twice in {name!r}")
        try:
            values[key] = kinds[key](text.strip())
        except ValueError as err:
            raise ValueError(f"synthetic dataset option {key}={text!r} is not a {kinds[key].__name__}") from err
    return SyntheticSpec(**values)


def _generator(seed: int, partition_id: int) -> np.random.Generator:
    if partition_id < 0:
        raise ValueError(f"partition-id must be >= 0, got {partition_id}")
    return np.random.default_rng(np.random.SeedSequence([_STREAM_TAG, int(seed), int(partition_id)]))


def num_samples(spec: SyntheticSpec, partition_id: int) -> int:
    """How many examples (train + held out) client ``partition_id`` has, without generating them."""
    return _draw_size(_generator(spec.seed, partition_id))


def _draw_size(rng: np.random.Generator) -> int:
    drawn = int(rng.lognormal(SIZE_LOG_MEAN, SIZE_LOG_SIGMA))  # floor, as LEAF's astype(int)
    return min(drawn + MIN_SAMPLES, MAX_SAMPLES)


@functools.lru_cache(maxsize=8)  # bounded: an actor serves many clients one after the other
def client_data(spec: SyntheticSpec, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """All examples of one client: features ``(n, 60)`` float32 and labels ``(n,)`` int64 (read-only).

    Deterministic in ``(spec, partition_id)``; costs O(n) whatever the number of clients.
    """
    rng = _generator(spec.seed, partition_id)
    n = _draw_size(rng)  # first draw: num_samples() reads the same number
    u = rng.normal(0.0, spec.alpha)
    w = rng.normal(u, 1.0, (NUM_FEATURES, NUM_CLASSES))
    b = rng.normal(u, 1.0, NUM_CLASSES)
    big_b = rng.normal(0.0, spec.beta)
    v = rng.normal(big_b, 1.0, NUM_FEATURES)
    # N(v, diag(Sigma)) without a Cholesky factor: the covariance is diagonal.
    x = v + np.sqrt(feature_variances()) * rng.standard_normal((n, NUM_FEATURES))
    y = np.argmax(x @ w + b, axis=1)  # softmax is monotone: its argmax is the logits' argmax
    x, y = x.astype(np.float32), y.astype(np.int64)
    x.setflags(write=False)  # cached and shared: callers copy what they hand out
    y.setflags(write=False)
    return x, y


def split_point(n: int) -> int:
    """Examples ``[:split_point(n)]`` train, the rest are held out (FedProx: ``int(0.9 n)``)."""
    return int(TRAIN_FRACTION * n)


def train_split(spec: SyntheticSpec, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples client ``partition_id`` trains on."""
    x, y = client_data(spec, partition_id)
    cut = split_point(len(y))
    return torch.from_numpy(x[:cut].copy()), torch.from_numpy(y[:cut].copy())


def test_split(spec: SyntheticSpec, clients: int = TEST_CLIENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's test set: the held-out examples of clients ``0 .. clients - 1``, pooled."""
    xs, ys = [], []
    for pid in range(clients):
        x, y = client_data(spec, pid)
        cut = split_point(len(y))
        xs.append(x[cut:])
        ys.append(y[cut:])
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
