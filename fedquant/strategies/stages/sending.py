"""Downlink stage: the model each client is sent (dense, or encoded by a ``DownlinkCompressor``)."""

from __future__ import annotations

from flwr.app import ArrayRecord, Message

from fedquant.metrics.bandwidth import RoundTraffic, dense_float32_bytes
from fedquant.strategies.downlink import DownlinkCompressor
from fedquant.strategies.round import TrainRound
from fedquant.strategies.stages.base import RoundStage


class Downlink(RoundStage):
    """Sends each client the round's model and, on the replies, learns which reference it holds."""

    def __init__(self, downlink: DownlinkCompressor | None) -> None:
        self.downlink = downlink

    def configure(self, state: TrainRound, messages: list[Message]) -> None:
        """Fill ``state.sent`` (what each node rebuilds) and ``state.wire`` (what its message carries)."""
        for message in messages:
            node_id = message.metadata.dst_node_id
            record = next(iter(message.content.array_records.values()))
            state.sent[node_id], state.wire[node_id], downlink_entries = self._send_model(
                state.server_round, node_id, record, state.traffic
            )
            state.entries.setdefault(node_id, {}).update(downlink_entries)

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Read (and remove) the replies' reference claims."""
        self.unconfigured(state.server_round, replies)

    def unconfigured(self, server_round: int, replies: list[Message]) -> None:
        """Read (and remove) the replies' reference claims, configured here or not."""
        if self.downlink is not None:
            self.downlink.confirm(server_round, replies)

    def _send_model(
        self, server_round: int, node_id: int, record: ArrayRecord, traffic: RoundTraffic
    ) -> tuple[ArrayRecord, ArrayRecord, dict]:
        """What node ``node_id`` rebuilds, what its message carries, and the downlink config entries."""
        traffic.downlink_dense_bytes += dense_float32_bytes(record)
        if self.downlink is None:
            traffic.downlink_mse.append(0.0)
            return record, record, {}
        sent = self.downlink.send(server_round, node_id, record)
        traffic.downlink_mse.append(sent.mse)
        return sent.model, sent.wire, sent.config
