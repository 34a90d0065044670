"""Figures of a run and of a codec sweep (PNG, and PDF for papers).

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so saving works in any
process (Ray workers, servers without a display) and the caller's backend (e.g. a notebook's
inline backend) is left alone.

Sweep figures give every codec its own colour from Paul Tol's colour-blind-safe "muted" palette
(black for fp32 alone) and its own marker; past ten codecs the colours repeat with dashed lines
and other markers. Curves are the mean over the seeds with the 95 % Student-t interval shaded.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

MB = 1e6
# Paul Tol, "muted" (https://personal.sron.nl/~pault/), colour-blind safe; black first for the reference.
PALETTE = ("#000000", "#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p", "d", "8", "H", "1")
TIME_KEYS = ("simulated-round-seconds", "simulated-upload-seconds")


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r.get(key) if r.get(key) is not None else float("nan")) for r in rows]


def _save(fig: Figure, stem: Path, formats: Sequence[str]) -> dict[str, Path]:
    paths = {}
    for fmt in formats:
        path = stem.with_suffix(f".{fmt}")
        fig.savefig(path, dpi=150, bbox_inches="tight")
        paths[fmt] = path
    return paths


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
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=10))
    ax2.set_ylabel("uplink per round (kB)")
    ax2.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def codec_style(index: int) -> dict[str, Any]:
    """Colour, marker and line style of the ``index``-th codec of a figure (all pairs distinct).

    Black is the first codec's alone (the reference, fp32); the others cycle through the nine
    colours, solid first, then dashed and dotted, each with its own marker.
    """
    if index == 0:
        return {"color": PALETTE[0], "marker": MARKERS[0], "ls": "-"}
    cycle, colour = divmod(index - 1, len(PALETTE) - 1)
    return {"color": PALETTE[1 + colour], "marker": MARKERS[index % len(MARKERS)], "ls": ("-", "--", ":")[cycle % 3]}


def _band(values: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per position: mean, and the 95 % t-interval's bounds (the mean itself with one seed)."""
    from simulations.sweep_stats import t_quantile

    mean, low, high = [], [], []
    for column in zip(*values):
        col = [v for v in column if math.isfinite(v)]
        m = statistics.fmean(col) if col else math.nan
        h = t_quantile(len(col) - 1) * statistics.stdev(col) / math.sqrt(len(col)) if len(col) > 1 else 0.0
        mean.append(m)
        low.append(m - h)
        high.append(m + h)
    return mean, low, high


def mean_curves(runs: Mapping[int, Sequence[Mapping[str, Any]]]) -> dict[str, list[float]]:
    """A codec's seeds averaged round by round (over the rounds all of them finished).

    Keys: ``round``, ``accuracy`` with ``low``/``high`` (95 % interval), ``mb`` (cumulative uplink),
    and ``seconds`` (cumulative simulated round time; absent without a link profile).
    """
    seeds = [list(rows) for rows in runs.values() if rows]
    n = min(len(rows) for rows in seeds)
    seeds = [rows[:n] for rows in seeds]
    acc, low, high = _band([_series(rows, "accuracy") for rows in seeds])
    out = {
        "round": _series(seeds[0], "round"),
        "accuracy": acc,
        "low": low,
        "high": high,
        "mb": _band([[v / MB for v in _series(rows, "cumulative-uplink-bytes")] for rows in seeds])[0],
    }
    key = next((k for k in TIME_KEYS if seeds[0] and seeds[0][0].get(k) is not None), None)
    if key is not None:
        out["seconds"] = _band([_cumsum(_series(rows, key)) for rows in seeds])[0]
    return out


def _cumsum(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v if math.isfinite(v) else 0.0
        out.append(total)
    return out


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper-left envelope: points no other point beats with fewer bytes and more accuracy, by bytes."""
    frontier: list[tuple[float, float]] = []
    for x, y in sorted(p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])):
        if not frontier or y > frontier[-1][1]:
            frontier.append((x, y))
    return frontier


def plot_sweep(
    curves: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
    stem: str | Path,
    title: str = "",
    *,
    target: float | None = None,
    formats: Sequence[str] = ("png", "pdf"),
) -> dict[str, Path]:
    """Write :func:`sweep_figure` as ``stem.png`` and ``stem.pdf`` (``formats``); returns the paths by format."""
    return _save(sweep_figure(curves, title, target=target), Path(stem), formats)


def readable_log_axis(axis: Any) -> None:
    """Label a log axis with plain numbers at 1-2-5 steps (1 per decade past 3 decades), no minor labels.

    Matplotlib's default labels the minor ticks of a log axis that spans less than a decade, in
    ``2x10^-2`` form, where they collide; call after plotting (the ticks follow the data's range).
    """
    low, high = axis.get_view_interval()
    decades = math.log10(high / low) if low > 0 and high > low else 1.0
    subs = (1.0, 2.0, 5.0) if decades < 3 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def sweep_figure(
    curves: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]], title: str = "", *, target: float | None = None
) -> Figure:
    """Accuracy against cumulative uplink MB (log x) and against simulated time, one line per codec.

    ``curves``: codec -> seed -> that run's rows (round > 0). Each line is the mean over the
    seeds, the band its 95 % interval; the dashed black step is the Pareto frontier of the mean
    curves (the best accuracy any codec reached within a byte budget). Without a link profile
    the right panel shows accuracy by round. The legend sits outside the axes, on the right.
    """
    means = {codec: mean_curves(runs) for codec, runs in curves.items() if any(runs.values())}
    timed = bool(means) and all("seconds" in m for m in means.values())
    fig = Figure(figsize=(12, 4.8))
    left, right = fig.subplots(1, 2)
    handles = []
    for i, (codec, m) in enumerate(means.items()):
        style = codec_style(i)
        every = max(1, len(m["round"]) // 8)
        n_seeds = len(curves[codec])
        label = f"{codec} ({n_seeds} seed{'s' * (n_seeds > 1)})"
        for ax, x in ((left, m["mb"]), (right, m["seconds"] if timed else m["round"])):
            (line,) = ax.plot(x, m["accuracy"], lw=1.6, ms=5, markevery=every, label=label, **style)
            low, high = [max(v, 0.0) for v in m["low"]], [min(v, 1.0) for v in m["high"]]  # accuracy is in [0, 1]
            ax.fill_between(x, low, high, color=style["color"], alpha=0.15, lw=0)
        handles.append(line)
    frontier = pareto_frontier([(x, y) for m in means.values() for x, y in zip(m["mb"], m["accuracy"])])
    if frontier:
        xs = [p[0] for p in frontier] + [max(x for m in means.values() for x in m["mb"])]
        ys = [p[1] for p in frontier] + [frontier[-1][1]]
        (front,) = left.step(xs, ys, where="post", color="black", ls=(0, (4, 2)), lw=1.0, label="Pareto frontier")
        handles.append(front)
    left.set_xscale("log")
    readable_log_axis(left.xaxis)
    left.set_xlabel("cumulative uplink traffic (MB, log scale)")
    left.set_title("Accuracy against uplink traffic")
    if timed:
        right.set_xscale("log")
        readable_log_axis(right.xaxis)
        right.set_xlabel("simulated time (s, cumulative round times, log scale)")
        right.set_title("Accuracy against simulated time")
    else:
        right.set_xlabel("round")
        right.set_title("Accuracy by round (no link profile: no simulated time)")
        right.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=10))
    for ax in (left, right):
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3, which="both")
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls=":")
    if target is not None:
        left.annotate(
            f"target {target:.2f}",
            (0.01, target),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            color="grey",
            va="bottom",
        )
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def plot_uplink_bars(rows: Sequence[Any], path: str | Path, title: str = "") -> Path:
    """Total uplink MB per codec (mean over the seeds, whiskers: 95 % interval), linear axis, values written."""
    rows = [r for r in rows if r.uplink_mb.n]
    fig = Figure(figsize=(8, 1.2 + 0.35 * max(len(rows), 1)))
    ax = fig.subplots()
    means = [r.uplink_mb.mean for r in rows]
    halves = [r.uplink_mb.half if math.isfinite(r.uplink_mb.half) else 0.0 for r in rows]
    colours = [codec_style(i)["color"] for i in range(len(rows))]
    ax.barh([r.codec for r in rows], means, xerr=halves, color=colours, alpha=0.85, capsize=2)
    top = max(means, default=1.0)
    for y, (mean, r) in enumerate(zip(means, rows)):
        ax.text(
            mean + 0.01 * top, y, f" {mean:.3g} MB, {r.bits_per_param.mean:.2f} bits/param", va="center", fontsize=8
        )
    ax.set_xlim(0, top * 1.45)
    ax.invert_yaxis()
    ax.set_xlabel("total uplink traffic per run (MB)")
    ax.set_title("Uplink traffic by codec" + (f"\n{title}" if title else ""), fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    return path
