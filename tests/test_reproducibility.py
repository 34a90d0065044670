"""Exact reproducibility: runs with the same config give the same history, whatever node ids Flower draws.

Flower's simulation engine gives the virtual nodes new random node ids in every run and the same
partition ids; the app keys client sampling and seeds by partition id
(``simulations.node_directory``), so two runs agree bit for bit.
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict

from simulations.node_directory import PartitionDirectory, partition_query
from tests.flower_fakes import InProcessGrid

# Columns that hold wall-clock time: the only ones two runs may disagree on.
TIMING_COLUMNS = {"elapsed-seconds", "encode-seconds", "decode-seconds"}


def history_rows(folder: Path) -> list[dict[str, str]]:
    """``history.csv`` without its timing columns, as text (a bit-level comparison)."""
    with (folder / "history.csv").open() as fh:
        return [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(fh)]


def random_id_grid(num_nodes: int, seed: int) -> InProcessGrid:
    """An in-process grid whose nodes have random 63-bit ids (as Flower's simulation draws them)."""
    from simulations.client_app import app as client_app

    grid = InProcessGrid(client_app, num_nodes)
    ids = random.Random(seed).sample(range(2, 1 << 63), num_nodes)
    grid.contexts = {
        nid: Context(run_id=1, node_id=nid, node_config=dict(ctx.node_config), state=RecordDict(), run_config={})
        for nid, ctx in zip(ids, grid.contexts.values())
    }
    return grid


def test_same_config_same_history_whatever_the_node_ids(tmp_path):
    from simulations.server_app import run_server

    # 5 nodes, 2 sampled per round (which ones, and their QSGD seeds, used to follow the node ids).
    config = {"codec": "qsgd:levels=4", "rounds": 2, "fraction-train": 0.4, "local-epochs": 1, "min-local-steps": 0}
    for run, seed in (("a", 1), ("b", 2)):
        run_server(random_id_grid(5, seed), config, out_dir=str(tmp_path), run_name=run)
    rows_a, rows_b = history_rows(tmp_path / "a"), history_rows(tmp_path / "b")
    assert len(rows_a) == 3 and float(rows_a[2]["quantization-mse"]) > 0
    assert rows_a == rows_b


class _CountingGrid(InProcessGrid):
    def queries(self) -> int:
        return sum(m.metadata.message_type == "query" for m in self.sent)


def test_each_node_is_asked_for_its_partition_once():
    from simulations.client_app import app as client_app

    grid = _CountingGrid(client_app, 6)
    directory = PartitionDirectory()
    first = directory.ordered_nodes(grid)
    assert [directory.partition_of[n] for n in first] == list(range(6))
    for _ in range(3):
        assert directory.ordered_nodes(grid) == first
    assert grid.queries() == 6
    # A node that joins later is asked once, when it first appears.
    late = 999
    grid.contexts[late] = Context(run_id=1, node_id=late, node_config={"partition-id": 6, "num-partitions": 7},
                                  state=RecordDict(), run_config={})  # fmt: skip
    assert directory.ordered_nodes(grid) == [*first, late] and grid.queries() == 7


@pytest.mark.parametrize(
    "answer",
    [{"partition-id": 5, "num-partitions": 5}, {"partition-id": -1, "num-partitions": 5},
     {"partition-id": True, "num-partitions": 5}, {"partition-id": "0", "num-partitions": 5}, {}],
)  # fmt: skip
def test_an_invalid_partition_answer_is_ignored(answer):
    from flwr.app import ConfigRecord

    from tests.flower_fakes import set_task_identity

    set_task_identity()

    class _Grid:
        def get_node_ids(self):
            return [7, 3]

        def send_and_receive(self, messages, *, timeout=None):
            replies = []
            for m in messages:
                ok = m.metadata.dst_node_id == 7
                content = {"partition-id": 0, "num-partitions": 5} if ok else answer
                replies.append(Message(RecordDict({"config": ConfigRecord(content)}), reply_to=m))
            return replies

    directory = PartitionDirectory()
    assert directory.ordered_nodes(_Grid()) == [7, 3]  # the node with a partition first
    assert directory.partition_of == {7: 0}
    assert partition_query().config_records["config"]["fedquant-sim.query"] == "partition-id"


@pytest.mark.slow
def test_two_simulations_with_the_default_config_agree_and_converge(tmp_path):
    """The default run on Flower's default federation (2 supernodes), twice, through Ray.

    With the old defaults (no clipping, no minimum of local steps) this run collapsed to chance
    (measured with QSGD: 0.90 0.94 0.94 0.91 0.90 0.94 0.95 0.96 0.97 0.88 0.95 0.95 0.95 0.94
    0.82 0.79 0.63 0.10 0.10 0.10), and two runs sampled partitions and drew QSGD seeds from
    random node ids.
    """
    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.server_app import make_server_app
    from simulations.settings import SimSettings

    for run in ("a", "b"):
        app = make_server_app(out_dir=str(tmp_path), run_name=run)
        run_simulation(app, client_app, num_supernodes=2,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})  # fmt: skip
    rows = history_rows(tmp_path / "a")
    assert rows == history_rows(tmp_path / "b")
    accuracy = [float(r["accuracy"]) for r in rows[1:]]
    assert len(accuracy) == SimSettings().rounds and {r["diverged"] for r in rows[1:]} == {"0"}
    # 359 test digits: the binomial sd of the accuracy at 0.95 is 0.012, so a model that stays
    # >= 0.9 from round 3 on and ends >= 0.95 has learned and kept it.
    assert min(accuracy[2:]) >= 0.9 and accuracy[-1] >= 0.95
