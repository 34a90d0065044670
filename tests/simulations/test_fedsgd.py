"""The data-parallel mode (``mode="fedsgd"``): one minibatch gradient per client, SGD with momentum on the server."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedquant.rng import derive_seed
from fedquant.strategies import QuantizedStrategy
from simulations.client_app import app as client_app
from simulations.data import load_partition, load_test_set
from simulations.fedsgd import FedSGD
from simulations.models import build_model
from simulations.node_directory import PartitionDirectory
from simulations.settings import RunConfigError, SimSettings
from simulations.task import minibatch_gradient_step
from tests.flower_fakes import InProcessGrid

NODES, LR, MOMENTUM = 3, 0.2, 0.9


def _gradient(settings: SimSettings, state: dict, pid: int, server_round: int) -> dict[str, torch.Tensor]:
    """What partition ``pid``'s client computes in ``server_round``, recomputed here: ``w - (w - g)``."""
    data = load_partition(settings.dataset, pid, NODES, settings.partitioning, settings.dirichlet_alpha, settings.seed)
    model = build_model(settings.model, data.input_shape, data.num_classes)
    model.load_state_dict(state)
    stepped, _, _ = minibatch_gradient_step(
        model, data, batch_size=settings.batch_size, seed=derive_seed(settings.seed, "batches", server_round, pid)
    )
    return {name: state[name] - stepped[name] for name, _ in model.named_parameters()}


def _run(settings: SimSettings, rounds: int, clients_per_round: int = 0):
    test = load_test_set(settings.dataset)
    model = build_model(settings.model, test.input_shape, test.num_classes, seed=settings.seed)
    directory = PartitionDirectory()
    inner = FedSGD(
        fraction_train=settings.fraction_train, fraction_evaluate=0.0, min_train_nodes=1, seed=settings.seed,
        directory=directory, learning_rate=settings.learning_rate, momentum=settings.server_momentum,
        parameter_names=[n for n, _ in model.named_parameters()], clients_per_round=clients_per_round,
    )  # fmt: skip
    grid = InProcessGrid(client_app, NODES)
    strategy = QuantizedStrategy(inner, codec=settings.codec, seed=settings.seed, min_numel=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
        train_config=ConfigRecord(settings.as_config()),
    )  # fmt: skip
    return start, result.arrays.to_torch_state_dict(), grid


def test_the_server_takes_sgd_momentum_steps_on_the_mean_minibatch_gradient():
    settings = SimSettings(mode="fedsgd", codec="fp32", model="mlp", fraction_train=1.0, batch_size=8,
                           learning_rate=LR, server_momentum=MOMENTUM, clip_norm=0.0)  # fmt: skip
    w0, w2, grid = _run(settings, rounds=2)
    # every reply carried one minibatch gradient of the model it was sent: rebuild the two steps
    g1 = [_gradient(settings, w0, pid, 1) for pid in range(NODES)]
    mean1 = {k: sum(g[k] for g in g1) / NODES for k in g1[0]}
    w1 = {k: (w0[k] - LR * mean1[k]) if k in mean1 else w0[k] for k in w0}
    g2 = [_gradient(settings, w1, pid, 2) for pid in range(NODES)]
    for name, mean in mean1.items():
        velocity = MOMENTUM * mean + sum(g[name] for g in g2) / NODES
        torch.testing.assert_close(w2[name], w1[name] - LR * velocity, rtol=1e-4, atol=1e-6)
        assert not torch.equal(w2[name], w0[name])
    assert sum(m.metadata.message_type == "train" for m in grid.sent) == 2 * NODES


def test_a_codec_quantizes_the_gradient_and_clients_per_round_is_the_number_sampled():
    settings = SimSettings(mode="fedsgd", codec="qsgd:levels=4", model="mlp", fraction_train=1.0, batch_size=8,
                           learning_rate=LR, server_momentum=0.0, clip_norm=0.0)  # fmt: skip
    w0, w1, grid = _run(settings, rounds=1, clients_per_round=2)
    sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(sent) == 2
    pids = [m.metadata.dst_node_id - 101 for m in sent]
    exact = [_gradient(settings, w0, pid, 1) for pid in pids]
    for name in exact[0]:
        step = (w0[name] - w1[name]) / LR
        mean = sum(g[name] for g in exact) / 2
        assert not torch.equal(step, mean)  # quantized ...
        rel = float((step - mean).norm() / mean.norm())
        assert rel < 0.5, (name, rel)  # ... but the mean gradient, not something else


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"mode": "sgd"}, "mode='sgd'"),
        ({"clients_per_round": 4}, 'only with mode="fedsgd"'),
        ({"mode": "fedsgd", "server_momentum": 1.0}, "server-momentum=1.0"),
        ({"mode": "fedsgd", "downlink_codec": "qsgd"}, "downlink-codec='qsgd'"),
        ({"mode": "fedsgd", "clients_per_round": -1}, "clients-per-round=-1"),
    ],
)
def test_bad_fedsgd_settings_are_refused_with_the_key(overrides, needle):
    with pytest.raises(RunConfigError) as err:
        SimSettings(**overrides)
    assert any(needle in line for line in err.value.problems), err.value.problems


def test_run_server_runs_the_mode_from_the_run_config(tmp_path):
    from simulations.server_app import run_server

    history = run_server(
        InProcessGrid(client_app, NODES), {"mode": "fedsgd", "clients-per-round": 2}, rounds=2, model="mlp",
        codec="qsgd:levels=8", batch_size=8, clip_norm=0.0, out_dir=str(tmp_path),
    )  # fmt: skip
    rows = [r for r in history.rounds if r["round"] > 0]
    assert len(rows) == 2 and all(r["bits-per-param"] < 8 for r in rows)
    for r in rows:
        assert sum(c["round"] == r["round"] for c in history.clients) == 2
