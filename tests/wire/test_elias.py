"""Elias omega code, QSGD's Code_s and Code'_s: codewords bit for bit, round trips, sizes, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from fedquant.errors import PayloadError
from fedquant.wire.elias import (
    code_s_decode,
    code_s_dense_decode,
    code_s_dense_encode,
    code_s_encode,
    elias_omega_decode,
    elias_omega_encode,
    elias_omega_lengths,
)

U64_MAX = 2**64 - 1


def omega_reference(k: int) -> str:
    """Elias omega codeword of k >= 1, straight from the recursive definition (algorithms.md §1.3)."""
    code = "0"
    while k > 1:
        b = bin(k)[2:]
        code = b + code
        k = len(b) - 1
    return code


def bit_string(data: np.ndarray, nbits: int | None = None) -> str:
    bits = "".join(format(int(b), "08b") for b in np.asarray(data, np.uint8))
    return bits if nbits is None else bits[:nbits]


def random_levels(n: int, s: int, density: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mags = rng.integers(1, s + 1, n)
    signs = np.where(rng.random(n) < 0.5, -1, 1)
    return np.where(rng.random(n) < density, mags * signs, 0).astype(np.int16)


# ---------------------------------------------------------------------------------------------
# Elias omega


@pytest.mark.parametrize(
    ("k", "code"),
    [
        (1, "0"),
        (2, "100"),
        (3, "110"),
        (4, "101000"),
        (5, "101010"),
        (8, "1110000"),
        (16, "10100100000"),
        (17, "10100100010"),
    ],
)
def test_known_codewords(k, code):
    data, nbits = elias_omega_encode(np.array([k]))
    assert nbits == len(code)
    assert bit_string(data) == code + "0" * (-len(code) % 8)  # zero padding
    assert elias_omega_lengths(np.array([k]))[0] == len(code)
    assert omega_reference(k) == code


def test_round_trip_all_integers_to_a_million():
    values = np.arange(1, 10**6 + 1, dtype=np.int64)
    data, nbits = elias_omega_encode(values)
    lengths = elias_omega_lengths(values)
    assert nbits == int(lengths.sum())
    assert data.dtype == np.uint8 and data.size == (nbits + 7) // 8
    out = elias_omega_decode(data, values.size, 10**6)
    assert out.dtype == np.uint64
    np.testing.assert_array_equal(out, values)
    np.testing.assert_array_equal(elias_omega_decode(data, values.size, 10**6, total_bits=nbits), values)


def test_matches_reference_encoder_for_large_values():
    rng = np.random.default_rng(7)
    exps = rng.integers(0, 63, 3000)
    values = [int(rng.integers(1, 2**62)) >> int(e) or 1 for e in exps]
    values += [1, 2, 2**32 - 1, 2**32, 2**52, 2**53 + 1, 2**62, 2**63, U64_MAX]
    arr = np.array(values, dtype=np.uint64)
    data, nbits = elias_omega_encode(arr)
    expected = "".join(omega_reference(v) for v in values)
    assert nbits == len(expected)
    assert bit_string(data, nbits) == expected
    np.testing.assert_array_equal(elias_omega_lengths(arr), [len(omega_reference(v)) for v in values])
    np.testing.assert_array_equal(elias_omega_decode(data, arr.size, U64_MAX), arr)


def test_empty_and_input_validation():
    data, nbits = elias_omega_encode(np.zeros(0, np.int64))
    assert nbits == 0 and data.size == 0
    assert elias_omega_decode(b"", 0, 5).size == 0
    with pytest.raises(ValueError, match=">= 1"):
        elias_omega_encode(np.array([3, 0]))
    with pytest.raises(ValueError, match=">= 1"):
        elias_omega_encode(np.array([-1]))
    with pytest.raises(ValueError, match="integers"):
        elias_omega_encode(np.array([1.0]))


def test_decoder_accepts_bytes_and_memoryview():
    values = np.array([5, 1, 900, 3])
    data, _ = elias_omega_encode(values)
    np.testing.assert_array_equal(elias_omega_decode(bytes(data), 4, 1000), values)
    np.testing.assert_array_equal(elias_omega_decode(memoryview(bytes(data)), 4, 1000), values)


# ---------------------------------------------------------------------------------------------
# Code_s (sparse) and Code'_s (dense)


def test_code_s_bit_layout():
    # nonzeros at 0-based positions 1 (-2) and 4 (+1): gap 2, sign 1, omega(2); gap 3, sign 0, omega(1)
    levels = np.array([0, -2, 0, 0, 1])
    data, nbits = code_s_encode(levels)
    expected = "100" + "1" + "100" + "110" + "0" + "0"
    assert nbits == len(expected)
    assert bit_string(data) == expected + "1" * (-len(expected) % 8)  # padded with 1 bits
    np.testing.assert_array_equal(code_s_decode(data, 5, 2), levels)


def test_code_s_dense_bit_layout():
    # omega(|l| + 1) per coordinate, then the sign bit for nonzeros
    levels = np.array([0, -2, 1, 0])
    data, nbits = code_s_dense_encode(levels)
    expected = "0" + "110" + "1" + "100" + "0" + "0"
    assert nbits == len(expected)
    assert bit_string(data) == expected + "0" * (-len(expected) % 8)
    np.testing.assert_array_equal(code_s_dense_decode(data, 4, 2), levels)


def sparse_bits(levels: np.ndarray) -> int:
    idx = np.flatnonzero(levels)
    gaps = np.diff(idx, prepend=-1)
    return int(elias_omega_lengths(gaps).sum() + idx.size + elias_omega_lengths(np.abs(levels[idx])).sum())


def dense_bits(levels: np.ndarray) -> int:
    return int(elias_omega_lengths(np.abs(levels.astype(np.int64)) + 1).sum() + np.count_nonzero(levels))


LEVEL_CASES = {
    "sparse": (random_levels(5000, 1, 0.01, 1), 1),
    "dense": (random_levels(5000, 4, 0.8, 2), 4),
    "all-zero": (np.zeros(300, np.int8), 4),
    "single-zero": (np.zeros(1, np.int8), 1),
    "single-nonzero": (np.array([-3], np.int8), 3),
    "first-and-last": (np.array([2, 0, 0, 0, 0, 0, 0, 0, 0, -1], np.int8), 2),
    "every-position": (np.array([1, -1, 1, 1, -1], np.int8), 1),
    "large-s": (random_levels(3000, 1000, 0.5, 3), 1000),
    "huge-gap": (np.concatenate([np.zeros(70000, np.int8), [5]]).astype(np.int8), 5),
}


@pytest.mark.parametrize("case", sorted(LEVEL_CASES))
def test_code_s_round_trip(case):
    levels, s = LEVEL_CASES[case]
    data, nbits = code_s_encode(levels)
    assert nbits == sparse_bits(levels)
    assert data.size == (nbits + 7) // 8
    for total in (None, nbits):
        out = code_s_decode(data, levels.size, s, total)
        assert out.dtype == (np.int8 if s <= 127 else np.int16)
        np.testing.assert_array_equal(out, levels)


@pytest.mark.parametrize("case", sorted(LEVEL_CASES))
def test_code_s_dense_round_trip(case):
    levels, s = LEVEL_CASES[case]
    data, nbits = code_s_dense_encode(levels)
    assert nbits == dense_bits(levels)
    assert data.size == (nbits + 7) // 8
    for total in (None, nbits):
        np.testing.assert_array_equal(code_s_dense_decode(data, levels.size, s, total), levels)


def test_code_s_empty_vector():
    for encode, decode in ((code_s_encode, code_s_decode), (code_s_dense_encode, code_s_dense_decode)):
        data, nbits = encode(np.zeros(0, np.int8))
        assert nbits == 0 and data.size == 0
        assert decode(data, 0, 1).size == 0


def test_code_s_stream_ending_in_zero_bits_is_not_cut_short():
    # The last triple "0 0 0" (gap 1, +, level 1) is all zero bits; 1-bit padding keeps it apart.
    levels = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1], np.int8)
    data, nbits = code_s_encode(levels)
    assert nbits % 8 != 0
    np.testing.assert_array_equal(code_s_decode(data, levels.size, 1), levels)


def test_code_s_level_out_of_int8_range_uses_wider_dtype():
    levels = np.array([0, 40000, -40000], np.int32)
    data, nbits = code_s_encode(levels)
    out = code_s_decode(data, 3, 40000, nbits)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, levels)


# ---------------------------------------------------------------------------------------------
# Bad input: every decoder raises PayloadError (never IndexError, a numba error or a hang).


def test_omega_truncated_extended_and_bad_padding():
    values = np.arange(1, 200)
    data, nbits = elias_omega_encode(values)
    with pytest.raises(PayloadError, match="ends in the middle"):
        elias_omega_decode(data[:-1], values.size, 1000)
    with pytest.raises(PayloadError, match="trailing"):
        elias_omega_decode(np.append(data, np.uint8(0)), values.size, 1000)
    with pytest.raises(PayloadError, match="declares"):
        elias_omega_decode(data, values.size, 1000, total_bits=nbits + 8)
    with pytest.raises(PayloadError, match="declares"):
        elias_omega_decode(data, values.size - 1, 1000, total_bits=nbits)
    assert nbits % 8 != 0
    bad = data.copy()
    bad[-1] |= 1  # a 1 in the padding
    with pytest.raises(PayloadError, match="padding"):
        elias_omega_decode(bad, values.size, 1000)


def test_omega_value_beyond_max_and_overlong_codeword():
    data, _ = elias_omega_encode(np.array([3, 17, 2]))
    with pytest.raises(PayloadError, match="beyond the allowed maximum"):
        elias_omega_decode(data, 3, 16)
    # all ones: the group lengths grow 2, 4, 16, 65536 bits, past the 64-bit limit
    with pytest.raises(PayloadError, match="malformed"):
        elias_omega_decode(np.full(32, 0xFF, np.uint8), 1, U64_MAX)


def test_declared_huge_counts_fail_before_allocating():
    data, _ = elias_omega_encode(np.array([1, 2, 3]))
    with pytest.raises(PayloadError, match="cannot hold"):
        elias_omega_decode(data, 10**15, 10)
    dense, _ = code_s_dense_encode(np.array([1, 0, 2]))
    with pytest.raises(PayloadError, match="cannot hold"):
        code_s_dense_decode(dense, 10**15, 2)
    with pytest.raises(PayloadError, match="declares"):
        code_s_decode(dense, 3, 2, total_bits=10**15)


def test_code_s_bad_streams():
    levels = random_levels(2000, 4, 0.3, 5)
    data, nbits = code_s_encode(levels)
    n = levels.size
    with pytest.raises(PayloadError):
        code_s_decode(data[:-1], n, 4, nbits - 8)
    # Without total_bits a cut that lands on a triple boundary is itself a valid (shorter) stream;
    # then the result differs (the caller's envelope CRC catches such truncation).
    for cut in range(1, 6):
        try:
            out = code_s_decode(data[:-cut], n, 4)
        except PayloadError:
            continue
        assert not np.array_equal(out, levels)
    with pytest.raises(PayloadError, match="trailing|ends in the middle"):
        code_s_decode(np.append(data, np.uint8(0xFF)), n, 4)
    with pytest.raises(PayloadError, match="declares"):
        code_s_decode(np.append(data, np.uint8(0)), n, 4, nbits)
    with pytest.raises(PayloadError, match="beyond the allowed maximum"):
        code_s_decode(data, n, 3)
    last = int(np.flatnonzero(levels)[-1])
    with pytest.raises(PayloadError, match="past the end"):
        code_s_decode(data, last, 4)
    with pytest.raises(PayloadError, match="past the end"):
        code_s_decode(data, 0, 4)
    if nbits % 8:
        bad = data.copy()
        bad[-1] &= 0xFE  # a 0 in the 1-bit padding
        with pytest.raises(PayloadError):
            code_s_decode(bad, n, 4, nbits)


def test_code_s_dense_bad_streams():
    levels = random_levels(2000, 4, 0.7, 6)
    data, nbits = code_s_dense_encode(levels)
    n = levels.size
    with pytest.raises(PayloadError, match="ends in the middle"):
        code_s_dense_decode(data[:-1], n, 4)
    with pytest.raises(PayloadError, match="trailing"):
        code_s_dense_decode(np.append(data, np.uint8(0)), n, 4)
    with pytest.raises(PayloadError, match="trailing|declares"):
        code_s_dense_decode(data, n - 50, 4)
    with pytest.raises(PayloadError, match="beyond the allowed maximum"):
        code_s_dense_decode(data, n, 3)
    with pytest.raises(PayloadError, match="declares"):
        code_s_dense_decode(data, n, 4, nbits + 1)


DECODERS = {
    "omega": lambda d: elias_omega_decode(d, 100, 1000),
    "code_s": lambda d: code_s_decode(d, 1000, 4),
    "code_s+bits": lambda d: code_s_decode(d, 1000, 4, len(d) * 8),
    "dense": lambda d: code_s_dense_decode(d, 300, 4),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_random_garbage_raises_payload_error_or_decodes_within_bounds(name):
    decode = DECODERS[name]
    rng = np.random.default_rng(11)
    rejected = 0
    for trial in range(300):
        garbage = rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8)
        if trial % 3 == 0:
            garbage[: garbage.size // 2] = 0xFF  # long runs of 1s stress the overlong-codeword path
        try:
            out = decode(garbage)
        except PayloadError:
            rejected += 1
            continue
        # garbage that happens to be a valid stream must still respect the bounds
        assert np.abs(out.astype(np.int64)).max(initial=0) <= (1000 if name == "omega" else 4)
    assert rejected >= 250


def test_bit_flips_never_escape_as_other_errors():
    levels = random_levels(500, 4, 0.3, 9)
    cases = [
        (code_s_encode, lambda d, t: code_s_decode(d, 500, 4, t)),
        (code_s_dense_encode, lambda d, t: code_s_dense_decode(d, 500, 4, t)),
    ]
    for encode, decode in cases:
        data, nbits = encode(levels)
        changed = 0
        for bit in range(nbits):
            bad = data.copy()
            bad[bit // 8] ^= np.uint8(0x80 >> (bit % 8))
            for total in (None, nbits):
                try:
                    out = decode(bad, total)
                except PayloadError:
                    changed += 1
                    continue
                assert np.abs(out.astype(np.int64)).max() <= 4
                changed += int(not np.array_equal(out, levels))
        assert changed == 2 * nbits  # a prefix code: every single flip changes the result or is rejected


# A codeword whose 64-bit group reads a value >= 2**63: "10" (2), "101" (5), "111111" (63), then
# 64 bits starting with 1. Before the fix the next group's width came out negative, passed the
# bounds checks and the reader walked out of the buffer (SIGSEGV). Run in a subprocess so that a
# crash fails the test instead of killing pytest.
_GROUP_BOMB = """
import numpy as np
from fedquant.errors import PayloadError
from fedquant.wire.elias import code_s_decode, code_s_dense_decode, elias_omega_decode, elias_omega_decode_prefix
from fedquant.wire.entropy import entropy_decode

bits = "10" + "101" + "111111" + "1" + "0" * 63
bits += "1" * (-len(bits) % 8 + 8)
bomb = np.frombuffer(int(bits, 2).to_bytes(len(bits) // 8, "big"), np.uint8)
decoders = {
    "omega": lambda: elias_omega_decode(bomb, 1, 2**64 - 1),
    "omega-prefix": lambda: elias_omega_decode_prefix(bomb, 1, 2**64 - 1),
    "code_s": lambda: code_s_decode(bomb, 10, 4),
    "code_s_dense": lambda: code_s_dense_decode(bomb, 10, 4),
    "entropy-table": lambda: entropy_decode(bomb, 10, 9),
}
for name, decode in decoders.items():
    try:
        decode()
        print(name, "decoded")
    except PayloadError as err:
        print(name, "PayloadError", err)
"""


def test_forged_64_bit_group_is_rejected_not_a_crash():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _GROUP_BOMB], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"decoder process died with status {run.returncode}: {run.stderr[-2000:]}"
    lines = run.stdout.splitlines()
    assert len(lines) == 5 and all(line.split()[1] == "PayloadError" for line in lines), run.stdout
    assert "malformed codeword" in lines[0]
