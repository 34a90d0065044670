"""The round stages behind QuantizedStrategy: the stage interface, the one per-round store, extra stages."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedquant.clients import quantize_mod
from fedquant.metrics.bandwidth import content_bytes
from fedquant.strategies import QuantizedStrategy
from fedquant.strategies.stages import RoundLedger, RoundStage, TrainRound
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app

NUM_NODES = 4


class Probe(RoundStage):
    """An extra stage that adds a config entry, watches the round and reports what it saw."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def configure(self, state: TrainRound, messages) -> None:
        self.calls.append(("configure", state.server_round))
        for node_id in state.sent:
            state.entries[node_id]["probe-round"] = state.server_round

    def receive(self, state: TrainRound, replies) -> None:
        self.calls.append(("receive", state.server_round))
        self.admitted = len(state.admitted)

    def report(self, state: TrainRound) -> dict[str, int | float]:
        self.calls.append(("report", state.server_round))
        return {"probe-admitted": self.admitted, "probe-reply-bytes": sum(state.reply_bytes.values())}

    def unconfigured(self, server_round: int, replies) -> None:
        self.calls.append(("unconfigured", server_round))


def _strategy(**kw) -> QuantizedStrategy:
    return QuantizedStrategy(FedAvg(min_available_nodes=NUM_NODES), "qsgd:levels=4", seed=3, min_numel=MIN_NUMEL, **kw)


def test_an_extra_stage_sees_every_hook_once_per_round_and_its_metrics_join_the_round():
    probe = Probe()
    strategy = _strategy(extra_stages=[probe])
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    result = strategy.start(grid, initial_arrays(), num_rounds=2)
    assert probe.calls == [(hook, r) for r in (1, 2) for hook in ("configure", "receive", "report")]
    sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert [m.content["config"]["probe-round"] for m in sent] == [1] * NUM_NODES + [2] * NUM_NODES
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics["probe-admitted"] == NUM_NODES
        assert metrics["probe-reply-bytes"] == metrics["uplink-bytes"]  # the bytes the replies arrived with


def test_replies_of_a_round_not_configured_here_reach_the_unconfigured_hook():
    probe = Probe()
    strategy = _strategy(extra_stages=[probe])
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    strategy.aggregate_train(5, replies)
    assert probe.calls == [("configure", 1), ("unconfigured", 5)]


def test_extra_stages_must_be_round_stages():
    with pytest.raises(ValueError, match="extra_stages"):
        _strategy(extra_stages=[object()])


def test_the_ledger_keeps_a_round_from_configure_to_aggregate_and_forgets_older_ones():
    ledger = RoundLedger()
    ledger.open("train", 1, "one")
    ledger.open("evaluate", 1, "eval one")
    ledger.open("train", 2, "two")  # round 1 was never aggregated: forgotten
    assert ledger.close("train", 1) is None
    assert ledger.peek("evaluate", 1) == "eval one"  # another kind keeps its own rounds
    assert ledger.close("train", 2) == "two" and ledger.close("train", 2) is None
    ledger.open("evaluate", 3, "eval three")
    assert len(ledger) == 1 and ledger.close("evaluate", 3) == "eval three"


def test_a_strategy_holds_no_state_of_finished_rounds():
    strategy = _strategy(uplink_bytes_budget=10**9)
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    strategy.start(grid, initial_arrays(), num_rounds=3)
    assert len(strategy._rounds) == 0  # noqa: SLF001 - every train and evaluate round closed


def test_the_written_messages_carry_what_the_downlink_bytes_count():
    strategy = _strategy()
    grid = InProcessGrid(make_client_app([quantize_mod]), NUM_NODES)
    messages = list(strategy.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    state = strategy._rounds.peek("train", 1)  # noqa: SLF001
    assert state.traffic.downlink_bytes == sum(content_bytes(m.content) for m in messages)
    assert len({id(m.content) for m in messages}) == NUM_NODES  # each message got its own content

