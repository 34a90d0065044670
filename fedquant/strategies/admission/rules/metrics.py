"""Client metrics under the admission rules: the round's schema by vote, typed values, bounded weights and aggregates.

Flower's strategies average every reply's MetricRecord with weights read from the same record,
trusting both: a list under a key the others send as a number raises out of
``aggregate_train``/``aggregate_evaluate``, ``-1e300`` moves the mean to ``-1e299`` and a weight of
``1e9`` buys the whole aggregate. :class:`~fedquant.strategies.QuantizedStrategy` therefore

1. votes the round's **schema** (:func:`vote_schema`): the key set a strict majority of the replies
   carry; without one, the declared keys (``AdmissionRules.metric_keys``, the weight key) or else
   the keys a strict majority carries, other keys being stripped rather than held against anyone,
   so exactly half of the clients cannot get the other half rejected. Each key is a number unless
   it is declared in ``AdmissionRules.list_metrics`` and a strict majority sends it as a list, of
   the length a strict majority sends;
2. checks every reply against it (:func:`check_record`): a value of another type, length or kind
   (a string, bytes, a bool, a nested list, a non-number: whatever bypassed ``MetricRecord``'s own
   checks) or a non-finite one rejects that reply alone;
3. (the weight rule, :mod:`.weights`, bounds the weights relative to the round and writes them into
   the replies, so the inner strategy aggregates the model and the metrics with bounded weights);
4. keeps each aggregated client metric, whatever the inner strategy computed, within the range
   of the round's values without the ``t`` lowest and highest (:func:`clamp_metrics`).

Why a clamped mean rather than a median or a trimmed mean: with honest clients the weighted mean
of accuracies over examples is what users expect (the overall accuracy), and it is almost always
inside that window, so the numbers do not change; with up to ``t`` liars the window lies inside
the honest range, so no liar moves the metric beyond what some honest client reported. A median
would discard the weighting in every round, a trimmed mean would change honest rounds too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from flwr.app import MetricRecord, RecordDict

from fedquant.metrics.robust import clamp_to_window, finite, is_number
from fedquant.strategies.admission.reasons import REASON_METRICS, REASON_WEIGHT
from fedquant.strategies.admission.rules.base import Problem, Rule
from fedquant.strategies.admission.rules.weights import problem as weight_problem
from fedquant.strategies.admission.settings import AdmissionRules
from fedquant.strategies.admission.vote import MetricSchema, Vote


class Metrics(Rule):
    """Rejects (reason ``metrics``, or ``num-examples`` for the weight) a MetricRecord off the round's schema."""

    reason = REASON_METRICS

    # always on: its switches are read record by record (check_record)

    def check(self, vote: Vote, record: MetricRecord | None) -> Problem | None:
        return check_record(record, vote.schema, self.weight_key, self.rules)


def single_metric_record(content: RecordDict) -> MetricRecord | None:
    """The reply's MetricRecord when it holds exactly one, else None.

    Read from the content's items: Flower's ``content.metric_records`` builds a view that writes
    every record back into the content, a cost paid several times per reply and round.
    """
    records = [record for record in content.values() if isinstance(record, MetricRecord)]
    return records[0] if len(records) == 1 else None


def vote_schema(records: Sequence[MetricRecord | None], weight_key: str, rules: AdmissionRules) -> MetricSchema | None:
    """The round's schema from the replies' MetricRecords (None when the rule is off or none has one)."""
    present = [r for r in records if r is not None]
    if not rules.consistent_metrics or not present:
        return None
    n = len(present)
    sets = Counter(frozenset(r.keys()) for r in present)
    keys, count = sets.most_common(1)[0]
    strict = 2 * count > n
    if not strict:
        if rules.metric_keys is not None:
            keys = frozenset(rules.metric_keys)
        else:
            carriers = Counter(k for r in present for k in r.keys())
            keys = frozenset(k for k, c in carriers.items() if 2 * c > n)
        keys |= {weight_key}
    keys = frozenset(k for k in keys if isinstance(k, str))
    lists: dict[str, int] = {}
    for key in keys & rules.list_metrics:
        carried = [r[key] for r in present if key in r]
        lengths = Counter(len(v) for v in carried if isinstance(v, list))
        if lengths:
            length, c = lengths.most_common(1)[0]
            if 2 * c > len(carried):
                lists[key] = length
    return MetricSchema(keys, lists, strict)


def check_record(
    record: MetricRecord | None, schema: MetricSchema | None, weight_key: str, rules: AdmissionRules
) -> Problem | None:
    """``(reason, sentence)`` when a reply's MetricRecord fails the rules, else None."""
    if record is None:
        if rules.consistent_metrics or rules.check_weight:
            return REASON_METRICS, "expected exactly one MetricRecord"
        return None
    keys = set(record.keys())
    if schema is not None:
        if not all(isinstance(k, str) for k in keys):
            return REASON_METRICS, "a MetricRecord key is not a string"
        missing = schema.keys - keys
        extra = keys - schema.keys
        if weight_key in missing and rules.check_weight:
            return REASON_WEIGHT, f"the MetricRecord has no '{weight_key}'"
        if missing or (extra and schema.strict):
            return (
                REASON_METRICS,
                f"MetricRecord keys differ from the round's: missing {sorted(missing)}, extra {sorted(extra)}",
            )
    problem = weight_problem(rules, record.get(weight_key), weight_key)
    if problem is not None:
        return REASON_WEIGHT, problem
    for key, value in record.items():
        if schema is not None and key not in schema.keys:
            continue  # stripped by conform()
        problem = _value_problem(key, value, schema, rules)
        if problem is not None:
            return REASON_METRICS, problem
    return None


def _value_problem(key: str, value: object, schema: MetricSchema | None, rules: AdmissionRules) -> str | None:
    if schema is not None:  # consistent_metrics: the type the key carries in the round
        length = schema.lists.get(key)
        if length is None and not is_number(value):
            return f"metric '{key}' must be a number, as the round sends it; got {type(value).__name__}"
        if length is not None:
            if not isinstance(value, list) or len(value) != length:
                got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
                return f"metric '{key}' must be a list of {length} numbers, as the round sends it; got {got}"
            if length > rules.max_list_length:
                return f"metric '{key}' holds {length} values, more than max_list_length {rules.max_list_length}"
            if not all(is_number(v) for v in value):
                return f"metric '{key}' must hold numbers only"
    elif not (is_number(value) or (isinstance(value, list) and all(is_number(v) for v in value))):
        return None if not rules.finite_metrics else f"metric '{key}' is not a number or a list of numbers"
    if rules.finite_metrics and not finite(value):
        return f"metric '{key}' is not finite"
    return None


def conform(record: MetricRecord, schema: MetricSchema | None) -> list[str]:
    """Strip the keys outside the schema from an admitted record; return the stripped keys."""
    if schema is None:
        return []
    extra = [k for k in record.keys() if k not in schema.keys]
    for key in extra:
        del record[key]
    return extra


# ---------------------------------------------------------------------------------------------- aggregates
def clamp_metrics(
    aggregated: MetricRecord | None,
    records: Sequence[MetricRecord],
    schema: MetricSchema | None,
    trim: float,
    weight_key: str,
) -> MetricRecord | None:
    """Keep each client metric the inner strategy aggregated within the window of the replies' values.

    Only keys every record carries are touched, the weight key and the inner strategy's own keys
    stay; a value of the wrong type or not finite becomes the median of the replies' values.
    """
    if aggregated is None or not records or any(r is None for r in records):
        return aggregated  # (replies without a single MetricRecord reach here only with the rules off)
    keys = schema.keys if schema is not None else frozenset.intersection(*(frozenset(r.keys()) for r in records))
    for key in keys:
        if key == weight_key or key not in aggregated or not all(key in r for r in records):
            continue
        values = [r[key] for r in records]
        if all(is_number(v) and finite(v) for v in values):
            aggregated[key] = clamp_to_window(aggregated[key], values, trim)
        elif all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1 and _finite_lists(values):
            out = aggregated[key]
            columns = list(zip(*values, strict=True))
            if not isinstance(out, list) or len(out) != len(columns):
                out = [float(np.median(c)) for c in columns]
            aggregated[key] = [float(clamp_to_window(o, c, trim)) for o, c in zip(out, columns, strict=True)]
    return aggregated


def _finite_lists(values: Sequence[list]) -> bool:
    return all(all(is_number(x) for x in v) and finite(v) for v in values)
