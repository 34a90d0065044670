"""Admission as registered rules: which rules a run builds, a new rule added by registration alone,
the cross-round store's one eviction rule."""

from __future__ import annotations

import numpy as np
import pytest

from fedquant.strategies.admission import Admission, AdmissionRules, References
from fedquant.strategies.admission import rules as registered
from fedquant.strategies.admission.rules.base import Rule
from fedquant.strategies.drift import DriftLedger, DriftRule
from fedquant.strategies.node_memory import NodeMemory
from tests.strategies.test_attacks import ATTACKER, _round, _scaled, _wrap


def _names(admission: Admission) -> list[str]:
    return [type(rule).__name__ for rule in admission.rules]


def test_the_switches_pick_the_rules_a_run_builds_in_registration_order():
    assert _names(Admission(AdmissionRules(), "num-examples")) == [
        "Metrics",
        "Weights",
        "NonFloat",
        "Norms",
        "Persistence",
    ]
    every = AdmissionRules(reject_opposing=True, cross_round=DriftRule())
    assert _names(Admission(every, "num-examples")) == [kind.__name__ for kind in registered.REGISTERED]
    # switched off, only the rules that always hold remain (a NaN norm or weight is never admitted)
    assert _names(Admission(AdmissionRules.off(), "num-examples")) == ["Metrics", "Weights", "Norms"]


def test_the_cross_round_rule_keeps_its_ledger_in_the_references():
    admission = Admission(AdmissionRules(cross_round=DriftRule(sketch_size=16)), "num-examples", seed=3)
    (drift,) = [rule for rule in admission.rules if rule.reason == "drift"]
    ledger = drift.ledger(admission.references)
    assert isinstance(ledger, DriftLedger) and drift.ledger(admission.references) is ledger
    assert ledger.sketch.seed == 3  # the server's seed, as before the rule was registered


class TooLarge(Rule):
    """A rule written for the test: rejects every update above a fixed norm (reason ``too-large``)."""

    reason = "too-large"
    limit = 0.0

    def judge(self, vote, references, decoded, reference, record):
        if decoded.update_norm > self.limit:
            return f"norm {decoded.update_norm:.3g} above {self.limit:g}", 1.0
        return None, 1.0


def test_a_new_rule_is_a_module_and_one_registration(monkeypatch):
    """Registered after the others, a rule judges every decoded update and its reason is reported
    (``rejected-too-large``) without any other module knowing it."""
    baseline = _wrap()
    _, metrics = _round(baseline)
    assert "rejected-too-large" not in metrics and metrics["rejected-replies"] == 0
    TooLarge.limit = metrics["update-norm-median"]  # about half of the honest updates lie above it
    monkeypatch.setattr(registered, "REGISTERED", (*registered.REGISTERED, TooLarge))
    strategy = _wrap()
    assert _names(strategy.admitting)[-1] == "TooLarge"
    _, metrics = _round(strategy)
    assert 0 < metrics["rejected-too-large"] == metrics["rejected-replies"] < 10


def test_a_new_rule_sees_updates_as_the_rules_before_it_left_them(monkeypatch):
    """The norm rule clips an update 5 x the others' first; the new rule judges the clipped update."""
    seen: list[float] = []

    class Watch(TooLarge):
        reason = "watch"

        def judge(self, vote, references, decoded, reference, record):
            seen.append(decoded.update_norm)
            return None, 1.0

    monkeypatch.setattr(registered, "REGISTERED", (*registered.REGISTERED, Watch))
    _, metrics = _round(_wrap(), tamper=_scaled({ATTACKER}, 5.0))
    assert metrics["rejected-watch"] == 0 and metrics["clipped-update-norm"] == 1 and len(seen) == 10
    assert max(seen) < 2.5 * float(np.median(seen))  # clipped to 2 x the reference, not 5 x


def test_node_memory_forgets_the_least_recently_written_beyond_its_bound():
    memory: NodeMemory[float] = NodeMemory(2)
    memory.put(1, 0.5)
    memory.put(2, 0.25)
    memory.put(1, 0.75)  # 1 is now the most recent
    memory.put(3, 1.0)  # 2 is forgotten
    assert list(memory) == [1, 3] and memory.get(2, 0.0) == 0.0 and memory.get(1, 0.0) == 0.75
    assert len(memory) == 2 and 3 in memory and 2 not in memory


def test_references_build_a_rules_memory_once():
    references = References()
    built = []
    first = references.kept("x", lambda: built.append(1) or np.zeros(3))
    assert references.kept("x", lambda: built.append(2) or None) is first and built == [1]


@pytest.mark.parametrize("kind", ["train", "evaluate"])
def test_train_and_evaluate_weights_have_references_of_their_own(kind):
    references = References()
    references.weights[kind].end_round([5.0, 5.0])
    other = "evaluate" if kind == "train" else "train"
    assert references.weights[kind].value([]) == 5.0 and references.weights[other].value([]) is None
