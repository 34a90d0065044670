"""Bits per parameter as measured on the wire, for README's codec table (a markdown table, exits 0).

Every setting encodes one update of the simulation's default model (the digits CNN, every float
tensor, as ``quantize_mod`` sends it: tensors below ``min_numel`` go as they are) and counts the
bytes of the payloads, envelopes included. The update is Gaussian with a different scale per
tensor (fixed-width settings do not depend on the values; entropy-coded ones do, and on real
updates they come out lower, see the sweep). ``vNMSE`` is ``||x^ - x||^2 / ||x||^2`` over the
encoded tensors.

Usage::

    python -m benchmarks.codec_table
    python -m benchmarks.codec_table --codecs "qsgd;eden:bits=2" --model mlp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.specs import parse_codec_list
from fedquant.codecs import available_codecs, get_codec
from fedquant.protocol import DEFAULT_MIN_NUMEL
from simulations.models import build_model

FRONTIER = [
    "qsgd:coding=entropy",
    "dqsg:coding=entropy",
    "eden:bits=1",
    "eden:bits=2",
    "ecdq:bits=1",
    "ecdq:bits=2",
]


def model_update(model_name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Gaussian update for every parameter of the model, scaled per tensor."""
    model = build_model(model_name, (1, 8, 8), 10, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=gen) * float(torch.rand(1, generator=gen) * 0.1 + 1e-3)
        for name, p in model.state_dict().items()
        if p.is_floating_point()
    }


def measure(spec: str, update: dict[str, torch.Tensor], min_numel: int) -> tuple[float, float]:
    """(bits per parameter over all tensors, vNMSE over the encoded ones) of one setting."""
    codec = get_codec(spec)
    total_bits, numel, err, norm = 0, 0, 0.0, 0.0
    for i, x in enumerate(update.values()):
        numel += x.numel()
        if x.numel() < min_numel:
            total_bits += 32 * x.numel()
            continue
        payload = codec.encode(x, seed=i)
        total_bits += 8 * len(payload)
        side = {"side_info": x} if codec.needs_side_info else {}
        y = codec.decode(payload, i, **side)
        err += float(((y - x).double() ** 2).sum())
        norm += float((x.double() ** 2).sum())
    return total_bits / numel, err / norm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default=None, help="';'-separated specs (default: every codec + frontier rows)")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--min-numel", type=int, default=DEFAULT_MIN_NUMEL)
    args = parser.parse_args(argv)
    specs = parse_codec_list(args.codecs) if args.codecs else [*available_codecs(), *FRONTIER]
    update = model_update(args.model)
    params = sum(x.numel() for x in update.values())
    print(f"{args.model}: {params:,} parameters in {len(update)} float tensors (min_numel {args.min_numel})\n")
    print("| spec | unbiased | bits/param | vNMSE |")
    print("|---|---|---:|---:|")
    for spec in specs:
        codec = get_codec(spec)
        bits, vnmse = measure(spec, update, args.min_numel)
        side = " (side info)" if codec.needs_side_info else ""
        print(f"| `{spec}` | {'yes' if codec.unbiased else 'no'}{side} | {bits:.2f} | {vnmse:.4g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
