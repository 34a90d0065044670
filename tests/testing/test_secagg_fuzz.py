"""Mutated client replies at every stage: rejected as dropouts or failing the round cleanly, never a crash."""

from __future__ import annotations

from fedquant.testing.secagg_fuzz import FAILURES, run_fuzz
from tests.flower_fakes import set_task_identity

CASES = 240


def test_no_mutated_reply_crashes_hangs_or_corrupts_the_sum():
    set_task_identity()
    outcomes, kinds, failures = run_fuzz(CASES, seed=3)
    assert not failures, failures[:10]
    assert sum(outcomes.values()) == CASES
    assert outcomes["completed-rejected"] > CASES // 3  # most mutations are caught and the round goes on
    stages = {k.split()[0] for k in kinds}
    assert stages == {"advertise", "share-keys", "collect", "unmask"}
    assert not set(outcomes) & set(FAILURES)
