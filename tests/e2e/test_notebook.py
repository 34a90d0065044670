"""The quickstart notebook runs top to bottom (a small simulation included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=int(scaled(600)), kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "qsgd:levels=4" in text and text.count("| fp32 |") == 1  # the codec table and the sweep table, once
    assert "last-3 accuracy" in text and "last-5" not in text  # 3 rounds: a last-3 mean, labelled so
    lines = sum(
        len(out.get("text", "").splitlines()) for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
    )
    assert lines < 80, lines  # the tables and a few lines, not every round's log
    assert (tmp_path / "results" / "notebook" / "sweep.png").stat().st_size > 0
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the matplotlib figure and the sweep PNG
