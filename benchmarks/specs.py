"""The codec settings every benchmark runs: each registered codec, with representative parameters.

Every name in ``fedquant.codecs.available_codecs()`` gets at least one row: names missing from
``REPRESENTATIVE`` are added with their defaults, and a codec whose module is not there (yet)
or rejects its parameters shows up as "not available" with the reason, never silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedquant.codecs import available_codecs, get_codec
from fedquant.codecs.codec import Codec

# Representative settings per registered name (defaults of a name are its first row).
REPRESENTATIVE: dict[str, list[str]] = {
    "fp32": ["fp32"],
    "fp16": ["fp16"],
    "qsgd": [
        "qsgd",
        "qsgd:levels=1,bucket_size=128",
        "qsgd:levels=7",
        "qsgd:coding=elias",
        "qsgd:coding=entropy",
    ],
    "terngrad": ["terngrad", "terngrad:coding=entropy"],
    "signsgd": ["signsgd", "signsgd:coding=entropy"],
    "bingrad-b": ["bingrad-b", "bingrad-b:coding=entropy"],
    "bingrad-pb": ["bingrad-pb"],
    "orq": ["orq", "orq:coding=entropy"],
    "linear": ["linear"],
    "dqsg": ["dqsg", "dqsg:coding=entropy", "dqsg:coding=elias", "dqsg:levels=2,coding=entropy"],
    "ndqsg": ["ndqsg", "ndqsg:coding=entropy"],
    "ecdq": ["ecdq", "ecdq:coding=fixed", "ecdq:bits=2", "ecdq:bits=2,lattice=z", "ecdq:bits=4"],
}

#: Fixed-width settings: quantize + pack and unpack + dequantize as single passes (the
#: throughput benchmark's 3x-a-copy target per core).
FIXED_WIDTH_PATHS = (
    "qsgd",
    "qsgd:levels=1,bucket_size=128",
    "qsgd:levels=7",
    "terngrad",
    "signsgd",
    "dqsg",
    "ndqsg",
    "orq",
    "linear",
    "bingrad-b",
    "bingrad-pb",
)

#: Settings behind the ``rht+`` rotation, EDEN at integer and fractional bits (after the
#: registered codecs' rows; the throughput benchmark's 6x-a-copy target per core).
RHT_PATHS = (
    "rht+fp32",
    "rht+qsgd:levels=7",
    "rht+dqsg",
    "rht+ndqsg",
    "eden:bits=1",
    "eden:bits=2",
    "eden:bits=1.037",
    "eden:bits=0.5",
)

#: The level-selection codecs (levels from each bucket's sorted values, as their papers define
#: them): their encode has the throughput benchmark's 7x-a-copy target per core, or within a
#: margin of its floor (``benchmarks.codec_floor``), their decode the fixed-width 3x.
LEVEL_SELECTION_PATHS = ("orq", "linear", "bingrad-b", "bingrad-pb")

#: ECDQ at half a bit (the scalar lattice), one and two bits (E8): the throughput benchmark's
#: 8x-a-copy target per core, encode and decode, or within a margin of their floor (issue 45).
ECDQ_PATHS = ("ecdq:bits=0.5", "ecdq:bits=1", "ecdq:bits=2")

#: Entropy-coded settings behind the rotation (rows without a target here).
RHT_ENTROPY_PATHS = ("rht+dqsg:levels=2,coding=entropy", "eden:bits=2,coding=entropy")


@dataclass
class Setting:
    """One benchmark row: the spec, the codec (None if not available) and why not."""

    spec: str
    codec: Codec | None
    reason: str = ""


def all_specs(only: list[str] | None = None) -> list[str]:
    """Specs for every registered codec (or those whose name or spec is in ``only``)."""
    specs: list[str] = []
    for name in available_codecs():
        specs += REPRESENTATIVE.get(name, [name])
    for name in REPRESENTATIVE:
        if name not in available_codecs():
            specs += REPRESENTATIVE[name]
    specs += RHT_PATHS + RHT_ENTROPY_PATHS
    specs += [spec for spec in ECDQ_PATHS if spec not in specs]
    if only:
        specs = [s for s in specs if s in only or s.split(":")[0] in only] + [
            s for s in only if s not in specs and (":" in s or "+" in s)
        ]
    return specs


def build(spec: str) -> Setting:
    """The codec of ``spec``, or a Setting that says why it is not available."""
    try:
        return Setting(spec, get_codec(spec))
    except (ImportError, AttributeError) as err:
        return Setting(spec, None, f"not available ({type(err).__name__}: {err})")
    except ValueError as err:
        return Setting(spec, None, f"not available ({err})")


def side_info_for(codec: Codec, x: torch.Tensor) -> torch.Tensor | None:
    """Decoder side information for codecs that need it: a noisy copy of ``x`` (1% noise)."""
    if not codec.needs_side_info:
        return None
    gen = torch.Generator().manual_seed(99)
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.device)
    xf = x.float()
    return xf + 0.01 * (xf.std() if xf.numel() > 1 else xf.abs().sum()) * noise


def parse_codec_list(text: str | None) -> list[str] | None:
    """Split a ``--codecs`` value into names and specs.

    ``"fp32,qsgd:levels=1,bucket_size=128,terngrad"`` gives ``["fp32",
    "qsgd:levels=1,bucket_size=128", "terngrad"]``: a ``key=value`` item whose key (the text before
    its ``=``) holds no ``:`` belongs to the spec before it, also when a chained stage follows
    (``"rht:max_log2=12,min_log2=4+qsgd"`` is one spec). ``;`` always separates.
    """
    if not text:
        return None
    out: list[str] = []
    for part in text.split(";"):
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item and ":" not in item.split("=", 1)[0] and out:
                out[-1] += "," + item
            else:
                out.append(item)
    return out
