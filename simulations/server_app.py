"""The ServerApp: FedAvg wrapped in fedquant's QuantizedStrategy, scored on a held-out test set.

Before anything runs it checks the whole run config (:class:`~simulations.settings.RunConfigError`,
one line per problem) and the federation's data (:mod:`simulations.federation_check`). Each round
it logs one line (accuracy, uplink bytes, compression) and rewrites the run's ``history.json``,
``history.csv`` and ``history.png`` in its own folder under ``out-dir`` (see
:mod:`simulations.history`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedquant.metrics import messages_bytes
from fedquant.rng import derive_seed
from fedquant.strategies import QuantizedStrategy
from fedquant.strategies.secure_round import MESSAGE_DOWN_PREFIX, MESSAGE_UP_PREFIX
from simulations.data import load_test_set
from simulations.divergence import DIVERGED_COLUMN, DivergenceMonitor
from simulations.feasibility import feasibility_problems
from simulations.federation_check import data_warnings
from simulations.history import (
    MODEL_FILE,
    RunHistory,
    end_active_runs,
    reserve_run_dir,
    run_dir_name,
    settings_difference,
    write_atomically,
)
from simulations.link_times import LinkTimes
from simulations.links import UplinkProfile, parse_uplink
from simulations.models import build_model
from simulations.node_directory import PartitionDirectory
from simulations.settings import CLIENT_INFO_KEY, EVALUATE_KEYS, FEDERATION_KEY, RunConfigError, SimSettings
from simulations.task import evaluate, limit_threads


class SeededFedAvg(FedAvg):
    """FedAvg whose client sampling comes from the run's seed instead of Python's global ``random``.

    The nodes are sorted by partition id (``directory``), not by their random node ids, so runs
    with the same seed (the codecs of a sweep, or two ``flwr run``) train the same partitions
    each round.
    """

    def __init__(self, *args: Any, seed: int = 0, directory: PartitionDirectory | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed = seed
        self.directory = directory if directory is not None else PartitionDirectory()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.fraction_train == 0.0:
            return []
        all_nodes = self.directory.ordered_nodes(grid)
        sample_size = min(len(all_nodes), max(int(len(all_nodes) * self.fraction_train), self.min_train_nodes))
        rng = random.Random(derive_seed(self.seed, "sample-clients", server_round))
        node_ids = rng.sample(all_nodes, sample_size)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(all_nodes))
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, node_ids, MessageType.TRAIN)


class RecordingStrategy(QuantizedStrategy):
    """QuantizedStrategy that also records what each client reports about itself.

    Its ``message-bytes-up`` / ``-down`` count the train messages and replies as Flower serialises
    them, plus, in a secure round, every other stage's (``secagg-message-bytes-*-<stage>``).
    Before the wrapper decodes a round's replies, it reads each reply's ``client-info``
    ConfigRecord (partition id, dataset, partitioning, codec and device the client used) into the
    history, and tells the uplink profile which partition each node holds. Codec seeds derive
    from the partition id (``directory``), not from the random node id.
    """

    def __init__(
        self,
        *args: Any,
        history: RunHistory,
        uplink: UplinkProfile | None,
        directory: PartitionDirectory,
        downlink: UplinkProfile | None = None,
        **kwargs: Any,
    ) -> None:
        links = [LinkTimes(downlink, uplink)] if downlink is not None else []
        super().__init__(*args, uplink_bandwidth=uplink, extra_stages=links, **kwargs)
        self.history = history
        self.directory = directory
        self.last_train_metrics: dict[int, dict[str, Any]] = {}
        self.sent: dict[int, tuple[int, int]] = {}  # round -> (train messages, their bytes)
        self.applied_rounds: list[int] = []  # rounds whose aggregate replaced the model
        self.round_failures: dict[int, str] = {}  # round -> why it applied no update

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.sent[server_round] = (len(messages), messages_bytes(messages))
        return messages

    def client_seed(self, server_round: int, node_id: int) -> int:
        """Seed from the node's partition id when known (stable across runs), else from its node id."""
        pid = self.directory.partition_of.get(node_id)
        if pid is None:
            return super().client_seed(server_round, node_id)
        return derive_seed(self.seed, server_round, "partition", pid)

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[ArrayRecord | None, MetricRecord | None]:
        # Aggregate in partition order, not arrival order: float sums then do not depend on
        # which client finished first, and a run repeats exactly.
        replies = sorted(replies, key=_partition_of)
        infos = []
        for msg in replies:
            if msg.has_error() or CLIENT_INFO_KEY not in msg.content.config_records:
                continue
            info = dict(msg.content.config_records[CLIENT_INFO_KEY])
            info["node-id"] = msg.metadata.src_node_id
            infos.append(info)
            pid = _reported_partition(info)
            if pid is not None:
                self.directory.confirm(int(info["node-id"]), pid)
        self.history.add_clients(server_round, infos)
        sent, sent_bytes = self.sent.pop(server_round, (0, 0))
        failed = sum(msg.has_error() for msg in replies)
        wire = {
            "message-bytes-down": sent_bytes,  # measured before the wrapper decodes the replies in place
            "message-bytes-up": messages_bytes(replies),
            "train-messages": sent,
            "node-failures": failed + max(0, sent - len(replies)),  # error replies and missing ones
        }
        arrays, metrics = super().aggregate_train(server_round, replies)
        wire["message-bytes-up"] += _protocol_bytes(metrics, MESSAGE_UP_PREFIX)
        wire["message-bytes-down"] += _protocol_bytes(metrics, MESSAGE_DOWN_PREFIX)
        self.last_train_metrics[server_round] = {**(dict(metrics) if metrics is not None else {}), **wire}
        if arrays is not None:
            self.applied_rounds.append(server_round)
        else:
            self.round_failures[server_round] = self._why_not_applied(server_round, sent, len(replies), failed)
        return arrays, metrics

    def _why_not_applied(self, server_round: int, sent: int, replies: int, failed: int) -> str:
        secure = self.secure_failures.get(server_round)
        if secure:
            return f"secure aggregation failed: {secure}"
        metrics = self.last_train_metrics.get(server_round, {})
        rejected = int(metrics.get("rejected-replies", 0) or 0)
        return (f"{sent} clients asked, {replies} replied, {failed} with an error, {rejected} rejected"
                + (", the inner aggregation failed" if metrics.get("aggregation-failed") else ""))  # fmt: skip


def _inner_strategy(settings: SimSettings, directory: PartitionDirectory, model: Any) -> SeededFedAvg:
    """FedAvg, or in ``mode="fedsgd"`` data-parallel SGD with server momentum (:mod:`simulations.fedsgd`)."""
    common = {"fraction_train": settings.fraction_train, "fraction_evaluate": 0.0, "min_train_nodes": 1,
              "min_available_nodes": 1, "seed": settings.seed, "directory": directory}  # fmt: skip
    if settings.mode != "fedsgd":
        return SeededFedAvg(**common)
    from simulations.fedsgd import FedSGD  # imports this module

    return FedSGD(**common, learning_rate=settings.learning_rate, momentum=settings.server_momentum,
                  parameter_names=[name for name, _ in model.named_parameters()],
                  clients_per_round=settings.clients_per_round)  # fmt: skip


def _protocol_bytes(metrics: MetricRecord | None, prefix: str) -> int:
    """Whole-message bytes of a secure round's stages besides collect (the train messages counted above)."""
    if metrics is None:
        return 0
    return sum(int(v) for k, v in metrics.items() if k.startswith(prefix) and k != prefix + "collect")


def _reported_partition(info: Any) -> int | None:
    """The partition id a client reported, if it is an int (client info is untrusted)."""
    pid = info.get("partition-id")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _partition_of(msg: Message) -> tuple[int, int]:
    if not msg.has_error() and CLIENT_INFO_KEY in msg.content.config_records:
        pid = _reported_partition(msg.content.config_records[CLIENT_INFO_KEY])
        if pid is not None:
            return (0, pid)
    return (1, msg.metadata.src_node_id)


def run_server(
    grid: Grid,
    run_config: dict[str, Any],
    *,
    directory: PartitionDirectory | None = None,
    on_start: Callable[[RunHistory], Any] | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    **overrides: Any,
) -> RunHistory:
    """Run the whole federation as the run config says; returns the history it wrote.

    ``overrides`` (snake_case keys) take precedence over the run config; the sweep uses them.
    ``directory`` keeps what was learned about the nodes' partitions from an earlier run on the
    same grid (the sweep passes one to all its runs). ``on_start`` gets the history as soon as
    its folder exists (before round 1); ``on_round(row)`` is called with each round's history
    row (the sweep's progress lines).

    Raises :class:`~simulations.settings.RunConfigError` before anything runs when the config is
    invalid. The history goes to a new folder (``history.folder``), rewritten after every round;
    if the run raises, its ``status`` is saved as ``failed`` (``stopped`` for Ctrl-C) first.
    """
    try:
        settings = SimSettings.from_run_config(run_config, **overrides)
    except RunConfigError as err:
        for problem in err.problems:
            log(ERROR, "fedquant: invalid run config: %s", problem)
        raise
    directory = directory if directory is not None else PartitionDirectory()
    num_nodes = directory.wait_for_registration(grid)
    name = run_dir_name(settings, num_nodes)
    changed = settings_difference(Path(settings.out_dir).expanduser() / name, settings) if settings.overwrite else {}
    if changed:  # overwrite=true reuses a folder only for the same settings
        problem = (f"overwrite=true would replace {Path(settings.out_dir) / name}, whose run had other settings ("
                   + ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in changed.items())
                   + "); set run-name or out-dir to keep both")  # fmt: skip
        log(ERROR, "fedquant: %s", problem)
        raise RunConfigError([problem])
    folder = reserve_run_dir(settings.out_dir, name, settings.overwrite)
    history = RunHistory(settings, folder=folder, num_nodes=num_nodes).track()
    log(INFO, "fedquant: results of this run go to %s (rewritten after every round)", folder)
    _record_stops_on_exit()
    if on_start is not None:
        on_start(history)
    history.save()  # the folder says "running" from the start
    t0 = time.perf_counter()
    try:
        problems = feasibility_problems(settings, num_nodes)
        if problems:
            for problem in problems:
                log(ERROR, "fedquant: this run cannot train: %s", problem)
            raise RunRefused(problems)
        test = load_test_set(settings.dataset)
        model = build_model(settings.model, test.input_shape, test.num_classes, seed=settings.seed)
        uplink = parse_uplink(settings.uplink, settings.seed)
        downlink = parse_uplink(settings.downlink, derive_seed(settings.seed, "downlink"))
    except BaseException as err:
        _record_end(history, err, t0)
        raise
    for warning in data_warnings(settings, num_nodes):
        log(WARNING, "fedquant: %s", warning)
        history.warnings.append(warning)
    for profile in (uplink, downlink):
        if profile is not None:  # speeds keyed by partition id, as the directory places the nodes
            profile.client_keys = directory.partition_of
    strategy = RecordingStrategy(
        _inner_strategy(settings, directory, model),
        codec=settings.codec,
        seed=settings.seed,
        min_numel=settings.min_numel,
        history=history,
        uplink=uplink,
        downlink=downlink,
        downlink_codec=None if settings.downlink_codec.strip().lower() in ("", "none") else settings.downlink_codec,
        upload_deadline_seconds=settings.upload_deadline_seconds or None,
        uplink_bytes_budget=settings.uplink_bytes_budget or None,
        directory=directory,
        secure_aggregation=settings.secagg_config(),
    )
    monitor = DivergenceMonitor(test.num_classes)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, test)
        train_metrics = strategy.last_train_metrics.get(server_round, {})
        row = {"round": server_round, "accuracy": accuracy, "loss": loss, **train_metrics}
        if server_round > 0:
            already = monitor.diverged
            why = monitor.check(server_round, accuracy, loss)
            row[DIVERGED_COLUMN] = int(why is not None)
            if why is not None and not already:
                log(WARNING, "fedquant: the run DIVERGED at round %d: %s. %s", server_round, why, DIVERGENCE_ADVICE)
        row["elapsed-seconds"] = history.wall_seconds = time.perf_counter() - t0
        history.add_round(row)
        history.divergence = {"round": monitor.first_round, "reason": monitor.reason} if monitor.diverged else None
        history.save()
        log(INFO, "%s", _round_line(row, settings.rounds))
        if on_round is not None:
            on_round(row)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    try:
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=settings.rounds,
            train_config=ConfigRecord({**settings.client_config(), FEDERATION_KEY: uuid.uuid4().hex}),
            evaluate_config=ConfigRecord(settings.client_config(EVALUATE_KEYS)),
            evaluate_fn=evaluate_fn,
        )
        if not strategy.applied_rounds:
            raise NoUpdateApplied(
                f"no round applied an update in {settings.rounds} rounds, the model is the initial one ("
                + "; ".join(f"round {r}: {why}" for r, why in sorted(strategy.round_failures.items())[:3])
                + ("; ..." if len(strategy.round_failures) > 3 else "")
                + ")"
            )
        save_model(result.arrays, folder / MODEL_FILE)
    except BaseException as err:
        _record_end(history, err, t0)
        raise
    history.wall_seconds = time.perf_counter() - t0
    history.finish("finished")
    final = history.final
    log(
        INFO,
        "fedquant: %s reached accuracy %.4f after %d rounds, %.3f MB uplink in total; results in %s",
        settings.uplink_name,
        final.get("accuracy", float("nan")),
        settings.rounds,
        (final.get("cumulative-uplink-bytes") or 0) / 1e6,
        folder,
    )
    nested = [r["ndqsg-nested-tensors"] for r in history.rounds if r.get("ndqsg-nested-tensors") is not None]
    if nested and not any(nested):
        log(WARNING, "fedquant: NDQSG nested no tensor in any round (every rho reached 2M+1, ndqsg-nested-tensors "
            "= 0): every tensor went as DQSG, so this run is a DQSG run")  # fmt: skip
    if monitor.recovered:
        log(WARNING, "fedquant: this run diverged at round %d (%s) and recovered by the last round; compare "
            "its final accuracy with care. %s", monitor.first_round, monitor.reason, DIVERGENCE_ADVICE)  # fmt: skip
    elif monitor.diverged:
        log(WARNING, "fedquant: this run DIVERGED (first at round %d: %s); its final accuracy is not meaningful. %s",
            monitor.first_round, monitor.reason, DIVERGENCE_ADVICE)  # fmt: skip
    return history


DIVERGENCE_ADVICE = "Lower learning-rate, or set clip-norm (run config) if it is 0."


class RunRefused(RunConfigError):
    """The run config is valid but cannot train on this federation or with this data (before round 1)."""


class NoUpdateApplied(RuntimeError):
    """Every round ended without an aggregate: the run trained nothing."""


def _record_end(history: RunHistory, err: BaseException, t0: float) -> None:
    """Save how the run ended on ``err``: ``interrupted`` (Ctrl-C), else ``failed`` with the reason."""
    history.wall_seconds = time.perf_counter() - t0
    reason = f"{type(err).__name__}: {err}" if not isinstance(err, RunConfigError) else "; ".join(err.problems)
    if isinstance(err, KeyboardInterrupt):
        status = "interrupted"
    elif type(err).__name__ == "RunNotRunningException":  # flwr stop: the SuperLink refuses the run's next call
        status, reason = "stopped", "stopped (flwr stop): the SuperLink no longer runs it"
    else:
        status = "failed"
    history.finish(status, reason)
    log(ERROR, "fedquant: the run %s after %d rounds (%s); the finished rounds are in %s",
        history.status, history.last_round, history.error, history.folder)  # fmt: skip


_EXIT_HANDLER_ADDED = False


def _record_stops_on_exit() -> None:
    """Once per process: when Flower ends it on a signal (``flwr stop``), the runs going on say ``stopped``."""
    global _EXIT_HANDLER_ADDED
    if _EXIT_HANDLER_ADDED:
        return
    from flwr.supercore.exit import add_exit_handler

    add_exit_handler(lambda: end_active_runs("stopped", "stopped by a signal (flwr stop)"), run_before_force_exit=True)
    _EXIT_HANDLER_ADDED = True


def save_model(arrays: ArrayRecord, path: Path) -> Path:
    """The model as a PyTorch state dict (``torch.load(path)``, then ``model.load_state_dict``), atomically."""
    import torch

    state = arrays.to_torch_state_dict()
    return write_atomically(path, lambda p: torch.save(state, p))


def _round_line(row: dict[str, Any], rounds: int) -> str:
    text = f"[fedquant] round {row['round']}/{rounds}: accuracy {row['accuracy']:.4f}, loss {row['loss']:.4f}"
    if "uplink-bytes" in row:
        ratio, bits = row.get("compression-ratio", float("nan")), row.get("bits-per-param", float("nan"))
        text += (
            f" | uplink {row['uplink-bytes'] / 1e3:.1f} kB (x{ratio:.1f}, {bits:.2f} bits/param)"
            f", cumulative {row.get('cumulative-uplink-bytes', 0) / 1e6:.3f} MB"
        )
    if "simulated-upload-seconds" in row:
        text += f", upload {row['simulated-upload-seconds']:.2f} s"
    if "downlink-compression-ratio" in row and row["downlink-compression-ratio"] != 1.0:
        text += f" | downlink x{row['downlink-compression-ratio']:.1f}"
    if "deadline-met-fraction" in row:
        text += f", deadline met {row['deadline-met-fraction']:.0%}"
    return text


def make_server_app(on_start: Callable[[RunHistory], Any] | None = None, **overrides: Any) -> ServerApp:
    """A ServerApp whose run config is overridden by ``overrides`` (for ``run_simulation``).

    ``on_start`` gets the run's history once its folder exists (``simulations.run`` keeps it).
    """
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        limit_threads()
        run_server(grid, dict(context.run_config), on_start=on_start, **overrides)

    return server_app


app = make_server_app()

__all__ = ["NoUpdateApplied", "RecordingStrategy", "RunRefused", "app", "make_server_app", "run_server", "save_model"]
