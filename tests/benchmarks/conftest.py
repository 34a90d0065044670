"""Fixtures of the benchmark tests: the simulation tests' placeholders for figures."""

from tests.simulations.conftest import no_figures, no_history_figure  # noqa: F401 (fixtures)
