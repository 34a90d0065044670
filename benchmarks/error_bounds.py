"""What error feedback does with each codec: declared bound, exact error on a Gaussian, scale (a table, exits 0).

For every codec spec (default: each registered quantizer with its defaults, plus a few
sub-1-bit settings), the quantizer's declared ``error_bound`` (``omega`` for unbiased codecs)
for a 2^16-element tensor, its ``expected_error`` on a Gaussian tensor of that size (exact where
the quantizer has a closed form, else the bound), the measured relative error of one
encode/decode, and what ``ef+`` does: the scale ``1 / (1 + omega)`` it applies, keeps the codec
as it is, or refuses it. Usage::

    python -m benchmarks.error_bounds
    python -m benchmarks.error_bounds --codecs "eden:bits=0.5;terngrad;qsgd:levels=2"
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
from fedquant.codecs.transforms.error_feedback import ef_scale

EXTRA = ["qsgd:levels=2", "eden:bits=1", "eden:bits=0.5", "terngrad:clip=2.5"]
NUMEL = 1 << 16


def row(spec: str, x: torch.Tensor) -> str:
    codec = get_codec(spec)
    q = codec.quantizer
    bound = q.error_bound(NUMEL)
    exact = codec.expected_error(x, seed=1)
    side = {"side_info": x} if codec.needs_side_info else {}  # NDQSG as its client sees it: the exact value
    decoded = codec.decode(codec.encode(x, seed=1), seed=1, **side)
    measured = float((decoded - x).square().sum() / x.square().sum())
    try:
        get_codec("ef+" + spec)
    except ValueError as err:
        action = "refused: " + str(err).split(": ", 2)[-1].split(",")[0]
    else:
        action = f"scales by {ef_scale(exact):.3f}" if q.unbiased else "as it is (biased, bound <= 1)"
    cells = [
        f"`{spec}`",
        "yes" if q.unbiased else "no",
        "none" if bound is None else f"{bound:.4g}",
        "–" if exact is None else f"{exact:.4g}",
        f"{measured:.4g}",
        action,
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default=None, help="';'-separated specs (default: every codec and a few more)")
    args = parser.parse_args(argv)
    specs = parse_codec_list(args.codecs) if args.codecs else [*available_codecs(), *EXTRA]
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    head = ["codec", "unbiased", f"declared bound ({NUMEL} elements)", "expected error, Gaussian", "measured, one draw"]
    print("| " + " | ".join([*head, "ef+"]) + " |")
    print("|---|---|---:|---:|---:|---|")
    for spec in specs:
        print(row(spec, x))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
