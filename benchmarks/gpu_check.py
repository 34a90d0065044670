"""All CUDA checks of the project in one run: prints PASS/FAIL per check, exits 1 on any failure.

Run it on a machine with a CUDA device (``python -m benchmarks.gpu_check``); without one it
says so and exits with status 2 (nothing was checked). It checks

* the counter-based streams: ``fedquant.rng.uniform`` and ``random_bits`` are bit-identical on
  CUDA and CPU (several seeds, offsets, sizes) -- the dithered codecs rely on it;
* every codec setting of :mod:`benchmarks.specs` (every registered codec, nothing skipped; a
  codec that is not available is a FAIL), for float32/float16/bfloat16 inputs of several shapes
  including a non-contiguous one: encode on CUDA works and gives the same bytes as encode on CPU;
  the CUDA payload decodes on CPU to the same tensor as the CPU payload; decoding straight to
  ``device="cuda"`` gives that tensor too. Codecs that need side information get a noisy copy of
  the input, on the device.

Usage::

    python -m benchmarks.gpu_check            # all codecs
    python -m benchmarks.gpu_check --codecs qsgd,dqsg
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.specs import all_specs, build, parse_codec_list, side_info_for
from fedquant.rng import random_bits, uniform


class Checks:
    """Runs named checks, prints PASS/FAIL for each and counts failures."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], str | None]) -> None:
        try:
            detail = fn()
        except Exception as err:  # a check that raises is a failure, reported with its cause
            tb = traceback.format_exception_only(type(err), err)[-1].strip()
            self.failed.append(name)
            print(f"FAIL  {name}: {tb}")
            return
        if detail:
            self.failed.append(name)
            print(f"FAIL  {name}: {detail}")
        else:
            self.passed += 1
            print(f"PASS  {name}")


def check_streams(checks: Checks, dev: str) -> None:
    for seed in (0, 1234, 2**62 + 7, 2**63 - 1):
        for offset in (0, 1, 123_456_789):
            for n in (1, 1000, 1_000_003):

                def same(seed=seed, offset=offset, n=n) -> str | None:
                    a = uniform(seed, n, offset=offset, device=dev).cpu()
                    b = uniform(seed, n, offset=offset)
                    if not torch.equal(a, b):
                        return f"{int((a != b).sum())} of {n} uniforms differ"
                    if not torch.equal(
                        random_bits(seed, n, offset=offset, device=dev).cpu(), random_bits(seed, n, offset=offset)
                    ):
                        return "random_bits differ"
                    return None

                checks.run(f"rng.uniform/random_bits cuda==cpu seed={seed} offset={offset} n={n}", same)


def _inputs() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((1,), (3, 700), (1_000_003,)):
            out.append((f"{str(dtype).split('.')[-1]} {list(shape)}", torch.randn(shape, generator=gen).to(dtype)))
    x = torch.randn(64, 48, generator=gen)
    out.append(("float32 non-contiguous [48, 64]", x.t()))
    out.append(("float32 zeros [1000]", torch.zeros(1000)))
    return out


def check_codecs(checks: Checks, specs: list[str], dev: str) -> None:
    inputs = _inputs()
    for spec in specs:
        setting = build(spec)
        if setting.codec is None:
            checks.run(f"{spec}: available", lambda r=setting.reason: r)
            continue
        codec = setting.codec
        dev_codec = build(spec).codec
        stage = getattr(dev_codec, "quantizer", dev_codec)  # pipeline codecs: the quantizer picks the path
        if torch.device(dev).type == "cpu" and hasattr(stage, "force_torch"):
            stage.force_torch = True  # dry run on CPU: the torch (device) path against the kernels
        for label, x in inputs:
            xc = x.to(dev)
            if not x.is_contiguous():
                xc = x.t().contiguous().to(dev).t()  # keep the non-contiguous layout on the device

            def run(codec=codec, dev_codec=dev_codec, x=x, xc=xc) -> str | None:
                seed = 77
                cpu_payload = codec.encode(x, seed=seed)
                cuda_payload = dev_codec.encode(xc, seed=seed)
                side_cpu = side_info_for(codec, x)
                side_cuda = None if side_cpu is None else side_cpu.to(xc.device)
                ref = codec.decode(cpu_payload, seed=seed, side_info=side_cpu)
                problems = []
                if cuda_payload != cpu_payload:
                    problems.append("CUDA encode gives different bytes than CPU encode")
                got = codec.decode(cuda_payload, seed=seed, side_info=side_cpu)
                if not torch.equal(got, ref):
                    problems.append("CUDA payload decodes on CPU to a different tensor")
                on_device = dev_codec.decode(cuda_payload, seed=seed, side_info=side_cuda, device=dev)
                if on_device.device.type != torch.device(dev).type or not torch.equal(on_device.cpu(), ref):
                    problems.append("decode to device='cuda' (side info on CUDA) differs")
                if got.shape != x.shape or got.dtype != x.dtype:
                    problems.append(f"round trip gives {got.dtype} {list(got.shape)}")
                return "; ".join(problems) or None

            checks.run(f"{spec}: {label}", run)


def report_cuda_speed(specs: list[str], dev: str) -> None:
    """Informational: CUDA encode time of 25M float32 elements per codec (not a check)."""
    x = torch.randn(25_000_000, device=dev)
    for spec in specs:
        setting = build(spec)
        if setting.codec is None:
            continue
        try:
            setting.codec.encode(x, seed=1)
            sync(dev)
            t0 = time.perf_counter()
            setting.codec.encode(x, seed=1)
            sync(dev)
            print(f"info  {spec}: CUDA encode of 25M float32 in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        except Exception as err:
            print(f"info  {spec}: CUDA encode of 25M failed ({type(err).__name__}: {err})")


def sync(dev: str) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", help="comma-separated codec names or specs (default: all)")
    ap.add_argument("--no-speed", action="store_true", help="skip the informational CUDA timing")
    ap.add_argument(
        "--device",
        default="cuda",
        help="device to check against the CPU; 'cpu' is a dry run that compares the torch path with the kernels",
    )
    args = ap.parse_args(argv)
    dev = args.device
    if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was checked (run it on a CUDA machine)")
        return 2
    where = torch.cuda.get_device_name(0) if torch.device(dev).type == "cuda" else dev
    print(f"gpu_check on {where}, torch {torch.__version__}")
    specs = all_specs(parse_codec_list(args.codecs))
    checks = Checks()
    check_streams(checks, dev)
    check_codecs(checks, specs, dev)
    if not args.no_speed:
        report_cuda_speed(specs, dev)
    print(f"\n{checks.passed} passed, {len(checks.failed)} failed")
    for name in checks.failed:
        print(f"  FAILED: {name}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
