"""Symbol histograms counted in the quantizer's own pass and handed to the entropy coder."""

import numpy as np
import pytest
import torch

from fedquant.codecs import get_codec
from fedquant.codecs.coders import symbols as coders
from fedquant.codecs.kernels.common import PARALLEL_MIN
from fedquant.wire import entropy
from tests.helpers import sample_tensor

ENTROPY_SPECS = [
    "qsgd:coding=entropy",
    "qsgd:levels=300,bucket_size=1000,coding=entropy",
    "terngrad:coding=entropy",
    "signsgd:coding=entropy",
    "orq:levels=9,coding=entropy",
    "linear:levels=5,coding=entropy",
    "bingrad-b:coding=entropy",
    "bingrad-pb:coding=entropy",
    "dqsg:levels=2,coding=entropy",
    "ndqsg:rho=5,coding=entropy",
    "eden:bits=2,coding=entropy",
    "rht+dqsg:levels=2,coding=entropy",
]


@pytest.fixture
def counting_coder(monkeypatch):
    """An ``entropy_encode`` that takes ``counts=`` (as the interleaved coder does) and records them."""
    plain = entropy.entropy_encode
    seen = []

    def encode(symbols, num_symbols, counts=None):
        seen.append((np.asarray(symbols).copy(), num_symbols, counts))
        return plain(symbols, num_symbols)

    monkeypatch.setattr(entropy, "entropy_encode", encode)
    coders.coder_takes_counts.cache_clear()
    yield seen
    coders.coder_takes_counts.cache_clear()


@pytest.mark.parametrize("spec", ENTROPY_SPECS)
@pytest.mark.parametrize("n", [1, 1000, PARALLEL_MIN + 4099])
def test_kernels_count_the_symbols_they_send(spec, n, counting_coder):
    codec = get_codec(spec)
    x = sample_tensor((n,), seed=n)
    plain = get_codec(spec)
    plain.force_torch = True  # the torch path counts nothing: the coder counts itself
    payload = codec.encode(x, seed=3)
    assert len(counting_coder) == 1
    symbols, k, counts = counting_coder[0]
    assert counts is not None and counts.dtype == np.int64 and counts.shape == (k,)
    assert np.array_equal(counts, np.bincount(symbols.astype(np.int64), minlength=k))
    assert payload == plain.encode(x, seed=3)  # the counts change nothing on the wire
    assert counting_coder[1][2] is None


def test_counts_are_not_passed_to_a_coder_without_the_argument(monkeypatch):
    plain = entropy.entropy_encode
    calls = []

    def encode(symbols, num_symbols):  # an older coder: a counts= keyword would raise TypeError
        calls.append(num_symbols)
        return plain(symbols, num_symbols)

    monkeypatch.setattr(entropy, "entropy_encode", encode)
    coders.coder_takes_counts.cache_clear()
    try:
        codec = get_codec("qsgd:coding=entropy")
        assert not codec.quantizer.wants_counts()
        x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
        payload = codec.encode(x, seed=1)
        assert calls == [33] and codec.decode(payload, seed=1).shape == x.shape
    finally:
        coders.coder_takes_counts.cache_clear()
