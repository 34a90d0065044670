"""Wire bytes against another checkout: every codec's payloads and whole client replies, digest by digest.

A refactoring must not change a byte on the wire. This script computes, with public APIs only
(``get_codec``, ``Codec.encode``/``encode_stateful``/``decode``, ``QuantizedStrategy``,
``quantize_mod`` and the tests' in-process Grid), a SHA-256 digest per case:

* payloads: every registered codec x coding (``benchmarks.specs`` rows plus every coding), with
  and without ``rht+``, over several shapes, dtypes and seeds, and the decoded tensor of each;
* ``ef+`` pipelines: two rounds of ``encode_stateful``, payloads and carried state;
* whole rounds: train messages as sent (downlink payloads included), every client reply (arrays,
  metrics without timings) and the aggregated model, for plain, ``ef+``, NDQSG (per-tensor
  codecs, two groups), downlink compression and an upload budget.

Run as ``python -m benchmarks.wire_identity --base /path/to/other/checkout``: the cases run once
in this checkout and once in a subprocess importing the other one; the script prints the counts
and every differing case, and exits 1 on a difference. ``--dump FILE`` only writes this
checkout's digests (JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(0,), (1,), (10,), (1000,), (37, 53), (4, 1024)]
SEEDS = [0, 1, 12345, 2**40 + 7]
#: Metric keys that hold wall-clock times (they differ between any two runs).
TIMINGS = ("encode-seconds", "decode-seconds", "fedquant.encode-seconds")


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, (bytes, bytearray)) else repr(part).encode())
    return h.hexdigest()[:24]


def _specs() -> list[str]:
    from fedquant.codecs import available_codecs, codec_class

    specs: list[str] = []
    try:
        from benchmarks.specs import REPRESENTATIVE

        for rows in REPRESENTATIVE.values():
            specs += rows
    except ImportError:
        pass
    for name in available_codecs():
        params = codec_class(name).params
        for coding in params["coding"].choices if "coding" in params else (None,):
            specs.append(name if coding is None else f"{name}:coding={coding}")
    specs += ["eden:bits=1", "eden:bits=2", "eden:bits=1.5", "eden:bits=0.5", "eden:bits=3,coding=entropy"]
    specs += ["qsgd:levels=3,bucket_size=0", "dqsg:bucket_size=0,coding=elias", "ndqsg:rho=5,alpha=0.8"]
    specs += ["rht+" + s for s in list(specs) if not s.startswith("eden")]
    return list(dict.fromkeys(specs))


def _tensor(shape, seed, dtype):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.1).to(dtype)


def payload_cases() -> dict[str, str]:
    import torch

    from fedquant.codecs import get_codec

    out: dict[str, str] = {}
    for spec in _specs():
        codec = get_codec(spec)
        for shape in SHAPES:
            for i, seed in enumerate(SEEDS):
                dtype = (torch.float32, torch.float16, torch.float64, torch.bfloat16)[i % 4]
                x = _tensor(shape, i + 3, dtype)
                key = f"payload {spec} {shape} {dtype} seed={seed}"
                try:
                    payload = codec.encode(x, seed)
                except Exception as err:  # an encoder's refusal is part of its behaviour
                    out[key] = f"raises {type(err).__name__}: {err}"
                    continue
                out[key] = _digest(payload)
                side = {"side_info": x.float() + 0.01} if codec.needs_side_info else {}
                y = codec.decode(payload, seed, shape=shape, dtype=dtype, **side)
                out[key.replace("payload", "decoded", 1)] = _digest(y.float().numpy().tobytes(), tuple(y.shape))
    for spec in ("ef+signsgd", "ef+qsgd:levels=2", "ef+rht+dqsg:coding=entropy", "ef+ndqsg", "ef+eden:bits=1"):
        try:
            codec = get_codec(spec)
        except ValueError as err:  # a refused combination (ef+ndqsg) is part of the behaviour too
            out[f"stateful {spec}"] = f"raises {type(err).__name__}: {err}"
            continue
        for shape in ((1000,), (37, 53)):
            state = None
            for step, seed in enumerate(SEEDS[:3]):
                payload, state = codec.encode_stateful(_tensor(shape, 20 + step, torch.float32), seed, state)
                carried = b"".join(v.numpy().tobytes() for _, v in sorted(state.items()))
                out[f"stateful {spec} {shape} step {step}"] = _digest(payload, carried)
    return out


def _message_digest(message) -> str:
    if message.has_error():
        return f"error {message.error.code}: {message.error.reason}"
    parts = []
    for name, record in message.content.array_records.items():
        for key, array in record.items():
            parts.append((name, key, array.stype, array.dtype, tuple(array.shape), _digest(array.data)))
    for name, record in message.content.metric_records.items():
        parts.append((name, sorted((k, v) for k, v in record.items() if k not in TIMINGS)))
    for name, record in message.content.config_records.items():
        parts.append((name, sorted(record.items())))
    return _digest(*parts)


def round_cases() -> dict[str, str]:
    from flwr.serverapp.strategy import FedAvg

    from fedquant.clients import quantize_mod
    from fedquant.strategies import QuantizedStrategy
    from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

    runs = {
        "qsgd": {"codec": "qsgd:levels=4"},
        "qsgd-entropy": {"codec": "qsgd:levels=7,coding=entropy"},
        "eden": {"codec": "eden:bits=2"},
        "ef-signsgd": {"codec": "ef+signsgd"},
        "ef-rht-dqsg": {"codec": "ef+rht+dqsg:coding=entropy"},
        "ndqsg": {"codec": "ndqsg:levels=3"},
        "ndqsg-entropy-fixed-rho": {"codec": "ndqsg:levels=3,rho=5,coding=entropy"},
        "rht-ndqsg": {"codec": "rht+ndqsg"},
        "downlink": {"codec": "qsgd:levels=4", "downlink_codec": "qsgd:levels=16"},
        "downlink-fp32-eden": {"codec": "eden:bits=1", "downlink_codec": "eden:bits=4", "downlink_full_codec": "fp32"},
        "budget": {"codec": "qsgd:levels=16", "uplink_bytes_budget": 2500},
        "no-client-mse": {"codec": "dqsg", "client_mse": False},
    }
    out: dict[str, str] = {}
    for label, kwargs in runs.items():
        random.seed(0)  # Flower samples nodes with the global ``random``: fix the order of the messages
        grid = InProcessGrid(make_client_app([quantize_mod]), 4)
        replies: list = []
        real = grid.send_and_receive

        def recording(messages, *, timeout=None, _real=real, _replies=replies):
            got = _real(messages, timeout=timeout)
            _replies.extend(got)
            return got

        grid.send_and_receive = recording
        strategy = QuantizedStrategy(FedAvg(min_available_nodes=4), seed=5, min_numel=MIN_NUMEL, **kwargs)
        result = strategy.start(grid, initial_arrays(), num_rounds=3)
        for i, message in enumerate(grid.sent):
            out[f"round {label} sent {i}"] = _message_digest(message)
        for i, reply in enumerate(replies):
            out[f"round {label} reply {i}"] = _message_digest(reply)
        final = [(k, _digest(a.data)) for k, a in result.arrays.items()]
        out[f"round {label} model"] = _digest(*final)
        for r, metrics in result.train_metrics_clientapp.items():
            out[f"round {label} train metrics {r}"] = _digest(
                sorted((k, v) for k, v in metrics.items() if k not in TIMINGS)
            )
    return out


def all_cases() -> dict[str, str]:
    return {**payload_cases(), **round_cases()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the other checkout (its fedquant is imported in a subprocess)")
    parser.add_argument("--dump", help="write this checkout's digests to FILE and exit")
    args = parser.parse_args()
    if args.dump:
        Path(args.dump).write_text(json.dumps(all_cases(), indent=0, sort_keys=True))
        return 0
    if not args.base:
        parser.error("--base or --dump is required")
    with tempfile.TemporaryDirectory() as tmp:
        base_file = Path(tmp) / "base.json"
        env = {**os.environ, "PYTHONPATH": str(Path(args.base).resolve())}
        script = Path(__file__).resolve()
        subprocess.run(
            [sys.executable, str(script), "--dump", str(base_file)], env=env, cwd=args.base, check=True
        )  # this file need not exist there: it is run from here, importing the other checkout
        base = json.loads(base_file.read_text())
    here = all_cases()
    missing = sorted(set(base) ^ set(here))
    differ = sorted(k for k in set(base) & set(here) if base[k] != here[k])
    payloads = sum(1 for k in here if k.startswith(("payload", "stateful")) and not here[k].startswith("raises"))
    replies = sum(1 for k in here if " reply " in k)
    sent = sum(1 for k in here if " sent " in k)
    same = len(set(base) & set(here)) - len(differ)
    print(f"cases: {len(here)} here, {len(base)} in {args.base}; {payloads} payloads, {replies} replies, {sent} sent")
    print(f"identical: {same}, different: {len(differ)}, only on one side: {len(missing)}")
    for key in differ[:40]:  # the first; --dump both sides for the rest
        print(f"  DIFFERENT {key}: {base[key]} -> {here[key]}")
    for key in missing[:20]:
        print(f"  ONE SIDE  {key}")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or str(REPO))
    sys.exit(main())
