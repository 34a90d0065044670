"""Datasets and partitioning: the offline digits default and the flwr-datasets (Hugging Face) path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from simulations.data import load_partition, load_test_set


def _all_parts(dataset: str, n: int, partitioning: str, alpha: float = 0.5, seed: int = 0):
    return [load_partition(dataset, i, n, partitioning, alpha, seed) for i in range(n)]


def _rows(data) -> set[bytes]:
    return {row.numpy().tobytes() + bytes([int(label)]) for row, label in zip(data.x, data.y)}


def test_digits_test_set_is_fixed_and_normalised():
    test = load_test_set("digits")
    assert test.x.shape == (359, 1, 8, 8)  # 20 % of each class, rounded and test.x.dtype == torch.float32
    assert test.y.dtype == torch.int64 and set(test.y.tolist()) == set(range(10))
    assert float(test.x.min()) == -1.0 and float(test.x.max()) == 1.0  # pixels 0..16 -> [-1, 1]


@pytest.mark.parametrize("partitioning", ["iid", "dirichlet"])
def test_digits_partitions_cover_the_training_set_once(partitioning):
    parts = _all_parts("digits", 20, partitioning)
    assert sum(len(p) for p in parts) == 1797 - 359
    assert all(len(p) >= 1 for p in parts)
    # load_digits holds a few duplicate images, so compare multisets of (image, label) rows.
    seen = [r for p in parts for r in (row.numpy().tobytes() + bytes([int(y)]) for row, y in zip(p.x, p.y))]
    train = load_partition("digits", 0, 1, "iid")
    assert sorted(seen) == sorted(row.numpy().tobytes() + bytes([int(y)]) for row, y in zip(train.x, train.y))
    # No training example is in the server's test set.
    assert not (_rows(train) & _rows(load_test_set("digits")))


def test_iid_partitions_are_balanced_and_seeded():
    parts = _all_parts("digits", 20, "iid")
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(len(set(p.y.tolist())) >= 8 for p in parts)  # ~72 examples of 10 balanced classes
    again = load_partition("digits", 3, 20, "iid", seed=0)
    other = load_partition("digits", 3, 20, "iid", seed=1)
    assert torch.equal(again.x, parts[3].x)
    assert not torch.equal(other.x, parts[3].x)


def test_dirichlet_skews_labels():
    # Dir(0.1) over 20 clients puts nearly all of a class on a few clients, so a client sees few
    # classes; iid clients see (almost) all 10.
    skewed = np.mean([len(set(p.y.tolist())) for p in _all_parts("digits", 20, "dirichlet", alpha=0.1)])
    iid = np.mean([len(set(p.y.tolist())) for p in _all_parts("digits", 20, "iid")])
    assert skewed < 6 < iid


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nope", 0, 2), "unknown dataset"),
        (("digits", 0, 2, "shards"), "unknown partitioning"),
        (("digits", 0, 2, "dirichlet", 0.0), "dirichlet-alpha"),
        (("digits", 2, 2), "partition-id"),
        (("digits", 0, 5000), "empty"),
    ],
)
def test_bad_requests_raise(args, message):
    with pytest.raises(ValueError, match=message):
        load_partition(*args)


# --- flwr-datasets on a tiny dataset in the Hugging Face format, built locally ---------------


def _tiny_hf_dataset(folder, *, with_test: bool, colour: bool = False):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("flwr_datasets")
    from PIL import Image

    rng = np.random.default_rng(0)
    shape = (12, 12, 3) if colour else (12, 12)
    features = datasets.Features({"picture": datasets.Image(), "digit": datasets.ClassLabel(num_classes=3)})

    def split(n):
        images = [Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)) for _ in range(n)]
        return datasets.Dataset.from_dict({"picture": images, "digit": [i % 3 for i in range(n)]}, features=features)

    (folder / "data").mkdir(parents=True)
    split(60).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    if with_test:
        split(15).to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    return f"hf:{folder}"


@pytest.mark.parametrize("partitioning", ["iid", "dirichlet"])
def test_hf_dataset_through_flwr_datasets(tmp_path, partitioning):
    name = _tiny_hf_dataset(tmp_path / "tiny", with_test=True)
    parts = _all_parts(name, 3, partitioning, alpha=1.0, seed=partitioning == "iid")
    assert sum(len(p) for p in parts) == 60
    for p in parts:
        assert p.x.shape[1:] == (1, 12, 12) and p.x.dtype == torch.float32
        assert -1.0 <= float(p.x.min()) and float(p.x.max()) <= 1.0
        assert p.num_classes == 3 and set(p.y.tolist()) <= {0, 1, 2}
    assert len({r for p in parts for r in _rows(p)}) == 60  # disjoint
    test = load_test_set(name)
    assert len(test) == 15 and test.input_shape == (1, 12, 12)


def test_hf_dataset_without_test_split_holds_out_part_of_train(tmp_path):
    name = _tiny_hf_dataset(tmp_path / "notest", with_test=False, colour=True)
    parts = _all_parts(name, 2, "iid")
    test = load_test_set(name)
    assert test.input_shape == (3, 12, 12)
    assert sum(len(p) for p in parts) + len(test) == 60 and len(test) == 6  # 10 % held out
    assert not (set().union(*(_rows(p) for p in parts)) & _rows(test))
