"""The size model: every codec predicts its payload bytes without encoding (exact for fixed width)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedquant.codecs import available_codecs, codec_class, get_codec
from fedquant.codecs.coders.symbols import omega_bits, omega_bits_bound, stream_bytes
from fedquant.wire.elias import code_s_dense_encode, code_s_encode
from fedquant.wire.entropy import entropy_encode
from tests.helpers import EF_REFUSED

SHAPES = [(0,), (1,), (10,), (511,), (1000,), (37, 53), (3, 4096)]
SPECS = [
    prefix + (name if coding is None else f"{name}:coding={coding}")
    for name in available_codecs()
    for coding in (codec_class(name).codings or (None,))
    for prefix in ("", "rht+", "ef+rht:max_log2=12+")
    if not (prefix.startswith("ef+") and name in EF_REFUSED)
] + ["eden:bits=1.5", "eden:bits=0.5", "qsgd:levels=3,bucket_size=0", "dqsg:levels=2,bucket_size=64,coding=entropy"]


def _data(kind: str, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if kind == "heavy":  # Student-t(2): a few huge values, many near zero
        x = x / torch.empty(shape).exponential_(generator=gen).sqrt()
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=gen) < 0.05)
    return x


#: How far an estimating size model (ECDQ's entropy coding) may be off: on Gaussian data, and on
#: any data (a heavy tail that the rotation leaves widens the index range).
ESTIMATE_GAUSSIAN = (0.8, 1.25)
ESTIMATE_ANY = (0.5, 2.0)


def _estimate_holds(codec, shape, kind: str, actual: int, predicted: int) -> bool:
    """ECDQ's estimate: at fixed width, Gaussian data land within one bit per coordinate (the median
    index range sits at the edge of a power of two at some sizes); otherwise within the ratios above."""
    if codec.quantizer.coding == "fixed" and kind == "gauss":
        n = math.prod(shape)
        for t in codec.wire_transforms:
            n = t.output_numel(n)
        return abs(actual - predicted) <= -(-(n + 7) // 8)  # a bit per coordinate (E8: per padded one)
    low, high = ESTIMATE_GAUSSIAN if kind == "gauss" else ESTIMATE_ANY
    return low <= actual / predicted <= high


@pytest.mark.parametrize("spec", SPECS)
def test_prediction_is_exact_for_fixed_width_and_an_upper_bound_otherwise(spec):
    codec = get_codec(spec)
    model = codec.quantizer.size_model
    assert model == ("exact" if getattr(codec.quantizer, "coding", "fixed") == "fixed" else "bound") or (
        codec.quantizer.name == "ecdq" and model == "estimate"
    )
    for shape in SHAPES:
        predicted = codec.predict_bytes(shape)
        for seed, kind in enumerate(("gauss", "heavy", "sparse")):
            x = _data(kind, shape, seed)
            actual = len(codec.encode(x, seed))
            if model == "exact":
                assert predicted == actual, (shape, kind)
            elif model == "bound":
                assert actual <= predicted, (shape, kind, actual, predicted)
            else:
                assert _estimate_holds(codec, shape, kind, actual, predicted), (shape, kind, actual, predicted)
    assert codec.predict_bytes(1000) == codec.predict_bytes((1000,))
    assert codec.predict_bytes((4, 250), torch.float16) == codec.predict_bytes((4, 250))  # the dtype is one byte


def _rng_symbols(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(0, k, n)
    if kind == "one":
        return np.full(n, k - 1)
    if kind == "two-skewed":
        return np.where(rng.random(n) < 0.999, 0, k - 1)
    if kind == "rare-tail":  # every symbol present, all but one rare: the widest table
        out = np.zeros(n, np.int64)
        out[: min(k, n)] = np.arange(min(k, n))
        return rng.permutation(out)
    raise ValueError(kind)


@pytest.mark.parametrize("k", [2, 3, 7, 33, 256, 4097])
@pytest.mark.parametrize("n", [1, 5, 1000, 70_000])
def test_entropy_stream_bound_holds_for_any_distribution(k, n):
    rng = np.random.default_rng(k * 7 + n)
    for kind in ("uniform", "one", "two-skewed", "rare-tail"):
        symbols = _rng_symbols(kind, n, k, rng) % k
        assert len(entropy_encode(symbols, k)) <= stream_bytes(n, k, "entropy"), kind
    # Uniform symbols over all of a power-of-two alphabet cost close to the bound (it is tight).
    if n >= 1000 and k in (2, 256):
        uniform = len(entropy_encode(rng.integers(0, k, n), k))
        assert uniform >= 0.85 * stream_bytes(n, k, "entropy")


@pytest.mark.parametrize("half", [1, 3, 16, 1000])
def test_elias_stream_bound_is_the_worst_case(half):
    n = 999
    worst = np.full(n, half, np.int64) * np.where(np.arange(n) % 2, 1, -1)  # every level at +-h: dense, longest
    dense, _ = code_s_dense_encode(worst)
    sparse, _ = code_s_encode(worst)
    assert 1 + len(dense) == stream_bytes(n, 2 * half + 1, "elias")  # the bound counts the longest dense stream
    assert 1 + min(len(dense), len(sparse)) <= stream_bytes(n, 2 * half + 1, "elias")
    rng = np.random.default_rng(half)
    levels = rng.integers(-half, half + 1, n)
    assert 1 + min(len(code_s_dense_encode(levels)[0]), len(code_s_encode(levels)[0])) <= stream_bytes(
        n, 2 * half + 1, "elias"
    )


def test_the_concave_omega_bound_is_above_every_codeword_length():
    values = [*range(1, 200_000), *(2**e + d for e in range(18, 64) for d in (-1, 0, 1))]
    lengths = np.array([omega_bits(v) for v in values], np.float64)
    assert (omega_bits_bound(np.array(values, np.float64)) >= lengths).all()
