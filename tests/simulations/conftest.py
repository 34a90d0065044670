"""Fixtures of the simulation tests."""

from __future__ import annotations

from pathlib import Path

import pytest


def _placeholder(path) -> Path:
    Path(path).write_bytes(b"figure")
    return Path(path)


@pytest.fixture
def no_history_figure(monkeypatch):
    """Runs write a placeholder ``history.png`` instead of drawing it (see :func:`no_figures`)."""
    import simulations.history

    monkeypatch.setattr(simulations.history, "plot_run", lambda rows, path, title="": _placeholder(path))


@pytest.fixture
def no_figures(monkeypatch, no_history_figure):
    """Runs and sweeps write a placeholder for every figure instead of drawing it with matplotlib.

    Drawing is most of the time of a short in-process run (a history PNG after every round, the
    sweep's PNG and PDF figures after every run: 0.3-1.5 s each); tests of what runs compute and
    store, not of the figures, use this. The figures themselves are drawn for real in the tests
    that check them (``test_sweep.py``'s figure and table tests, ``test_run_folders.py``'s history;
    the sweep's figure test draws its own figures, not its runs' histories).
    """
    import simulations.sweep

    def sweep_figures(curves, stem, title="", *, target=None, formats=("png", "pdf")):
        return {fmt: _placeholder(Path(stem).with_suffix(f".{fmt}")) for fmt in formats}

    monkeypatch.setattr(simulations.sweep, "plot_sweep", sweep_figures)
    monkeypatch.setattr(simulations.sweep, "plot_uplink_bars", lambda rows, path, title="": _placeholder(path))
