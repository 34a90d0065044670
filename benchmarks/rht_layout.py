"""Which block layout of the ``rht+`` rotation loses less: vNMSE and bits per coordinate.

For each length, codec and data kind the script rotates the tensor with a layout of
:func:`fedquant.codecs.transforms.rht.block_layout`, encodes the rotated tensor with the codec,
decodes, rotates back and reports ``vNMSE = mean ||x_hat - x||^2 / ||x||^2`` over seeded draws
and the bits per coordinate of the payload (real bytes, envelope included; the ``rht+`` prefix
of the spec would add 4 bytes). The layouts:

* ``none``: no rotation (reference);
* ``pad``: the whole tensor padded with zeros to one power of two;
* ``blocks 2^K``: blocks of ``2**K`` and the rest padded to the next power of two;
* ``binary 2^K/2^M``: blocks of ``2**K``, the rest by its binary digits down to ``2**M``, the
  remainder padded.

Data: ``gauss`` (iid N(0, 1), which a rotation leaves iid Gaussian: only the padding counts),
``t2`` (iid Student-t with 2 degrees of freedom: heavy tails, where the rotation helps) and, with
``--real``, real client updates (the two 8192-element hidden weight matrices of the digits MLP of
:mod:`benchmarks.real_update_pairs`, 3 rounds x 5 clients: 30 tensors).

Usage::

    python -m benchmarks.rht_layout                                   # the table of docs/rht_layout.md
    python -m benchmarks.rht_layout --sizes 10,1000 --codecs "qsgd:levels=7"
    python -m benchmarks.rht_layout --real
    python -m benchmarks.rht_layout --markdown /tmp/rht_layout.md     # the table also as a file
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.codec_throughput import parse_size
from benchmarks.specs import parse_codec_list
from fedquant.codecs import get_codec
from fedquant.codecs.transforms.rht import RandomizedHadamard

LAYOUTS: dict[str, tuple[int, int | None] | None] = {
    "none": None,
    "pad": (62, None),
    "blocks 2^8": (8, None),
    "blocks 2^9": (9, None),
    "blocks 2^10": (10, None),
    "blocks 2^11": (11, None),
    "blocks 2^12": (12, None),
    "blocks 2^13": (13, None),
    "blocks 2^16": (16, None),
    "blocks 2^20": (20, None),
    "binary 2^16/2^0": (16, 0),
    "binary 2^16/2^8": (16, 8),
}


def sample(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=gen)
    if kind == "t2":  # Student-t(2): N(0,1) / sqrt(chi2_2 / 2), chi2_2 = 2 Exp(1)
        z = torch.randn(n, generator=gen)
        e = torch.empty(n).exponential_(generator=gen)
        return z / e.sqrt()
    raise ValueError(kind)


def measure(spec: str, layout: tuple[int, int | None] | None, tensors: list[torch.Tensor]) -> tuple[float, float]:
    """(mean vNMSE, mean bits per coordinate) of ``spec`` behind the layout over ``tensors``."""
    codec = get_codec(spec)
    rot = RandomizedHadamard() if layout is None else RandomizedHadamard(max_log2=layout[0], min_log2=layout[1])
    err = 0.0
    bits = 0.0
    for d, x in enumerate(tensors):
        x = x.reshape(-1).float()
        n = x.numel()
        seed = 7 + d
        y = x if layout is None else rot.forward(x, seed)
        payload = codec.encode(y, seed=seed)
        y_hat = codec.decode(payload, seed=seed, side_info=y if codec.needs_side_info else None)
        x_hat = y_hat if layout is None else rot.inverse(y_hat, n, seed)
        err += float((x_hat.double() - x.double()).pow(2).sum() / x.double().pow(2).sum())
        bits += len(payload) * 8 / n
    return err / len(tensors), bits / len(tensors)


def real_updates() -> list[torch.Tensor]:
    """The hidden weight matrices' updates of the P2 clients of a short digits-MLP run."""
    from benchmarks.real_update_pairs import collect_pairs

    pairs, _, _ = collect_pairs(rounds=3, clients=10, min_numel=4096)
    return [x for round_pairs in pairs for x, _ in round_pairs]


def print_row(label: str, specs: list[str], layouts: dict, tensors: list[torch.Tensor], lines: list[str]) -> None:
    for spec in specs:
        cells = [f"{v:.4g} @ {b:.3f}" for v, b in (measure(spec, lay, tensors) for lay in layouts.values())]
        emit(lines, f"| {label} | {spec} | " + " | ".join(cells) + " |")


def emit(lines: list[str], line: str) -> None:
    """Print a line of the table and keep it for ``--markdown``."""
    print(line, flush=True)
    lines.append(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", default="qsgd:levels=7;dqsg:levels=2,coding=entropy")
    ap.add_argument("--sizes", default="10,1000,1048576,1572864,25M")
    ap.add_argument("--data", default="gauss,t2")
    ap.add_argument("--layouts", help="comma-separated layout names (default: all)")
    ap.add_argument("--real", action="store_true", help="real digits-MLP updates instead of --sizes/--data")
    ap.add_argument("--markdown", type=Path, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    lines: list[str] = []
    status = run(args, lines)
    if args.markdown:
        command = "python -m benchmarks.rht_layout " + " ".join(argv if argv is not None else sys.argv[1:])
        args.markdown.write_text(f"Written by `{command.strip()}`.\n\n" + "\n".join(lines) + "\n")
    return status


def run(args: argparse.Namespace, lines: list[str]) -> int:
    layouts = LAYOUTS if not args.layouts else {k: LAYOUTS[k] for k in args.layouts.split(",")}
    specs = parse_codec_list(args.codecs)
    emit(lines, "| n, data | codec | " + " | ".join(layouts) + " |")
    emit(lines, "|---|---|" + "---|" * len(layouts))
    if args.real:
        tensors = real_updates()
        print_row(f"{tensors[0].numel():,}, real ({len(tensors)} updates)", specs, layouts, tensors, lines)
        return 0
    for n in [parse_size(s) for s in args.sizes.split(",")]:
        draws = max(1, min(200, (1 << 21) // n))
        for kind in args.data.split(","):
            tensors = [sample(kind, n, 1000 + d) for d in range(draws)]
            print_row(f"{n:,}, {kind}", specs, layouts, tensors, lines)
    emit(lines, "\ncells: vNMSE @ bits/coordinate (payload bytes), mean of max(1, min(200, 2^21 / n)) draws")
    return 0


if __name__ == "__main__":
    sys.exit(main())
