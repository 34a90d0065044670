"""A shared random subset of the rotated coordinates (SecAggConfig.keep): fewer values on the wire, an unbiased mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedquant.codecs.summable import WEIGHT_SCALE, SumGrid, decode_sum, encode_update
from fedquant.secagg import SecAggConfig


def _round(updates, config, rotation_seed):
    previous = torch.stack(updates).mean(0).numpy()
    grid = config.scale_rule().grid(updates[0].numel(), len(updates), rotation_seed, previous)
    total = sum(encode_update(u, grid, 50 + i).values.astype(np.int64) for i, u in enumerate(updates)) % grid.modulus
    return grid, decode_sum(total.astype(np.uint32), grid, [50 + i for i in range(len(updates))],
                            len(updates) * WEIGHT_SCALE).double()  # fmt: skip


def test_every_client_sends_the_same_subset_and_the_wire_shrinks():
    grid = SecAggConfig(bits=2, clip=1.0, keep=0.25).scale_rule().grid(3000, 10, 7)
    assert grid.padded_numel == 3072 and grid.sent_numel == 768 == len(set(grid.kept_indices()))
    assert np.array_equal(grid.kept_indices(), SumGrid.from_config(grid.to_config("g."), "g.").kept_indices())
    other = SecAggConfig(bits=2, clip=1.0, keep=0.25).scale_rule().grid(3000, 10, 8)
    assert not np.array_equal(grid.kept_indices(), other.kept_indices())  # a fresh subset every round
    enc = encode_update(torch.ones(3000) * 0.01, grid, 3)
    assert enc.values.shape == (768,)


def test_the_subsampled_mean_is_unbiased_with_the_predicted_spread():
    """Over 200 rounds (subsets), the decoded mean's average converges on the true mean, and its error
    energy is (1 / keep - 1) times the mean's energy on average (plus the rounding's)."""
    rng = np.random.default_rng(0)
    common = rng.standard_normal(600) * 0.05
    updates = [torch.tensor(common + 0.02 * rng.standard_normal(600), dtype=torch.float32) for _ in range(8)]
    true = torch.stack(updates).mean(0).double()
    keep = 0.3
    config = SecAggConfig(bits=6, clip=10.0, keep=keep)
    decoded = torch.stack([_round(updates, config, seed)[1] for seed in range(200)])
    errors = ((decoded - true) ** 2).sum(1) / (true**2).sum()
    assert abs(float(errors.mean()) - (1 / keep - 1)) < 0.25 * (1 / keep - 1)
    bias = decoded.mean(0) - true  # each coordinate: mean of 200 draws with relative variance ~2.3
    assert float((bias**2).sum() / (true**2).sum()) < 5 * (1 / keep - 1) / 200


def test_keep_one_is_the_full_codec():
    rng = np.random.default_rng(1)
    updates = [torch.tensor(rng.standard_normal(700) * 0.01, dtype=torch.float32) for _ in range(5)]
    full = _round(updates, SecAggConfig(bits=3, clip=1.0), 4)
    same = _round(updates, SecAggConfig(bits=3, clip=1.0, keep=1.0), 4)
    assert full[0] == same[0] and torch.equal(full[1], same[1])


@pytest.mark.parametrize("keep", [0.0, 1.5, 1, 1e-4])
def test_bad_keep_is_refused(keep):
    with pytest.raises(ValueError, match="keep"):
        SecAggConfig(keep=keep)
