"""Compare codecs on identical data, partitions, client samples and seeds.

    python -m simulations.sweep                                   # every codec fedquant has
    python -m simulations.sweep --codecs fp32,qsgd:levels=4,bucket_size=512,orq:levels=4 --rounds 10
    python -m simulations.sweep --set partitioning=dirichlet --set dirichlet-alpha=0.3

All codecs run inside ONE simulation (one Ray start, the same virtual clients and node ids): the
ServerApp runs the federation once per codec, one after the other, from the same initial model,
with the same client sample each round. Writes into ``--out``: one folder per codec (history
JSON/CSV/PNG), ``sweep.csv``, ``sweep.md`` (the markdown table) and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import csv
import time
from collections.abc import Sequence
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedquant.codecs import available_codecs
from simulations.history import run_dir_name
from simulations.node_directory import PartitionDirectory
from simulations.plots import plot_comparison
from simulations.server_app import run_server
from simulations.settings import SimSettings
from simulations.task import limit_threads

COLUMNS = ["codec", "final accuracy", "best accuracy", "uplink MB", "compression ratio", "bits/param", "seconds"]


@dataclass
class SweepRow:
    """One codec's outcome (``error`` set when the run failed)."""

    codec: str
    final_accuracy: float = float("nan")
    best_accuracy: float = float("nan")
    uplink_mb: float = float("nan")
    compression_ratio: float = float("nan")
    bits_per_param: float = float("nan")
    seconds: float = float("nan")
    error: str = ""

    def cells(self) -> list[str]:
        if self.error:
            return [self.codec, f"failed: {self.error}", "", "", "", "", ""]
        return [
            self.codec,
            f"{self.final_accuracy:.4f}",
            f"{self.best_accuracy:.4f}",
            f"{self.uplink_mb:.3f}",
            f"{self.compression_ratio:.1f}",
            f"{self.bits_per_param:.2f}",
            f"{self.seconds:.0f}",
        ]


def split_codecs(text: str) -> list[str]:
    """Split a comma-separated codec list; ``key=value`` pieces belong to the spec before them.

    ``"fp32,qsgd:levels=4,bucket_size=512,orq"`` -> ``["fp32", "qsgd:levels=4,bucket_size=512", "orq"]``.
    """
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def summarize(codec: str, rounds: Sequence[dict[str, Any]], seconds: float) -> SweepRow:
    """A table row from a run's per-round history (round 0 = the initial model)."""
    trained = [r for r in rounds if r["round"] > 0]
    if not trained:
        return SweepRow(codec, error="no round finished")
    sent = sum(r.get("uplink-bytes") or 0 for r in trained)
    dense = sum(r.get("uplink-bytes-dense") or 0 for r in trained)
    numel_bits = [(r.get("bits-per-param"), r.get("uplink-bytes")) for r in trained]
    # Bits per parameter over the whole run: weight each round's value by its bytes' share.
    weighted = [(b, w) for b, w in numel_bits if b is not None and w]
    bits = sum(b * w for b, w in weighted) / sum(w for _, w in weighted) if weighted else float("nan")
    return SweepRow(
        codec=codec,
        final_accuracy=float(trained[-1]["accuracy"]),
        best_accuracy=max(float(r["accuracy"]) for r in trained),
        uplink_mb=sent / 1e6,
        compression_ratio=dense / sent if sent else float("nan"),
        bits_per_param=bits,
        seconds=seconds,
    )


def markdown_table(rows: Sequence[SweepRow]) -> str:
    """The results as a GitHub markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(
    rows: Sequence[SweepRow], histories: dict[str, list[dict[str, Any]]], out: Path, title: str, command: str = ""
) -> dict[str, Path]:
    """Write ``sweep.csv``, ``sweep.md`` and ``sweep.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "sweep.csv", "md": out / "sweep.md", "png": out / "sweep.png"}
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["codec", "final_accuracy", "best_accuracy", "uplink_mb", "compression_ratio",
                         "bits_per_param", "seconds", "error"])  # fmt: skip
        for r in rows:
            writer.writerow([r.codec, r.final_accuracy, r.best_accuracy, r.uplink_mb, r.compression_ratio,
                             r.bits_per_param, r.seconds, r.error])  # fmt: skip
    text = f"{title}\n\n" + markdown_table(rows)
    if command:
        text += f"\nReproduce: `{command}`\n"
    paths["md"].write_text(text)
    plot_comparison({k: [r for r in v if r["round"] > 0] for k, v in histories.items()}, paths["png"], title)
    return paths


def make_sweep_app(codecs: Sequence[str], out: Path, command: str = "", **overrides: Any) -> ServerApp:
    """A ServerApp that runs the federation once per codec and writes the comparison."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        limit_threads()
        rows: list[SweepRow] = []
        histories: dict[str, list[dict[str, Any]]] = {}
        base = SimSettings.from_run_config(dict(context.run_config), out_dir=str(out / "runs"), **overrides)
        directory = PartitionDirectory()  # the nodes are asked for their partition once, not per codec
        for i, codec in enumerate(codecs, 1):
            log(INFO, "[sweep %d/%d] %s ...", i, len(codecs), codec)
            t0 = time.perf_counter()
            try:
                history = run_server(grid, base.as_config(), directory=directory, codec=codec)
            except Exception as err:  # noqa: BLE001 - one failing codec must not end the sweep
                rows.append(SweepRow(codec, error=f"{type(err).__name__}: {err}"))
                log(INFO, "[sweep %d/%d] %s failed: %s", i, len(codecs), codec, err)
                continue
            rows.append(summarize(codec, history.rounds, time.perf_counter() - t0))
            histories[codec] = history.rounds
            r = rows[-1]
            log(INFO, "[sweep %d/%d] %s: accuracy %.4f, %.3f MB uplink, x%.1f, %.2f bits/param, %.0f s",
                i, len(codecs), codec, r.final_accuracy, r.uplink_mb, r.compression_ratio, r.bits_per_param,
                r.seconds)  # fmt: skip
        title = (
            f"{base.dataset} ({base.partitioning}), {base.model}, {base.rounds} rounds, "
            f"fraction-train {base.fraction_train}, {base.local_epochs} local epochs, seed {base.seed}"
        )
        paths = write_results(rows, histories, out, title, command)
        print("\n" + paths["md"].read_text(), flush=True)
        log(INFO, "sweep results: %s", ", ".join(str(p) for p in paths.values()))

    return server_app


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m simulations.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default=",".join(available_codecs()),
                        help="comma-separated codec specs (default: every codec fedquant has)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None, help="rounds per codec (default: the app's)")
    parser.add_argument("--num-supernodes", type=int, default=20, help="virtual clients (default 20)")
    parser.add_argument("--num-cpus", type=float, default=1, help="CPUs per client (default 1)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per client, e.g. 0.25 (default 0)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"any run-config key: {', '.join(SimSettings.keys())}")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("results/sweep"), help="output folder")
    return parser.parse_args(argv)


def run_sweep(
    codecs: Sequence[str],
    *,
    out: Path,
    num_supernodes: int = 20,
    num_cpus: float = 1,
    num_gpus: float = 0.0,
    command: str = "",
    **overrides: Any,
) -> list[SweepRow]:
    """Run the sweep in one local simulation; returns the rows it wrote to ``out/sweep.csv``."""
    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app

    SimSettings.from_run_config({}, **overrides)  # fail on a bad setting before Ray starts
    out = Path(out).resolve()
    run_simulation(
        server_app=make_sweep_app(codecs, out, command, **overrides),
        client_app=client_app,
        num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}},
    )
    with (out / "sweep.csv").open() as fh:
        rows = []
        for rec in csv.DictReader(fh):
            error = rec.pop("error")
            codec = rec.pop("codec")
            rows.append(SweepRow(codec, **{k: float(v) for k, v in rec.items()}, error=error))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    import shlex
    import sys

    args = _parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip().replace("-", "_")] = value.strip().strip('"')
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    codecs = split_codecs(args.codecs)
    command = ("python -m simulations.sweep " + shlex.join(sys.argv[1:] if argv is None else list(argv))).strip()
    rows = run_sweep(codecs, out=args.out, num_supernodes=args.num_supernodes, num_cpus=args.num_cpus,
                     num_gpus=args.num_gpus, command=command, **overrides)  # fmt: skip
    failed = [r.codec for r in rows if r.error]
    return 1 if failed or len(rows) != len(codecs) else 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["SweepRow", "make_sweep_app", "markdown_table", "run_dir_name", "run_sweep", "split_codecs", "summarize"]
