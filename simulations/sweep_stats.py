"""Statistics of a codec sweep over seeds: one summary per run, mean and 95 % interval per codec.

A run's history (one row per round, round 0 = the initial model) becomes a :class:`RunSummary`:
final accuracy, the mean accuracy of the last ``k`` rounds, what it sent, and the rounds, uplink
bytes and simulated seconds it took to first reach a target accuracy. :func:`codec_rows` pools
the seeds of each codec into :class:`CodecRow` (Student-t 95 % intervals over the seeds, the
difference to ``fp32`` paired by seed, since every codec sees the same clients per seed), and
:func:`markdown_table` writes the table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

REFERENCE = "fp32"
NESTED_KEY = "ndqsg-nested-tensors"
TIME_KEYS = ("simulated-round-seconds", "simulated-upload-seconds")  # with a downlink profile, else uplink only


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with the half-width of its two-sided 95 % Student-t interval (nan for n < 2)."""

    mean: float
    half: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Interval:
        vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not vals:
            return cls(math.nan, math.nan, 0)
        mean = statistics.fmean(vals)
        if len(vals) < 2:
            return cls(mean, math.nan, 1)
        return cls(mean, t_quantile(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals)), len(vals))

    def text(self, digits: int = 4, scale: float = 1.0) -> str:
        if self.n == 0:
            return "–"
        if self.n == 1 or not math.isfinite(self.half):
            return f"{self.mean * scale:.{digits}f}"
        return f"{self.mean * scale:.{digits}f} ± {self.half * scale:.{digits}f}"

    def contains(self, value: float) -> bool:
        return self.n >= 2 and abs(value - self.mean) <= self.half


def t_quantile(df: int, level: float = 0.95) -> float:
    """The ``(1 + level) / 2`` quantile of Student's t with ``df`` degrees of freedom (4.30 for df = 2)."""
    from scipy.stats import t  # scipy comes with scikit-learn

    return float(t.ppf(0.5 + level / 2, df))


@dataclass
class RunSummary:
    """What one codec x seed run reached (``None``: never reached the target / not measured)."""

    codec: str
    seed: int
    rounds: int
    final_accuracy: float
    last_k_accuracy: float
    uplink_bytes: float
    dense_bytes: float
    bits_per_param: float
    rounds_to_target: int | None
    bytes_to_target: float | None
    seconds_to_target: float | None
    nested_tensors: float | None  # NDQSG: mean tensors sent nested per round (0: every tensor went as DQSG)
    diverged: bool  # still diverged at its last round (the server's check, simulations/divergence.py)
    collapsed_rounds: int  # rounds flagged diverged, recovered from or not
    wall_seconds: float
    message_bytes: float = math.nan  # the replies as Flower serialises them (nan: stored before all were counted)


def _counts_every_message(row: Mapping[str, Any]) -> bool:
    """Whether the row's ``message-bytes-up`` counts every message (a secure round stored before its
    other stages were counted has no ``secagg-message-bytes-up-collect``)."""
    counted = row.get("message-bytes-up") is not None
    return counted and ("secagg-sampled" not in row or row.get("secagg-message-bytes-up-collect") is not None)


def summarize_run(
    codec: str, seed: int, rows: Sequence[Mapping[str, Any]], *, last_k: int, target: float | None, wall: float = 0.0
) -> RunSummary:
    """A :class:`RunSummary` from a run's per-round rows (round 0, the initial model, is left out)."""
    trained = [r for r in rows if r.get("round", 0) > 0]
    if not trained:
        raise ValueError(f"{codec} seed {seed}: no round finished")
    acc = [float(r["accuracy"]) for r in trained]
    sent = [float(r.get("uplink-bytes") or 0) for r in trained]
    bits = [(float(r["bits-per-param"]), b) for r, b in zip(trained, sent) if r.get("bits-per-param") is not None]
    weight = sum(b for _, b in bits)
    cumulative, clock, reached = 0.0, 0.0, None
    timed = any(k in trained[0] for k in TIME_KEYS)
    for r, b in zip(trained, sent):
        cumulative += b
        clock += float(next((r[k] for k in TIME_KEYS if r.get(k) is not None), 0.0))
        if reached is None and target is not None and float(r["accuracy"]) >= target:
            reached = (int(r["round"]), cumulative, clock if timed else None)
    nested = [float(r[NESTED_KEY]) for r in trained if r.get(NESTED_KEY) is not None]
    return RunSummary(
        codec=codec,
        seed=seed,
        rounds=len(trained),
        final_accuracy=acc[-1],
        last_k_accuracy=statistics.fmean(acc[-last_k:]),
        uplink_bytes=sum(sent),
        dense_bytes=sum(float(r.get("uplink-bytes-dense") or 0) for r in trained),
        bits_per_param=sum(b * w for b, w in bits) / weight if weight else math.nan,
        rounds_to_target=reached[0] if reached else None,
        bytes_to_target=reached[1] if reached else None,
        seconds_to_target=reached[2] if reached else None,
        nested_tensors=statistics.fmean(nested) if nested else None,
        diverged=bool(trained[-1].get("diverged")),
        collapsed_rounds=sum(bool(r.get("diverged")) for r in trained),
        wall_seconds=wall,
        message_bytes=sum(float(r["message-bytes-up"]) for r in trained)
        if all(_counts_every_message(r) for r in trained)
        else math.nan,
    )


@dataclass
class CodecRow:
    """One codec over its seeds."""

    codec: str
    seeds: list[int]
    final: Interval
    last_k: Interval
    uplink_mb: Interval
    bits_per_param: Interval
    rounds_to_target: Interval
    mb_to_target: Interval
    seconds_to_target: Interval
    reached: int  # seeds that reached the target
    delta: Interval | None = None  # last-k accuracy minus fp32's, paired by seed
    verdict: str = ""
    nested_tensors: float | None = None
    diverged: int = 0  # seeds that ended diverged
    recovered: int = 0  # seeds flagged diverged in some round that recovered by the last
    errors: list[str] = field(default_factory=list)
    message_mb: Interval = field(default_factory=lambda: Interval(math.nan, math.nan, 0))


def codec_rows(runs: Sequence[RunSummary], errors: Mapping[str, list[str]] | None = None) -> list[CodecRow]:
    """Pool the seeds of each codec (in first-seen order); compare with fp32's when it ran."""
    errors = errors or {}
    order = list(dict.fromkeys([r.codec for r in runs] + list(errors)))
    by_codec = {c: [r for r in runs if r.codec == c] for c in order}
    rows = []
    for codec, rs in by_codec.items():
        reached = [r for r in rs if r.rounds_to_target is not None]
        nested = [r.nested_tensors for r in rs if r.nested_tensors is not None]
        rows.append(
            CodecRow(
                codec=codec,
                seeds=[r.seed for r in rs],
                final=Interval.of([r.final_accuracy for r in rs]),
                last_k=Interval.of([r.last_k_accuracy for r in rs]),
                uplink_mb=Interval.of([r.uplink_bytes / 1e6 for r in rs]),
                bits_per_param=Interval.of([r.bits_per_param for r in rs]),
                rounds_to_target=Interval.of([r.rounds_to_target for r in reached]),
                mb_to_target=Interval.of([r.bytes_to_target / 1e6 for r in reached]),
                seconds_to_target=Interval.of([r.seconds_to_target for r in reached]),
                reached=len(reached),
                nested_tensors=statistics.fmean(nested) if nested else None,
                diverged=sum(r.diverged for r in rs),
                recovered=sum(bool(r.collapsed_rounds) and not r.diverged for r in rs),
                errors=list(errors.get(codec, [])),
                message_mb=Interval.of([r.message_bytes / 1e6 for r in rs]),
            )
        )
    ref = next((row for row in rows if row.codec == REFERENCE and row.last_k.n), None)
    if ref is not None:
        ref_by_seed = {r.seed: r.last_k_accuracy for r in by_codec[REFERENCE]}
        for row in rows:
            if row is ref or not row.last_k.n:
                continue
            pairs = [r.last_k_accuracy - ref_by_seed[r.seed] for r in by_codec[row.codec] if r.seed in ref_by_seed]
            row.delta = Interval.of(pairs)
            row.verdict = verdict(row.last_k, ref.last_k)
        ref.verdict = "reference"
    return rows


def verdict(codec: Interval, reference: Interval) -> str:
    """``within fp32's spread`` when the codec's mean lies inside fp32's 95 % interval, else above/below."""
    if codec.n == 0 or reference.n < 2:
        return ""
    if reference.contains(codec.mean):
        return "within fp32's spread"
    return "above fp32's spread" if codec.mean > reference.mean else "below fp32's spread"


def default_target(runs: Sequence[RunSummary], fraction: float = 0.95) -> float | None:
    """``fraction`` of fp32's mean last-k accuracy, rounded down to 0.01 (None without fp32 runs)."""
    ref = [r.last_k_accuracy for r in runs if r.codec == REFERENCE]
    return math.floor(100 * fraction * statistics.fmean(ref)) / 100 if ref else None


def markdown_table(rows: Sequence[CodecRow], *, last_k: int, target: float | None) -> str:
    """The sweep's table: accuracy with 95 % intervals over the seeds, cost, and the cost to reach ``target``."""
    goal = f"{target:.2f}" if target is not None else "target"
    head = [
        "codec",
        "bits/param",
        "uplink MB",
        "uplink message MB",
        "final accuracy",
        f"last-{last_k} accuracy",
        f"Δ last-{last_k} vs fp32",
        "verdict",
        f"rounds to {goal}",
        f"MB to {goal}",
        f"sim. s to {goal}",
        "nested tensors",
        "seeds",
    ]
    align = ["---"] + ["---:"] * 6 + ["---"] + ["---:"] * 4 + ["---"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        if not r.last_k.n:
            lines.append(f"| {r.codec} | failed: {'; '.join(r.errors) or 'no run'} |" + " |" * (len(head) - 2))
            continue
        n = len(r.seeds)
        reached = "" if r.reached == n else f" ({r.reached}/{n} reached)"
        nested = (
            "–"
            if r.nested_tensors is None
            else f"{r.nested_tensors:.1f}" + (" (all DQSG)" if not r.nested_tensors else "")
        )
        seeds = ",".join(map(str, r.seeds)) + (f"; {r.diverged} diverged" if r.diverged else "")
        seeds += f"; {r.recovered} collapsed and recovered" if r.recovered else ""
        seeds += f"; {len(r.errors)} failed" if r.errors else ""
        cells = [
            r.codec,
            r.bits_per_param.text(2),
            r.uplink_mb.text(3),
            r.message_mb.text(3),
            r.final.text(4),
            r.last_k.text(4),
            "–" if r.delta is None else r.delta.text(4),
            r.verdict,
            (r.rounds_to_target.text(1) + reached) if r.reached else f"not reached (0/{n})",
            r.mb_to_target.text(3) if r.reached else "–",
            r.seconds_to_target.text(1) if r.reached and r.seconds_to_target.n else "–",
            nested,
            seeds,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


__all__ = ["CodecRow", "Interval", "RunSummary", "codec_rows", "default_target", "markdown_table", "summarize_run"]
