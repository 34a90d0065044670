"""ResNets in the simulation: uplink bytes and seconds per round, finite evaluation, final accuracy.

The app's ServerApp and ClientApp (``simulations.server_app.run_server``, ``simulations.client_app``)
run the rounds on the test suite's in-process grid (no Ray: the clients of a round train one after
another in this process), for each model and codec asked. The data come through flwr-datasets:
``--dataset cifar10`` (Hugging Face Hub, online) or, by default, ``local``: a dataset of CIFAR-10's
shape (32x32 RGB, 10 classes, its ``img``/``label`` columns) made here as Parquet files, each class a
fixed random colour pattern under Gaussian noise, read as ``hf:<folder>``, so the whole path is the
one CIFAR-10 takes. Training takes the app's settings unless given. Exits 1 when an evaluation of
any round is not finite. Usage::

    python -m benchmarks.resnet_row --local-epochs 1 --min-local-steps 0 --batch-size 32   # docs/models.md's row
    python -m benchmarks.resnet_row --dataset cifar10 --nodes 10     # the real CIFAR-10 (online)
    python -m benchmarks.resnet_row --dataset digits --models resnet20 --codecs eden:bits=2 --nodes 10
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

CLASSES = 10
SIDE = 32


def make_local_cifar(folder: Path, train_size: int, test_size: int, seed: int = 0, noise: float = 0.3) -> str:
    """A CIFAR-10-shaped dataset in the Hugging Face layout (``data/train-*.parquet``, ``data/test-*.parquet``)
    under ``folder``; returns its dataset name for the app (``hf:<folder>``)."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    templates = rng.uniform(0.0, 1.0, size=(CLASSES, 4, 4, 3))  # coarse colour blocks, upsampled to 32x32
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=CLASSES)})

    def split(n: int) -> datasets.Dataset:
        labels = rng.integers(0, CLASSES, size=n)
        base = templates[labels].repeat(SIDE // 4, axis=1).repeat(SIDE // 4, axis=2)
        pixels = np.clip(base + noise * rng.standard_normal(base.shape), 0.0, 1.0)
        images = [Image.fromarray((255 * p).astype(np.uint8)) for p in pixels]
        return datasets.Dataset.from_dict({"img": images, "label": labels.tolist()}, features=features)

    (folder / "data").mkdir(parents=True, exist_ok=True)
    split(train_size).to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    split(test_size).to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    return f"hf:{folder}"


def run_one(dataset: str, model: str, codec: str, args: argparse.Namespace, out: Path) -> dict:
    """One federation through the app's ServerApp on the in-process grid; the row's numbers."""
    from simulations.client_app import app
    from simulations.data import load_test_set
    from simulations.models import build_model
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    training = {k: getattr(args, k) for k in ("local_epochs", "min_local_steps", "batch_size", "learning_rate")}
    history = run_server(
        InProcessGrid(app, args.nodes), {}, seed=args.seed, out_dir=str(out), run_name=f"{model}-{codec}",
        overwrite=True, dataset=dataset, model=model, codec=codec, rounds=args.rounds,
        fraction_train=args.fraction_train, **{k: v for k, v in training.items() if v is not None},
    )  # fmt: skip
    rows = json.loads((history.folder / "history.json").read_text())["rounds"]
    trained = [r for r in rows if r["round"] > 0]
    elapsed = [r["elapsed-seconds"] for r in rows]
    test = load_test_set(dataset)
    params = sum(p.numel() for p in build_model(model, test.input_shape, test.num_classes).parameters())
    return {
        "model": model,
        "codec": codec,
        "params": params,
        "uplink": float(np.mean([r["uplink-bytes"] for r in trained])),
        "dense": float(np.mean([r["uplink-bytes-dense"] for r in trained])),
        "seconds": float(np.mean(np.diff(elapsed))) if len(elapsed) > 1 else float("nan"),
        "finite": all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows),
        "accuracy": rows[-1]["accuracy"],
        "loss": rows[-1]["loss"],
        "losses": [r["loss"] for r in rows],
        "clamped": int(sum(r.get("policy-clamped-values", 0) for r in trained)),
        "rejected": int(sum(r.get("rejected-replies", 0) for r in trained)),
    }


def _row(r: dict) -> str:
    finite = "yes" if r["finite"] else "NO"
    losses = " / ".join("NaN" if loss is None or not math.isfinite(loss) else f"{loss:.3f}" for loss in r["losses"])
    return (
        f"| {r['model']} | {r['params']:,} | `{r['codec']}` | {r['uplink']:,.0f} | {r['dense'] / r['uplink']:.1f} | "
        f"{r['seconds']:.1f} | {finite} | {r['accuracy']:.4f} | {losses} | {r['clamped']} | {r['rejected']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="local", help="local (CIFAR-10's shape, made here), cifar10, digits, ...")
    parser.add_argument("--models", default="resnet20,resnet18")
    parser.add_argument("--codecs", default="fp32,eden:bits=2", help="comma-separated specs (eden:bits=2: the default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--fraction-train", type=float, default=0.5)
    parser.add_argument("--local-epochs", type=int, default=None, help="default: the app's")
    parser.add_argument("--min-local-steps", type=int, default=None, help="default: the app's")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the app's")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the app's")
    parser.add_argument("--train-size", type=int, default=800, help="local dataset: training images")
    parser.add_argument("--test-size", type=int, default=200, help="local dataset: test images")
    parser.add_argument("--noise", type=float, default=0.3, help="local dataset: pixel noise (std, pixels in [0, 1])")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    print("| model | params | codec | uplink bytes/round | x fp32 | s/round | finite eval every round | "
          "final accuracy | test loss per round (0 first) | clamped | rejected |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|")
    failed = False
    with tempfile.TemporaryDirectory(prefix="resnet_row_") as tmp:
        dataset = args.dataset
        if dataset == "local":
            folder = Path(tmp) / "local-cifar"
            dataset = make_local_cifar(folder, args.train_size, args.test_size, args.seed, args.noise)
        for model in args.models.split(","):
            for codec in args.codecs.split(","):
                r = run_one(dataset, model, codec, args, Path(tmp) / "runs")
                failed |= not r["finite"]
                print(_row(r), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
