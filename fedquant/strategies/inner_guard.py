"""The inner strategy's aggregation, kept from ending the run on replies the admission rules let through.

Two layers, both applied by :class:`~fedquant.strategies.QuantizedStrategy`:

- **Zero-norm updates** are taken out before an inner strategy that divides by a reply's update
  norm (Flower's server-side DP clipping: ``clipping_norm / norm``, the norm computed in the
  reply's dtype, so a float32 update whose squared entries underflow counts as 0). Such an update
  carries no direction, and its clipped value would be itself: leaving it out changes the round
  only by its weight share, and a client cannot use it to stop the round (keeping the model on a
  failed aggregation would let one client freeze training by sending zeros every round).
- **Any exception** out of the inner strategy's ``aggregate_train`` / ``aggregate_evaluate`` is
  logged with its traceback and counted (``aggregation-failed``); the round keeps the current
  model (Flower's ``Strategy.start`` keeps it when the arrays are None) and reports no inner
  metrics. This is the net for what no admission rule foresees, whatever the inner strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import ERROR

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore import log
from flwr.supercore.differential_privacy import get_norm

# Strategies that compute ``clipping_norm / update_norm`` on every reply (ZeroDivisionError at 0).
NORM_DIVIDING: tuple[type[Strategy], ...] = (
    DifferentialPrivacyServerSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
)


def divides_by_update_norm(strategy: Strategy) -> bool:
    """Whether ``strategy`` divides by each reply's update norm."""
    return isinstance(strategy, NORM_DIVIDING)


def zero_norm_update(reply: Message, model: ArrayRecord) -> bool:
    """Whether one of the reply's ArrayRecords differs from ``model`` by a norm that computes as 0.

    The norm is Flower's own (:func:`flwr.supercore.differential_privacy.get_norm`, in the
    reply's dtype), so exactly the updates its clipping would divide by zero are caught.
    """
    current = model.to_numpy_ndarrays()
    for record in reply.content.array_records.values():
        arrays = record.to_numpy_ndarrays()
        if len(arrays) != len(current):
            continue  # not an update of the model; the inner strategy decides
        update = [np.subtract(a, c) for a, c in zip(arrays, current, strict=True)]
        if get_norm(update) == 0:
            return True
    return False


def without_zero_norm_updates(
    strategy: Strategy, replies: Sequence[Message], model: ArrayRecord | None
) -> tuple[list[Message], int]:
    """``replies`` without the zero-norm updates when ``strategy`` divides by update norms; how many left."""
    if model is None or not divides_by_update_norm(strategy):
        return list(replies), 0
    kept = [r for r in replies if r.has_error() or not zero_norm_update(r, model)]
    return kept, len(replies) - len(kept)


def guarded_train(
    strategy: Strategy, server_round: int, replies: list[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None, bool]:
    """The inner strategy's ``aggregate_train``, or ``(None, None, True)`` when it raises."""
    try:
        arrays, metrics = strategy.aggregate_train(server_round, replies)
    except Exception as err:  # noqa: BLE001 -- any inner failure on client input must not end the run
        _log_failure(strategy, "aggregate_train", server_round, err, "keeping the current model")
        return None, None, True
    return arrays, metrics, False


def guarded_evaluate(strategy: Strategy, server_round: int, replies: list[Message]) -> tuple[MetricRecord | None, bool]:
    """The inner strategy's ``aggregate_evaluate``, or ``(None, True)`` when it raises."""
    try:
        return strategy.aggregate_evaluate(server_round, replies), False
    except Exception as err:  # noqa: BLE001 -- as in guarded_train
        _log_failure(strategy, "aggregate_evaluate", server_round, err, "no evaluate metrics this round")
        return None, True


def _log_failure(strategy: Strategy, step: str, server_round: int, err: Exception, outcome: str) -> None:
    log(
        ERROR,
        "fedquant: round %s: the inner strategy %s's %s raised %s: %s; %s",
        server_round,
        type(strategy).__name__,
        step,
        type(err).__name__,
        err,
        outcome,
        exc_info=err,
    )
