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
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedquant.rng import derive_seed
from fedquant.strategies import QuantizedStrategy
from simulations.data import load_test_set
from simulations.divergence import DIVERGED_COLUMN, DivergenceMonitor
from simulations.federation_check import data_warnings
from simulations.history import RunHistory, reserve_run_dir, run_dir_name
from simulations.link_times import LinkTimes
from simulations.links import UplinkProfile, parse_uplink
from simulations.models import build_model
from simulations.node_directory import PartitionDirectory
from simulations.settings import CLIENT_INFO_KEY, FEDERATION_KEY, RunConfigError, SimSettings
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
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.last_train_metrics[server_round] = dict(metrics) if metrics is not None else {}
        return arrays, metrics


def _inner_strategy(settings: SimSettings, directory: PartitionDirectory, model: Any) -> SeededFedAvg:
    """FedAvg, or in ``mode="fedsgd"`` data-parallel SGD with server momentum (:mod:`simulations.fedsgd`)."""
    common = {"fraction_train": settings.fraction_train, "fraction_evaluate": 0.0, "min_train_nodes": 1,
              "seed": settings.seed, "directory": directory}  # fmt: skip
    if settings.mode != "fedsgd":
        return SeededFedAvg(**common)
    from simulations.fedsgd import FedSGD  # imports this module

    return FedSGD(**common, learning_rate=settings.learning_rate, momentum=settings.server_momentum,
                  parameter_names=[name for name, _ in model.named_parameters()],
                  clients_per_round=settings.clients_per_round)  # fmt: skip


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
    test = load_test_set(settings.dataset)
    model = build_model(settings.model, test.input_shape, test.num_classes, seed=settings.seed)
    uplink = parse_uplink(settings.uplink, settings.seed)
    downlink = parse_uplink(settings.downlink, derive_seed(settings.seed, "downlink"))
    directory = directory if directory is not None else PartitionDirectory()
    num_nodes = directory.wait_for_registration(grid)
    folder = reserve_run_dir(settings.out_dir, run_dir_name(settings, num_nodes), settings.overwrite)
    history = RunHistory(settings, folder=folder, num_nodes=num_nodes)
    log(INFO, "fedquant: results of this run go to %s (rewritten after every round)", folder)
    if on_start is not None:
        on_start(history)
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
    history.save()  # the folder says "running" from the start
    t0 = time.perf_counter()

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
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=settings.rounds,
            train_config=ConfigRecord({**settings.as_config(), FEDERATION_KEY: uuid.uuid4().hex}),
            evaluate_config=ConfigRecord(settings.as_config()),
            evaluate_fn=evaluate_fn,
        )
    except BaseException as err:
        history.wall_seconds = time.perf_counter() - t0
        history.finish("stopped" if isinstance(err, KeyboardInterrupt) else "failed", f"{type(err).__name__}: {err}")
        log(ERROR, "fedquant: the run %s after %d rounds (%s); the finished rounds are in %s",
            history.status, max(0, len(history.rounds) - 1), history.error, folder)  # fmt: skip
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

__all__ = ["RecordingStrategy", "app", "make_server_app", "run_server"]
