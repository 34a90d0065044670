"""Per-round history: one row per round, written to JSON and CSV for plots.

>>> recorder = HistoryRecorder("runs/qsgd")                # writes runs/qsgd/history.{json,csv}
>>> recorder.record(1, {"uplink-bytes": 1234}, prefix="train/")
>>> recorder.record(1, {"accuracy": 0.81}, prefix="evaluate/")
>>> recorder.record_result(result)                          # or all rounds of a flwr Result at once

A row is ``{"round": r, "train/uplink-bytes": ..., "evaluate/accuracy": ..., ...}``. Recording
into a round that already has a row merges into it. Both files are rewritten after every
``record`` (histories are small), so they are complete whenever a run stops.

Prefixes used for a flwr ``Result`` (:func:`result_rows`): ``train/`` (the aggregated train
MetricRecord, fedquant's bandwidth metrics included), ``evaluate/`` (client-side evaluation),
``server/`` (the ServerApp's ``evaluate_fn``).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRAIN_PREFIX = "train/"
EVALUATE_PREFIX = "evaluate/"
SERVER_PREFIX = "server/"


def json_safe(value: Any) -> Any:
    """A JSON-friendly value: lists stay lists, non-finite floats become None."""
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_rows_csv(path: str | Path, rows: list[dict[str, Any]], lead: tuple[str, ...] = ("round",)) -> None:
    """Write per-round rows as CSV: the ``lead`` columns present first, then the rest sorted.

    Rows may hold different keys (missing cells stay empty); list values are written as JSON.
    """
    keys = {key for row in rows for key in row}
    columns = [k for k in lead if k in keys] + sorted(keys - set(lead))
    with Path(path).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})


def result_rows(result: Any) -> list[dict[str, Any]]:
    """Turn a flwr ``Result`` (from ``Strategy.start``) into per-round rows, sorted by round.

    Parameters
    ----------
    result : flwr.serverapp.strategy.Result
        Uses ``train_metrics_clientapp``, ``evaluate_metrics_clientapp`` and
        ``evaluate_metrics_serverapp`` (dicts of round -> MetricRecord).

    Returns
    -------
    list of dict
        ``{"round": r, "train/<key>": ..., "evaluate/<key>": ..., "server/<key>": ...}``.
    """
    rows: dict[int, dict[str, Any]] = {}
    sources = (
        (TRAIN_PREFIX, result.train_metrics_clientapp),
        (EVALUATE_PREFIX, result.evaluate_metrics_clientapp),
        (SERVER_PREFIX, result.evaluate_metrics_serverapp),
    )
    for prefix, per_round in sources:
        for server_round, metrics in per_round.items():
            row = rows.setdefault(int(server_round), {"round": int(server_round)})
            row.update({prefix + key: json_safe(value) for key, value in dict(metrics).items()})
    return [rows[r] for r in sorted(rows)]


class HistoryRecorder:
    """Collects per-round metrics and keeps ``<out_dir>/<name>.json`` and ``.csv`` up to date.

    Parameters
    ----------
    out_dir : str or Path
        Created if missing.
    name : str
        File stem (default ``"history"``).
    """

    def __init__(self, out_dir: str | Path, name: str = "history") -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out_dir / f"{name}.json"
        self.csv_path = self.out_dir / f"{name}.csv"
        self._rows: dict[int, dict[str, Any]] = {}

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows so far, sorted by round."""
        return [self._rows[r] for r in sorted(self._rows)]

    def record(self, server_round: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
        """Merge ``metrics`` (keys prefixed with ``prefix``) into the row of ``server_round``."""
        row = self._rows.setdefault(int(server_round), {"round": int(server_round)})
        row.update({prefix + key: json_safe(value) for key, value in dict(metrics).items()})
        self.flush()

    def record_result(self, result: Any) -> None:
        """Merge every round of a flwr ``Result`` (see :func:`result_rows`)."""
        for row in result_rows(result):
            self._rows.setdefault(row["round"], {"round": row["round"]}).update(row)
        self.flush()

    def flush(self) -> None:
        """Rewrite both files from the rows held."""
        rows = self.rows
        self.json_path.write_text(json.dumps(rows, indent=1) + "\n")
        write_rows_csv(self.csv_path, rows)

    @staticmethod
    def load(path: str | Path) -> list[dict[str, Any]]:
        """Read the rows back from a JSON history file."""
        return json.loads(Path(path).read_text())
