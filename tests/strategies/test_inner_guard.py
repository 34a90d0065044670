"""No reply may raise out of the wrapper through the inner strategy, whatever the inner strategy.

Flower's ``DifferentialPrivacyServerSideFixedClipping`` divided by a zero update's norm
(``ZeroDivisionError`` out of ``aggregate_train``: one client ended the run); the robust inner
strategies get zero and identical updates here too, and a strategy that raises on anything.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    FedMedian,
    FedTrimmedAvg,
    Krum,
)

from fedquant.strategies import AdmissionRules
from tests.flower_fakes import InProcessGrid, initial_arrays, make_client_app
from tests.strategies.test_attacks import (
    ATTACKER,
    N,
    SortedFedAvg,
    _distance,
    _forge,
    _round,
    _scaled,
    _update_of,
    _wrap,
)

SECOND = ATTACKER + 1


def _dp_fixed():
    return DifferentialPrivacyServerSideFixedClipping(
        SortedFedAvg(min_available_nodes=N), noise_multiplier=0.0, clipping_norm=10.0, num_sampled_clients=N
    )


def _dp_adaptive():
    return DifferentialPrivacyServerSideAdaptiveClipping(
        SortedFedAvg(min_available_nodes=N), noise_multiplier=0.0, num_sampled_clients=N, initial_clipping_norm=10.0
    )


INNER = {
    "DP-fixed": _dp_fixed,
    "DP-adaptive": _dp_adaptive,
    "FedMedian": lambda: FedMedian(min_available_nodes=N),
    "FedTrimmedAvg": lambda: FedTrimmedAvg(beta=0.2, min_available_nodes=N),
    "Krum": lambda: Krum(num_malicious_nodes=2, min_available_nodes=N),
    "FedAvg": lambda: SortedFedAvg(min_available_nodes=N),
}


def _tiny(nodes, scale: float):
    """Tamper: each of ``nodes`` sends its update times ``scale`` (0: exactly the model it received)."""
    return _scaled(nodes, scale)


def _copies(nodes):
    """Tamper: each of ``nodes`` sends the update of the first honest node (identical updates)."""

    def tamper(replies, messages):
        source = next(r for r in replies if r.metadata.src_node_id not in nodes)
        update = _update_of(source, messages)
        return [_forge(r, update, "fp32", messages) if r.metadata.src_node_id in nodes else r for r in replies]

    return tamper


CASES = {
    "one zero": _tiny({ATTACKER}, 0.0),
    "two zeros": _tiny({ATTACKER, SECOND}, 0.0),
    "one float32-underflow": _tiny({ATTACKER}, 1e-30),  # nonzero, but its squared norm is 0 in float32
    "two copies": _copies({ATTACKER, SECOND}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("inner", list(INNER))
def test_zero_and_identical_updates_never_raise(inner, case):
    arrays, metrics = _round(_wrap(inner=INNER[inner]()), tamper=CASES[case])
    assert metrics.get("aggregation-failed", 0) == 0  # read with .get: on main, only a raise fails this test
    assert arrays is not None
    assert all(np.isfinite(a.numpy()).all() for a in arrays.values())


def test_dp_clipping_leaves_a_zero_update_out_and_aggregates_the_rest():
    """Was ``ZeroDivisionError`` out of ``aggregate_train``. The round aggregates the other 9 replies."""
    arrays, metrics = _round(_wrap(inner=_dp_fixed()), tamper=_tiny({ATTACKER}, 0.0))
    assert metrics["zero-norm-dropped"] == 1 and metrics["aggregation-failed"] == 0
    without, _ = _round(
        _wrap(inner=_dp_fixed()), tamper=lambda replies, _: [r for r in replies if r.metadata.src_node_id != ATTACKER]
    )
    assert _distance(arrays, without) < 1e-6  # exactly the round of the other clients


def test_zero_updates_count_in_fedavg():
    """A strategy that does not divide by norms keeps zero updates (they are honest 'no change' replies)."""
    _, metrics = _round(_wrap(), tamper=_tiny({ATTACKER}, 0.0))
    assert metrics.get("zero-norm-dropped", 0) == 0 and metrics["rejected-replies"] == 0


class Raising(FedAvg):
    """An inner strategy that fails on whatever it gets (a bug, or an input nobody foresaw)."""

    def aggregate_train(self, server_round, replies):
        raise RuntimeError("inner train failure")

    def aggregate_evaluate(self, server_round, replies):
        raise RuntimeError("inner evaluate failure")


def test_an_inner_strategy_that_raises_keeps_the_model_and_is_counted(flwr_log):
    arrays, metrics = _round(_wrap(inner=Raising(min_available_nodes=N)))
    assert arrays is None and metrics["aggregation-failed"] == 1
    assert any(r.levelno == logging.ERROR and "inner train failure" in r.getMessage() for r in flwr_log)


@pytest.mark.parametrize("inner", ["raising", *INNER])
def test_evaluate_replies_never_raise(inner, flwr_log):
    """Zero losses, identical replies and an inner strategy that raises: a metric record or None, no exception."""
    strategy = _wrap(
        inner=Raising(min_available_nodes=N, fraction_evaluate=1.0) if inner == "raising" else INNER[inner]()
    )
    grid = InProcessGrid(make_client_app([]), N)
    messages = list(strategy.configure_evaluate(1, initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    for reply in replies[:2]:
        reply.content["metrics"]["eval-loss"] = 0.0
    metrics = strategy.aggregate_evaluate(1, replies)
    if inner == "raising":
        assert metrics["aggregation-failed"] == 1
    else:
        assert metrics is None or all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def test_rules_off_still_cannot_crash_dp():
    """With every admission rule off the zero update still reaches the guard, not Flower's division."""
    _, metrics = _round(_wrap(inner=_dp_fixed(), admission=AdmissionRules.off()), tamper=_tiny({ATTACKER}, 0.0))
    assert metrics["zero-norm-dropped"] == 1
