"""Attack x defence: how far a minority of clients moves the model, and whether the run survives.

Every run is a whole federation in this process (no Ray): the real
:class:`~fedquant.strategies.QuantizedStrategy` (codec ``eden:bits=2``, the default; default
admission rules) around each defence, and on every client the real ``quantize_mod`` after local
training. The task is the default one, scikit-learn's digits (1,437 training images in 10 IID
partitions, the 360-image held-out set for accuracy), with a model small enough that a 20-round
run takes seconds: an MLP 64-64-10 with a BatchNorm layer after the hidden layer (4,810 float
parameters; its int64 ``num_batches_tracked`` is what the integer attack targets). All 10 clients
train every round (1 epoch of SGD, batch 16, lr 0.05, momentum 0.9), so ``k`` attackers are
exactly ``k`` of 10 replies; the attackers are the first ``k`` clients, ``k`` = 1, 2 and 4.

Attackers train honestly first, see every honest update of the round (an omniscient, colluding
adversary) and then send, through ``quantize_mod``, a valid reply:

``weight-boost``          a fixed random direction at 9.5 x the round's median honest norm (inside
                          the norm rule's factor 10) with ``num-examples = 1e9`` (the old cap)
``scaled-honest``         its own update x 9.5, honest weight
``sign-flip``             its own update x -1 (``sign-flip-alternate``: in even rounds only;
                          ``sign-flip-after-10``: from round 11 on, honest before)
``little-is-enough``      mean - z x std of the honest updates, per coordinate, with Baruch et al.
                          (2019)'s ``z_max`` for n = 10 and k attackers (0, 0.25, 0.84 for k = 1, 2, 4)
``colluders-100x``        its own update x 100
``zero-update``           no change (drags the norm median down)
``int-counter``           the BatchNorm's int64 ``num_batches_tracked`` set to 4.6e18
``extra-key``             an honest update with one more metric key (the key-set vote)

and those that ride the bounds round after round (issue 41): ``in-bound-push`` (the same fixed
random direction every round at 0.99 x the largest norm and weight the rules admit),
``little-is-enough-z1`` (z = 1 every round), ``dead-zone-cosine`` (cosine -0.45 with the sum of
the others' updates, inside the persistence rule's allowance, at the admitted bounds),
``flip-and-push`` (a sign flip in odd rounds, the in-bound push in even ones),
``orthogonal-drift`` (the fixed direction made orthogonal to the others' sum, 1.9 x the median
norm, 2.9 x the weight) and ``sign-flip-new-id`` (a sign flip from a new node id every round).
For the metrics only (FedAvg, k = 1): ``mse-lie``
(``quantization-mse = -1e300``, ``encode-seconds = 1e300``), ``list-metric`` (``train-loss`` as a
list) and ``eval-lie`` (evaluate replies with ``eval-loss = -1e30`` and ``num-examples = 1e9``).

Defences, each inside the wrapper: ``FedAvg``, ``FedMedian``, ``FedTrimmedAvg`` (beta 0.2),
``Krum`` (``num_malicious_nodes = 4``) and ``DP-clip`` (Flower's
``DifferentialPrivacyServerSideFixedClipping`` around FedAvg, clipping norm 1.0, about the median
honest update norm of the first rounds; no noise, so that runs repeat).

Cell: L2 distance over the float entries of the final global model from the honest run (all 10
clients honest) of the same defence with seed 0, the RMS distance of the two models' predicted
class probabilities on the test set, and the test accuracy; "counter +x" when the BatchNorm
counter differs from the honest one. The honest spread of a defence is the largest distance
between two of its honest runs with seeds 0..S-1 (the seed changes the batch order and the
codec's randomness, not the data nor the initial model). Gate: every model attack, with one
attacker, must leave the FedAvg model's predictions within FedAvg's honest spread of predictions
(``sign-flip-new-id``: 1.5 x it); predictions, because the L2 distance also counts directions the
network ignores (docs/threat-model.md, "Where the distance lies"). ``--drift off`` or
``--drift ROUND,TOTAL`` runs with the cross-round rule off or other factors.

Run: ``python -m benchmarks.attacks`` (a distance/accuracy run, not a timing: no bench lock; about
30 minutes on one core of a busy 2-core machine); ``--quick`` (FedAvg, k = 1, 3 honest seeds, a few
minutes); ``--honest`` prints the honest clients' rejections and clippings per reason on IID and Dirichlet (0.5)
partitions instead; ``--partitioning dirichlet`` runs the attack table on the Dirichlet partitions.
Exits 1 when the gate is missed or any run raised.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    FedMedian,
    FedTrimmedAvg,
    Krum,
    Strategy,
)
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from fedquant.clients import quantize_mod
from fedquant.protocol import METRIC_CLIENT_ENCODE_SECONDS, METRIC_CLIENT_MSE
from fedquant.rng import derive_seed
from fedquant.strategies import AdmissionRules, QuantizedStrategy
from fedquant.strategies.drift import DriftRule
from simulations.data import TensorData, load_partition, load_test_set
from simulations.task import evaluate, train

NUM_CLIENTS = 10
ROUNDS = 20
CODEC = "eden:bits=2"
HIDDEN = 64
LOCAL_EPOCHS, BATCH_SIZE, LEARNING_RATE = 1, 16, 0.05
CLIP_NORM, MIN_STEPS = 0.0, 0
NORM_SCALE = 9.5  # just inside the default norm rule (10 x the median)
BOOSTED_WEIGHT = 1e9  # the old absolute weight cap
HONEST_SEEDS = 5
FRACTIONS = (1, 2, 4)
DP_CLIPPING_NORM = 1.0
COUNTER = "2.num_batches_tracked"


class BenchModel(nn.Module):
    """64-64-10 MLP with BatchNorm after the hidden layer (its ``num_batches_tracked`` is int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def state_dict(self, *args, **kwargs):  # keys without the "net." prefix
        return {k.removeprefix("net."): v for k, v in super().state_dict(*args, **kwargs).items()}

    def load_arrays(self, arrays: ArrayRecord) -> None:
        state = {f"net.{k}": torch.from_numpy(np.array(a.numpy())) for k, a in arrays.items()}
        nn.Module.load_state_dict(self, state)


def initial_model() -> ArrayRecord:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BenchModel()
    return ArrayRecord({k: Array(v.detach().numpy().copy()) for k, v in model.state_dict().items()})


@dataclass
class Task:
    partitions: list[TensorData]
    test: TensorData


def load_task(partitioning: str = "iid", alpha: float = 0.5) -> Task:
    parts = [load_partition("digits", i, NUM_CLIENTS, partitioning, alpha, 0) for i in range(NUM_CLIENTS)]
    return Task([_batchable(p) for p in parts], load_test_set("digits"))


def _batchable(data: TensorData) -> TensorData:
    """The partition without its last image when that image would be a batch of its own (BatchNorm needs two)."""
    if len(data) % BATCH_SIZE != 1:
        return data
    return TensorData(data.x[:-1], data.y[:-1], data.num_classes)


# ---------------------------------------------------------------------------------------------- attacks
@dataclass
class RoundView:
    """What an omniscient attacker sees in a round: the model sent and every honest update."""

    server_round: int
    received: dict[str, np.ndarray]
    honest: dict[int, dict[str, np.ndarray]]  # node -> trained arrays (honest)
    attackers: list[int]

    def update(self, node: int) -> dict[str, np.ndarray]:
        return {k: self.honest[node][k] - self.received[k] for k in self.float_keys}

    @property
    def float_keys(self) -> list[str]:
        return [k for k, v in self.received.items() if v.dtype.kind == "f"]

    def median_norm(self) -> float:
        norms = [_norm(self.update(n)) for n in self.honest if n not in self.attackers]
        return float(np.median(norms))

    def with_update(self, node: int, update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(self.honest[node])
        for k, u in update.items():
            out[k] = (self.received[k].astype(np.float64) + u).astype(self.received[k].dtype)
        return out


def _norm(update: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(u, np.float64) ** 2)) for u in update.values()))


@dataclass
class Attack:
    """A forged train reply: ``arrays(view, node)`` before the mod, ``metrics`` and ``tamper`` around it."""

    name: str
    arrays: Callable[[RoundView, int], dict[str, np.ndarray]] | None = None
    metrics: Callable[[dict], dict] | None = None
    tamper: Callable[[Message], None] | None = None
    evaluate: Callable[[dict], dict] | None = None
    model: bool = True  # moves the model (main table) or only metrics (metrics table)
    offline: bool = False  # the attackers send nothing
    gated: bool = True  # one attacker of 10 must leave FedAvg within the honest spread
    gate: float = 1.0  # ... times this
    new_id: bool = False  # the attackers come back under a new node id every round


def _direction(view: RoundView) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(12345)
    d = {k: rng.standard_normal(view.received[k].shape) for k in view.float_keys}
    n = _norm(d)
    return {k: v / n for k, v in d.items()}


def _scaled(scale: float):
    return lambda view, node: view.with_update(node, {k: scale * u for k, u in view.update(node).items()})


def _flip_when(rounds: Callable[[int], bool]):
    """A sign flip in the rounds ``rounds(server_round)`` says, an honest update in the others."""
    flip = _scaled(-1.0)
    return lambda view, node: flip(view, node) if rounds(view.server_round) else dict(view.honest[node])


def _weight_boost(view, node):
    target = NORM_SCALE * view.median_norm()
    return view.with_update(node, {k: target * v for k, v in _direction(view).items()})


def lie_z(n: int, m: int) -> float:
    """Baruch et al. (2019)'s z_max: the attackers stay closer to the mean than ``s`` honest clients."""
    s = math.floor(n / 2 + 1) - m
    return float(statistics.NormalDist().inv_cdf((n - s) / n))


def _little_is_enough(view, node, z: float | None = None):
    honest = [view.update(n) for n in view.honest]
    z = z if z is not None else lie_z(len(view.honest), len(view.attackers))
    return view.with_update(
        node, {k: np.mean([u[k] for u in honest], 0) - z * np.std([u[k] for u in honest], 0) for k in view.float_keys}
    )


def _in_bound_push(view, node):
    """A fixed random direction at the largest norm the rules admit (they clip it to clip_factor x the reference)."""
    rules = AdmissionRules()
    target = 0.99 * (rules.norm_factor or 10.0) * view.median_norm()
    return view.with_update(node, {k: target * v for k, v in _direction(view).items()})


def _in_bound_weight(metrics: dict) -> dict:
    factor = getattr(AdmissionRules(), "weight_reject_factor", None) or 1e6  # older rules had none
    return {**metrics, "num-examples": 0.99 * factor * metrics["num-examples"]}


def _others_direction(view: RoundView, node: int) -> dict[str, np.ndarray]:
    """The unit direction of the sum of the round's other updates."""
    total = {k: sum(view.update(n)[k] for n in view.honest if n != node) for k in view.float_keys}
    n = _norm(total)
    return {k: v / n for k, v in total.items()}


def _against_others(cosine: float, scale: float):
    """The fixed random direction, at ``cosine`` with the sum of the others' updates, at ``scale`` x the
    median honest norm (``scale`` None: the largest norm the rules admit)."""

    def arrays(view, node):
        g = _others_direction(view, node)
        d = _direction(view)
        along = sum(float(np.sum(d[k] * g[k])) for k in g)
        ortho = {k: d[k] - along * g[k] for k in g}
        n = _norm(ortho)
        unit = {k: cosine * g[k] + math.sqrt(1 - cosine**2) * ortho[k] / n for k in g}
        factor = scale if scale is not None else 0.99 * (AdmissionRules().norm_factor or 10.0)
        return view.with_update(node, {k: factor * view.median_norm() * v for k, v in unit.items()})

    return arrays


def _flip_and_push(view, node):
    """A sign flip in odd rounds, the in-bound push in even ones."""
    return _scaled(-1.0)(view, node) if view.server_round % 2 else _in_bound_push(view, node)


def _int_counter(view, node):
    out = dict(view.honest[node])
    out[COUNTER] = np.full_like(view.received[COUNTER], 4.6e18)
    return out


def _mse_lie(reply: Message) -> None:
    record = next(iter(reply.content.metric_records.values()))
    record[METRIC_CLIENT_MSE] = -1e300
    record[METRIC_CLIENT_ENCODE_SECONDS] = 1e300


OFFLINE = Attack("offline", offline=True)
ATTACKS = {
    a.name: a
    for a in [
        Attack("weight-boost", _weight_boost, lambda m: {**m, "num-examples": BOOSTED_WEIGHT}),
        Attack("scaled-honest", _scaled(NORM_SCALE)),
        Attack("sign-flip", _scaled(-1.0)),
        Attack("sign-flip-alternate", _flip_when(lambda r: r % 2 == 0)),
        Attack("sign-flip-after-10", _flip_when(lambda r: r > 10)),
        Attack("little-is-enough", _little_is_enough),
        Attack("colluders-100x", _scaled(100.0)),
        Attack("zero-update", lambda view, node: dict(view.received)),
        Attack("int-counter", _int_counter),
        Attack("extra-key", metrics=lambda m: {**m, "extra-key": 1.0}),
        Attack("mse-lie", tamper=_mse_lie, model=False),
        Attack("list-metric", metrics=lambda m: {**m, "train-loss": [1.0, 2.0]}, model=False),
        Attack("eval-lie", evaluate=lambda m: {**m, "eval-loss": -1e30, "num-examples": BOOSTED_WEIGHT}, model=False),
        Attack("little-is-enough-z1", lambda view, node: _little_is_enough(view, node, 1.0)),
        # Across rounds: inside every per-round rule every round (issue 41); the cross-round rule's gate.
        Attack("in-bound-push", _in_bound_push, _in_bound_weight),
        Attack("dead-zone-cosine", _against_others(-0.45, None), _in_bound_weight),
        Attack("flip-and-push", _flip_and_push, _in_bound_weight),
        Attack("orthogonal-drift", _against_others(0.0, 1.9), lambda m: {**m, "num-examples": 2.9 * m["num-examples"]}),
        Attack("sign-flip-new-id", _scaled(-1.0), new_id=True, gate=1.5),
    ]
}


# ---------------------------------------------------------------------------------------------- federation
def _set_task_identity() -> None:
    for attr, value in (("run_id", 1), ("node_id", 1), ("task_id", 1)):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:
            setattr(TaskIdentity, attr, value)


class Federation:
    """Ten in-process clients behind a Grid-like ``get_node_ids``; the attackers forge their replies."""

    def __init__(
        self, task: Task, attack: Attack | None, attackers: int, seed: int, available: int = NUM_CLIENTS
    ) -> None:
        _set_task_identity()
        self.task, self.attack, self.seed, self.available = task, attack, seed, available
        self.server_round = 0
        self.error_replies = 0  # replies quantize_mod turned into errors (a client-side failure)
        self.nodes = [1001 + i for i in range(NUM_CLIENTS)]
        self.attackers = self.nodes[:attackers] if attack is not None else []
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={"partition-id": i}, state=RecordDict(), run_config={})
            for i, n in enumerate(self.nodes)
        }

    def get_node_ids(self) -> list[int]:
        """The nodes online in the current round: a seeded draw of ``available`` of them."""
        if self.attack is not None and self.attack.new_id and self.attackers:
            self._new_ids()
        if self.available >= len(self.nodes):
            return list(self.nodes)
        rng = np.random.default_rng(derive_seed(self.seed, "available", self.server_round))
        return sorted(int(n) for n in rng.choice(self.nodes, self.available, replace=False))

    def _new_ids(self) -> None:
        """The attackers under node ids of this round (partition kept, client state fresh)."""
        for i, old in enumerate(self.attackers):
            new = 100_000 * (i + 1) + self.server_round
            if new == old:
                continue
            pid = self.nodes.index(old)
            self.nodes[pid] = self.attackers[i] = new
            self.contexts[new] = Context(
                run_id=1, node_id=new, node_config={"partition-id": pid}, state=RecordDict(), run_config={}
            )

    def _train_honest(self, msg: Message, server_round: int) -> tuple[dict[str, np.ndarray], dict]:
        node = msg.metadata.dst_node_id
        pid = self.nodes.index(node)
        model = BenchModel()
        model.load_arrays(next(iter(msg.content.array_records.values())))
        data = self.task.partitions[pid]
        loss = train(
            model, data, epochs=LOCAL_EPOCHS, batch_size=BATCH_SIZE, lr=LEARNING_RATE,
            seed=derive_seed(self.seed, "batches", server_round, pid), clip_norm=CLIP_NORM, min_steps=MIN_STEPS,
        )  # fmt: skip
        arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        return arrays, {"train-loss": loss, "num-examples": len(data)}

    def train(self, server_round: int, messages: list[Message]) -> list[Message]:
        messages = sorted(messages, key=lambda m: m.metadata.dst_node_id)
        received = {m.metadata.dst_node_id: m for m in messages}
        honest = {n: self._train_honest(m, server_round) for n, m in received.items()}
        some = next(iter(received.values()))
        sent = {k: a.numpy() for k, a in next(iter(some.content.array_records.values())).items()}
        view = RoundView(server_round, sent, {n: h[0] for n, h in honest.items()}, self.attackers)
        replies = []
        for node, msg in received.items():
            arrays, metrics = honest[node]
            attacking = node in self.attackers
            if attacking and self.attack.offline:
                continue
            if attacking and self.attack.arrays is not None:
                arrays = self.attack.arrays(view, node)
            if attacking and self.attack.metrics is not None:
                metrics = self.attack.metrics(metrics)
            content = RecordDict(
                {"arrays": ArrayRecord({k: Array(np.array(v, order="C")) for k, v in arrays.items()}),
                 "metrics": MetricRecord(metrics)}
            )  # fmt: skip
            reply = quantize_mod(msg, self.contexts[node], lambda m, _c, c=content: Message(c, reply_to=m))
            if reply.has_error():
                self.error_replies += 1
            elif attacking and self.attack.tamper is not None:
                self.attack.tamper(reply)
            replies.append(reply)
        return replies

    def evaluate(self, messages: list[Message]) -> list[Message]:
        replies = []
        for msg in sorted(messages, key=lambda m: m.metadata.dst_node_id):
            node = msg.metadata.dst_node_id
            if node in self.attackers and self.attack.offline:
                continue
            model = BenchModel()
            model.load_arrays(next(iter(msg.content.array_records.values())))
            data = self.task.partitions[self.nodes.index(node)]
            loss, acc = evaluate(model, data)
            metrics = {"eval-loss": loss, "eval-acc": acc, "num-examples": len(data)}
            if node in self.attackers and self.attack.evaluate is not None:
                metrics = self.attack.evaluate(metrics)
            replies.append(Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg))
        return replies


# ---------------------------------------------------------------------------------------------- defences
AVAILABLE = NUM_CLIENTS


def _fedavg() -> FedAvg:
    return FedAvg(**_kw())


def _kw() -> dict:
    n = AVAILABLE
    return {"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": n, "min_evaluate_nodes": n,
            "min_available_nodes": n}  # fmt: skip


DEFENCES: dict[str, Callable[[], Strategy]] = {
    "FedAvg": _fedavg,
    "FedMedian": lambda: FedMedian(**_kw()),
    "FedTrimmedAvg": lambda: FedTrimmedAvg(beta=0.2, **_kw()),
    "Krum": lambda: Krum(num_malicious_nodes=4, **_kw()),
    "DP-clip": lambda: DifferentialPrivacyServerSideFixedClipping(
        _fedavg(), noise_multiplier=0.0, clipping_norm=DP_CLIPPING_NORM, num_sampled_clients=NUM_CLIENTS
    ),
}


# ---------------------------------------------------------------------------------------------- one run
ADMISSION = AdmissionRules(cross_round=DriftRule())  # the gate measures the opt-in drift rule; --drift changes it


@dataclass
class RunResult:
    arrays: ArrayRecord | None = None
    accuracy: float = math.nan
    probabilities: np.ndarray | None = None  # the final model's softmax on the test set (float64)
    error: str | None = None
    train_metrics: list[dict] = field(default_factory=list)
    eval_metrics: list[dict] = field(default_factory=list)
    error_replies: int = 0
    seconds: float = 0.0

    def counts(self, prefix: str) -> Counter:
        out: Counter = Counter()
        for m in self.train_metrics:
            for k, v in m.items():
                if k.startswith(prefix) and k not in (f"{prefix}replies",) and isinstance(v, (int, float)):
                    out[k.removeprefix(prefix)] += v
        return out


def run(task: Task, defence: str, attack: Attack | None, attackers: int, seed: int, rounds: int) -> RunResult:
    """One federation of ``rounds`` rounds; exceptions are caught and reported (a crash is a result)."""
    result = RunResult()
    start = time.perf_counter()
    federation = Federation(task, attack, attackers, seed, AVAILABLE)
    strategy = QuantizedStrategy(DEFENCES[defence](), CODEC, seed=seed, min_numel=1, admission=ADMISSION)
    arrays = initial_model()
    try:
        for server_round in range(1, rounds + 1):
            federation.server_round = server_round
            messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), federation))
            new, metrics = strategy.aggregate_train(server_round, federation.train(server_round, messages))
            arrays = new if new is not None else arrays
            result.train_metrics.append(dict(metrics or {}))
            messages = list(strategy.configure_evaluate(server_round, arrays, ConfigRecord(), federation))
            result.eval_metrics.append(
                dict(strategy.aggregate_evaluate(server_round, federation.evaluate(messages)) or {})
            )
    except Exception as err:  # noqa: BLE001 - a crash of the run is what this measures
        result.error = f"{type(err).__name__}: {err}"
        traceback.print_exc(limit=3, file=sys.stderr)
    result.arrays = arrays
    result.error_replies = federation.error_replies
    model = BenchModel()
    try:
        model.load_arrays(arrays)
        result.accuracy = evaluate(model, task.test)[1]
        with torch.no_grad():
            result.probabilities = torch.softmax(model.eval()(task.test.x).double(), dim=1).numpy()
    except Exception as err:  # noqa: BLE001 - a poisoned model may not even load
        result.error = result.error or f"model does not load: {err}"
    result.seconds = time.perf_counter() - start
    return result


def distance(a: ArrayRecord | None, b: ArrayRecord | None) -> float:
    """L2 distance over the float entries (float64); inf when a model is missing or not finite."""
    if a is None or b is None:
        return math.inf
    total = 0.0
    for key in b.keys():
        if b[key].numpy().dtype.kind == "f":
            total += float(np.sum((a[key].numpy().astype(np.float64) - b[key].numpy().astype(np.float64)) ** 2))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def function_distance(a: RunResult, b: RunResult) -> float:
    """RMS over the test set of the L2 distance between two final models' predicted class
    probabilities: what the models compute, blind to directions the network ignores (a bias
    before BatchNorm, a layer's scale that BatchNorm undoes); inf when a model is missing."""
    if a.probabilities is None or b.probabilities is None:
        return math.inf
    gap = float(np.sqrt(np.mean(np.sum((a.probabilities - b.probabilities) ** 2, axis=1))))
    return gap if math.isfinite(gap) else math.inf


def counter_gap(a: ArrayRecord | None, b: ArrayRecord | None) -> float:
    """How far the BatchNorm step counter of ``a`` lies from ``b``'s."""
    if a is None or b is None:
        return math.inf
    return abs(float(a[COUNTER].numpy()) - float(b[COUNTER].numpy()))


# ---------------------------------------------------------------------------------------------- tables
def spread(honest: list[RunResult]) -> float:
    """The honest run-to-run spread: the largest distance between two honest runs (different seeds)."""
    return max(distance(a.arrays, b.arrays) for i, a in enumerate(honest) for b in honest[i + 1 :])


def function_spread(honest: list[RunResult]) -> float:
    """The honest run-to-run spread of :func:`function_distance`."""
    return max(function_distance(a, b) for i, a in enumerate(honest) for b in honest[i + 1 :])


def _cell(result: RunResult, reference: RunResult) -> str:
    if result.error:
        return "crash"
    gap = counter_gap(result.arrays, reference.arrays)
    extra = f", counter +{gap:.3g}" if gap > 0 else ""
    return (
        f"{distance(result.arrays, reference.arrays):.3g} / {function_distance(result, reference):.3g} / "
        f"{result.accuracy:.3f}{extra}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="FedAvg only, one attacker, 3 honest seeds")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seeds", type=int, default=HONEST_SEEDS, help="honest seeds for the spread")
    parser.add_argument("--defences", default=",".join(DEFENCES))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    parser.add_argument("--honest", action="store_true", help="honest rejections/clippings per reason instead")
    parser.add_argument("--partitioning", choices=("iid", "dirichlet"), default="iid", help="the attack table's")
    parser.add_argument("--drift", default=None, help="the cross-round rule: 'off' or ROUND_FACTOR,TOTAL_FACTOR")
    args = parser.parse_args(argv)
    global ADMISSION
    if args.drift == "off":
        ADMISSION = AdmissionRules(cross_round=None)
    elif args.drift:
        round_factor, total_factor = (float(x) for x in args.drift.split(","))
        ADMISSION = AdmissionRules(cross_round=DriftRule(round_factor=round_factor, total_factor=total_factor))
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # one INFO line per round and call otherwise
    if args.honest:
        return honest_table(args.rounds, args.seeds)
    defences = ["FedAvg"] if args.quick else args.defences.split(",")
    fractions = [1] if args.quick else [int(f) for f in args.fractions.split(",")]
    seeds = min(args.seeds, 3) if args.quick else args.seeds
    attacks = [ATTACKS[a] for a in args.attacks.split(",")]
    task = load_task(args.partitioning)
    start = time.perf_counter()
    print(
        f"digits {args.partitioning}, {NUM_CLIENTS} clients (all every round), {args.rounds} rounds, {CODEC}, "
        f"default AdmissionRules; cell: L2 distance from the honest seed-0 model / distance of its test-set "
        "probabilities (RMS) / test accuracy"
    )
    honest = {d: [run(task, d, None, 0, seed, args.rounds) for seed in range(seeds)] for d in defences}
    failed = any(h.error for runs in honest.values() for h in runs)
    print("| attack | k | " + " | ".join(defences) + " |")
    print("|" + "---|" * (2 + len(defences)))
    cells = [
        f"{spread(honest[d]):.3g} / {function_spread(honest[d]):.3g} / {np.mean([h.accuracy for h in honest[d]]):.3f}"
        for d in defences
    ]
    print(f"| honest spread ({seeds} seeds) | 0 | " + " | ".join(cells) + " |")
    over, metric_rows = [], []
    for attack in attacks:
        for k in fractions:
            if not attack.model:
                if "FedAvg" in defences and k == fractions[0]:
                    metric_rows.append((attack, k, run(task, "FedAvg", attack, k, 0, args.rounds)))
                continue
            cells = []
            for d in defences:
                r = run(task, d, attack, k, 0, args.rounds)
                cell = _cell(r, honest[d][0])
                failed |= r.error is not None
                if (
                    d == "FedAvg"
                    and k == 1
                    and (r.error or not function_distance(r, honest[d][0]) <= attack.gate * function_spread(honest[d]))
                ):
                    cell += " **over**" if attack.gated else " (over, not gated)"
                    if attack.gated:
                        over.append(attack.name)
                cells.append(cell)
            print(f"| {attack.name} | {k} | " + " | ".join(cells) + " |", flush=True)
    if metric_rows:
        print_metric_table(honest["FedAvg"], metric_rows)
        failed |= any(r.error for _, _, r in metric_rows)
    print(f"\n{time.perf_counter() - start:.0f} s")
    if over:
        print(
            f"FAIL: one attacker of {NUM_CLIENTS} moves the FedAvg model's predictions beyond the honest spread: "
            + ", ".join(over)
        )
    if failed:
        print("FAIL: a run raised")
    return 1 if over or failed else 0


def _final(results: list[dict], key: str) -> float:
    values = [m[key] for m in results if key in m]
    return float(values[-1]) if values else math.nan


def print_metric_table(honest: list[RunResult], rows: list[tuple[Attack, int, RunResult]]) -> None:
    """Reported metrics under the metric attacks (FedAvg): the last round's value against the honest range."""
    keys = [
        ("train", "quantization-mse"),
        ("train", "encode-seconds"),
        ("train", "train-loss"),
        ("evaluate", "eval-loss"),
    ]

    def value(r: RunResult, kind: str, key: str) -> float:
        return _final(r.train_metrics if kind == "train" else r.eval_metrics, key)

    print("\nmetrics (FedAvg, last round): value reported; first row: the range over the honest seeds")
    print("| attack | k | " + " | ".join(k for _, k in keys) + " |")
    print("|" + "---|" * (2 + len(keys)))
    ranges = [
        (min(value(h, kind, key) for h in honest), max(value(h, kind, key) for h in honest)) for kind, key in keys
    ]
    print("| honest | 0 | " + " | ".join(f"{lo:.3g}..{hi:.3g}" for lo, hi in ranges) + " |")
    for attack, k, r in rows:
        if r.error:
            print(f"| {attack.name} | {k} | crash: {r.error[:60]} |")
            continue
        print(f"| {attack.name} | {k} | " + " | ".join(f"{value(r, kind, key):.3g}" for kind, key in keys) + " |")


def honest_table(rounds: int, seeds: int) -> int:
    """Honest runs only: train replies rejected and clipped per reason, evaluate replies rejected, client
    error replies (FedAvg, default rules), accuracy over seeds. Exits 1 when a run raised."""
    print(f"honest clients, FedAvg, default AdmissionRules, {NUM_CLIENTS} clients, {rounds} rounds, {seeds} seeds")
    print("| partitioning | train replies | rejected | by reason | clipped | by reason | evaluate rejected "
          "| error replies | accuracy |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    for partitioning in ("iid", "dirichlet"):
        task = load_task(partitioning)
        results = [run(task, "FedAvg", None, 0, seed, rounds) for seed in range(seeds)]
        replies = seeds * rounds * NUM_CLIENTS
        rejected = sum((r.counts("rejected-") for r in results), Counter())
        rejected.pop("share", None)
        clipped = sum((r.counts("clipped-") for r in results), Counter())
        evaluate_rejected = sum(int(m.get("rejected-replies", 0)) for r in results for m in r.eval_metrics)
        errors = sum(r.error_replies for r in results)
        accs = [r.accuracy for r in results]
        print(
            f"| {partitioning} | {replies} | {sum(rejected.values())} | {dict(+rejected) or '-'} | "
            f"{sum(clipped.values())} | {dict(+clipped) or '-'} | {evaluate_rejected} | {errors} | "
            f"{np.mean(accs):.3f} ± {np.std(accs):.3f} |",
            flush=True,
        )
        for r in results:
            if r.error:
                print(f"FAIL: a {partitioning} run raised: {r.error}")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
