"""How many kernel threads the server's reply decoding uses (fedquant/strategies/reply_decoder.py)."""

from __future__ import annotations

import numba
import pytest
from flwr.serverapp.strategy import FedAvg

import fedquant.strategies.stages.decoding as decoding_stage
from fedquant.clients import quantize_mod
from fedquant.codecs.threads import current_kernel_threads, kernel_threads
from fedquant.strategies import QuantizedStrategy
from fedquant.strategies.reply_decoder import decode_reply, decode_threads, decode_threads_for
from tests.flower_fakes import MIN_NUMEL, InProcessGrid, initial_arrays, make_client_app


def test_one_thread_per_reply_once_replies_outnumber_the_threads():
    assert decode_threads_for(100, 2) == 1
    assert decode_threads_for(2, 2) == 1
    assert decode_threads_for(1, 2) == 2  # a lone reply keeps every thread
    assert decode_threads_for(3, 8) == 8
    assert decode_threads_for(1, 1) == 1


def test_decode_threads_sets_and_restores_the_kernel_threads():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread on this machine: nothing to choose")
    with kernel_threads(2):
        with decode_threads(50) as count:
            assert count == 1 and current_kernel_threads() == 1
        assert current_kernel_threads() == 2
        with decode_threads(1) as count:
            assert count == 2 and current_kernel_threads() == 2


@pytest.mark.parametrize(("nodes", "expected"), [(4, 1), (1, 2)])
def test_the_strategy_decodes_a_round_of_many_replies_on_one_thread(monkeypatch, nodes, expected):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread on this machine: nothing to choose")
    seen = []

    def watched(*args, **kwargs):
        seen.append(current_kernel_threads())
        return decode_reply(*args, **kwargs)

    monkeypatch.setattr(decoding_stage, "decode_reply", watched)
    grid = InProcessGrid(make_client_app([quantize_mod]), nodes)
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes)
    strategy = QuantizedStrategy(inner, "qsgd:levels=4", seed=3, min_numel=MIN_NUMEL)
    with kernel_threads(2):
        result = strategy.start(grid, initial_arrays(), num_rounds=1)
        assert current_kernel_threads() == 2  # restored after the round
    assert result.train_metrics_clientapp[1]["rejected-replies"] == 0
    assert seen == [expected] * nodes
