"""Assignment stage: each sampled client's codec setting, seed and codec config entries."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedquant.codecs import Codec
from fedquant.metrics.bandwidth import content_bytes
from fedquant.strategies.budget import UploadBudget
from fedquant.strategies.decode_plan import DecodePlan
from fedquant.strategies.round import LOG_PREFIX, TrainRound
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.tensor_policy import TensorPolicy


class Assignment(RoundStage):
    """Asks the decode plan (then the upload budget, if any) which codec each client uses this round;
    the tensor policy's per-tensor codecs (BatchNorm statistics, the user's patterns) go on top.

    ``client_seed(server_round, node_id)`` gives each client's seed (the wrapper's overridable method).
    """

    def __init__(
        self,
        codec: Codec,
        decode_plan: DecodePlan,
        budget: UploadBudget | None,
        client_seed: Callable[[int, int], int],
        min_numel: int,
        client_mse: bool,
        tensor_policy: TensorPolicy | None = None,
    ) -> None:
        self.codec = codec
        self.decode_plan = decode_plan
        self.budget = budget
        self.client_seed = client_seed
        self.min_numel = min_numel
        self.client_mse = client_mse
        self.tensor_policy = tensor_policy

    def configure(self, state: TrainRound, messages: list[Message]) -> None:
        """Assign codecs and seeds; add each client's codec entries to ``state.entries``."""
        server_round, arrays = state.server_round, state.model
        node_ids = [m.metadata.dst_node_id for m in messages]
        assignments = self.decode_plan.assign(server_round, node_ids, self.codec)
        if self.budget is not None:
            state.budget = self.budget.choose(assignments, arrays)
            assignments = state.budget.assignments
        if self.tensor_policy is not None:
            names = list(arrays.keys())
            assignments = {node: self.tensor_policy.assign(a, names) for node, a in assignments.items()}
        state.assignments = assignments
        state.dtypes = {name: np.dtype(array.dtype) for name, array in arrays.items()}
        for message in messages:
            node_id = message.metadata.dst_node_id
            records = message.content.array_records
            if len(records) != 1:
                raise ValueError(
                    f"{LOG_PREFIX} needs train messages with exactly one ArrayRecord; "
                    f"the message to node {node_id} has {len(records)}"
                )
            assignment = assignments[node_id]
            state.seeds[node_id] = self.client_seed(server_round, node_id)
            state.entries[node_id] = {
                **assignment.record_codec(self.min_numel).config_entries(state.seeds[node_id], self.client_mse),
                **assignment.config,
            }


def write_messages(state: TrainRound, messages: list[Message]) -> None:
    """Give each message its own content: the stages' config entries and the model as ``state.wire`` holds it."""
    for message in messages:
        node_id = message.metadata.dst_node_id
        record_name = next(iter(message.content.array_records.keys()))
        wire = {record_name: state.wire[node_id]} if node_id in state.wire else None
        # Inner strategies share one RecordDict among all messages: give each its own.
        message.content = _with_config_entries(message.content, state.entries.get(node_id, {}), wire)
        state.traffic.downlink_bytes_of[node_id] = content_bytes(message.content)
        state.traffic.downlink_bytes += state.traffic.downlink_bytes_of[node_id]


def _with_config_entries(
    content: RecordDict, entries: dict, arrays: dict[str, ArrayRecord] | None = None
) -> RecordDict:
    """A new RecordDict sharing ``content``'s records, with ``entries`` added to a copy of its ConfigRecord.

    ``arrays`` replaces ArrayRecords by name (the encoded model of a downlink codec).

    The first ConfigRecord gets the entries (Flower's strategies send exactly one); a message
    without one gets a ConfigRecord named ``"config"``.
    """
    records = {**dict(content.items()), **(arrays or {})}
    config_names = list(content.config_records.keys())
    name = config_names[0] if config_names else "config"
    config = ConfigRecord(dict(content.config_records[name])) if config_names else ConfigRecord()
    for key, value in entries.items():
        config[key] = value
    records[name] = config
    return RecordDict(records)
