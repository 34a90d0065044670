"""CUDA path of the simulations, in one run: a few clients share one GPU, train and encode on CUDA.

    python benchmarks/gpu_sim_check.py            # on a machine with a CUDA GPU

Checks, each printed as PASS/FAIL:

1. every codec encodes a CUDA tensor and decodes it to a finite tensor of the same shape, with an
   error of the size its CPU encoding has (the same seed; within 1 % or 1e-6 absolute);
2. one local simulation, 4 clients with ``num-gpus = 0.25`` each (so they share the GPU), 2 rounds
   of the default app with QSGD: every client reports that it trained on CUDA, the model learns
   (accuracy above 0.3 on the 10 digit classes) and no reply was rejected.

Exits 0 when all pass, 1 when one fails, 2 when there is no CUDA device.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLIENTS, GPU_SHARE, ROUNDS, CODEC = 4, 0.25, 2, "qsgd:levels=16"


def check_codecs_on_cuda() -> list[tuple[str, bool, str]]:
    from fedquant.codecs import available_codecs, get_codec

    results = []
    x_cpu = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    x_gpu = x_cpu.cuda()
    for name in available_codecs():
        try:
            codec = get_codec(name)
            if codec.needs_side_info:
                payload = codec.encode(x_gpu, seed=3)
                results.append((name, len(payload) > 0, f"{len(payload)} bytes (decode needs side info)"))
                continue
            errs = []
            for x in (x_cpu, x_gpu):
                payload = codec.encode(x, seed=3)
                x_hat = codec.decode(payload, seed=3)
                ok_shape = x_hat.shape == x.shape and bool(torch.isfinite(x_hat).all())
                errs.append(float(((x_hat.cpu() - x_cpu) ** 2).mean()) if ok_shape else float("nan"))
            ok = errs[1] == errs[1] and abs(errs[1] - errs[0]) <= max(0.01 * errs[0], 1e-6)
            results.append((name, ok, f"mse cpu {errs[0]:.3e} cuda {errs[1]:.3e}"))
        except Exception as err:  # noqa: BLE001 - report every codec
            results.append((name, False, f"{type(err).__name__}: {err}"))
    return results


def check_simulation_on_shared_gpu() -> list[tuple[str, bool, str]]:
    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.server_app import make_server_app

    out = Path(tempfile.mkdtemp(prefix="gpu_sim_check_"))
    t0 = time.perf_counter()
    run_simulation(
        make_server_app(codec=CODEC, rounds=ROUNDS, fraction_train=1.0, out_dir=str(out), run_name="gpu"),
        client_app,
        num_supernodes=CLIENTS,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": GPU_SHARE}},
    )
    history = json.loads((out / "gpu" / "history.json").read_text())
    devices = sorted({c["device"] for c in history["clients"]})
    last = history["rounds"][-1]
    return [
        ("clients trained on CUDA", devices != [] and all(d.startswith("cuda") for d in devices), f"devices {devices}"),
        ("codec encoded on CUDA", all(c.get("encode-device", "").startswith("cuda") for c in history["clients"]),
         f"encode devices {sorted({c.get('encode-device') for c in history['clients']})}"),
        ("all clients replied", len(history["clients"]) == CLIENTS * ROUNDS, f"{len(history['clients'])} replies"),
        ("no rejected replies", last.get("rejected-replies") == 0, f"rejected {last.get('rejected-replies')}"),
        ("model learns", last["accuracy"] > 0.3, f"accuracy {last['accuracy']:.4f}"),
        ("bytes counted", (last.get("uplink-bytes") or 0) > 0, f"{last.get('uplink-bytes')} B, "
         f"{last.get('bits-per-param', float('nan')):.2f} bits/param, {time.perf_counter() - t0:.0f} s"),
    ]  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}")
    results = [("codec " + n, ok, msg) for n, ok, msg in check_codecs_on_cuda()]
    results += check_simulation_on_shared_gpu()
    for name, ok, msg in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<28} {msg}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
