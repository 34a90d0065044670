"""Distributed DP on the new secure paths (a shared subset of coordinates, groups, a dropout): the
history's ``dp-round-epsilon`` and ``dp-epsilon`` are those of the noise the clients really add,
over the coordinates they really send, hidden in the smallest group's surviving inputs.

The expectation is rebuilt from what travelled: each round's grid (from the collect requests),
the length of the integer vector each client encoded (``keep`` of the rotated coordinates), the
groups (the holders in the advertise requests) and who answered collect; composed with
``dp-accounting`` directly. The app's ServerApp and ClientApp run on the in-process grid (no Ray).
"""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event  # the "dp" extra (in "dev" too)
from dp_accounting.rdp import RdpAccountant

import fedquant.clients.secure as client_secure
from fedquant.secagg.accounting import ddg_rho
from fedquant.secagg.messages import RECORD
from fedquant.secagg.wiring import GRID_PREFIX, GRID_RECORD
from tests.flower_fakes import InProcessGrid

NODES, ROUNDS, KEEP = 7, 2, 0.4
DROPPED = 101  # partition 0: the fault injection of secagg-dropouts=1


def _epsilon(rhos: list[float], delta: float) -> float:
    accountant = RdpAccountant()
    for rho in rhos:
        accountant.compose(dp_event.ZCDpEvent(rho))
    return accountant.get_epsilon(delta)


# 1.0: the Gaussian regime, where epsilon depends on the sent coordinates through the sensitivity;
# 0.02: per-client noise of variance near 0.4 in round 1, where the discrete correction, which grows
# with the coordinates sent, adds about 1 % to rho (a useless epsilon, but it tells D from the rest).
@pytest.mark.parametrize("noise", [1.0, 0.02])
def test_epsilon_per_round_and_cumulative_follow_the_subset_the_groups_and_the_dropout(
    noise, tmp_path, monkeypatch, no_figures
):
    from simulations.client_app import app as client_app
    from simulations.server_app import run_server

    sent_lengths: list[int] = []  # per encoding, in order: the coordinates each client puts on the wire
    real = client_secure.encode_update

    def recording(update, grid, dither_seed, **kw):
        encoded = real(update, grid, dither_seed, **kw)
        sent_lengths.append(encoded.integers.size)
        return encoded

    monkeypatch.setattr(client_secure, "encode_update", recording)
    grid = InProcessGrid(client_app, NODES)
    config = {"secagg": True, "secagg-noise-multiplier": noise, "secagg-keep": KEEP, "secagg-groups": 2,
              "secagg-dropouts": 1, "fraction-train": 1.0, "rounds": ROUNDS, "local-epochs": 1,
              "min-local-steps": 2, "model": "logreg"}  # fmt: skip
    history = run_server(grid, config, out_dir=str(tmp_path))
    delta = 1e-5  # SecAggConfig's default delta (no run-config key)

    def stage(name):
        return [m for m in grid.sent if m.content.config_records.get(RECORD, {}).get("stage") == name]

    advertise, collect = stage("advertise"), stage("collect")
    assert len(advertise) == len(collect) == NODES * ROUNDS  # every node, every round
    assert len(sent_lengths) == (NODES - 1) * ROUNDS  # the dropped node never encodes
    rhos = []
    for r in range(ROUNDS):
        row = history.rounds[r + 1]
        assert row["secagg-failed"] == 0 and row["secagg-groups"] == 2 and row["secagg-survivors"] == NODES - 1
        groups = {tuple(m.content.config_records[RECORD]["holders"]) for m in advertise[r * NODES : (r + 1) * NODES]}
        assert sorted(len(g) for g in groups) == [3, 4] and sorted(n for g in groups for n in g) == list(
            range(101, 101 + NODES)
        )
        grid_record = collect[r * NODES].content.config_records[GRID_RECORD]
        clip, steps = grid_record[GRID_PREFIX + "clip"], grid_record[GRID_PREFIX + "steps"]
        variance, sized_for = grid_record[GRID_PREFIX + "noise-variance"], grid_record[GRID_PREFIX + "num-clients"]
        (dim,) = set(sent_lengths[r * (NODES - 1) : (r + 1) * (NODES - 1)])
        numel = grid_record[GRID_PREFIX + "numel"]
        assert KEEP * numel <= dim < numel  # keep of the rotated (padded) coordinates went up
        # One client's integer vector: the clipped update on the sent coordinates over the finest
        # step, plus at most 1 of rounding per sent coordinate.
        sensitivity = clip / min(steps) + math.sqrt(dim)
        assert sized_for == 4 and variance * sized_for == pytest.approx((noise * sensitivity) ** 2, rel=1e-12)
        hiding = min(len([n for n in g if n != DROPPED]) for g in groups)  # the smallest group's survivors
        rho = ddg_rho(sensitivity, variance, hiding - 1, dim)  # the others' noise hides one input
        rhos.append(rho)
        assert row["dp-round-epsilon"] == pytest.approx(_epsilon([rho], delta), rel=1e-9)
        assert row["dp-epsilon"] == pytest.approx(_epsilon(rhos, delta), rel=1e-9)
        assert row["dp-delta"] == delta
    assert 0 < history.rounds[1]["dp-epsilon"] < history.rounds[2]["dp-epsilon"] < math.inf
