"""Models: output shapes on every dataset geometry, seeded initialisation, sizes."""

from __future__ import annotations

import pytest
import torch

from simulations.models import MODEL_NAMES, build_model


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize(("shape", "classes"), [((1, 8, 8), 10), ((1, 28, 28), 62), ((3, 32, 32), 100)])
def test_forward_shapes(name, shape, classes):
    model = build_model(name, shape, classes)
    out = model(torch.zeros(2, *shape))
    assert out.shape == (2, classes) and torch.isfinite(out).all()


def test_same_seed_same_weights_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    a = build_model("cnn", (1, 8, 8), 10, seed=3).state_dict()
    b = build_model("cnn", (1, 8, 8), 10, seed=3).state_dict()
    c = build_model("cnn", (1, 8, 8), 10, seed=4).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_known_sizes():
    # ResNet-20 for CIFAR-10 has 0.27 M parameters (He et al. 2016, Table 6); LeNet-5 on 28x28
    # inputs: conv 6@5x5, conv 16@5x5, dense 256->120->10.
    assert _numel(build_model("resnet20", (3, 32, 32), 10)) == 272_474
    assert _numel(build_model("resnet18", (3, 32, 32), 10)) == 11_173_962  # the CIFAR ResNet-18
    lenet = (6 * 25 + 6) + (16 * 6 * 25 + 16) + (16 * 4 * 4 * 120 + 120) + (120 * 10 + 10)
    assert _numel(build_model("cnn", (1, 28, 28), 10)) == lenet


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg", (1, 8, 8), 10)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_model_dtype_option_builds_trains_and_evaluates_in_that_dtype(dtype):
    from simulations.data import TensorData
    from simulations.task import evaluate, train

    model = build_model(f"cnn:dtype={dtype}", (1, 8, 8), 10)
    assert {p.dtype for p in model.state_dict().values()} == {getattr(torch, dtype)}
    gen = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(32, 1, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen), 10)
    loss = train(model, data, epochs=1, batch_size=16, lr=0.05, seed=0)
    assert torch.isfinite(torch.tensor(loss)) and next(model.parameters()).dtype == getattr(torch, dtype)
    assert torch.isfinite(torch.tensor(evaluate(model, data)[0]))


@pytest.mark.parametrize("spec", ["cnn:dtype=bfloat16", "cnn:width=2", "cnn:dtype"])
def test_bad_model_options(spec):
    with pytest.raises(ValueError, match="dtype=float16"):
        build_model(spec, (1, 8, 8), 10)
