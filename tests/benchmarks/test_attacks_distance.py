"""benchmarks.attacks' prediction distance: zero for the same model, symmetric, inf when a model is missing."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.attacks import RunResult, function_distance, function_spread


def _result(p: np.ndarray | None) -> RunResult:
    return RunResult(probabilities=p)


def test_prediction_distance_is_the_rms_of_per_example_distances():
    a = np.array([[1.0, 0.0], [0.5, 0.5]])
    b = np.array([[0.0, 1.0], [0.5, 0.5]])
    assert function_distance(_result(a), _result(a)) == 0.0
    # per example: sqrt(2) and 0; RMS over two examples: 1
    assert math.isclose(function_distance(_result(a), _result(b)), 1.0)
    assert function_distance(_result(b), _result(a)) == function_distance(_result(a), _result(b))
    assert function_distance(_result(a), _result(None)) == math.inf
    assert function_distance(_result(a), _result(np.full((2, 2), np.nan))) == math.inf


def test_the_spread_is_the_largest_pairwise_distance():
    runs = [_result(np.array([[x, 1 - x]])) for x in (0.2, 0.3, 0.6)]
    assert math.isclose(function_spread(runs), math.sqrt(2) * 0.4)
