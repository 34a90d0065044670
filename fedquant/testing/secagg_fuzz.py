"""Fuzzing the secure-aggregation server with mutated client replies (``tests`` and ``benchmarks.secagg_fuzz``).

Each case runs one small secure round (5 clients) in process and mutates one reply of one
node at one stage: a missing, retyped, truncated, extended or flipped entry, a list with a
duplicate or a foreign id, another stage or session, an extra or missing record, a masked
segment of the wrong length, dtype or shape. Case ``i`` is a pure function of ``(seed, i)``.

Outcomes: ``completed`` (the round summed the survivors exactly), ``completed-rejected`` (the
same, with the mutated reply's node dropped and logged), ``completed-tampered`` (the
mutation left a survivor's masked vector valid but different: secure aggregation cannot see
that, the modulus bounds it), ``failed-clean`` (too few nodes left, reason logged), and the
failures ``exception`` (anything escaping the server), ``wrong-sum`` and ``slow``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedquant.secagg import LoopbackGrid, SecAggClient, SecAggConfig, SecAggServer, Segment, run_secure_sum
from fedquant.secagg.messages import MASKED_RECORD, RECORD, STAGES

FAILURES = ("exception", "wrong-sum", "slow")
SLOW_SECONDS = 20.0
NODES = [11, 22, 33, 44, 55]
SIZE, BITS = 64, 9


def _random_value(rng: np.random.Generator):
    kind = int(rng.integers(10))
    return [
        lambda: int(rng.integers(-(1 << 40), 1 << 40)),
        lambda: -1,
        lambda: float("nan"),
        lambda: "x" * int(rng.integers(0, 40)),
        lambda: rng.bytes(int(rng.integers(0, 200))),
        lambda: [int(v) for v in rng.integers(0, 100, int(rng.integers(0, 8)))],
        lambda: [rng.bytes(int(rng.integers(0, 90))) for _ in range(int(rng.integers(0, 8)))],
        lambda: [],
        lambda: True,
        lambda: 1 << 62,
    ][kind]()


def _mutate_value(rng: np.random.Generator, value):
    if isinstance(value, bytes) and value:
        choice = int(rng.integers(3))
        if choice == 0:
            return value[: int(rng.integers(len(value)))]
        if choice == 1:
            return value + rng.bytes(int(rng.integers(1, 40)))
        pos = int(rng.integers(len(value)))
        return value[:pos] + bytes([value[pos] ^ (1 << int(rng.integers(8)))]) + value[pos + 1 :]
    if isinstance(value, list) and value:
        out = list(value)
        choice = int(rng.integers(4))
        if choice == 0:
            out.pop(int(rng.integers(len(out))))
        elif choice == 1:
            out.append(out[int(rng.integers(len(out)))])
        elif choice == 2:
            out = out[::-1]
        else:
            i = int(rng.integers(len(out)))
            out[i] = _mutate_value(rng, out[i]) if isinstance(out[i], bytes) else int(rng.integers(0, 100))
        return out
    return _random_value(rng)


def mutate(rng: np.random.Generator, content: RecordDict) -> tuple[str, RecordDict, bool]:
    """A mutated copy of a reply: (kind, content, whether only masked data bytes were flipped)."""
    content = copy.deepcopy(content)
    record = content.config_records.get(RECORD)
    choice = int(rng.integers(12))
    if choice < 5 and record is not None and len(record):
        key = list(record)[int(rng.integers(len(record)))]
        record[key] = _mutate_value(rng, record[key])
        return f"value:{key}", content, False
    if choice == 5 and record is not None and len(record):
        key = list(record)[int(rng.integers(len(record)))]
        del record[key]
        return f"missing:{key}", content, False
    if choice == 6 and record is not None:
        record["stage"] = STAGES[int(rng.integers(len(STAGES)))]
        record["session"] = rng.bytes(16) if rng.random() < 0.5 else record["session"]
        return "stage-or-session", content, False
    if choice == 7:
        content.config_records["extra"] = ConfigRecord({"x": 1})
        if rng.random() < 0.5:
            content.array_records["extra-arrays"] = ArrayRecord({"x": Array(np.zeros(3, np.float32))})
        return "extra-record", content, False
    if choice == 8 and record is not None:
        del content.config_records[RECORD]
        return "no-record", content, False
    masked = content.array_records.get(MASKED_RECORD)
    if masked is not None:
        name = list(masked)[int(rng.integers(len(masked)))]
        arr = masked[name]
        kind = int(rng.integers(5))
        if kind == 0:
            data = _mutate_value(rng, arr.data)
            masked[name] = Array(dtype="uint8", shape=(len(data),), stype=arr.stype, data=data)
            return "masked-bytes", content, len(data) == len(arr.data)
        if kind == 1:
            masked[name] = Array(dtype="int64", shape=arr.shape, stype=arr.stype, data=arr.data)
        elif kind == 2:
            masked[name] = Array(dtype="uint8", shape=(len(arr.data) + 1,), stype=arr.stype, data=arr.data)
        elif kind == 3:
            del masked[name]
        else:
            masked["other"] = arr
        return "masked-layout", content, False
    key = "keys" if record is not None and "keys" in record else None
    if key is not None:
        record[key] = _random_value(rng)
        return "value:keys", content, False
    return "no-op", content, False


def run_case(seed: int, i: int) -> tuple[str, str]:
    """Run case ``i``: ``(outcome, detail)``."""
    rng = np.random.default_rng([seed, i])
    stage = STAGES[int(rng.integers(len(STAGES)))]
    victim = NODES[int(rng.integers(len(NODES)))]
    values = {n: rng.integers(0, 1 << BITS, SIZE, dtype=np.uint32) for n in NODES}
    encoders = {n: (lambda c, spec, n=n: {"v": values[n]}) for n in NODES}
    state = {"kind": "none", "tampered": False}

    def tamper(s: str, node: int, reply: Message) -> Message:
        if s != stage or node != victim or reply.has_error():
            return reply
        kind, content, tampered = mutate(rng, reply.content)
        state.update(kind=kind, tampered=tampered)
        return Message(content, reply_to=transport.requests[-1])

    server = SecAggServer(SecAggConfig(threshold=0.6), NODES, [Segment("v", SIZE, BITS)], server_round=1)
    transport = LoopbackGrid({n: SecAggClient(n) for n in NODES}, encoders, tamper=tamper)
    start = time.perf_counter()
    try:
        result = run_secure_sum(server, transport.send_and_receive)
    except Exception as err:  # noqa: BLE001 - any escape is the failure being looked for
        return "exception", f"{stage} {state['kind']}: {type(err).__name__}: {err}"
    if time.perf_counter() - start > SLOW_SECONDS:
        return "slow", f"{stage} {state['kind']}"
    if result is None:
        return "failed-clean", f"{stage} {state['kind']}: {server.failure}"
    want = sum(values[n].astype(np.uint64) for n in result.survivors) % (1 << BITS)
    if np.array_equal(result.sums["v"], want):
        rejected = victim in server.rejected
        return "completed-rejected" if rejected else "completed", f"{stage} {state['kind']}"
    if state["tampered"] and victim in result.survivors:
        return "completed-tampered", f"{stage} {state['kind']}"
    return "wrong-sum", f"{stage} {state['kind']}"


def run_fuzz(cases: int, seed: int = 0) -> tuple[Counter, Counter, list[tuple[int, str, str]]]:
    """Outcome counts, mutation-kind counts and the failures of ``cases`` cases."""
    logging.getLogger("fedquant.secagg").setLevel(logging.CRITICAL)
    outcomes, kinds, failures = Counter(), Counter(), []
    for i in range(cases):
        outcome, detail = run_case(seed, i)
        outcomes[outcome] += 1
        kinds[detail.split(":")[0]] += 1
        if outcome in FAILURES:
            failures.append((i, outcome, detail))
    return outcomes, kinds, failures
