"""Shared test fixtures."""

import logging
import os

# The tests exercise the compiled kernels themselves, never their twins (which a cold numba cache
# would otherwise pick: see fedquant.jit.cache); subprocesses and Ray workers inherit it.
os.environ["FEDQUANT_KERNELS"] = "numba"

import pytest

from fedquant.codecs import available_codecs, get_codec


@pytest.fixture(params=available_codecs())
def any_codec(request):
    """Every registered codec with its default parameters."""
    return get_codec(request.param)


@pytest.fixture(autouse=True)
def _flwr_log_level_restored():
    """Put the ``flwr`` logger's level back after each test: benchmarks' ``main`` quiets it, and a
    level left at ERROR hides the warnings later tests look for."""
    logger = logging.getLogger("flwr")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture
def flwr_log():
    """Records of the ``flwr`` logger (Flower's ``log`` does not propagate to the root logger)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Keep(level=logging.DEBUG)
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def pytest_collection_modifyitems(config, items):
    """Give every test that skips without CUDA the ``cuda`` marker, so ``pytest -m cuda`` runs them all."""
    for item in items:
        if any("CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
