"""The ResNet benchmark's row on a tiny CIFAR-shaped dataset through flwr-datasets (slow: trains ResNet-20)."""

from __future__ import annotations

import pytest

pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")


@pytest.mark.slow
def test_resnet20_row_has_finite_evaluation_and_both_codecs(capsys):
    from benchmarks.resnet_row import main

    code = main(["--models", "resnet20", "--rounds", "2", "--nodes", "2", "--train-size", "64", "--test-size", "16",
                 "--local-epochs", "1", "--min-local-steps", "0", "--batch-size", "32"])  # fmt: skip
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| resnet20")]
    assert code == 0 and len(rows) == 2
    fp32, eden = (line.split("|") for line in rows)
    assert "yes" in fp32[7] and "yes" in eden[7]  # finite evaluation every round
    assert float(fp32[4].replace(",", "")) > 10 * float(eden[4].replace(",", ""))  # bytes per round
    assert eden[11].strip() == "0"  # no honest reply rejected


def test_local_cifar_has_cifars_shape(tmp_path):
    from benchmarks.resnet_row import make_local_cifar
    from simulations.data import load_partition, load_test_set

    name = make_local_cifar(tmp_path / "cifar", train_size=40, test_size=10)
    part = load_partition(name, 0, 2, "iid", 0.5, 0)
    assert part.input_shape == (3, 32, 32) and part.num_classes == 10 and len(part) == 20
    assert len(load_test_set(name)) == 10
