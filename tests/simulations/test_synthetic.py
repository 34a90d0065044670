"""Synthetic(alpha, beta): determinism, the generative model's statistics, LEAF's sizes, cost per client.

Statistical bounds are 5 standard deviations of the estimator under the generative model (fixed
seeds, so a pass is reproducible; a wrong variance or size law misses by far more).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from simulations import synthetic
from simulations.data import check_dataset_name, load_partition, load_test_set
from simulations.models import build_model
from simulations.settings import SimSettings
from simulations.synthetic import SyntheticSpec, client_data, num_samples, parse_spec

SPEC = SyntheticSpec()


def _phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def test_names_and_options():
    assert parse_spec("synthetic") == SyntheticSpec(1.0, 1.0, 0)
    assert parse_spec("synthetic:alpha=0.5,beta=0.5") == SyntheticSpec(0.5, 0.5, 0)
    assert parse_spec("synthetic: beta=0 , seed=7") == SyntheticSpec(1.0, 0.0, 7)
    check_dataset_name("synthetic:alpha=0,beta=0")
    assert SimSettings(dataset="synthetic:alpha=0.5", model="logreg").dataset == "synthetic:alpha=0.5"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("synthetic:gamma=1", "use alpha"),
        ("synthetic:alpha", "use alpha"),
        ("synthetic:alpha=x", "not a float"),
        ("synthetic:alpha=-1", "alpha must be"),
        ("synthetic:beta=nan", "beta must be"),
        ("synthetic:alpha=1,alpha=2", "twice"),
        ("synthetic:seed=1.5", "not a int"),
        ("synthetic:seed=-1", "seed must be"),
        ("synthetics", "unknown dataset"),
    ],
)
def test_bad_names_raise(name, message):
    with pytest.raises(ValueError, match=message):
        check_dataset_name(name)


def test_a_client_is_a_function_of_the_population_seed_and_its_id():
    a = load_partition("synthetic", 5, 10)
    synthetic.client_data.cache_clear()
    b = load_partition("synthetic", 5, 10**9, "dirichlet", 0.1, seed=3)  # run seed and partitioning do not apply
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert a.x.dtype == torch.float32 and a.y.dtype == torch.int64 and a.x.shape[1] == 60
    other_client = load_partition("synthetic", 6, 10)
    other_population = load_partition("synthetic:seed=1", 5, 10)
    assert not torch.equal(other_client.x[:1], a.x[:1])
    assert not torch.equal(other_population.x[:1], a.x[:1])
    # The tensors handed out are copies: changing one does not change the cached client.
    a.x.zero_()
    assert torch.equal(load_partition("synthetic", 5, 10).x, b.x)


def test_one_client_costs_one_client(monkeypatch):
    # A client's data comes from its own stream only: generating the last of a billion clients
    # draws that one stream (no list, permutation or array over the clients).
    drawn: list[tuple[int, int]] = []
    real = synthetic._generator

    def spy(seed: int, partition_id: int) -> np.random.Generator:
        drawn.append((seed, partition_id))
        return real(seed, partition_id)

    monkeypatch.setattr(synthetic, "_generator", spy)
    synthetic.client_data.cache_clear()
    data = load_partition("synthetic:seed=2", 10**9 - 1, 10**9)
    assert drawn == [(2, 10**9 - 1)]
    assert 0 < len(data) <= synthetic.MAX_SAMPLES


def test_sizes_follow_leafs_lognormal():
    # LEAF: n = min(floor(L) + 5, 1000), L ~ lognormal(3, 2): P(n >= 5 + k) = P(L >= k) for integer k.
    n = np.array([num_samples(SPEC, pid) for pid in range(4000)])
    assert n.min() >= synthetic.MIN_SAMPLES and n.max() == synthetic.MAX_SAMPLES
    for k in (1, 20, 100, 995):
        p = 1 - _phi((math.log(k) - 3) / 2)
        observed = float(np.mean(n >= 5 + k))
        assert abs(observed - p) <= 5 * math.sqrt(p * (1 - p) / len(n)), (k, observed, p)
    assert [len(client_data(SPEC, pid)[1]) for pid in range(20)] == n[:20].tolist()


def _clients(spec: SyntheticSpec, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [client_data(spec, pid) for pid in range(count)]


def test_within_client_feature_variance_is_sigma():
    # Pooled within-client variance of feature j: Sigma_jj * chi2(df) / df, df = sum(n_k - 1);
    # its relative standard deviation is sqrt(2 / df).
    clients = _clients(SPEC, 300)
    sq = sum(((x - x.mean(0)) ** 2).sum(0, dtype=np.float64) for x, _ in clients)
    df = sum(len(x) - 1 for x, _ in clients)
    ratio = sq / df / synthetic.feature_variances()
    assert np.all(np.abs(ratio - 1) <= 5 * math.sqrt(2 / df)), ratio


@pytest.mark.parametrize("beta", [0.0, 2.0])
def test_beta_spreads_the_clients_feature_means(beta):
    # Average over features of a client's sample mean: B_k + mean_j(v_kj - B_k) + noise, so across
    # clients its variance is beta^2 + 1/60 + E[sum_j Sigma_jj / (60^2 n_k)] (the last < 3e-4).
    clients = _clients(SyntheticSpec(alpha=1.0, beta=beta), 400)
    means = np.array([x.mean(dtype=np.float64) for x, _ in clients])
    expected = beta**2 + 1 / 60
    noise = float(np.mean([synthetic.feature_variances().sum() / (3600 * len(x)) for x, _ in clients]))
    observed = float(means.var(ddof=1))
    assert abs(observed - expected - noise) <= 5 * math.sqrt(2 / (len(means) - 1)) * (expected + noise)


def test_labels_come_from_each_clients_own_teacher():
    # Every client's labels are a linear-softmax function of its features: a logistic regression
    # fitted on one client's train split separates it; one fitted on another client does not.
    # (Clients often see only 1-5 classes; take the first two with 200+ examples of 3+ classes.)
    rich = [pid for pid in range(100) if len(client_data(SPEC, pid)[1]) >= 200]
    rich = [pid for pid in rich if len(np.unique(client_data(SPEC, pid)[1])) >= 3][:2]
    (x0, y0), (x1, y1) = ((torch.from_numpy(np.array(a)) for a in client_data(SPEC, pid)) for pid in rich)

    def fit(x, y):
        model = build_model("logreg", (60,), 10)
        opt = torch.optim.LBFGS(model.parameters(), max_iter=100, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        return model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny problem: more threads only contend on a shared machine
    try:
        own = (fit(x0, y0)(x0).argmax(1) == y0).float().mean()
        other = (fit(x1, y1)(x0).argmax(1) == y0).float().mean()
    finally:
        torch.set_num_threads(threads)
    assert own >= 0.95
    assert other < own - 0.2


def test_alpha_does_not_change_labels():
    # A property of the generative model (FedProx's code): u_k shifts every class's logit by the
    # same u_k * (sum_j x_j + 1), so the argmax, hence every label, is the same for any alpha.
    for pid in range(30):
        _, y_small = client_data(SyntheticSpec(alpha=0.0), pid)
        _, y_large = client_data(SyntheticSpec(alpha=5.0), pid)
        assert np.mean(y_small == y_large) >= 0.99


def test_server_test_set_pools_the_held_out_tenth_of_clients_0_to_99():
    test = load_test_set("synthetic")
    sizes = [num_samples(SPEC, pid) for pid in range(synthetic.TEST_CLIENTS)]
    assert len(test) == sum(n - int(0.9 * n) for n in sizes)
    x3, y3 = client_data(SPEC, 3)
    cut = int(0.9 * len(y3))
    start = sum(n - int(0.9 * n) for n in sizes[:3])
    assert torch.equal(test.x[start : start + len(y3) - cut], torch.from_numpy(np.array(x3[cut:])))
    train = load_partition("synthetic", 3, 10)
    assert len(train) == cut
    assert not {r.tobytes() for r in train.x.numpy()} & {r.tobytes() for r in test.x.numpy()}


def test_models_for_feature_vectors():
    assert build_model("logreg", (60,), 10)(torch.zeros(3, 60)).shape == (3, 10)
    assert sum(p.numel() for p in build_model("logreg", (60,), 10).parameters()) == 60 * 10 + 10
    assert build_model("mlp", (60,), 10)(torch.zeros(3, 60)).shape == (3, 10)
    with pytest.raises(ValueError, match="needs images"):
        build_model("cnn", (60,), 10)
