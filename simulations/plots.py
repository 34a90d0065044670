"""Plots of a run and of a codec comparison (PNG files).

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so saving works in any
process (Ray workers, servers without a display) and the caller's backend (e.g. a notebook's
inline backend) is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

MB = 1e6


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r.get(key, float("nan"))) for r in rows]


def plot_run(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Accuracy against cumulative uplink MB (left) and uplink bytes per round (right).

    ``rows``: per-round dicts with ``round``, ``accuracy``, ``uplink-bytes``,
    ``cumulative-uplink-bytes`` and optionally ``uplink-bytes-dense``.
    """
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([v / MB for v in _series(rows, "cumulative-uplink-bytes")], _series(rows, "accuracy"), marker="o", ms=3)
    ax1.set_xlabel("cumulative uplink (MB)")
    ax1.set_ylabel("test accuracy")
    ax1.grid(alpha=0.3)
    rounds = _series(rows, "round")
    ax2.bar(rounds, [v / 1e3 for v in _series(rows, "uplink-bytes")], label="sent")
    if any(r.get("uplink-bytes-dense") is not None for r in rows):
        dense = [v / 1e3 for v in _series(rows, "uplink-bytes-dense")]
        ax2.plot(rounds, dense, color="gray", ls="--", label="float32 would be")
        ax2.legend()
    ax2.set_xlabel("round")
    ax2.set_ylabel("uplink per round (kB)")
    ax2.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_comparison(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = "") -> Path:
    """One line per codec: accuracy against cumulative uplink MB (log x), and total uplink bars."""
    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    totals = []
    for i, (label, rows) in enumerate(runs.items()):
        x = [v / MB for v in _series(rows, "cumulative-uplink-bytes")]
        style = ("-", "--", ":")[(i // 10) % 3]  # the colour cycle has 10 colours
        ax1.plot(x, _series(rows, "accuracy"), marker="o", ms=2, ls=style, label=label)
        totals.append((label, x[-1] if x else 0.0))
    ax1.set_xscale("log")
    ax1.set_xlabel("cumulative uplink (MB, log scale)")
    ax1.set_ylabel("test accuracy")
    ax1.grid(alpha=0.3, which="both")
    ax1.legend(fontsize=7)
    ax2.barh([t[0] for t in totals], [t[1] for t in totals])
    ax2.set_xscale("log")
    ax2.set_xlabel("total uplink (MB, log scale)")
    ax2.invert_yaxis()
    ax2.tick_params(axis="y", labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
