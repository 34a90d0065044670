"""Screening stage: who may reply, with which metrics and which integer entries, before any decoding."""

from __future__ import annotations

from flwr.app import Message

from fedquant.strategies.admission import Admission, Vote
from fedquant.strategies.round import TrainRound
from fedquant.strategies.stages.base import RoundStage


class Screening(RoundStage):
    """Opens the round's vote and asks admission for the replies that pass before decoding (sender,
    metrics, weights, integer and bool entries: the cheap rules, cheapest first)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Open ``state.vote`` and fill ``state.screened`` (node id -> reply, in arrival order)."""
        state.vote = Vote("train")
        content_replies = [r for r in replies if not r.has_error()]
        screened = self.admission.screen_replies(content_replies, state.sent, state.vote, state.reject)
        state.screened, clipped = self.admission.screen_entries(
            {r.metadata.src_node_id: r for r in screened}, state.received, state.reject
        )
        state.traffic.clipped_reasons += clipped
