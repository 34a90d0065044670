"""Compare codecs over seeds on identical data, client samples and seeds.

    python -m simulations.sweep                                        # every codec, digits, seed 0
    python -m simulations.sweep --preset separating --seeds 0,1,2      # the codec table's task
    python -m simulations.sweep --codecs fp32,qsgd:levels=4,orq:levels=4 --rounds 10 --seeds 0,1,2
    python -m simulations.sweep --set partitioning=dirichlet --set dirichlet-alpha=0.3
    python -m simulations.sweep --codecs secagg,secagg:dropouts=2,eden:bits=2,fp32 --seeds 0-2   # secure arm

All runs share ONE simulation (one Ray start, the same virtual clients): the ServerApp runs the
federation once per codec x seed, seed by seed, from the same initial model per seed and with
the same client sample per round and seed, so codecs differ only by their codec. The seed
changes the initial model, the client samples, the batches, the codec's random streams and the
digits partitions (Synthetic's population has its own seed, ``synthetic:seed=S``).

Resumable: every finished run is stored in ``--out``/``records/`` (atomically); running the same
command again (after a crash or Ctrl-C) reuses the runs stored with the same settings and runs
the others, replacing the folder of a run that was interrupted (``--restart`` discards them all).
A sweep whose settings differ from the runs its ``--out`` holds is refused before anything runs,
naming the differences (use another ``--out``, or ``--restart``): stored results are never
replaced silently. One Ctrl-C ends the sweep at once (exit 130); the run it interrupted says
``interrupted`` in its folder. Progress lines give codec, seed, round and an ETA.

Writes into ``--out``: ``sweep.md`` (the table: mean ± 95 % interval over the seeds),
``sweep.csv`` (one line per run), ``sweep.png``/``.pdf`` (accuracy against uplink bytes and
simulated time, :mod:`simulations.plots`), ``sweep-uplink.png`` and each run's history under
``runs/``; ``--table FILE`` writes the markdown table there too (``docs/codec-table.md``), with
the figures beside it under the same stem (``docs/codec-table.png``, ``.pdf``, ``-uplink.png``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedquant.codecs import available_codecs
from simulations.history import settings_difference
from simulations.node_directory import PartitionDirectory
from simulations.plots import plot_sweep, plot_uplink_bars
from simulations.server_app import run_server
from simulations.settings import RunConfigError, SimSettings
from simulations.sweep_stats import (
    CodecRow,
    RunSummary,
    codec_rows,
    default_target,
    markdown_table,
    summarize_run,
)
from simulations.task import limit_threads

RECORDS = "records"
# Settings that name where a run is written, not what it computes: not compared on resume.
_NOT_COMPARED = ("out-dir", "run-name")


@dataclass(frozen=True)
class Preset:
    """A named task: run-config overrides and the federation it needs."""

    description: str
    num_supernodes: int
    overrides: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "digits": Preset("the app's defaults on scikit-learn's digits (the quick default)", 20),
    # Chosen by `python -m benchmarks.separating_task` (README, "A task that separates codecs").
    "separating": Preset(
        "Synthetic(0.5, 0.5), MLP, 100 clients, 50 per round, lognormal uplinks (the codec table's task)",
        100,
        {
            "dataset": "synthetic:alpha=0.5,beta=0.5",
            "model": "mlp",
            "fraction_train": 0.5,
            "local_epochs": 1,
            "min_local_steps": 10,
            "rounds": 40,
            "uplink": "lognormal:median=2,sigma=1",
        },
    ),
    # The papers' regime (docs/app.md, "Data-parallel SGD"): every client sends one minibatch gradient per step.
    "fedsgd": Preset(
        "digits, MLP, data-parallel SGD: 10 IID clients, all each step, one gradient of 32 examples each, "
        "server SGD lr 0.1 momentum 0.9",
        10,
        {
            "mode": "fedsgd",
            "model": "mlp",
            "fraction_train": 1.0,
            "batch_size": 32,
            "learning_rate": 0.1,
            "clip_norm": 0.0,
            "rounds": 150,
        },
    ),
    # Hub datasets (pip install -e ".[hub]", internet on first use); run times: benchmarks/preset_cost.py.
    "femnist": Preset(
        "FEMNIST (flwr-datasets), CNN, 200 clients with Dirichlet(0.5) labels, 20 per round",
        200,
        {
            "dataset": "femnist",
            "model": "cnn",
            "partitioning": "dirichlet",
            "dirichlet_alpha": 0.5,
            "fraction_train": 0.1,
            "local_epochs": 1,
            "batch_size": 32,
            "rounds": 100,
        },
    ),
    "cifar10": Preset(
        "CIFAR-10 (flwr-datasets), ResNet-20, 100 clients with Dirichlet(0.3) labels, 10 per round",
        100,
        {
            "dataset": "cifar10",
            "model": "resnet20",
            "partitioning": "dirichlet",
            "dirichlet_alpha": 0.3,
            "fraction_train": 0.1,
            "local_epochs": 2,
            "batch_size": 32,
            "rounds": 200,
        },
    ),
}


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


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or a range ``"0-4"`` -> seeds, in order, without repeats."""
    seeds: list[int] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = piece.partition("-")
        try:
            values = range(int(low), int(high) + 1) if dash and low else [int(piece)]
        except ValueError:
            raise ValueError(f"--seeds: {piece!r} is not a seed (use e.g. 0,1,2 or 0-4)") from None
        seeds += [s for s in values if s not in seeds]
    if not seeds or any(s < 0 for s in seeds):
        raise ValueError(f"--seeds needs seeds >= 0, got {text!r}")
    return seeds


def run_slug(codec: str, seed: int) -> str:
    """File-name-safe name of one run (``ef+eden:bits=0.5`` seed 1 -> ``ef+eden-bits=0.5_seed1``)."""
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "-", codec).strip("-") + f"_seed{seed}"


SECURE_ARM = "secagg"


def arm_overrides(entry: str) -> dict[str, Any]:
    """The settings one sweep entry changes: a codec spec, or the secure-aggregation arm.

    ``"qsgd:levels=4"`` -> ``{"codec": "qsgd:levels=4"}``; ``"secagg"`` turns secure aggregation
    on (the uplink codec is then unused: the secure stage quantizes to integers itself), and
    ``"secagg:bits=4,dropouts=2"`` also sets ``secagg-bits`` and ``secagg-dropouts`` (any
    ``secagg-*`` run-config key, without its prefix).
    """
    name, _, params = entry.partition(":")
    if name != SECURE_ARM:
        return {"codec": entry}
    overrides: dict[str, Any] = {"secagg": True}
    for piece in filter(None, (p.strip() for p in params.split(","))):
        key, sep, value = piece.partition("=")
        if not sep:
            raise RunConfigError([f"{entry!r}: {piece!r} is not key=value (e.g. secagg:bits=4,dropouts=2)"])
        overrides["secagg_" + key.strip().replace("-", "_")] = value.strip()
    return overrides


def arm_settings(base: SimSettings, entry: str, **changes: Any) -> SimSettings:
    """``base`` with one sweep entry (see :func:`arm_overrides`) and ``changes`` applied."""
    return SimSettings.from_run_config(base.as_config(), **arm_overrides(entry), **changes)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in _NOT_COMPARED}


class RunStore:
    """Finished runs of a sweep, one JSON file each under ``<out>/records/``, written atomically."""

    def __init__(self, out: Path) -> None:
        self.folder = Path(out) / RECORDS

    def path(self, codec: str, seed: int) -> Path:
        return self.folder / f"{run_slug(codec, seed)}.json"

    def load(self, codec: str, seed: int, settings: SimSettings, federation: dict[str, Any]) -> dict | None:
        """The stored run, if it ran with these settings on this federation; else None."""
        path = self.path(codec, seed)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        same = record.get("settings") == _comparable(settings.as_config()) and record.get("federation") == federation
        return record if same and record.get("rounds") else None

    def conflict(self, codec: str, seed: int, settings: SimSettings, federation: dict[str, Any]) -> str | None:
        """What differs between the stored run (or its unfinished folder under ``runs/``) and these settings."""
        path = self.path(codec, seed)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = None
        changes: dict[str, tuple[Any, Any]] = {}
        if record is not None:
            stored, new = record.get("settings") or {}, _comparable(settings.as_config())
            changes = {k: (stored.get(k), new.get(k)) for k in sorted({*stored, *new}) if stored.get(k) != new.get(k)}
            if record.get("federation") != federation:
                changes["federation"] = (record.get("federation"), federation)
            where = path
        else:
            where = self.folder.parent / "runs" / run_slug(codec, seed)
            changes = settings_difference(where, settings)
        if not changes:
            return None
        listed = ", ".join(f"{k}: {old!r} stored, {new!r} now" for k, (old, new) in changes.items())
        return f"{where} holds {codec} seed {seed} with other settings ({listed})"

    def save(
        self,
        codec: str,
        seed: int,
        settings: SimSettings,
        federation: dict[str, Any],
        rounds: list[dict[str, Any]],
        wall: float,
        sampled: list[tuple[int, Any]] = (),
    ) -> dict[str, Any]:
        """Store a finished run (its rows and the ``(round, partition id)`` of every client sampled)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {
            "codec": codec,
            "seed": seed,
            "settings": _comparable(settings.as_config()),
            "federation": federation,
            "wall-seconds": wall,
            "sampled": [list(x) for x in sampled],
            "rounds": rounds,
        }
        path = self.path(codec, seed)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # a crash never leaves half a record
        return record

    def clear(self) -> int:
        """Delete every stored run; returns how many."""
        files = list(self.folder.glob("*.json")) if self.folder.is_dir() else []
        for f in files:
            f.unlink()
        return len(files)


class Progress:
    """Log lines ``[sweep 3/12] qsgd seed 1: round 7/30 | 2m10s elapsed, ETA 5m40s``."""

    def __init__(self, runs: int, rounds: int, pending: int) -> None:
        self.runs, self.rounds = runs, rounds
        self.left = pending * rounds  # rounds still to run in this session
        self.done = 0
        self.t0 = time.perf_counter()

    def hook(self, index: int, codec: str, seed: int) -> Callable[[dict[str, Any]], None]:
        def on_round(row: dict[str, Any]) -> None:
            if row.get("round", 0) < 1:
                return
            self.done += 1
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / self.done * max(self.left - self.done, 0)
            log(
                INFO,
                "[sweep %d/%d] %s seed %d: round %d/%d, accuracy %.4f | %s elapsed, ETA %s",
                index,
                self.runs,
                codec,
                seed,
                row["round"],
                self.rounds,
                row.get("accuracy", float("nan")),
                _duration(elapsed),
                _duration(eta),
            )

        return on_round


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def describe(settings: SimSettings, num_supernodes: int | None, seeds: Sequence[int]) -> str:
    """The settings in words, for titles: dataset, model, federation, rounds, seeds."""
    from simulations import synthetic

    if synthetic.is_synthetic(settings.dataset):
        spec = synthetic.parse_spec(settings.dataset)
        data = f"Synthetic(α={spec.alpha:g}, β={spec.beta:g})"
    else:
        data = settings.dataset + (
            f", Dirichlet α={settings.dirichlet_alpha:g}" if settings.partitioning == "dirichlet" else ", IID"
        )
    names = {
        "logreg": "logistic regression", "mlp": "MLP", "cnn": "CNN", "resnet20": "ResNet-20", "resnet18": "ResNet-18"
    }
    base, _, options = settings.model.partition(":")
    model = names.get(base, base) + (f" ({options})" if options else "")
    clients = (
        f"{num_supernodes} clients, {max(int(num_supernodes * settings.fraction_train), 1)} per round"
        if num_supernodes
        else f"{settings.fraction_train:.0%} of the clients per round"
    )
    link = "" if settings.uplink in ("", "none") else f", uplink {settings.uplink}"
    return f"{data}, {model}, {clients}, {settings.rounds} rounds{link}; {len(seeds)} seed{'s' * (len(seeds) > 1)}"


@dataclass
class SweepResult:
    """Every run's summary, the per-codec rows, and the failures (codec -> messages)."""

    runs: list[RunSummary]
    rows: list[CodecRow]
    errors: dict[str, list[str]]
    target: float | None
    paths: dict[str, Path]


def write_results(
    runs: Sequence[RunSummary],
    curves: dict[str, dict[int, list[dict[str, Any]]]],
    target: float | None,
    errors: dict[str, list[str]],
    out: Path,
    *,
    title: str,
    last_k: int,
    command: str = "",
    table: Path | None = None,
) -> SweepResult:
    """Write ``sweep.md``, ``sweep.csv`` and the figures into ``out`` (and the table to ``table``)."""
    out.mkdir(parents=True, exist_ok=True)
    last_k = min(last_k, max((r.rounds for r in runs), default=last_k))  # a 3-round run's mean is a last-3
    rows = codec_rows(runs, errors)
    paths = {"md": out / "sweep.md", "csv": out / "sweep.csv"}
    with paths["csv"].open("w", newline="") as fh:
        names = list(RunSummary.__dataclass_fields__)
        writer = csv.DictWriter(fh, fieldnames=[*names, "error"])
        writer.writeheader()
        for r in runs:
            writer.writerow({**asdict(r), "error": ""})
        for codec, messages in errors.items():
            for m in messages:
                writer.writerow({"codec": codec, "error": m})
    text = f"{title}\n\n" + markdown_table(rows, last_k=last_k, target=target) + _legend(last_k, target)
    wall = sum(r.wall_seconds for r in runs)
    text += f"\n{len(runs)} runs, {wall / 60:.1f} minutes of wall time in all (the runs alone).\n"
    if command:
        text += f"\nReproduce: `{command}` (a rerun reuses the runs stored in its `--out` folder)\n"
    paths["md"].write_text(text)
    figures_drawn: dict[str, Path] = {}
    if curves:
        figures_drawn = plot_sweep(curves, out / "sweep", title, target=target)
        paths.update(figures_drawn)
        paths["uplink"] = plot_uplink_bars(rows, out / "sweep-uplink.png", title)
    if table is not None:  # the table with its figures beside it (codec-table.md: codec-table.png, ...)
        table.parent.mkdir(parents=True, exist_ok=True)
        figures = ""
        if curves:  # the same figures as the sweep's: copied, not drawn twice
            stem = table.with_suffix("")
            for fmt, path in figures_drawn.items():
                paths[f"table-{fmt}"] = _copy(path, stem.with_suffix(path.suffix))
            paths["table-uplink"] = _copy(paths["uplink"], stem.with_name(stem.name + "-uplink.png"))
            figures = (
                f"\n![Accuracy against uplink traffic and simulated time]({stem.name}.png)\n"
                f"([PDF]({stem.name}.pdf))\n\n![Uplink traffic by codec]({stem.name}-uplink.png)\n"
            )
        table.write_text("<!-- written by simulations/sweep.py; do not edit by hand -->\n" + text + figures)
        paths["table"] = table
    return SweepResult(list(runs), rows, errors, target, paths)


def _copy(source: Path, target: Path) -> Path:
    """``source``'s bytes written to ``target`` (the same file when they are one)."""
    if source.resolve() != target.resolve():
        shutil.copyfile(source, target)
    return target


def _legend(last_k: int, target: float | None) -> str:
    goal = f"{target:.2f}" if target is not None else "the target"
    return (
        f"\nMean ± half-width of the 95 % Student-t interval over the seeds. `bits/param` and `uplink MB` count "
        f"the payload: the bytes of the replies' ArrayRecords (envelopes and every tensor included; bits/param: x 8 "
        f"/ parameters sent). `uplink message MB`: the replies as Flower serialises them for the wire (metadata, "
        f"metrics and client records included, in secure rounds every protocol stage's replies, the transport's "
        f"RPC framing not; – for runs stored before it was counted). `last-{last_k} accuracy`: mean test "
        f"accuracy of the last {last_k} rounds. `Δ vs fp32`: the difference to fp32's last-{last_k} accuracy, paired "
        f"by seed (same clients, same initial model). `verdict`: whether the codec's mean lies inside fp32's "
        f"interval. `rounds/MB/sim. s to {goal}`: first round at or above {goal} test accuracy, over the seeds "
        "that reached it (`sim. s` needs an uplink profile). `nested tensors`: NDQSG only, tensors sent nested "
        "per round (0: every tensor fell back to DQSG, the row is DQSG's). `seeds`: the seeds run; `diverged`: "
        "seeds whose model was still diverged at the last round (the server's check on its own evaluation); "
        "`collapsed and recovered`: seeds where that check fired in some round but the model recovered.\n"
    )


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep runs and where it writes.

    ``overrides`` are run-config settings (snake_case) over the app's defaults; ``federation``
    (supernodes, CPUs and GPUs per client) is stored with every run, since it changes the result.
    """

    codecs: tuple[str, ...]
    seeds: tuple[int, ...]
    out: Path
    last_k: int = 5
    target: float | None = None
    command: str = ""
    table: Path | None = None
    federation: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)

    def settings(self, run_config: dict[str, Any] | None = None) -> SimSettings:
        """The runs' settings (before codec and seed), writing histories under ``out/runs``."""
        return SimSettings.from_run_config(dict(run_config or {}), out_dir=str(self.out / "runs"), **self.overrides)

    def checked_settings(self, run_config: dict[str, Any] | None = None) -> SimSettings:
        """:meth:`settings`, after checking every codec of the plan with them (before any run).

        Raises :class:`~simulations.settings.RunConfigError` naming every codec that cannot run:
        a typo in the 17th codec is found before the first 16 have run for an hour.
        """
        base = self.settings(run_config)
        problems = []
        for codec in dict.fromkeys(self.codecs):
            try:
                arm_settings(base, codec)
            except RunConfigError as err:
                problems.extend(err.problems)
        if problems:
            raise RunConfigError(problems)
        return base

    def runs(self) -> list[tuple[int, str]]:
        """``(seed, codec)`` in the order they run: seed by seed, so a stopped sweep has whole seeds."""
        return [(seed, codec) for seed in self.seeds for codec in self.codecs]


def run_plan(grid: Grid, run_config: dict[str, Any], plan: SweepPlan) -> SweepResult:
    """Run every codec x seed of ``plan`` not stored yet on ``grid``; write and return the results."""
    base = plan.checked_settings(run_config)
    store = RunStore(plan.out)
    order = plan.runs()
    stored = {(s, c): store.load(c, s, arm_settings(base, c, seed=s), plan.federation) for s, c in order}
    pending = sum(v is None for v in stored.values())
    if pending < len(order):
        log(
            INFO,
            "[sweep] %d of %d runs already done in %s; running the other %d",
            len(order) - pending,
            len(order),
            store.folder,
            pending,
        )
    progress = Progress(len(order), base.rounds, pending)
    directory = PartitionDirectory()  # the nodes are asked for their partition once, not per run
    done: dict[tuple[str, int], dict[str, Any]] = {}
    errors: dict[str, list[str]] = {}
    title = describe(base, plan.federation.get("num-supernodes"), plan.seeds)

    def write() -> SweepResult:
        return write_results(
            *summaries(done, plan.last_k, plan.target),
            errors,
            plan.out,
            title=title,
            last_k=plan.last_k,
            command=plan.command,
            table=plan.table,
        )

    for i, (seed, codec) in enumerate(order, 1):
        record = stored[(seed, codec)]
        if record is None:
            log(INFO, "[sweep %d/%d] %s seed %d ...", i, len(order), codec, seed)
            unfinished = plan.out / "runs" / run_slug(codec, seed)
            if (unfinished / "history.json").exists():
                log(INFO, "[sweep %d/%d] replacing the unfinished run in %s", i, len(order), unfinished)
            t0 = time.perf_counter()
            try:
                history = run_server(
                    grid,
                    base.as_config(),
                    directory=directory,
                    seed=seed,
                    **arm_overrides(codec),
                    run_name=run_slug(codec, seed),
                    overwrite=True,  # a run not stored is unfinished (interrupted, failed): replaced, not beside
                    on_round=progress.hook(i, codec, seed),
                )
            except Exception as err:  # noqa: BLE001 - one failing run must not end the sweep
                errors.setdefault(codec, []).append(f"seed {seed}: {type(err).__name__}: {err}")
                log(WARNING, "[sweep %d/%d] %s seed %d failed: %s", i, len(order), codec, seed, err)
                progress.left -= base.rounds
                write()
                continue
            sampled = sorted(
                {(c["round"], c.get("partition-id")) for c in history.clients}, key=lambda t: (t[0], str(t[1]))
            )
            record = store.save(
                codec,
                seed,
                arm_settings(base, codec, seed=seed),
                plan.federation,
                history.rounds,
                time.perf_counter() - t0,
                sampled,
            )
        done[(codec, seed)] = record
        r = summarize_run(codec, seed, record["rounds"], last_k=plan.last_k, target=None)
        log(
            INFO,
            "[sweep %d/%d] %s seed %d: final accuracy %.4f, last-%d %.4f, %.3f MB uplink, %.2f bits/param%s",
            i,
            len(order),
            codec,
            seed,
            r.final_accuracy,
            min(plan.last_k, r.rounds),
            r.last_k_accuracy,
            r.uplink_bytes / 1e6,
            r.bits_per_param,
            _nesting_note(r),
        )
        if record is not stored[(seed, codec)]:
            write()  # the files stay current after each new run
    result = write()
    log(INFO, "sweep results: %s", ", ".join(str(p) for p in result.paths.values()))
    return result


def make_sweep_app(plan: SweepPlan) -> ServerApp:
    """A ServerApp that runs the federation once per codec x seed and writes the comparison."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        limit_threads()
        run_plan(grid, dict(context.run_config), plan)

    return server_app


def summaries(
    done: dict[tuple[str, int], dict[str, Any]], last_k: int, target: float | None
) -> tuple[list[RunSummary], dict[str, dict[int, list[dict[str, Any]]]], float | None]:
    """Summaries of the finished runs (target: the given one, else 95 % of fp32's), their curves, the target."""
    if target is None:
        target = default_target(
            [summarize_run(c, s, r["rounds"], last_k=last_k, target=None) for (c, s), r in done.items()]
        )
    runs = [
        summarize_run(c, s, r["rounds"], last_k=last_k, target=target, wall=r["wall-seconds"])
        for (c, s), r in done.items()
    ]
    curves: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for (c, s), r in done.items():
        curves.setdefault(c, {})[s] = [row for row in r["rounds"] if row["round"] > 0]
    return runs, curves, target


def _nesting_note(run: RunSummary) -> str:
    if run.nested_tensors is None:
        return ""
    if run.nested_tensors == 0:
        return " | NDQSG nested no tensor in any round: every tensor went as DQSG"
    return f" | NDQSG nested {run.nested_tensors:.1f} tensors per round"


def run_sweep(
    codecs: Sequence[str],
    *,
    out: Path,
    seeds: Sequence[int] = (0,),
    num_supernodes: int = 20,
    num_cpus: float = 1,
    num_gpus: float = 0.0,
    last_k: int = 5,
    target: float | None = None,
    command: str = "",
    table: Path | None = None,
    restart: bool = False,
    **overrides: Any,
) -> SweepResult:
    """Run the sweep in one local simulation (Ray); returns what it wrote to ``out``.

    Runs stored in ``out`` with the same settings are reused (``restart=True`` deletes them first).
    """
    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.loopback import ray_loopback_only

    plan = SweepPlan(
        tuple(codecs),
        tuple(seeds),
        Path(out).resolve(),
        last_k,
        target,
        command,
        table,
        {"num-supernodes": num_supernodes, "num-cpus": num_cpus, "num-gpus": num_gpus},
        dict(overrides),
    )
    base = plan.checked_settings()  # fail on a bad setting or codec before Ray starts
    if last_k < 1:
        raise ValueError(f"last-k must be >= 1 (a run shorter than k averages all its rounds), got {last_k}")
    from simulations.feasibility import dataset_problem, engine_problems, federation_problems

    arms = [arm_settings(base, c) for c in dict.fromkeys(codecs)]
    cannot = [p for arm in arms for p in engine_problems(arm) + federation_problems(arm, num_supernodes)]
    cannot += [p for p in [dataset_problem(base.dataset)] if p]
    if cannot:  # every arm on this federation, and the data, before Ray starts
        raise RunConfigError(cannot)
    store = RunStore(plan.out)
    if restart:
        store.clear()
        shutil.rmtree(plan.out / "runs", ignore_errors=True)  # and the folders of the runs it discards
    else:
        conflicts = [store.conflict(c, s, arm_settings(base, c, seed=s), plan.federation) for s, c in plan.runs()]
        if any(conflicts):
            raise RunConfigError(
                [c for c in conflicts if c]
                + [f"{plan.out} holds runs with other settings: use another --out, or --restart to replace them"]
            )
    ray_loopback_only()  # Ray's servers on 127.0.0.1, not on every interface
    run_simulation(
        server_app=make_sweep_app(plan),
        client_app=client_app,
        num_supernodes=num_supernodes,
        backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}},
    )
    return load_sweep(plan)


def load_sweep(plan: SweepPlan) -> SweepResult:
    """The runs of ``plan`` stored in its folder (a missing run is reported as an error)."""
    base = plan.settings()
    store = RunStore(plan.out)
    done: dict[tuple[str, int], dict[str, Any]] = {}
    errors: dict[str, list[str]] = {}
    for seed, codec in plan.runs():
        record = store.load(codec, seed, arm_settings(base, codec, seed=seed), plan.federation)
        if record is None:
            errors.setdefault(codec, []).append(f"seed {seed}: no finished run")
        else:
            done[(codec, seed)] = record
    runs, _, goal = summaries(done, plan.last_k, plan.target)
    return SweepResult(runs, codec_rows(runs, errors), errors, goal, {})


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m simulations.sweep", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--codecs",
        default=",".join(available_codecs()),
        help="comma-separated codec specs, and secagg[:bits=B,dropouts=K,...] for the secure-aggregation arm "
        "(default: every codec fedquant has)",
    )
    parser.add_argument("--seeds", default="0", help="seeds, e.g. 0,1,2 or 0-4 (default 0)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="digits",
        help="task: " + "; ".join(f"{k}: {p.description}" for k, p in PRESETS.items()),
    )
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the preset's)")
    parser.add_argument("--last-k", type=int, default=5, help="rounds averaged for the last-k accuracy (default 5)")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="accuracy for the rounds/bytes/seconds-to-target columns (default: 95%% of fp32's)",
    )
    parser.add_argument("--num-supernodes", type=int, default=None, help="virtual clients (default: the preset's)")
    parser.add_argument("--num-cpus", type=float, default=1, help="CPUs per client (default 1)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per client, e.g. 0.25 (default 0)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"any run-config key: {', '.join(SimSettings.keys())}",
    )
    parser.add_argument("--out", type=Path, default=Path("results/sweep"), help="output folder")
    parser.add_argument(
        "--table", type=Path, default=None, help="also write the markdown table to this file, its figures beside it"
    )
    parser.add_argument("--restart", action="store_true", help="discard the runs stored in --out and run all")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    import shlex
    import sys

    from simulations.run import stop_at_ctrl_c

    args = _parse_args(argv)
    preset = PRESETS[args.preset]
    overrides: dict[str, Any] = dict(preset.overrides)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip().replace("-", "_")] = value.strip().strip('"')
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    codecs = split_codecs(args.codecs)
    stop_at_ctrl_c("sweep")  # one Ctrl-C ends the sweep at once; the run it interrupted says so
    command = ("python -m simulations.sweep " + shlex.join(sys.argv[1:] if argv is None else list(argv))).strip()
    try:
        result = run_sweep(
            codecs,
            out=args.out,
            seeds=seeds,
            num_supernodes=args.num_supernodes or preset.num_supernodes,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            last_k=args.last_k,
            target=args.target,
            command=command,
            table=args.table,
            restart=args.restart,
            **overrides,
        )
    except RunConfigError as err:  # before any run, like python -m simulations.run (exit 2)
        for problem in err.problems:
            print(f"sweep: invalid: {problem}", file=sys.stderr)
        return 2
    print("\n" + (Path(args.out) / "sweep.md").read_text(), flush=True)
    return 1 if result.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = [
    "PRESETS",
    "RunStore",
    "SweepPlan",
    "arm_overrides",
    "arm_settings",
    "SweepResult",
    "load_sweep",
    "make_sweep_app",
    "parse_seeds",
    "run_plan",
    "run_sweep",
    "split_codecs",
]
