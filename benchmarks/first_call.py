"""First encode + decode of every codec in a fresh process with an empty numba cache (target: <= 3 s).

Each codec runs in its own new Python process whose ``NUMBA_CACHE_DIR`` is a new empty folder, as
on a fresh installation: the seconds of ``get_codec(spec)`` plus the first ``encode`` and
``decode`` of (a) an update of the simulation's default model (the digits CNN, every float
tensor, as ``quantize_mod`` sends it with ``min-numel=1``) and (b) one tensor of 2^20 elements.
Interpreter start and ``import torch`` are reported apart (``import s``): they are paid before
any codec. ``CPU s`` is the process time of both first calls (all threads): on a machine busy
with other jobs the wall times grow with the load, the CPU time much less. The background
warm-up each process starts (``fedquant.codecs.kernels.warmup``) is stopped by the process id the
measured process reports (a pid file would not exist yet: the warm-up is still importing when
the twins' first call is done).

``--mode numba`` measures what the first call cost before the warm cache (compile on first use);
``--warm`` adds a column measured after a full warm-up of one shared cache folder (the compiled
kernels, loaded from disk), and the warm-up's own duration.

Usage::

    python -m benchmarks.first_call
    python -m benchmarks.first_call --codecs "qsgd;eden:bits=2" --mode numba
    python -m benchmarks.first_call --warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.specs import parse_codec_list

TARGET_SECONDS = 3.0
ROOT = Path(__file__).resolve().parent.parent

# Runs in the fresh process: prints one JSON line of timings.
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
from fedquant.codecs import get_codec
from simulations.models import build_model
t_import = time.perf_counter() - t0

cpu = 0.0

def first(spec, tensors):
    global cpu
    t, c = time.perf_counter(), time.process_time()
    codec = get_codec(spec)
    for i, x in enumerate(tensors):
        payload = codec.encode(x, seed=i)
        codec.decode(payload, seed=i, **({"side_info": x} if codec.needs_side_info else {}))
    cpu += time.process_time() - c
    return time.perf_counter() - t

gen = torch.Generator().manual_seed(0)
model = build_model("cnn", (1, 8, 8), 10, seed=0)
update = [0.01 * torch.randn(p.shape, generator=gen) for p in model.state_dict().values() if p.is_floating_point()]
spec = sys.argv[1]
cnn = first(spec, update)
big = first(spec, [torch.randn(1 << 20, generator=gen)])
from fedquant.jit import cache
warmup = cache._spawned.pid if cache._spawned is not None else None
print(json.dumps({"import": t_import, "cnn": cnn, "big": big, "cpu": cpu, "warmup": warmup}))
"""


def stop_warmup(pid: int | None) -> None:
    """Stop the background warm-up ``pid`` a measured process started (if it still runs)."""
    if pid is None:
        return
    try:
        if b"fedquant.codecs.kernels.warmup" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            time.sleep(0.05)
            if not Path(f"/proc/{pid}/cmdline").read_bytes():  # gone (or a zombie of init)
                return
        os.kill(pid, signal.SIGKILL)  # its cache folder is thrown away anyway
    except (OSError, ProcessLookupError):
        return


def measure(spec: str, cache_root: Path, mode: str, threads: int) -> dict[str, float]:
    """Timings of ``spec``'s first calls in a fresh process with numba's cache in ``cache_root``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_root), "FEDQUANT_KERNELS": mode, "PYTHONPATH": str(ROOT)}
    env["NUMBA_NUM_THREADS"] = str(threads)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, spec, str(threads)], env=env, cwd=ROOT, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"{spec}: {out.stderr.strip().splitlines()[-1:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    stop_warmup(row.pop("warmup"))
    return row


def warm_cache(cache_root: Path, threads: int) -> float:
    """Run the warm-up in the foreground into ``cache_root``; its seconds."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_root), "PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedquant.codecs.kernels.warmup"], env=env, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    from fedquant.codecs import available_codecs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default=None, help="';'-separated specs (default: every registered codec)")
    parser.add_argument("--mode", default="auto", choices=("auto", "numba"), help="FEDQUANT_KERNELS of the runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch and numba threads")
    parser.add_argument("--warm", action="store_true", help="also measure with a warmed cache")
    args = parser.parse_args(argv)
    specs = parse_codec_list(args.codecs) if args.codecs else available_codecs()
    load = os.getloadavg()[0]
    print(f"{args.mode}, {args.threads} thread(s), load {load:.1f} at the start, target {TARGET_SECONDS} s")
    warm_root = None
    if args.warm:
        warm_root = Path(tempfile.mkdtemp(prefix="fq-warm-"))
        print(f"full warm-up of an empty cache: {warm_cache(warm_root, args.threads):.0f} s")
    header = "| spec | import s | first call, CNN update s | first call, 2^20 elements s | CPU s of both |"
    print(f"\n{header}{' warm cache: CNN / 2^20 s |' if warm_root else ''}")
    print("|---|---:|---:|---:|---:|" + ("---:|" if warm_root else ""))
    misses = []
    for spec in specs:
        with tempfile.TemporaryDirectory(prefix="fq-cold-") as cold:
            row = measure(spec, Path(cold), args.mode, args.threads)
        line = f"| `{spec}` | {row['import']:.2f} | {row['cnn']:.2f} | {row['big']:.2f} | {row['cpu']:.2f} |"
        if warm_root:
            warm = measure(spec, warm_root, "auto", args.threads)
            line += f" {warm['cnn']:.2f} / {warm['big']:.2f} |"
        print(line, flush=True)
        if max(row["cnn"], row["big"]) > TARGET_SECONDS:
            misses.append(spec)
    if warm_root:
        shutil.rmtree(warm_root, ignore_errors=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    if misses:
        print(f"MISS: first call above {TARGET_SECONDS} s: {', '.join(misses)}")
        return 1
    print(f"every first call within {TARGET_SECONDS} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
