"""Per-round history of one simulation: what the server measured, written as JSON, CSV and PNG.

A run gets its own folder (:func:`reserve_run_dir`: never an existing run's, unless asked) and
the three files are rewritten after every round, each atomically (a temporary file, then
``os.replace``), so a run that is stopped, killed or crashes keeps the rounds it finished and a
reader never sees half a file. ``history.json``'s ``status`` says how the run ended:
``running`` (still, or the process died without a word: a kill), ``finished``, ``failed`` (with
``error``: it raised, was refused before round 1, or applied no update), ``interrupted`` (Ctrl-C)
or ``stopped`` (``flwr stop``, SIGTERM); ``last-round`` is the last round it completed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedquant.metrics.history import json_safe, write_rows_csv
from simulations.plots import plot_run
from simulations.settings import SimSettings

# Leading columns of history.csv; every other metric follows in alphabetical order.
LEAD_COLUMNS = ("round", "accuracy", "loss", "elapsed-seconds")
FILES = ("history.json", "history.csv", "history.png")
STATUSES = ("running", "finished", "failed", "interrupted", "stopped")
# Settings always in a run folder's name (in this order); any other key appears when it differs
# from its default. Keys that say where the run goes are never part of the name.
NAME_KEYS = ("codec", "dataset", "partitioning", "seed", "secagg")
UNNAMED_KEYS = ("out-dir", "run-name", "overwrite")
NAME_LIMIT = 150
MODEL_FILE = "model.pt"
# Runs of this process that have not ended yet: a signal handler records how they ended.
_ACTIVE: dict[int, RunHistory] = {}
_ACTIVE_LOCK = threading.Lock()


def run_dir_name(settings: SimSettings, num_nodes: int | None = None) -> str:
    """Folder name of a run: ``run-name`` if set, else the settings that tell runs apart.

    ``<codec>_<dataset>_<partitioning>_seed<seed>`` (``secagg`` for the codec under secure
    aggregation), then ``<key>=<value>`` for every other
    setting that differs from its default, then ``<num_nodes>nodes``; characters other than
    letters, digits and ``_.+=-`` become ``-`` (``eden:bits=2`` gives ``eden-bits=2``). Names
    longer than ``NAME_LIMIT`` are cut and end in a hash of the whole name.
    """
    if settings.run_name:
        name = settings.run_name
    else:
        s = settings
        parts = [s.uplink_name, s.dataset, s.partitioning, f"seed{s.seed}"]
        parts += [f"{k}={v}" for k, v in s.changed().items() if k not in (*NAME_KEYS, *UNNAMED_KEYS)]
        if num_nodes is not None:
            parts.append(f"{num_nodes}nodes")
        name = "_".join(parts)
    name = re.sub(r"[^A-Za-z0-9_.+=-]+", "-", name).strip("-.") or "run"
    if len(name) > NAME_LIMIT:
        name = f"{name[: NAME_LIMIT - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return name


def reserve_run_dir(out_dir: str | Path, name: str, overwrite: bool = False) -> Path:
    """Create the run's folder ``out_dir/name`` and return it; an existing folder is never reused.

    When ``name`` exists, the first free one of ``name-2``, ``name-3``, ... is taken (created
    atomically, so two runs started at once get two folders). ``overwrite=True`` reuses
    ``out_dir/name`` and replaces its history files.
    """
    base = Path(out_dir).expanduser().resolve()
    base.mkdir(parents=True, exist_ok=True)
    if overwrite:
        (base / name).mkdir(exist_ok=True)
        return base / name
    for count in itertools.count(1):
        folder = base / (name if count == 1 else f"{name}-{count}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise AssertionError("unreachable")


def write_atomically(path: Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` to a temporary file beside ``path`` (same suffix), then move it over ``path``."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@dataclass
class RunHistory:
    """Rows (one per round, round 0 = initial model) and per-client records of one run.

    With a ``folder``, :meth:`save` (called after every round) and :meth:`finish` write the files
    there.
    """

    settings: SimSettings
    rounds: list[dict[str, Any]] = field(default_factory=list)
    clients: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    divergence: dict[str, Any] | None = None  # {"round": first diverged round, "reason": ...} or None
    folder: Path | None = None
    num_nodes: int | None = None
    status: str = "running"
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_round(self, row: dict[str, Any]) -> None:
        self.rounds.append({k: json_safe(v) for k, v in row.items()})

    def add_clients(self, server_round: int, infos: list[dict[str, Any]]) -> None:
        for info in infos:
            self.clients.append({"round": server_round, **{k: json_safe(v) for k, v in info.items()}})

    @property
    def final(self) -> dict[str, Any]:
        """The last round's row (empty before any round)."""
        return self.rounds[-1] if self.rounds else {}

    @property
    def last_round(self) -> int:
        """The last round completed (0: none, only the initial model scored)."""
        return max((int(r["round"]) for r in self.rounds), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings.as_config(),
            "status": self.status,
            "error": self.error,
            "last-round": self.last_round,
            "num-nodes": self.num_nodes,
            "warnings": self.warnings,
            "wall-seconds": self.wall_seconds,
            "divergence": self.divergence,
            "rounds": self.rounds,
            "clients": self.clients,
        }

    def save(self) -> dict[str, Path] | None:
        """Write the files into :attr:`folder` (nothing without one)."""
        return None if self.folder is None else self.write(self.folder)

    def finish(self, status: str, error: str | None = None) -> dict[str, Path] | None:
        """Record how the run ended (one of ``STATUSES``) and save; the first end recorded stays."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        with self._lock:
            if self.status == "running":
                self.status, self.error = status, error
        with _ACTIVE_LOCK:
            _ACTIVE.pop(id(self), None)
        return self.save()

    def track(self) -> RunHistory:
        """Register this run as going on, so that :func:`end_active_runs` records its end."""
        with _ACTIVE_LOCK:
            _ACTIVE[id(self)] = self
        return self

    def write(self, folder: str | Path) -> dict[str, Path]:
        """Write ``history.json``, ``history.csv`` and ``history.png`` into ``folder``, each atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {name: folder / name for name in FILES}
        with self._lock:
            text = json.dumps(self.to_json(), indent=1)
            rows = list(self.rounds)
            write_atomically(paths["history.json"], lambda p: p.write_text(text))
            write_atomically(paths["history.csv"], lambda p: write_rows_csv(p, rows, lead=LEAD_COLUMNS))
            trained = [r for r in rows if r["round"] > 0]
            if trained:
                s = self.settings
                title = f"{s.codec} | {s.dataset} {s.partitioning} | {s.model}"
                write_atomically(paths["history.png"], lambda p: plot_run(trained, p, title))
        return paths


def end_active_runs(status: str, reason: str) -> list[RunHistory]:
    """Record ``status`` (``interrupted``, ``stopped``) for every run of this process still going on.

    Called from a signal or exit handler: the finished rounds are on disk already, only the
    status is left to write. Returns the runs it ended.
    """
    with _ACTIVE_LOCK:
        runs = list(_ACTIVE.values())
    for history in runs:
        history.finish(status, reason)
    return runs


def settings_difference(folder: str | Path, settings: SimSettings) -> dict[str, tuple[Any, Any]]:
    """Run-config keys whose value in ``folder``'s ``history.json`` differs from ``settings``.

    ``{key: (stored, new)}``; empty when the folder holds no history or the same settings (keys
    that only say where a run goes are not compared).
    """
    try:
        stored = load_history(folder).get("settings") or {}
    except (OSError, ValueError):
        return {}
    new = settings.as_config()
    return {k: (stored.get(k), new.get(k)) for k in sorted({*stored, *new})
            if k not in UNNAMED_KEYS and stored.get(k) != new.get(k)}  # fmt: skip


def load_history(folder: str | Path) -> dict[str, Any]:
    """Read a run's ``history.json``."""
    return json.loads((Path(folder) / "history.json").read_text())
