"""Datasets for the simulations: the offline default (scikit-learn digits), Synthetic(alpha, beta), Hub datasets.

Every dataset comes out as float32 inputs (images ``(N, C, H, W)``, or feature vectors ``(N, F)``
for ``synthetic``) and int64 labels, already normalised, as :class:`TensorData`. Clients load
their partition with :func:`load_partition`; the server evaluates the global model on
:func:`load_test_set`, a split no client trains on.

Names
-----
``digits``
    scikit-learn's ``load_digits``: 1797 handwritten digits, 8x8 grey, 10 classes; ships with
    scikit-learn, so no download. 20 % (stratified, fixed) is the server's test set.
``synthetic``, ``synthetic:alpha=A,beta=B,seed=S``
    Synthetic(alpha, beta) of FedProx / LEAF (:mod:`simulations.synthetic`): 60 features, 10
    classes, every client its own teacher and feature distribution, generated on the fly from
    ``(S, partition id)``, for any number of clients (default alpha = beta = 1, S = 0). The
    ``partitioning`` options do not apply: a client's data is its own by construction.
``mnist``, ``cifar10``, ``cifar100``, ``femnist``
    Hugging Face Hub datasets through flwr-datasets (``pip install -e ".[hub]"``, internet on the
    first use, then the local Hugging Face cache).
``hf:<path>``
    Any Hugging Face dataset (Hub name or local directory) with one ``Image`` column and one
    ``ClassLabel`` column; a ``test`` split when it has one, else 10 % of ``train`` held out.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from simulations import synthetic

PARTITIONINGS = ("iid", "dirichlet")
# Fixed, so that every seed and every partitioning is scored on the same test digits.
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0
_HELD_OUT_FRACTION = 0.1


@dataclass(frozen=True)
class HubSpec:
    """Where a Hub dataset lives and which columns hold the image and the label."""

    path: str
    image_key: str | None = None  # None: the dataset's Image column
    label_key: str | None = None  # None: the dataset's ClassLabel column


HUB_DATASETS: dict[str, HubSpec] = {
    "mnist": HubSpec("ylecun/mnist", "image", "label"),
    "cifar10": HubSpec("uoft-cs/cifar10", "img", "label"),
    "cifar100": HubSpec("uoft-cs/cifar100", "img", "fine_label"),
    "femnist": HubSpec("flwrlabs/femnist", "image", "character"),
}
HF_PREFIX = "hf:"


@dataclass
class TensorData:
    """Inputs ``x`` (float32, N x C x H x W, or N x F) and labels ``y`` (int64, N), with the class count."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


def dataset_names() -> list[str]:
    """Names accepted by ``dataset`` (besides ``synthetic:<options>`` and ``hf:<path>``)."""
    return ["digits", synthetic.PREFIX, *HUB_DATASETS]


def check_dataset_name(name: str) -> None:
    """Raise ``ValueError`` with the accepted names when ``name`` is not a known dataset.

    A ``synthetic:<options>`` name with a bad option raises with a sentence naming it.
    """
    if synthetic.is_synthetic(name):
        synthetic.parse_spec(name)
        return
    if name in dataset_names() or (name.startswith(HF_PREFIX) and len(name) > len(HF_PREFIX)):
        return
    raise ValueError(
        f"unknown dataset {name!r}; use one of {', '.join(dataset_names())}, "
        "'synthetic:alpha=..,beta=..' or 'hf:<path or hub name>'"
    )


def check_partitioning(partitioning: str, alpha: float) -> None:
    """Raise ``ValueError`` for an unknown partitioning or a non-positive Dirichlet alpha."""
    if partitioning not in PARTITIONINGS:
        raise ValueError(f"unknown partitioning {partitioning!r}; use one of {', '.join(PARTITIONINGS)}")
    if partitioning == "dirichlet" and not alpha > 0:
        raise ValueError(f"dirichlet-alpha must be > 0, got {alpha}")


def load_partition(
    dataset: str, partition_id: int, num_partitions: int, partitioning: str = "iid", alpha: float = 0.5, seed: int = 0
) -> TensorData:
    """The training data of one client.

    Parameters
    ----------
    dataset : str
        A name from :func:`dataset_names` or ``hf:<path>``.
    partition_id, num_partitions : int
        Which of how many clients (``partition-id`` / ``num-partitions`` of the node config).
    partitioning : {"iid", "dirichlet"}
        ``iid``: a seeded shuffle cut into equal parts. ``dirichlet``: per class, shares drawn from
        Dirichlet(alpha) over the clients (small alpha: few classes per client).
    alpha : float
        Dirichlet concentration.
    seed : int
        Seed of the partitioning; the same seed gives every client the same examples. Not used by
        ``synthetic``, whose population has its own seed (``synthetic:seed=S``).
    """
    check_dataset_name(dataset)
    check_partitioning(partitioning, alpha)
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}")
    if synthetic.is_synthetic(dataset):
        x, y = synthetic.train_split(synthetic.parse_spec(dataset), partition_id)
        return TensorData(x, y, synthetic.NUM_CLASSES)
    if dataset == "digits":
        train = _digits_split()[0]
        parts = _partition_indices(tuple(train.y.tolist()), num_partitions, partitioning, alpha, seed)
        idx = torch.as_tensor(parts[partition_id], dtype=torch.long)
        return TensorData(train.x[idx], train.y[idx], train.num_classes)
    fds, spec = _federated_dataset(dataset, num_partitions, partitioning, float(alpha), int(seed))
    return _to_tensors(fds.load_partition(partition_id, "train"), spec)


def load_test_set(dataset: str) -> TensorData:
    """The held-out set on which the server scores the global model.

    ``synthetic``: the held-out 10 % of clients ``0 .. 99`` of the population, pooled.
    """
    check_dataset_name(dataset)
    if synthetic.is_synthetic(dataset):
        x, y = synthetic.test_split(synthetic.parse_spec(dataset))
        return TensorData(x, y, synthetic.NUM_CLASSES)
    if dataset == "digits":
        return _digits_split()[1]
    fds, spec = _federated_dataset(dataset, 1, "iid", 1.0, 0)
    return _to_tensors(fds.load_split("test"), spec)


# --- digits ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _digits_split() -> tuple[TensorData, TensorData]:
    # The file behind sklearn.datasets.load_digits, read without importing scikit-learn: a
    # simulated client is a fresh process, and importing sklearn costs it seconds.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits dataset ships with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x = (table[:, :-1].reshape(-1, 1, 8, 8) / 16.0 - 0.5) / 0.5  # pixel values are 0..16
    y = table[:, -1].astype(np.int64)
    # Stratified split: the same share of every class goes to the test set.
    rng = np.random.default_rng(_DIGITS_SPLIT_SEED)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == c))
        test[members[: round(_DIGITS_TEST_FRACTION * len(members))]] = True

    def wrap(mask: np.ndarray) -> TensorData:
        return TensorData(torch.from_numpy(x[mask].copy()), torch.from_numpy(y[mask].copy()), 10)

    return wrap(~test), wrap(test)


@functools.lru_cache(maxsize=8)
def _partition_indices(
    labels: tuple[int, ...], num_partitions: int, partitioning: str, alpha: float, seed: int
) -> list[np.ndarray]:
    """Index lists, one per client; every example goes to exactly one client."""
    y = np.asarray(labels)
    if num_partitions > len(y):
        raise ValueError(f"{num_partitions} partitions of {len(y)} examples would leave clients empty")
    rng = np.random.default_rng(seed)
    if partitioning == "iid":
        return np.array_split(rng.permutation(len(y)), num_partitions)
    return _dirichlet_indices(y, num_partitions, alpha, rng)


def _dirichlet_indices(y: np.ndarray, num_partitions: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    # As flwr-datasets' DirichletPartitioner: per class, client shares ~ Dir(alpha); redraw until
    # every client holds at least one example (bounded, then fall back to moving single examples).
    classes = np.unique(y)
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for c in classes:
            members = rng.permutation(np.flatnonzero(y == c))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, chunk in enumerate(np.split(members, cuts)):
                parts[client].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= 1:
            return out
    # Give each empty client one example from the largest client.
    for i in range(num_partitions):
        if len(out[i]) == 0:
            donor = int(np.argmax([len(p) for p in out]))
            out[i], out[donor] = out[donor][-1:], out[donor][:-1]
    return out


# --- Hugging Face datasets through flwr-datasets ----------------------------------------------


def _hub_spec(dataset: str) -> HubSpec:
    if dataset.startswith(HF_PREFIX):
        return HubSpec(dataset[len(HF_PREFIX) :])
    return HUB_DATASETS[dataset]


@functools.lru_cache(maxsize=4)
def _federated_dataset(
    dataset: str, num_partitions: int, partitioning: str, alpha: float, seed: int
) -> tuple[Any, HubSpec]:
    try:
        import datasets
        from flwr_datasets import FederatedDataset
        from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner
        from flwr_datasets.preprocessor import Divider
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(f"dataset {dataset!r} needs flwr-datasets: pip install -e '.[hub]'") from err
    spec = _hub_spec(dataset)
    if spec.image_key is None or spec.label_key is None:
        # A generic dataset: find its columns (load_dataset reads the local cache / files).
        features = datasets.load_dataset(spec.path, split="train").features
        spec = HubSpec(
            spec.path,
            spec.image_key or _column_of(features, datasets.Image, spec.path, "Image"),
            spec.label_key or _column_of(features, datasets.ClassLabel, spec.path, "ClassLabel"),
        )
    if partitioning == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
    else:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by=spec.label_key, alpha=alpha, min_partition_size=1, seed=seed
        )
    splits = datasets.get_dataset_split_names(spec.path)
    preprocessor = None
    if "test" not in splits:
        preprocessor = Divider({"train": 1 - _HELD_OUT_FRACTION, "test": _HELD_OUT_FRACTION}, divide_split="train")
    fds = FederatedDataset(dataset=spec.path, partitioners={"train": partitioner}, preprocessor=preprocessor, seed=seed)
    return fds, spec


def _column_of(features: Any, kind: type, path: str, what: str) -> str:
    for name, feature in (features or {}).items():
        if isinstance(feature, kind):
            return name
    raise ValueError(f"dataset {path!r} has no {what} column (features: {list(features or {})})")


def _to_tensors(split: Any, spec: HubSpec) -> TensorData:
    images = split.with_format("numpy")[spec.image_key]
    x = np.asarray(images, dtype=np.float32)
    if x.ndim == 3:  # grey: N x H x W
        x = x[:, None]
    else:  # colour: N x H x W x C
        x = x.transpose(0, 3, 1, 2)
    x = (x / 255.0 - 0.5) / 0.5
    y = np.asarray(split[spec.label_key], dtype=np.int64)
    num_classes = split.features[spec.label_key].num_classes
    return TensorData(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y), int(num_classes))
