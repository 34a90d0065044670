"""Entropy coding of indices: round trips, size against the empirical entropy, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from fedquant.errors import PayloadError
from fedquant.wire.elias import elias_omega_encode, elias_omega_lengths
from fedquant.wire.entropy import PRECISION, empirical_entropy_bits, entropy_decode, entropy_encode, quantize_counts


def gaussian_indices(n: int, num_symbols: int, seed: int, spread: float = 6.0) -> np.ndarray:
    """Uniform quantization of a standard Gaussian over +-3 sigma into num_symbols bins (edges clipped)."""
    x = np.random.default_rng(seed).standard_normal(n)
    idx = np.floor((x / spread + 0.5) * num_symbols)
    return np.clip(idx, 0, num_symbols - 1).astype(np.uint16 if num_symbols > 256 else np.uint8)


def skewed_indices(n: int, num_symbols: int, seed: int) -> np.ndarray:
    """Geometric-like indices: P(i) ~ 2^-3i, so most mass sits on 0 and the entropy is low."""
    g = np.random.default_rng(seed).geometric(1 - 2**-3, n) - 1
    return np.minimum(g, num_symbols - 1).astype(np.uint16 if num_symbols > 256 else np.uint8)


def table_bits(symbols: np.ndarray, num_symbols: int) -> int:
    """Bits of the count table as documented in fedquant.wire.entropy (k, then gap/count pairs)."""
    counts = np.bincount(symbols.astype(np.int64), minlength=num_symbols)
    present = np.flatnonzero(counts)
    gaps = np.diff(present, prepend=-1)
    return int(
        elias_omega_lengths(np.array([present.size])).sum()
        + elias_omega_lengths(gaps).sum()
        + elias_omega_lengths(counts[present]).sum()
    )


CASES = {
    "binary-balanced": (np.random.default_rng(1).integers(0, 2, 5000), 2),
    "qsgd-s4-levels": (gaussian_indices(20000, 9, 2, spread=4.0), 9),
    "uniform-256": (np.random.default_rng(3).integers(0, 256, 20000), 256),
    "gaussian-257": (gaussian_indices(20000, 257, 4), 257),
    "gaussian-4096": (gaussian_indices(50000, 4096, 5), 4096),
    "gaussian-65536": (gaussian_indices(50000, 65536, 6), 65536),
    "skewed-16": (skewed_indices(30000, 16, 7), 16),
    "two-far-symbols": (np.where(np.random.default_rng(8).random(3000) < 0.3, 65535, 0), 65536),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip(case):
    symbols, num_symbols = CASES[case]
    data = entropy_encode(symbols, num_symbols)
    assert data.dtype == np.uint8
    out = entropy_decode(data, symbols.size, num_symbols)
    assert out.dtype == (np.uint8 if num_symbols <= 256 else np.uint16)
    np.testing.assert_array_equal(out, symbols)
    np.testing.assert_array_equal(entropy_decode(bytes(data), symbols.size, num_symbols), symbols)


@pytest.mark.parametrize(
    ("name", "symbols", "num_symbols"),
    [
        ("gaussian-16", gaussian_indices(100_000, 16, 11), 16),
        ("gaussian-256", gaussian_indices(100_000, 256, 12), 256),
        ("gaussian-4096", gaussian_indices(100_000, 4096, 13), 4096),
        ("skewed-4096", skewed_indices(100_000, 4096, 14), 4096),
        ("very-skewed-2", (np.random.default_rng(15).random(100_000) < 0.002).astype(np.uint8), 2),
    ],
)
def test_size_close_to_empirical_entropy(name, symbols, num_symbols):
    entropy = empirical_entropy_bits(symbols, num_symbols)
    table = table_bits(symbols, num_symbols)
    data = entropy_encode(symbols, num_symbols)
    size_bits = 8 * data.size
    # Requirement: within 5% of n*H plus a constant (the count table and the coder's final state).
    assert size_bits <= 1.05 * entropy + table + 128, (name, size_bits, entropy, table)
    # What rANS with the empirical model (quantized to 24-bit frequencies) really achieves: the
    # words stay within 0.1% + 96 bits of n*H (the final state is two 32-bit words).
    coded_bits = size_bits - 8 * ((table + 7) // 8)
    assert coded_bits <= 1.001 * entropy + 96, (name, coded_bits, entropy)
    # and never below the information content (a lossless code cannot beat n*H by more than the state)
    assert coded_bits >= entropy - 64


def test_absent_symbols_cost_nothing():
    symbols = gaussian_indices(20000, 16, 21)
    small = entropy_encode(symbols, 16)
    # The same data declared over a 65536-symbol alphabet: only the table's first gap may differ.
    large = entropy_encode(symbols.astype(np.uint16), 65536)
    assert abs(large.size - small.size) <= 1
    np.testing.assert_array_equal(entropy_decode(large, symbols.size, 65536), symbols)


def test_empirical_entropy_bits():
    assert empirical_entropy_bits(np.array([0, 1, 0, 1]), 2) == pytest.approx(4.0)
    assert empirical_entropy_bits(np.array([3, 3, 3]), 4) == 0.0
    assert empirical_entropy_bits(np.zeros(0, np.uint8), 4) == 0.0
    # counts 4, 1, 1, 2 out of 8: n*H = -8 * sum(p log2 p) = 4*1 + 1*3 + 1*3 + 2*2 = 14 bits
    s = np.array([0, 0, 0, 0, 1, 2, 3, 3])
    p = np.array([4, 1, 1, 2]) / 8
    assert empirical_entropy_bits(s, 4) == pytest.approx(-8 * (p * np.log2(p)).sum())
    assert empirical_entropy_bits(s, 4) == pytest.approx(14.0)


def test_single_symbol_and_empty_inputs():
    for num_symbols, value in ((1, 0), (2, 1), (4096, 4000), (65536, 65535)):
        symbols = np.full(1_000_000, value, np.uint16 if num_symbols > 256 else np.uint8)
        data = entropy_encode(symbols, num_symbols)
        assert data.size <= 8  # the table only: k=1, the symbol, the count
        np.testing.assert_array_equal(entropy_decode(data, symbols.size, num_symbols), symbols)
    empty = entropy_encode(np.zeros(0, np.uint8), 7)
    assert empty.size == 0
    assert entropy_decode(empty, 0, 7).size == 0
    one = entropy_encode(np.array([5]), 7)
    np.testing.assert_array_equal(entropy_decode(one, 1, 7), [5])


def test_encode_validates_input():
    with pytest.raises(ValueError, match="0..3"):
        entropy_encode(np.array([0, 4]), 4)
    with pytest.raises(ValueError, match="0..3"):
        entropy_encode(np.array([-1, 2]), 4)
    with pytest.raises(ValueError, match="integers"):
        entropy_encode(np.array([0.5]), 4)
    with pytest.raises(ValueError, match="num_symbols"):
        entropy_encode(np.array([0]), 0)
    with pytest.raises(ValueError, match="num_symbols"):
        entropy_encode(np.array([0]), 65537)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture(scope="module")
def coded():
    symbols = gaussian_indices(5000, 64, 31)
    return symbols, entropy_encode(symbols, 64)


def test_truncated_and_extended(coded):
    symbols, data = coded
    n = symbols.size
    for bad in (data[:-1], data[:-4], data[:-5], data[:10], data[:1], data[:0]):
        with pytest.raises(PayloadError):
            entropy_decode(bad, n, 64)
    for extra in ([0], [0, 0, 0, 0], [1, 0, 0, 0], [0xFF] * 8):
        with pytest.raises(PayloadError):
            entropy_decode(np.append(data, np.array(extra, np.uint8)), n, 64)


def test_wrong_count_or_alphabet(coded):
    symbols, data = coded
    with pytest.raises(PayloadError, match="sum to"):
        entropy_decode(data, symbols.size + 1, 64)
    with pytest.raises(PayloadError, match="sum to"):
        entropy_decode(data, symbols.size - 1, 64)
    with pytest.raises(PayloadError, match="alphabet|beyond"):
        entropy_decode(data, symbols.size, int(symbols.max()))
    with pytest.raises(PayloadError):
        entropy_decode(np.zeros(3, np.uint8), 0, 64)


def test_declared_huge_counts_fail_without_big_allocation():
    # A forged table: two symbols with 5e8 occurrences each, followed by a few bytes. Decoding
    # would allocate gigabytes; the information bound rejects it first.
    header, _ = elias_omega_encode(np.array([2, 1, 500_000_000, 1, 500_000_000]))
    forged = np.concatenate([header, np.array([1, 2, 3, 4, 5, 0, 0, 1], np.uint8)])
    with pytest.raises(PayloadError, match="too short"):
        entropy_decode(forged, 1_000_000_000, 2)
    # A table claiming more distinct symbols than the alphabet or the count allows.
    header, _ = elias_omega_encode(np.array([100, 1, 1]))
    with pytest.raises(PayloadError, match="beyond the allowed maximum"):
        entropy_decode(header, 10, 64)
    with pytest.raises(PayloadError):
        entropy_decode(np.array([0xFF] * 4, np.uint8), 10**11, 65536)


def test_random_garbage(coded):
    symbols, _ = coded
    rng = np.random.default_rng(41)
    for _ in range(300):
        garbage = rng.integers(0, 256, int(rng.integers(0, 2000)), dtype=np.uint8)
        with pytest.raises(PayloadError):
            entropy_decode(garbage, symbols.size, 64)


def test_bit_flips_are_rejected_or_change_nothing_silently(coded):
    symbols, data = coded
    rng = np.random.default_rng(43)
    rejected = 0
    for bit in rng.choice(8 * data.size, 300, replace=False):
        bad = data.copy()
        bad[bit // 8] ^= np.uint8(0x80 >> (bit % 8))
        try:
            out = entropy_decode(bad, symbols.size, 64)
        except PayloadError:
            rejected += 1
            continue
        # A flip that survives every check decodes to symbols with exactly the declared counts.
        assert out.size == symbols.size and out.max() < 64
    # The count check after decoding catches nearly every corruption of the rANS words.
    assert rejected >= 290


@pytest.mark.parametrize(
    "counts",
    [
        np.array([1, 1]),
        np.array([1, 2**38 - 1]),
        np.ones(65536, np.int64),
        np.concatenate([np.ones(65535, np.int64), [10**9]]),  # floors of 0 bumped to 1: overshoot
        np.concatenate([np.full(40000, 3, np.int64), [7, 2**20]]),
        np.random.default_rng(51).integers(1, 10**6, 4096),
    ],
)
def test_quantized_frequencies_are_a_valid_model(counts):
    freq = quantize_counts(counts, int(counts.sum()))
    assert freq.dtype == np.int64 and freq.size == counts.size
    assert int(freq.sum()) == 2**PRECISION
    assert freq.min() >= 1
    # close to proportional where counts are large enough to matter
    big = counts * 2**PRECISION >= 1000 * counts.sum()
    expected = counts[big] * 2**PRECISION / counts.sum()
    assert np.all(np.abs(freq[big] - expected) <= 0.01 * expected + counts.size)


def test_rare_symbols_in_a_large_alphabet_round_trip():
    # 65535 symbols seen once next to one symbol seen a million times: every frequency is 1 but one.
    rng = np.random.default_rng(52)
    symbols = np.concatenate([np.arange(65535, dtype=np.uint16), np.full(1_000_000, 65535, np.uint16)])
    rng.shuffle(symbols)
    data = entropy_encode(symbols, 65536)
    np.testing.assert_array_equal(entropy_decode(data, symbols.size, 65536), symbols)
