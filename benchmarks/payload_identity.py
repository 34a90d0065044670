"""Payload bytes and decoded values of this checkout against another (e.g. main): identical?

Kernel work must not change a single byte on the wire. This script encodes a grid of cases
(every registered codec and coding, ``rht+`` and ``ef+`` pipelines, EDEN at integer and
fractional rates; sizes on both sides of the kernels' serial/parallel switch; several seeds and
inputs) with the code on ``PYTHONPATH`` and, in a subprocess, with the checkout given as
``--base``, and compares the SHA-256 of every payload and of every decoded tensor (each side
decodes its own payload). It exits 1 on any difference or on a case only one side can run.

With ``--ignore-version`` a payload's digest leaves out its format version byte and the CRC-32
that covers it: a format version bump alone is then no difference, and what differs is what the
new version changed. Differences are summed up per spec (payload bytes, decoded values).

Usage::

    git worktree add --detach /tmp/base main
    python -m benchmarks.payload_identity --base /tmp/base            # full grid
    python -m benchmarks.payload_identity --base /tmp/base --quick    # small sizes only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPECS = [
    "fp32",
    "fp16",
    "qsgd",
    "qsgd:levels=1,bucket_size=128",
    "qsgd:levels=7,norm=l2",
    "qsgd:levels=300,bucket_size=0",
    "qsgd:coding=elias",
    "qsgd:coding=entropy",
    "qsgd:levels=7,coding=entropy",
    "terngrad",
    "terngrad:clip=2.5,coding=entropy",
    "signsgd",
    "signsgd:coding=entropy",
    "signsgd:bucket_size=0",
    "orq",
    "orq:levels=9,coding=entropy",
    "orq:levels=8,refine=3,level_dtype=float16",
    "linear",
    "linear:levels=5,coding=entropy",
    "bingrad-b",
    "bingrad-b:coding=entropy",
    "bingrad-pb",
    "bingrad-pb:coding=entropy",
    "dqsg",
    "dqsg:coding=entropy",
    "dqsg:levels=2,coding=entropy",
    "dqsg:levels=200,bucket_size=0",
    "dqsg:coding=elias",
    "ndqsg",
    "ndqsg:rho=5,alpha=0.9,coding=entropy",
    "rht+fp32",
    "rht+qsgd:levels=7",
    "rht+dqsg",
    "rht+dqsg:levels=2,coding=entropy",
    "rht+ndqsg",
    "rht+orq:levels=9",
    "ef+qsgd:levels=3",
    "ef+rht+signsgd",
    "eden:bits=1",
    "eden:bits=2",
    "eden:bits=3,bucket_size=128",
    "eden:bits=4",
    "eden:bits=8",
    "eden:bits=2,coding=entropy",
    "eden:bits=1.037",
    "eden:bits=1.5,bucket_size=64",
    "eden:bits=2.7",
    "eden:bits=0.5",
    "eden:bits=0.1",
    "eden:bits=0.999",
    "eden:bits=7.5",
    "ecdq",
    "ecdq:coding=fixed",
    "ecdq:bits=2,lattice=z",
    "ecdq:bits=0.5,lattice=e8,coding=fixed",
    "ecdq:bits=4",
]
SIZES = [1, 7, 100, 512, 1000, 4097, 65537, 300_001]
QUICK_SIZES = [1, 7, 100, 512, 1000, 4097]
SEEDS = [0, 1, 98765]
INPUTS = ("gauss", "student3", "sparse")


def make_input(kind: str, n: int, seed: int):
    """A float32 tensor of ``n`` elements: Gaussian, Student-t(3), or mostly zeros with ties."""
    import torch

    gen = torch.Generator().manual_seed(1000 * n + seed)
    if kind == "gauss":
        return torch.randn(n, generator=gen)
    if kind == "student3":
        g = torch.randn(n, generator=gen)
        chi = torch.randn(n, 3, generator=gen).square().sum(1)
        return g / (chi / 3).sqrt()
    x = torch.zeros(n)
    x[::7] = torch.randint(-3, 4, (len(range(0, n, 7)),), generator=gen).float() * 0.25
    return x


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:24]


def payload_digest(payload: bytes, ignore_version: bool) -> str:
    """:func:`digest` of a payload, without its version byte and CRC-32 if ``ignore_version``."""
    return digest(payload[:2] + payload[3:-4] if ignore_version else payload)


def run_cases(sizes: list[int], ignore_version: bool = False) -> dict[str, list[str]]:
    """``case -> [payload digest, decoded digest]`` (or ``["error", message]``) with this process's fedquant."""
    import torch

    from fedquant.codecs import get_codec

    torch.set_num_threads(1)
    results: dict[str, list[str]] = {}
    for spec in SPECS:
        try:
            codec = get_codec(spec)
        except (ValueError, ImportError) as err:
            results[f"{spec}"] = ["error", str(err)]
            continue
        for n in sizes:
            for seed in SEEDS:
                for kind in INPUTS:
                    key = f"{spec}|{n}|{seed}|{kind}"
                    x = make_input(kind, n, seed)
                    side = x + 0.01 * make_input("gauss", n, seed + 1) if codec.needs_side_info else None
                    try:
                        if codec.stateful:
                            payload, state = codec.encode_stateful(x, seed, None)
                            payload2, _ = codec.encode_stateful(x, seed + 1, state)
                            decoded = codec.decode(payload, seed)
                            sent = payload_digest(payload, ignore_version) + payload_digest(payload2, ignore_version)
                        else:
                            payload = codec.encode(x, seed)
                            decoded = codec.decode(payload, seed, side_info=side)
                            sent = payload_digest(payload, ignore_version)
                        results[key] = [sent, digest(decoded.numpy().tobytes())]
                    except (ValueError, RuntimeError) as err:
                        results[key] = ["error", f"{type(err).__name__}: {err}"]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="root of the checkout to compare with (its fedquant is imported there)")
    ap.add_argument("--quick", action="store_true", help="sizes up to 4097 only")
    ap.add_argument("--ignore-version", action="store_true", help="leave the format version byte (and CRC) out")
    args = ap.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else SIZES
    if not args.base:
        ap.error("--base is required")
    base_root = Path(args.base).resolve()
    env = {**os.environ, "PYTHONPATH": str(base_root)}
    worker = [str(Path(__file__).resolve())] + (["--quick"] if args.quick else [])
    worker += ["--ignore-version"] if args.ignore_version else []
    # The script runs from this checkout; its own path insert would shadow the base's fedquant.
    probe = subprocess.run(
        [sys.executable, "-c", "import fedquant, sys; print(fedquant.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=base_root,
    )
    if not probe.stdout.strip().startswith(str(base_root)):
        print(f"--base {base_root} does not provide fedquant (got {probe.stdout.strip()})")
        return 2
    base_run = subprocess.run(
        [sys.executable, "-c", _WORKER_SHIM, *worker],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=base_root,
    )
    if base_run.returncode:
        print(base_run.stderr)
        return 2
    base = json.loads(base_run.stdout)
    here = run_cases(sizes, args.ignore_version)
    same = differ = 0
    lines = []
    per_spec: dict[str, list[int]] = {}
    for key in sorted(set(base) | set(here)):
        if base.get(key) == here.get(key):
            same += 1
            continue
        differ += 1
        lines.append(f"  {key}: base {base.get(key)} here {here.get(key)}")
        b, h = base.get(key) or ["", ""], here.get(key) or ["", ""]
        counts = per_spec.setdefault(key.split("|")[0], [0, 0, 0])
        counts[0] += 1
        counts[1] += b[0] != h[0]
        counts[2] += b[1] != h[1]
    errors = sum(1 for v in here.values() if v[0] == "error")
    print(
        f"{len(here)} cases ({len(SPECS)} specs x sizes {sizes} x seeds {SEEDS} x inputs {list(INPUTS)}): "
        f"{same} identical (payload bytes and decoded values), {differ} different; "
        f"{errors} cases refused by both sides alike"
    )
    for spec, (cases, payloads, values) in per_spec.items():
        print(f"  {spec}: {cases} cases differ ({payloads} payloads, {values} decoded values)")
    for line in lines[:50]:
        print(line)
    return 1 if differ else 0


# Runs this file's run_cases with the base checkout's fedquant (the file itself is not imported
# through the base: it may not exist there).
_WORKER_SHIM = """
import json, runpy, sys
path = sys.argv[1]
module = runpy.run_path(path, run_name="payload_identity_worker")
sizes = module["QUICK_SIZES"] if "--quick" in sys.argv else module["SIZES"]
json.dump(module["run_cases"](sizes, "--ignore-version" in sys.argv), sys.stdout)
"""


if __name__ == "__main__":
    sys.exit(main())
