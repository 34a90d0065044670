"""Validation loss against bytes for several codecs over seeds; writes a markdown table and a plot.

Usage (from the example's folder, offline)::

    python -m flowertune_lora.sweep --doc ../../docs/lora.md --plot ../../docs/lora.png

Every codec x seed run fine-tunes the same cached base model on the same clients (per seed: the
same LoRA initialisation, local batches and sampled clients, Python's ``random`` being seeded
before each run because Flower's FedAvg samples with it), in this process without Ray
(:mod:`flowertune_lora.local_grid`). Each codec's final validation loss is pooled over the seeds
as a mean with its 95 % Student-t interval; the verdict compares it with fp32's interval. Exits 1
unless ``eden:bits=1`` or ``ecdq:bits=1`` ends no worse than fp32's spread (within it, or below)
while sending at least 16x fewer uplink bytes than the float32 adapters themselves.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flowertune_lora.local_grid import run_in_process
from flowertune_lora.server_app import default_run_name

CODECS = ("fp32", "fp16", "eden:bits=1", "ecdq:bits=1", "eden:bits=4")
GATED = ("eden:bits=1", "ecdq:bits=1")
MIN_RATIO = 16.0
REFERENCE = "fp32"


@dataclass(frozen=True)
class Interval:
    """Mean of the values with the half-width of its two-sided 95 % Student-t interval."""

    mean: float
    half: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Interval:
        from scipy.stats import t  # scipy comes with scikit-learn, a fedquant dependency

        if len(values) < 2:
            return cls(values[0] if values else math.nan, math.nan, len(values))
        half = float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
        return cls(statistics.fmean(values), half, len(values))

    def text(self, digits: int = 4) -> str:
        if not math.isfinite(self.half):
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ± {self.half:.{digits}f}"


def run_name(codec: str, seed: int) -> str:
    return default_run_name({"codec": codec, "seed": seed})


def verdict(codec: Interval, reference: Interval) -> str:
    if reference.n < 2 or not math.isfinite(reference.half):
        return ""
    if abs(codec.mean - reference.mean) <= reference.half:
        return "within fp32's spread"
    return "above fp32's spread" if codec.mean > reference.mean else "below fp32's spread"


def load(results: Path, codecs, seeds) -> dict[str, list[dict]]:
    return {c: [json.loads((results / run_name(c, s) / "history.json").read_text()) for s in seeds] for c in codecs}


def summarize(histories: dict[str, list[dict]]) -> list[dict]:
    """One row per codec: bytes per round (both counts), final val loss pooled over seeds, verdict."""
    finals = {c: [h["rounds"][-1]["val-loss"] for h in hs] for c, hs in histories.items()}
    reference = Interval.of(finals[REFERENCE]) if REFERENCE in finals else None
    rows = []
    for codec, hs in histories.items():
        trained = [r for h in hs for r in h["rounds"][1:]]
        uplink = statistics.fmean(r["flowertune-uplink-bytes"] for r in trained)
        dense = statistics.fmean(r["uplink-bytes-dense"] for r in trained)
        final = Interval.of(finals[codec])
        paired = None
        if REFERENCE in finals and codec != REFERENCE:
            paired = Interval.of([a - b for a, b in zip(finals[codec], finals[REFERENCE])])
        rows.append({
            "codec": codec,
            "uplink-per-round": uplink,
            "dense-per-round": dense,
            "ratio": dense / uplink,
            "bits-per-param": statistics.fmean(r["bits-per-param"] for r in trained),
            "cumulative-uplink": statistics.fmean(h["rounds"][-1]["flowertune-cumulative-uplink-bytes"] for h in hs),
            "cumulative-both": statistics.fmean(h["rounds"][-1]["flowertune-cumulative-bytes"] for h in hs),
            "initial": statistics.fmean(h["rounds"][0]["val-loss"] for h in hs),
            "final": final,
            "paired": paired,
            "verdict": verdict(final, reference) if reference and codec != REFERENCE else "",
            "rejected": sum(r.get("rejected-replies", 0) for r in trained),
            "seconds": statistics.fmean(h["seconds"] for h in hs),
        })  # fmt: skip
    return rows


def passes(rows: list[dict]) -> list[str]:
    """The gated codecs no worse than fp32's spread at >= MIN_RATIO fewer uplink bytes than float32 adapters."""
    return [r["codec"] for r in rows if r["codec"] in GATED and r["ratio"] >= MIN_RATIO
            and r["verdict"] in ("within fp32's spread", "below fp32's spread") and r["rejected"] == 0]  # fmt: skip


def markdown(rows: list[dict], histories: dict[str, list[dict]], seeds, clients: int) -> str:
    config = next(iter(histories.values()))[0]["run-config"]
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; {clients} clients, {config['num-server-rounds']} rounds, "
        f"fraction-train {config['fraction-train']}; bytes are means per round over the seeds, counted with "
        "`ArrayRecord.count_bytes()` as FlowerTune counts them.",
        "",
        "| codec | uplink bytes / round | fewer than fp32 adapters | bits / param | cumulative uplink | "
        "cumulative both ways | val loss, final (95 %) | − fp32, paired | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        paired = r["paired"].text() if r["paired"] else "–"
        lines.append(
            f"| `{r['codec']}` | {r['uplink-per-round']:,.0f} | {r['ratio']:.1f}x | {r['bits-per-param']:.2f} | "
            f"{r['cumulative-uplink']:,.0f} | {r['cumulative-both']:,.0f} | {r['final'].text()} | {paired} | "
            f"{r['verdict']} |"
        )
    rounds = range(int(config["num-server-rounds"]) + 1)
    lines += ["", "Validation loss per round (mean over the seeds; round 0: the base model with fresh adapters):", "",
              "| codec | " + " | ".join(f"r{i}" for i in rounds) + " |",
              "|---|" + "---:|" * len(rounds)]  # fmt: skip
    for codec, hs in histories.items():
        means = [statistics.fmean(h["rounds"][i]["val-loss"] for h in hs) for i in rounds]
        lines.append(f"| `{codec}` | " + " | ".join(f"{m:.4f}" for m in means) + " |")
    return "\n".join(lines) + "\n"


def plot(histories: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    for codec, hs in histories.items():
        trained = range(1, len(hs[0]["rounds"]))  # round 0 sent nothing
        x = [statistics.fmean(h["rounds"][i]["flowertune-cumulative-uplink-bytes"] for h in hs) for i in trained]
        y = [statistics.fmean(h["rounds"][i]["val-loss"] for h in hs) for i in trained]
        lo = [min(h["rounds"][i]["val-loss"] for h in hs) for i in trained]
        hi = [max(h["rounds"][i]["val-loss"] for h in hs) for i in trained]
        (line,) = ax.plot(x, y, marker="o", ms=3, label=codec)
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    base = statistics.fmean(h["rounds"][0]["val-loss"] for hs in histories.values() for h in hs)
    ax.axhline(base, color="grey", ls=":", lw=1, label="base model (round 0)")
    ax.set_xscale("log")
    ax.set_xlabel("cumulative uplink bytes (ArrayRecord.count_bytes)")
    ax.set_ylabel("validation loss (nats / token)")
    ax.set_title("Federated LoRA fine-tuning: mean and min-max over seeds")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated fedquant codec specs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--run-config", default="{}", help="JSON object of run-config overrides")
    parser.add_argument("--results", type=Path, default=Path("results/sweep"))
    parser.add_argument("--reuse", action="store_true", help="keep the runs whose history exists")
    parser.add_argument("--doc", type=Path, help="write the table (between markers if the file has them)")
    parser.add_argument("--plot", type=Path, help="write the plot of val loss against cumulative uplink bytes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = parser.parse_args(argv)

    codecs = [c.strip() for c in args.codecs.split(";" if ";" in args.codecs else ",") if c.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    overrides = json.loads(args.run_config)
    torch.set_num_threads(args.threads)
    started, ran = time.monotonic(), 0
    for seed in seeds:
        for codec in codecs:
            if args.reuse and (args.results / run_name(codec, seed) / "history.json").exists():
                continue
            random.seed(seed)  # Flower's FedAvg samples clients with Python's global random
            config = {**overrides, "codec": codec, "seed": seed, "out-dir": str(args.results),
                      "run-name": run_name(codec, seed)}  # fmt: skip
            run_in_process(config, args.clients)
            ran += 1
    histories = load(args.results, codecs, seeds)
    rows = summarize(histories)
    table = markdown(rows, histories, seeds, args.clients)
    print(table)
    print(f"{len(codecs) * len(seeds)} runs ({ran} run now, {time.monotonic() - started:.0f} s)")
    if args.doc:
        write_between_markers(args.doc, table)
    if args.plot:
        plot(histories, args.plot)
    passed = passes(rows)
    if passed:
        print(f"gate met: {', '.join(passed)} no worse than fp32's spread at >= {MIN_RATIO:.0f}x fewer uplink bytes")
        return 0
    print(f"gate missed: neither {' nor '.join(GATED)} is no worse than fp32's spread at >= {MIN_RATIO:.0f}x fewer "
          "uplink bytes", file=sys.stderr)  # fmt: skip
    return 1


def write_between_markers(path: Path, table: str, marker: str = "lora-table") -> None:
    """Replace the text between ``<!-- marker -->`` and ``<!-- /marker -->``, or write the table alone."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = f"{head}{start}\n{table}{end}{rest.split(end, 1)[1]}"
    else:
        text = f"{start}\n{table}{end}\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
