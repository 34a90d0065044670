"""Which partition each node holds: the stable key behind client sampling and per-client seeds.

Flower's simulation engine gives every virtual SuperNode a fresh random 64-bit node id in each
run (``LinkState.create_node``) but the same ``partition-id`` (``0..num-supernodes-1``, in its
node config). The server only sees node ids, so it asks each node once, with a small QUERY
message, which partition it holds, and from then on sorts and seeds by partition id: the same
run config samples the same partitions and sends them the same codec seeds in every run.

A node is asked the first time the server sees it (all nodes before round 1 in a simulation,
late joiners of a deployment when they appear), never again: with 10,000 registered nodes and
100 sampled per round, a round costs one ``get_node_ids()`` (which the sampling needs anyway) and
a sort, not a query of every node.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

QUERY_KEY = "fedquant-sim.query"  # ConfigRecord key of the question (its value: what is asked)
QUERY_PARTITION = "partition-id"
PARTITION_ID_KEY = "partition-id"  # node-config key set by Flower's simulation engine
NUM_PARTITIONS_KEY = "num-partitions"


def partition_query() -> RecordDict:
    """The content of the QUERY message that asks a node for its partition id."""
    return RecordDict({"config": ConfigRecord({QUERY_KEY: QUERY_PARTITION})})


def is_partition_query(msg: Message) -> bool:
    """Whether a QUERY message asks for the node's partition id (the ClientApp's side)."""
    config = msg.content.config_records.get("config")
    return config is not None and config.get(QUERY_KEY) == QUERY_PARTITION


def partition_answer(node_config: dict) -> RecordDict:
    """The reply content: the node's ``partition-id`` and ``num-partitions`` from its node config."""
    answer = {k: int(node_config[k]) for k in (PARTITION_ID_KEY, NUM_PARTITIONS_KEY) if k in node_config}
    return RecordDict({"config": ConfigRecord(answer)})


class PartitionDirectory:
    """Node id -> partition id, learned once per node; a stable order of the nodes.

    Parameters
    ----------
    timeout : float
        Seconds to wait for the answers to one query batch. A node that does not answer in
        time, answers with an error or without a valid partition id keeps no partition: it sorts
        after every node with one, by node id (not reproducible, and logged).
    """

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self.partition_of: dict[int, int] = {}
        self._asked: set[int] = set()

    def key(self, node_id: int) -> tuple[int, int]:
        """Sort key: ``(0, partition id)`` for a node with a partition, else ``(1, node id)``."""
        pid = self.partition_of.get(node_id)
        return (0, pid) if pid is not None else (1, node_id)

    def ordered_nodes(self, grid: Grid) -> list[int]:
        """The grid's nodes sorted by partition id (asks the nodes not seen before)."""
        node_ids = list(grid.get_node_ids())
        new = [n for n in node_ids if n not in self._asked]
        if new:
            self.learn(grid, new)
        return sorted(node_ids, key=self.key)

    def learn(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Ask ``node_ids`` for their partition id (one QUERY message each) and record the answers."""
        node_ids = sorted(set(node_ids))
        self._asked.update(node_ids)
        messages = [Message(partition_query(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
        replies = grid.send_and_receive(messages, timeout=self.timeout)
        learned = 0
        for reply in replies:
            node_id = reply.metadata.src_node_id
            pid = None if reply.has_error() else _valid_partition(reply)
            if pid is not None and node_id in self._asked:
                self.partition_of[node_id] = pid
                learned += 1
        missing = len(node_ids) - learned
        log(INFO, "fedquant: learned the partition of %d new node(s)", learned)
        if missing:
            log(WARNING, "fedquant: %d node(s) gave no partition id; they are sampled by node id (not reproducible)",
                missing)  # fmt: skip


def _valid_partition(reply: Message) -> int | None:
    """The reply's partition id if it is an int in ``0..num-partitions-1`` (the reply is untrusted)."""
    config = reply.content.config_records.get("config")
    if config is None:
        return None
    pid, num = config.get(PARTITION_ID_KEY), config.get(NUM_PARTITIONS_KEY)
    if isinstance(pid, bool) or not isinstance(pid, int) or isinstance(num, bool) or not isinstance(num, int):
        return None
    return pid if 0 <= pid < num else None
