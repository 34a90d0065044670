"""Per-round history of one simulation: what the server measured, written as JSON, CSV and PNG."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedquant.metrics.history import json_safe, write_rows_csv
from simulations.plots import plot_run
from simulations.settings import SimSettings

# Leading columns of history.csv; every other metric follows in alphabetical order.
LEAD_COLUMNS = ("round", "accuracy", "loss", "elapsed-seconds")
FILES = ("history.json", "history.csv", "history.png")


def run_dir_name(settings: SimSettings) -> str:
    """Folder name of a run: the run name, else codec, dataset, partitioning and seed."""
    name = settings.run_name or f"{settings.codec}_{settings.dataset}_{settings.partitioning}_seed{settings.seed}"
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "-", name).strip("-") or "run"


@dataclass
class RunHistory:
    """Rows (one per round, round 0 = initial model) and per-client records of one run."""

    settings: SimSettings
    rounds: list[dict[str, Any]] = field(default_factory=list)
    clients: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    divergence: dict[str, Any] | None = None  # {"round": first diverged round, "reason": ...} or None

    def add_round(self, row: dict[str, Any]) -> None:
        self.rounds.append({k: json_safe(v) for k, v in row.items()})

    def add_clients(self, server_round: int, infos: list[dict[str, Any]]) -> None:
        for info in infos:
            self.clients.append({"round": server_round, **{k: json_safe(v) for k, v in info.items()}})

    @property
    def final(self) -> dict[str, Any]:
        """The last round's row (empty before any round)."""
        return self.rounds[-1] if self.rounds else {}

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings.as_config(),
            "wall-seconds": self.wall_seconds,
            "divergence": self.divergence,
            "rounds": self.rounds,
            "clients": self.clients,
        }

    def write(self, folder: str | Path) -> dict[str, Path]:
        """Write ``history.json``, ``history.csv`` and ``history.png`` into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {name: folder / name for name in FILES}
        paths["history.json"].write_text(json.dumps(self.to_json(), indent=1))
        write_rows_csv(paths["history.csv"], self.rounds, lead=LEAD_COLUMNS)
        s = self.settings
        title = f"{s.codec} | {s.dataset} {s.partitioning} | {s.model}"
        plot_run([r for r in self.rounds if r["round"] > 0], paths["history.png"], title)
        return paths


def load_history(folder: str | Path) -> dict[str, Any]:
    """Read a run's ``history.json``."""
    return json.loads((Path(folder) / "history.json").read_text())
