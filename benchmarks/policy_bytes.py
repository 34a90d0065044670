"""Bytes of one reply under ``eden:bits=2`` with and without the default tensor policy, per model.

Predicted by each codec's size model (exact for fixed-width coding), envelopes and keys included,
for the BatchNorm test's model, ResNet-20 and ResNet-18 (CIFAR), at the app's ``min_numel=1`` and
the library's 1024. Usage::

    python -m benchmarks.policy_bytes
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flwr.app import ArrayRecord
from torch import nn

from fedquant.codecs import get_codec
from fedquant.records import RecordCodec
from fedquant.strategies import TensorPolicy
from simulations.models import build_model


def models() -> dict[str, nn.Module]:
    """The table's models (their initial weights: sizes do not depend on the values)."""
    return {
        "Linear-BatchNorm1d(1024) (the test's model)": nn.Sequential(
            nn.Linear(8, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 4)
        ),
        "resnet20 (CIFAR)": build_model("resnet20", (3, 32, 32), 10),
        "resnet18 (CIFAR)": build_model("resnet18", (3, 32, 32), 10),
    }


def main() -> int:
    codec, dense = get_codec("eden:bits=2"), get_codec("fp32")
    print("| model | `min_numel` | every tensor at `eden:bits=2` | with the default policy | extra | fp32 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, model in models().items():
        record = ArrayRecord(model.state_dict())
        own = TensorPolicy().tensor_codecs(list(record.keys()))
        for min_numel in (1, 1024):
            plain = RecordCodec(codec, min_numel).predict_bytes(record)
            policy = RecordCodec(codec, min_numel, own).predict_bytes(record)
            fp32 = RecordCodec(dense, min_numel).predict_bytes(record)
            extra = 100 * (policy - plain) / plain
            print(f"| {name} | {min_numel} | {plain:,} | {policy:,} | {extra:+.1f} % | {fp32:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
