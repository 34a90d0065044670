"""Entropy coding of indices: round trips, layouts, size against the empirical entropy, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedquant.errors import PayloadError
from fedquant.wire import rans
from fedquant.wire.elias import elias_omega_encode, elias_omega_lengths
from fedquant.wire.entropy import (
    MAX_PRECISION,
    Layout,
    choose_layout,
    empirical_entropy_bits,
    encode_section,
    entropy_decode,
    entropy_encode,
    entropy_encode_runs,
    quantize_counts,
    symbol_counts,
)


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


def section_layout(data: np.ndarray, symbols: np.ndarray, num_symbols: int) -> Layout:
    """The layout a coded stream declares (the two header bytes after the table, then the block size)."""
    at = (table_bits(symbols, num_symbols) + 7) // 8
    flags, lanes_log2 = int(data[at]), int(data[at + 1])
    block = int(data[at + 2]) if flags & 0x80 else None
    return Layout((flags & 0x1F) + 1, 1 << lanes_log2, block, "rans32" if flags & 0x20 else "rans64")


def forced(symbols: np.ndarray, num_symbols: int, layout: Layout) -> np.ndarray:
    """``symbols`` coded with a layout of the test's choosing."""
    counts = np.bincount(symbols.astype(np.int64), minlength=num_symbols)
    present = np.flatnonzero(counts)
    freq = quantize_counts(counts[present], symbols.size, layout.precision)
    gaps = np.diff(present, prepend=-1)
    table = np.empty(1 + 2 * present.size, np.int64)
    table[0], table[1::2], table[2::2] = present.size, gaps, counts[present]
    header, _ = elias_omega_encode(table)
    return encode_section(symbols, present, freq, layout, header)


CASES = {
    "binary-balanced": (np.random.default_rng(1).integers(0, 2, 5000), 2),
    "qsgd-s4-levels": (gaussian_indices(20000, 9, 2, spread=4.0), 9),
    "uniform-256": (np.random.default_rng(3).integers(0, 256, 20000), 256),
    "gaussian-257": (gaussian_indices(20000, 257, 4), 257),
    "gaussian-4096": (gaussian_indices(50000, 4096, 5), 4096),
    "gaussian-65536": (gaussian_indices(50000, 65536, 6), 65536),
    "skewed-16": (skewed_indices(30000, 16, 7), 16),
    "two-far-symbols": (np.where(np.random.default_rng(8).random(3000) < 0.3, 65535, 0), 65536),
    "many-lanes": (gaussian_indices(300_001, 9, 9, spread=4.0), 9),
    "several-blocks": (gaussian_indices(1_500_003, 9, 10, spread=4.0), 9),
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
    # from a buffer at an odd offset (the words are then not 4-byte aligned)
    shifted = np.frombuffer(b"\x00" + data.tobytes(), np.uint8)[1:]
    np.testing.assert_array_equal(entropy_decode(shifted, symbols.size, num_symbols), symbols)


def test_long_streams_use_many_lanes_and_blocks():
    s, k = CASES["many-lanes"]
    assert section_layout(entropy_encode(s, k), s, k) == Layout(12, 32, None, "rans32")
    s, k = CASES["several-blocks"]
    layout = section_layout(entropy_encode(s, k), s, k)
    assert layout.lanes == 32 and layout.block_log2 is not None and s.size > 1 << layout.block_log2
    small, k = CASES["qsgd-s4-levels"]
    assert section_layout(entropy_encode(small, k), small, k) == Layout(12, 1, None, "rans32")
    # Models above 12 bits: 64-bit states (8 lanes for long streams).
    s, k = CASES["gaussian-4096"]
    assert section_layout(entropy_encode(s, k), s, k).coder == "rans64"


def test_the_reused_word_buffer_never_leaks_into_a_returned_stream():
    """The encoder keeps its word buffer between calls (per thread): every returned stream must
    be its own bytes, unchanged by later encodes, in one thread and in several at once."""
    from concurrent.futures import ThreadPoolExecutor

    sizes = ((300_000, 33, 1), (20_000, 7, 2), (500_000, 300, 3))
    streams = [(gaussian_indices(n, k, seed), k) for n, k, seed in sizes]
    coded = [entropy_encode(s, k) for s, k in streams]
    kept = [bytes(c) for c in coded]
    again = [entropy_encode(s, k) for s, k in streams]  # reuses (and overwrites) the same buffer
    for (s, k), c, before, c2 in zip(streams, coded, kept, again, strict=True):
        assert bytes(c) == before == bytes(c2)
        assert np.array_equal(entropy_decode(c, s.size, k), s)
    with ThreadPoolExecutor(3) as pool:
        parallel = list(pool.map(lambda sk: entropy_encode(*sk), streams * 4))
    assert [bytes(c) for c in parallel] == kept * 4


LAYOUTS = [
    (coder, precision, lanes, block_log2, n)
    for coder, precisions, lane_counts in (
        ("rans64", (4, 12, 16, 17, 24), (1, 2, 4, 8)),
        ("rans32", (4, 12), (1, 2, 4, 8, 16, 32)),
    )
    for precision in precisions
    for lanes in lane_counts
    for block_log2, sizes in ((None, (2, 7, 8, 9, 33, 1024)), (10, (1025, 3 * 1024 + 5)))
    for n in sizes
]


@pytest.mark.parametrize(("coder", "precision", "lanes", "block_log2", "n"), LAYOUTS)
def test_every_layout_round_trips(coder, precision, lanes, block_log2, n):
    symbols = gaussian_indices(n, 9, n + precision, spread=4.0)
    symbols[:2] = (3, 5)  # at least two distinct symbols: a rANS section
    layout = Layout(precision, lanes, block_log2, coder)
    data = forced(symbols, 9, layout)
    assert section_layout(data, symbols, 9) == layout
    np.testing.assert_array_equal(entropy_decode(data, n, 9), symbols)
    # uint16 symbols (an alphabet above 256) take the one-at-a-time paths of every coder
    wide = forced(symbols.astype(np.uint16), 300, layout)
    np.testing.assert_array_equal(entropy_decode(wide, n, 300), symbols)


def test_layouts_a_coder_cannot_take_are_refused():
    symbols = gaussian_indices(1000, 9, 3, spread=4.0)
    for layout in (Layout(13, 32, None, "rans32"), Layout(12, 64, None, "rans32"), Layout(12, 16, None, "rans64"),
                   Layout(25, 1, None, "rans64"), Layout(12, 1, None, "rans16")):  # fmt: skip
        with pytest.raises(ValueError, match="layout"):
            forced(symbols, 9, layout)


def test_precision_follows_the_model_loss():
    n = 1_000_000
    # Near-uniform small alphabets: 12 bits round the model almost exactly.
    assert choose_layout(np.array([n // 2, n - n // 2]), n)[0].precision == 12
    # A symbol once in a million at 12 bits would cost ~n/4096 bits on the other one: more precision.
    assert choose_layout(np.array([n - 1, 1]), n)[0].precision > 12
    # 40000 distinct symbols: no 16-bit model holds them well.
    counts = np.full(40_000, 25)
    assert choose_layout(counts, int(counts.sum()))[0].precision == MAX_PRECISION
    # Short streams: a small table.
    assert choose_layout(np.array([30, 70]), 100)[0].precision < 12


@pytest.mark.parametrize(
    ("name", "symbols", "num_symbols"),
    [
        ("gaussian-16", gaussian_indices(100_000, 16, 11), 16),
        ("gaussian-256", gaussian_indices(100_000, 256, 12), 256),
        ("gaussian-4096", gaussian_indices(100_000, 4096, 13), 4096),
        ("skewed-4096", skewed_indices(100_000, 4096, 14), 4096),
        ("very-skewed-2", (np.random.default_rng(15).random(100_000) < 0.002).astype(np.uint8), 2),
        ("many-lanes-9", gaussian_indices(2_000_000, 9, 16, spread=4.0), 9),
        ("extremely-skewed-2", (np.random.default_rng(17).random(2_000_000) < 1e-4).astype(np.uint8), 2),
    ],
)
def test_size_close_to_empirical_entropy(name, symbols, num_symbols):
    entropy = empirical_entropy_bits(symbols, num_symbols)
    table = table_bits(symbols, num_symbols)
    data = entropy_encode(symbols, num_symbols)
    layout = section_layout(data, symbols, num_symbols)
    coded_bits = 8 * data.size - 8 * ((table + 7) // 8)
    # What rANS with the rounded model achieves: the rounding costs at most 0.1% (the encoder's
    # rule); the header bytes and each lane's final state (32 or 64 bits) come on top.
    overhead = 16 + (32 if layout.coder == "rans32" else 64) * layout.lanes
    assert coded_bits <= 1.001 * entropy + overhead + 64, (name, coded_bits, entropy, layout)
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
        entropy_encode(np.array([0, 4], np.uint8), 4)  # caught by the histogram pass
    with pytest.raises(ValueError, match="0..299"):
        entropy_encode(np.array([0, 300], np.uint16), 300)
    with pytest.raises(ValueError, match="0..3"):
        entropy_encode(np.array([-1, 2]), 4)
    with pytest.raises(ValueError, match="integers"):
        entropy_encode(np.array([0.5]), 4)
    with pytest.raises(ValueError, match="num_symbols"):
        entropy_encode(np.array([0]), 0)
    with pytest.raises(ValueError, match="num_symbols"):
        entropy_encode(np.array([0]), 65537)


# ---------------------------------------------------------------------------------------------
# Precomputed counts (a quantizer kernel's histogram)


@pytest.mark.parametrize("case", ["qsgd-s4-levels", "gaussian-4096", "many-lanes"])
def test_precomputed_counts_give_the_same_bytes(case):
    symbols, num_symbols = CASES[case]
    counts = np.bincount(symbols.astype(np.int64), minlength=num_symbols)
    np.testing.assert_array_equal(symbol_counts(symbols, num_symbols), counts)
    data = entropy_encode(symbols, num_symbols)
    np.testing.assert_array_equal(entropy_encode(symbols, num_symbols, counts=counts), data)
    np.testing.assert_array_equal(entropy_encode(symbols, num_symbols, counts=counts.astype(np.uint32)), data)


def test_wrong_counts_are_refused_or_decode_rejects_them():
    symbols = gaussian_indices(5000, 9, 61, spread=4.0)
    counts = np.bincount(symbols, minlength=9)
    with pytest.raises(ValueError, match="sum to"):
        entropy_encode(symbols, 9, counts=counts + 1)
    with pytest.raises(ValueError, match="9 integers"):
        entropy_encode(symbols, 9, counts=counts[:-1])
    with pytest.raises(ValueError, match="negative"):
        negative = counts.copy()
        negative[0], negative[1] = -1, negative[1] + negative[0] + 1
        entropy_encode(symbols, 9, counts=negative)
    absent = counts.copy()
    used = int(np.argmax(counts))
    absent[(used + 1) % 9] += absent[used]
    absent[used] = 0
    with pytest.raises(ValueError, match="absent"):
        entropy_encode(symbols, 9, counts=absent)
    with pytest.raises(ValueError, match="others"):
        entropy_encode(symbols, 9, counts=np.eye(9, dtype=np.int64)[used] * symbols.size)
    # symbols beyond the alphabet the caller's counts leave out: the encoder refuses them
    beyond = symbols.copy()
    beyond[7] = 200
    with pytest.raises(ValueError, match="absent|beyond"):
        entropy_encode(beyond, 9, counts=counts)
    # Counts that name every symbol but in the wrong amounts: valid rANS, but the table no
    # longer describes the data. Decoding returns the symbols or rejects the section; it never
    # returns other symbols.
    skew = counts.copy()
    skew[used] -= 100
    skew[(used + 1) % 9] += 100
    data = entropy_encode(symbols, 9, counts=skew)
    try:
        np.testing.assert_array_equal(entropy_decode(data, symbols.size, 9), symbols)
    except PayloadError:
        pass


@pytest.mark.parametrize("n", [10, 100_000, 3_000_001])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_histogram_kernel_counts_every_value(n, dtype):
    top = 256 if dtype == np.uint8 else 65536
    symbols = np.random.default_rng(n).integers(0, top, n).astype(dtype)
    symbols[: n // 3] = 7  # a long run of one value
    parts = max(1, n // (1 << 20))
    np.testing.assert_array_equal(rans.histogram(symbols, parts, top)[:top], np.bincount(symbols, minlength=top))
    # Tables sized by a smaller alphabet: the last entry counts the values beyond it.
    bins = 200 if dtype == np.uint8 else 1025
    counts = rans.histogram(symbols, parts, bins)
    expected = np.bincount(np.minimum(symbols, bins), minlength=bins + 1)
    np.testing.assert_array_equal(counts, expected)


def test_reciprocals_divide_exactly():
    rng = np.random.default_rng(71)
    for precision in (1, 2, 12, 16, 24):
        top = 1 << precision
        freq = np.unique(np.concatenate([[1, 2, 3, top // 2, top - 1], rng.integers(1, top, 40)]))
        freq = freq[(freq >= 1) & (freq < top)]  # a frequency of a model with at least two symbols
        table = rans.encoder_table(np.arange(freq.size), freq, freq.size, precision).reshape(-1, rans.ENC_ROW)
        for f, row in zip(freq.tolist(), table, strict=True):
            if f == 1:
                assert int(row[0]) == 2**64 - 1 and int(row[1]) >> 50 == 0
                continue
            shift = (f - 1).bit_length()
            assert int(row[0]) == ((1 << (shift + 63)) + f - 1) // f
            assert int(row[1]) >> 50 == shift - 1
            assert int(row[2]) == f << (63 - precision)


def test_rans32_reciprocals_divide_exactly():
    """The rans32 step ``x + bias + (x * rcp >> 32 >> shift) * (M - f)`` is ``(x // f) M + x % f + c``
    for every state below ``2**31``: at the top, at the last quotient steps below it and on random
    states, for both symbols of two-symbol models ``(f, M - f)`` over every frequency of small models
    and a sample of 12-bit ones (``f = 1`` included)."""
    rng = np.random.default_rng(72)
    for precision in (1, 2, 5, 12):
        top = 1 << precision
        freqs = range(1, top) if precision < 12 else [1, 2, 3, 2047, 2048, 2049, *rng.integers(4, top - 1, 60)]
        for f0 in freqs:
            freq = np.array([f0, top - f0], np.int64)
            table = rans.encoder_table32(np.arange(2), freq, 2, precision)
            for i, f in enumerate(freq.tolist()):
                rcp, k = int(table[i]) & 0xFFFFFFFF, int(table[i]) >> 32
                shift, cmpl, bias = (k >> 25) & 0xF, (k >> 13) & 0xFFF, k & 0x1FFF
                assert cmpl == top - f and k >> 31 == 0
                xs = [(1 << 31) - 1, 1 << 15, *(((1 << 31) // f) * f + d for d in (-2, -1)),
                      *rng.integers(1 << 15, 1 << 31, 50).tolist()]  # fmt: skip
                for x in xs:
                    q = (x * rcp) >> 32 >> shift
                    assert x + bias + q * cmpl == (x // f) * top + x % f + (0 if i == 0 else f0), (precision, f, x)


# ---------------------------------------------------------------------------------------------
# torch tensors (the CUDA path is a host round trip: the same bytes)


def test_torch_tensors_code_to_the_same_bytes():
    symbols, num_symbols = CASES["qsgd-s4-levels"]
    data = entropy_encode(symbols, num_symbols)
    as_tensor = torch.from_numpy(symbols.astype(np.int64))
    np.testing.assert_array_equal(entropy_encode(as_tensor, num_symbols), data)
    np.testing.assert_array_equal(symbol_counts(as_tensor, num_symbols), symbol_counts(symbols, num_symbols))


@pytest.mark.parametrize("case", ["qsgd-s4-levels", "gaussian-4096"])
def test_the_device_route_counts_on_the_device_and_codes_the_same_bytes(case, monkeypatch):
    """The CUDA route (range check and torch.bincount where the tensor is, then a host copy),
    run on CPU tensors: what the CUDA tests check on a GPU, minus the device."""
    import fedquant.wire.entropy as entropy

    monkeypatch.setattr(entropy, "_is_device_tensor", entropy._is_tensor)
    symbols, num_symbols = CASES[case]
    data = entropy_encode(symbols, num_symbols)
    tensor = torch.from_numpy(symbols.astype(np.int64))
    np.testing.assert_array_equal(
        entropy.symbol_counts(tensor, num_symbols), np.bincount(symbols, minlength=num_symbols)
    )
    np.testing.assert_array_equal(entropy.entropy_encode(tensor, num_symbols), data)
    counts = np.bincount(symbols, minlength=num_symbols)
    np.testing.assert_array_equal(entropy.entropy_encode(tensor, num_symbols, counts=counts), data)
    beyond = tensor.clone()
    beyond[3] = 257 if num_symbols <= 256 else num_symbols  # 257 would wrap to 1 in the uint8 host copy
    with pytest.raises(ValueError, match=f"0..{num_symbols - 1}"):
        entropy.entropy_encode(beyond, num_symbols, counts=counts)
    with pytest.raises(ValueError, match="integers"):
        entropy.symbol_counts(tensor.float(), num_symbols)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["qsgd-s4-levels", "gaussian-4096", "several-blocks"])
def test_cuda_tensors_code_to_the_same_bytes(case):
    symbols, num_symbols = CASES[case]
    data = entropy_encode(symbols, num_symbols)
    on_gpu = torch.from_numpy(symbols.astype(np.int64)).cuda()
    np.testing.assert_array_equal(symbol_counts(on_gpu, num_symbols), symbol_counts(symbols, num_symbols))
    np.testing.assert_array_equal(entropy_encode(on_gpu, num_symbols), data)
    np.testing.assert_array_equal(
        entropy_encode(on_gpu.to(torch.uint8 if num_symbols <= 256 else torch.int32), num_symbols), data
    )


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.fixture(scope="module")
def coded():
    symbols = gaussian_indices(5000, 64, 31)
    return symbols, entropy_encode(symbols, 64)


def _blocks(coder: str):
    symbols = gaussian_indices(4 * 1024 + 300, 9, 32, spread=4.0)
    return symbols, forced(symbols, 9, Layout(12, 32 if coder == "rans32" else 8, 10, coder))


@pytest.fixture(scope="module")
def coded_blocks():
    """A stream of 32 lanes in 5 blocks with a short last block (every kind of word in the format)."""
    return _blocks("rans32")


@pytest.fixture(scope="module")
def coded_blocks64():
    """The same in 8 lanes of 64-bit states."""
    return _blocks("rans64")


def test_truncated_and_extended(coded, coded_blocks, coded_blocks64):
    for (symbols, data), k in ((coded, 64), (coded_blocks, 9), (coded_blocks64, 9)):
        n = symbols.size
        for bad in (data[:-1], data[:-4], data[:-5], data[:10], data[:1], data[:0]):
            with pytest.raises(PayloadError):
                entropy_decode(bad, n, k)
        for extra in ([0], [0, 0, 0, 0], [1, 0, 0, 0], [0xFF] * 8):
            with pytest.raises(PayloadError):
                entropy_decode(np.append(data, np.array(extra, np.uint8)), n, k)


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


def _header_at(symbols, data, num_symbols) -> int:
    return (table_bits(symbols, num_symbols) + 7) // 8


@pytest.mark.parametrize("blocks", ["coded_blocks", "coded_blocks64"])
def test_invalid_headers_are_rejected(coded, blocks, request):
    symbols, data = coded
    at = _header_at(symbols, data, 64)
    assert data[at] & 0x20  # a rans32 section
    cases = {
        "precision": (0x1F, "precision 32"),  # rans64, P = 32 > 24
        "rans32 precision": (0x20 | 12, "rans32 section names precision 13"),  # rans32 models: P <= 12
        "precision for k": ((data[at] & 0xE0) | 2, "precision 3 for"),  # 2**3 < k symbols
        "reserved": (data[at] | 0x40, "reserved"),
    }
    for value, match in cases.values():
        bad = data.copy()
        bad[at] = value
        with pytest.raises(PayloadError, match=match):
            entropy_decode(bad, symbols.size, 64)
    for flags, lanes_log2, match in ((0x2B, 6, "2\\*\\*6 lanes"), (0x0B, 4, "2\\*\\*4 lanes"), (0x0B, 255, "lanes")):
        bad = data.copy()
        bad[at], bad[at + 1] = flags, lanes_log2
        with pytest.raises(PayloadError, match=match):
            entropy_decode(bad, symbols.size, 64)
    one_block = data.copy()
    one_block[at] |= 0x80
    with pytest.raises(PayloadError):
        entropy_decode(np.insert(one_block, at + 2, 12), symbols.size, 64)  # 2**12 < 5000: 2 blocks, no lengths
    with pytest.raises(PayloadError, match="one block"):
        entropy_decode(np.insert(one_block, at + 2, 13), symbols.size, 64)
    with pytest.raises(PayloadError, match="header bytes"):
        entropy_decode(data[: at + 1], symbols.size, 64)
    symbols, data = request.getfixturevalue(blocks)
    at = _header_at(symbols, data, 9)
    for b in (9, 33, 255):
        bad = data.copy()
        bad[at + 2] = b
        with pytest.raises(PayloadError, match="blocks of"):
            entropy_decode(bad, symbols.size, 9)
    lengths = data[at + 3 : at + 3 + 16].view("<u4")
    for edit in ((0, 1), (0, int(lengths[0]) + 1), (3, 2**32 - 1), (1, int(lengths[1]) - 1)):
        bad = data.copy()
        bad[at + 3 : at + 19].view("<u4")[edit[0]] = edit[1]
        with pytest.raises(PayloadError):
            entropy_decode(bad, symbols.size, 9)


def test_declared_huge_counts_fail_without_big_allocation():
    # A forged table: two symbols with 5e8 occurrences each, followed by a few bytes. Decoding
    # would allocate gigabytes; the information bound rejects it first.
    header, _ = elias_omega_encode(np.array([2, 1, 500_000_000, 1, 500_000_000]))
    forged = np.concatenate([header, np.array([0x0B, 0, 1, 2, 3, 4, 5, 0, 0, 1], np.uint8)])
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


@pytest.mark.parametrize("which", ["coded", "coded_blocks", "coded_blocks64"])
def test_bit_flips_are_rejected_or_change_nothing_silently(which, request):
    symbols, data = request.getfixturevalue(which)
    k = 64 if which == "coded" else 9
    rng = np.random.default_rng(43)
    rejected = 0
    for bit in rng.choice(8 * data.size, 300, replace=False):
        bad = data.copy()
        bad[bit // 8] ^= np.uint8(0x80 >> (bit % 8))
        try:
            out = entropy_decode(bad, symbols.size, k)
        except PayloadError:
            rejected += 1
            continue
        assert out.size == symbols.size and out.max() < k
    # A flipped word breaks its lane: the final-state check catches nearly every corruption.
    assert rejected >= 285


MODEL_COUNTS = [
    np.array([1, 1]),
    np.array([1, 2**38 - 1]),
    np.ones(65536, np.int64),
    np.concatenate([np.ones(65535, np.int64), [10**9]]),  # floors of 0 bumped to 1: overshoot
    np.concatenate([np.full(40000, 3, np.int64), [7, 2**20]]),
    np.random.default_rng(51).integers(1, 10**6, 4096),
]


@pytest.mark.parametrize(
    ("counts", "precision"),
    [(c, p) for c in MODEL_COUNTS for p in (12, 16, MAX_PRECISION) if c.size <= 1 << p],
)
def test_quantized_frequencies_are_a_valid_model(counts, precision):
    freq = quantize_counts(counts, int(counts.sum()), precision)
    assert freq.dtype == np.int64 and freq.size == counts.size
    assert int(freq.sum()) == 2**precision
    assert freq.min() >= 1
    # close to proportional where counts are large enough to matter
    big = counts * 2**precision >= 1000 * counts.sum()
    expected = counts[big] * 2**precision / counts.sum()
    assert np.all(np.abs(freq[big] - expected) <= 0.01 * expected + counts.size)


def test_leftover_slots_go_to_the_largest_deficits():
    # 3 symbols over 2**4 slots: shares 16 * (5, 3, 2) / 10 = (8, 4.8, 3.2); floors (8, 4, 3) leave
    # one slot, which goes to the symbol furthest below its share (symbol 1, 0.8 short).
    np.testing.assert_array_equal(quantize_counts(np.array([5, 3, 2]), 10, 4), [8, 5, 3])


def test_rare_symbols_in_a_large_alphabet_round_trip():
    # 65535 symbols seen once next to one symbol seen a million times: every frequency is 1 but one.
    rng = np.random.default_rng(52)
    symbols = np.concatenate([np.arange(65535, dtype=np.uint16), np.full(1_000_000, 65535, np.uint16)])
    rng.shuffle(symbols)
    data = entropy_encode(symbols, 65536)
    np.testing.assert_array_equal(entropy_decode(data, symbols.size, 65536), symbols)


def test_payloads_of_the_previous_format_version_are_rejected_with_the_reason():
    from fedquant.codecs import get_codec
    from fedquant.testing.fuzz_mutations import reseal
    from fedquant.wire.payload import FORMAT_VERSION

    codec = get_codec("qsgd:coding=entropy")
    data = codec.encode(torch.randn(1000, generator=torch.Generator().manual_seed(3)), seed=1)
    assert data[2] == FORMAT_VERSION == 5
    changed = {2: "entropy", 3: "entropy", 4: "rotation's random signs"}
    for version, what in changed.items():
        old = reseal(data[:2] + bytes([version]) + data[3:])
        why = rf"version {version} is not supported \(this fedquant reads 5\): version {version + 1} changed .*{what}"
        with pytest.raises(PayloadError, match=why):
            codec.decode(old, seed=1)


# ---------------------------------------------------------------------------------------------
# Every entropy-coded codec: the torch twins and CUDA write the same bytes; values as with fixed coding

ENTROPY_CODECS = [
    "qsgd:coding=entropy",
    "terngrad:coding=entropy",
    "signsgd:coding=entropy",
    "orq:coding=entropy",
    "dqsg:coding=entropy",
    "ndqsg:coding=entropy",
    "eden:bits=2,coding=entropy",
    "rht+dqsg:levels=2,coding=entropy",
]


def _decode_kwargs(codec, x):
    return {"side_info": x + 0.01} if codec.needs_side_info else {}


@pytest.mark.parametrize("spec", ENTROPY_CODECS)
def test_entropy_codecs_give_the_same_bytes_on_the_torch_path_and_decode_like_fixed(spec):
    from fedquant.codecs import get_codec
    from fedquant.wire.payload import read_payload

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(81))  # 32 lanes for every codec but signsgd
    fast, slow = get_codec(spec), get_codec(spec)
    slow.force_torch = True
    data = fast.encode(x, seed=5)
    assert slow.encode(x, seed=5) == data
    kwargs = _decode_kwargs(fast, x)
    y = fast.decode(data, seed=5, **kwargs)
    assert torch.equal(slow.decode(data, seed=5, **kwargs), y)
    fixed = get_codec(spec.replace("coding=entropy", "coding=fixed"))
    assert torch.equal(fixed.decode(fixed.encode(x, seed=5), seed=5, **kwargs), y)
    coded, packed = len(read_payload(data).body), len(read_payload(fixed.encode(x, seed=5)).body)
    # Signs of a Gaussian are incompressible: the table, header and final states on top.
    assert coded < packed if not spec.startswith("signsgd") else coded <= packed + 80


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ENTROPY_CODECS)
def test_entropy_codecs_give_the_same_bytes_from_cuda_tensors(spec):
    from fedquant.codecs import get_codec

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(82))
    codec = get_codec(spec)
    data = codec.encode(x.cuda(), seed=6)
    assert data == codec.encode(x, seed=6)
    kwargs = _decode_kwargs(codec, x)
    y = codec.decode(data, seed=6, **kwargs)
    cuda_kwargs = {k: v.cuda() for k, v in kwargs.items()}
    assert torch.equal(codec.decode(data, seed=6, device="cuda", **cuda_kwargs).cpu(), y)


# ---------------------------------------------------------------- runs coded together (ECDQ's tables)
def _runs(seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """uint8 runs of every kind: empty, one symbol, one-lane one-block and several blocks (of unlike
    lengths, so the four-at-a-time loop leaves blocks to finish alone), and 32 lanes."""
    rng = np.random.default_rng(seed)
    sizes = np.array([0, 5, 3000, 70_000, 200_001, 1, 40_000, 45_000, 9_000, 300_000, 17, 150_000], np.int64)
    skews = {"a": [0.9, 0.06, 0.03, 0.01], "b": [0.8, 0.1, 0.05, 0.05], "c": [1 / 8] * 8}
    kinds = "ababaabbcbab"
    runs = [rng.choice(len(skews[k]), size=s, p=skews[k]) for k, s in zip(kinds, sizes, strict=True)]
    runs[1][:] = 3  # one distinct symbol
    return np.concatenate(runs).astype(np.uint8), sizes


def _run_sections(symbols, sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [entropy_encode(symbols[a:b], 12) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def test_runs_coded_together_give_each_runs_bytes():
    symbols, sizes = _runs()
    alone = _run_sections(symbols, sizes)
    counts = np.stack([np.bincount(r, minlength=12) for r in np.split(symbols, np.cumsum(sizes)[:-1])])
    layouts = [choose_layout(c[c > 0], int(c.sum()))[0] for c in counts if np.count_nonzero(c) > 1]
    assert sum(lay.lanes == 1 for lay in layouts) >= 6 and any(lay.lanes == 32 for lay in layouts)
    assert any(lay.lanes == 1 and lay.block_log2 for lay in layouts)  # one lane, several blocks
    for given in (None, counts):
        together = entropy_encode_runs(symbols, sizes, 12, given)
        assert [t.tobytes() for t in together] == [a.tobytes() for a in alone]
    decoded = [entropy_decode(a, int(n), 12) for a, n in zip(alone, sizes, strict=True)]
    np.testing.assert_array_equal(np.concatenate(decoded), symbols)
