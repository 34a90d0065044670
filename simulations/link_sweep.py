"""Compare settings on simulated links: accuracy against bytes both ways and against wall-clock time.

    python -m simulations.link_sweep                      # fixed QSGD levels against the upload deadline
    python -m simulations.link_sweep --variant 'codec=qsgd:levels=4' --variant 'codec=qsgd:levels=16
        upload-deadline-seconds=0.5' --variant 'codec=fp32 downlink-codec=none' --set uplink=fixed:mbps=2

A variant is a space-separated list of run-config ``key=value`` overrides (its label). Every variant
runs in ONE simulation (same clients, partitions, client samples and link speeds) with the shared
``--set`` settings; each round's simulated wall-clock time is ``simulated-round-seconds``: the
slowest sampled client's download (train message bytes / its download speed) plus upload (reply bytes
/ its upload speed); local training time is not simulated. Writes ``links.csv``, ``links.md`` and
``links.png`` (accuracy against cumulative MB up + down, and against cumulative simulated seconds)
into ``--out``, plus each run's history under ``runs/``.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from simulations.link_times import SIMULATED_ROUND_SECONDS
from simulations.server_app import run_server
from simulations.settings import SimSettings
from simulations.task import limit_threads

# Defaults of the README's plot: slow heterogeneous uplinks, faster downlinks, digits CNN.
DEFAULT_SETTINGS = {
    "uplink": "lognormal:median=1,sigma=1",
    "downlink": "lognormal:median=8,sigma=1",
    "downlink-codec": "qsgd:levels=16",
    "rounds": "10",
}
DEFAULT_VARIANTS = [
    "codec=qsgd:levels=16",
    "codec=qsgd:levels=4",
    "codec=qsgd:levels=1",
    "codec=qsgd:levels=16 upload-deadline-seconds=0.3",
    "codec=qsgd:levels=16 downlink-codec=none",
]
TARGET_ACCURACY = 0.9
COLUMNS = ["variant", "final accuracy", "uplink MB", "downlink MB", "simulated s", f"s to {TARGET_ACCURACY:.0%}"]


@dataclass
class LinkRow:
    """One variant's outcome."""

    variant: str
    final_accuracy: float = math.nan
    uplink_mb: float = math.nan
    downlink_mb: float = math.nan
    simulated_seconds: float = math.nan
    seconds_to_target: float = math.nan
    error: str = ""

    def cells(self) -> list[str]:
        if self.error:
            return [self.variant, f"failed: {self.error}", "", "", "", ""]
        to_target = "not reached" if math.isnan(self.seconds_to_target) else f"{self.seconds_to_target:.1f}"
        return [
            self.variant,
            f"{self.final_accuracy:.4f}",
            f"{self.uplink_mb:.3f}",
            f"{self.downlink_mb:.3f}",
            f"{self.simulated_seconds:.1f}",
            to_target,
        ]


def parse_variant(text: str) -> dict[str, str]:
    """``"codec=qsgd:levels=4 downlink-codec=none"`` -> ``{"codec": "qsgd:levels=4", "downlink-codec": "none"}``."""
    out = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: {item!r} is not key=value")
        out[key.strip()] = value.strip().strip('"')
    return out


def cumulative(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """Running sum of a per-round metric (missing values count as 0)."""
    total, out = 0.0, []
    for row in rows:
        total += float(row.get(key) or 0.0)
        out.append(total)
    return out


def summarize_links(variant: str, rounds: Sequence[Mapping[str, Any]]) -> LinkRow:
    """A table row from a run's per-round history (round 0 = the initial model)."""
    trained = [r for r in rounds if r["round"] > 0]
    if not trained:
        return LinkRow(variant, error="no round finished")
    seconds = cumulative(trained, SIMULATED_ROUND_SECONDS)
    reached = [s for s, r in zip(seconds, trained, strict=True) if float(r["accuracy"]) >= TARGET_ACCURACY]
    return LinkRow(
        variant,
        final_accuracy=float(trained[-1]["accuracy"]),
        uplink_mb=cumulative(trained, "uplink-bytes")[-1] / 1e6,
        downlink_mb=cumulative(trained, "downlink-bytes")[-1] / 1e6,
        simulated_seconds=seconds[-1],
        seconds_to_target=reached[0] if reached else math.nan,
    )


def plot_links(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """Accuracy against cumulative MB both ways (left) and against cumulative simulated seconds (right)."""
    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    for label, rows in runs.items():
        rows = [r for r in rows if r["round"] > 0]
        both = [
            u + d for u, d in zip(cumulative(rows, "uplink-bytes"), cumulative(rows, "downlink-bytes"), strict=True)
        ]
        accuracy = [float(r["accuracy"]) for r in rows]
        ax1.plot([b / 1e6 for b in both], accuracy, marker="o", ms=2, label=label)
        ax2.plot(cumulative(rows, SIMULATED_ROUND_SECONDS), accuracy, marker="o", ms=2, label=label)
    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.set_xlabel("cumulative MB, uplink + downlink (log scale)")
    ax2.set_xlabel("simulated wall-clock seconds (download + upload of the slowest client, summed)")
    for ax in (ax1, ax2):
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3, which="both")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def write_link_results(
    rows: Sequence[LinkRow], histories: Mapping[str, Sequence[Mapping[str, Any]]], out: Path, title: str, command: str
) -> dict[str, Path]:
    """Write ``links.csv``, ``links.md`` and ``links.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "links.csv", "md": out / "links.md", "png": out / "links.png"}
    with paths["csv"].open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["variant", "final_accuracy", "uplink_mb", "downlink_mb", "simulated_seconds",
                         "seconds_to_target", "error"])  # fmt: skip
        for r in rows:
            writer.writerow([r.variant, r.final_accuracy, r.uplink_mb, r.downlink_mb, r.simulated_seconds,
                             r.seconds_to_target, r.error])  # fmt: skip
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    text = f"{title}\n\n" + "\n".join(lines) + "\n"
    paths["md"].write_text(text + (f"\nReproduce: `{command}`\n" if command else ""))
    plot_links(histories, paths["png"], title)
    return paths


def run_variants(
    grid: Grid, base: SimSettings, variants: Sequence[str]
) -> tuple[list[LinkRow], dict[str, list[dict[str, Any]]]]:
    """Run the federation once per variant on ``grid``; a failing variant is reported, the others go on."""
    rows: list[LinkRow] = []
    histories: dict[str, list[dict[str, Any]]] = {}
    for i, variant in enumerate(variants, 1):
        log(INFO, "[link sweep %d/%d] %s ...", i, len(variants), variant)
        try:
            overrides = {k.replace("-", "_"): v for k, v in parse_variant(variant).items()}
            config = base.replace(run_name=f"variant{i}").as_config()
            history = run_server(grid, config, **overrides)
        except Exception as err:  # noqa: BLE001 - one failing variant must not end the sweep
            rows.append(LinkRow(variant, error=f"{type(err).__name__}: {err}"))
            continue
        histories[variant] = history.rounds
        rows.append(summarize_links(variant, history.rounds))
    return rows, histories


def make_link_sweep_app(variants: Sequence[str], out: Path, command: str = "", **overrides: Any) -> ServerApp:
    """A ServerApp that runs every variant and writes the comparison into ``out``."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        limit_threads()
        base = SimSettings.from_run_config(dict(context.run_config), out_dir=str(out / "runs"), **overrides)
        rows, histories = run_variants(grid, base, variants)
        title = (
            f"{base.dataset} ({base.partitioning}), {base.model}, {base.rounds} rounds, fraction-train "
            f"{base.fraction_train}; up {base.uplink}, down {base.downlink} (Mbit/s)"
        )
        paths = write_link_results(rows, histories, out, title, command)
        print("\n" + paths["md"].read_text(), flush=True)

    return server_app


def main(argv: Sequence[str] | None = None) -> int:
    import shlex
    import sys

    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.loopback import ray_loopback_only

    parser = argparse.ArgumentParser(prog="python -m simulations.link_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", default=None, help="run-config overrides of one run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="setting of every run")
    parser.add_argument("--num-supernodes", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("results/links"))
    args = parser.parse_args(argv)
    settings = dict(DEFAULT_SETTINGS)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        settings[key.strip()] = value.strip().strip('"')
    overrides = {k.replace("-", "_"): v for k, v in settings.items()}
    SimSettings.from_run_config({}, **overrides)  # fail on a bad setting before Ray starts
    variants = args.variant or DEFAULT_VARIANTS
    command = ("python -m simulations.link_sweep " + shlex.join(sys.argv[1:] if argv is None else list(argv))).strip()
    out = args.out.resolve()
    ray_loopback_only()  # Ray's servers on 127.0.0.1, not on every interface
    run_simulation(
        server_app=make_link_sweep_app(variants, out, command, **overrides),
        client_app=client_app,
        num_supernodes=args.num_supernodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    with (out / "links.csv").open() as fh:
        failed = [r["variant"] for r in csv.DictReader(fh) if r["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
