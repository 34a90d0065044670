"""Where NDQSG nests in the simulation app: tensors sent nested per round on a few settings (a table, exits 0).

NDQSG's decode plan chooses ``rho`` per tensor from the spread of the previous round's decoded
updates and sends a tensor as DQSG when ``rho`` would reach ``2M + 1`` (nesting would save no
bits). This runs the app's ServerApp and ClientApp (the test suite's in-process grid, no Ray) for
6 rounds per setting and prints ``ndqsg-nested-tensors`` per round with the last round's
per-tensor ``rho`` range. Usage::

    python -m benchmarks.ndqsg_nesting
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulations.sweep import PRESETS

SETTINGS = [
    ("digits, IID, 20 clients, 10 per round", 20, {}),
    ("digits, Dirichlet 0.5, 20 clients", 20, {"partitioning": "dirichlet"}),
    ("digits, IID, 20 clients, levels=15", 20, {"codec": "ndqsg:levels=15"}),
    ("digits, IID, 2 clients (1 per round)", 2, {}),
    ("separating task", 100, PRESETS["separating"].overrides),
    ("separating task, levels=15", 100, {**PRESETS["separating"].overrides, "codec": "ndqsg:levels=15"}),
]


def main() -> int:
    from simulations.client_app import app
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.ERROR)
    print("| setting | nested tensors per round | rho range, last round | bits/param |")
    print("|---|---|---|---:|")
    with tempfile.TemporaryDirectory() as out:
        for name, nodes, overrides in SETTINGS:
            config = {"codec": "ndqsg", **overrides, "rounds": 6}
            history = run_server(InProcessGrid(app, nodes), {}, out_dir=out, run_name="ndqsg", **config)
            rows = [r for r in history.rounds if r["round"] > 0]
            nested = [r.get("ndqsg-nested-tensors") for r in rows]
            last = rows[-1]
            rho = f"{last.get('ndqsg-rho-min', '–')}..{last.get('ndqsg-rho-max', '–')}"
            print(f"| {name} | {nested} | {rho} | {last['bits-per-param']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
