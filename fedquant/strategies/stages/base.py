"""The stage interface: what a round stage may hook into, and in which order the wrapper calls it."""

from __future__ import annotations

from flwr.app import Message

from fedquant.strategies.round import TrainRound


class RoundStage:
    """One step of a train round; every hook does nothing unless a stage overrides it.

    ``QuantizedStrategy`` runs its stages in list order, one hook at a time for all of them:

    1. ``configure(state, messages)`` in ``configure_train``, after the inner strategy built the
       messages and before they are written (add config entries to ``state.entries[node]``,
       replace a node's model in ``state.wire[node]``);
    2. ``receive(state, replies)`` in ``aggregate_train`` (read, check, decode or aggregate the
       replies; write what later stages need into ``state``);
    3. ``report(state)``: the stage's entries of the round's train MetricRecord;
    4. ``unconfigured(server_round, replies)`` instead of 2 and 3 for a round not configured here.

    A stage owns its per-round state in ``state`` (a :class:`TrainRound`, forgotten with the
    round) and talks to other stages only through it.
    """

    def configure(self, state: TrainRound, messages: list[Message]) -> None:
        """Prepare the round's messages (nothing by default)."""

    def receive(self, state: TrainRound, replies: list[Message]) -> None:
        """Handle the round's replies (nothing by default)."""

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """The stage's metrics of the round (none by default)."""
        return {}

    def unconfigured(self, server_round: int, replies: list[Message]) -> None:
        """Replies of a round this strategy did not configure (nothing by default)."""
