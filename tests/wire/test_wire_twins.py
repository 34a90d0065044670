"""The wire kernels' twins (rANS, Elias): the kernels' bytes and values, the same rejections, no compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager

import numpy as np
import pytest

from fedquant.errors import PayloadError
from fedquant.jit import cache
from fedquant.wire.elias import (
    code_s_decode,
    code_s_dense_decode,
    code_s_dense_encode,
    code_s_encode,
    elias_omega_decode,
    elias_omega_decode_prefix,
    elias_omega_encode,
    elias_omega_lengths,
)
from fedquant.wire.entropy import Layout, entropy_decode, entropy_encode
from tests.codecs.kernels.test_kernel_cache import FRESH_PROCESS, ROOT
from tests.wire.test_elias import LEVEL_CASES, random_levels
from tests.wire.test_entropy import CASES, forced, gaussian_indices

TWIN_CASES = sorted(set(CASES) - {"several-blocks"})  # 1.5 M symbols: seconds in Python; blocks are below
LAYOUTS = [
    Layout(12, 32, 10, "rans32"),
    Layout(12, 1, None, "rans32"),
    Layout(10, 4, 10, "rans32"),
    Layout(12, 8, 10, "rans64"),
    Layout(12, 1, None, "rans64"),
    Layout(10, 2, 10, "rans64"),
    Layout(14, 4, None, "rans64"),
    Layout(24, 8, 10, "rans64"),
]


@contextmanager
def twins():
    """Run the twins (``FEDQUANT_KERNELS=twin``) inside the block; the compiled kernels outside."""
    before = os.environ.get(cache.MODE_ENV)
    os.environ[cache.MODE_ENV] = "twin"
    cache.READY = False
    try:
        yield
    finally:
        if before is None:
            del os.environ[cache.MODE_ENV]
        else:
            os.environ[cache.MODE_ENV] = before
        cache.READY = cache.mode() == "numba"  # as conftest leaves it; auto re-checks the marker


def both(fn):
    """``fn()`` with the compiled kernels and with the twins: each its result or its PayloadError message."""
    results = []
    for use_twins in (False, True):
        with twins() if use_twins else _nothing():
            try:
                results.append(("ok", fn()))
            except PayloadError as err:
                results.append(("PayloadError", str(err)))
    return results


@contextmanager
def _nothing():
    yield


def assert_same(fn):
    (kind_k, kernel), (kind_t, twin) = both(fn)
    assert kind_k == kind_t, (kernel, twin)
    if kind_k == "PayloadError":
        assert kernel == twin
        return kind_k
    for a, b in zip(kernel if isinstance(kernel, tuple) else (kernel,), twin if isinstance(twin, tuple) else (twin,),
                    strict=True):  # fmt: skip
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b
    return kind_k


# ---------------------------------------------------------------------------------------------- rANS
@pytest.mark.parametrize("case", TWIN_CASES)
def test_entropy_twins_give_the_kernels_bytes_and_symbols(case):
    symbols, k = CASES[case]
    assert_same(lambda: entropy_encode(symbols, k))
    data = entropy_encode(symbols, k)
    assert assert_same(lambda: entropy_decode(data, symbols.size, k)) == "ok"


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_entropy_twins_on_every_layout(layout):
    symbols = gaussian_indices(4 * 1024 + 300, 9, 32, spread=4.0)
    assert_same(lambda: forced(symbols, 9, layout))
    data = forced(symbols, 9, layout)
    assert assert_same(lambda: entropy_decode(data, symbols.size, 9)) == "ok"


def _mutations(data: np.ndarray, rng: np.random.Generator, flips: int):
    for bit in rng.choice(8 * data.size, flips, replace=False):
        bad = data.copy()
        bad[bit // 8] ^= np.uint8(0x80 >> (bit % 8))
        yield bad
    for cut in (1, 4, 5, data.size // 2):
        yield data[:-cut]
    for extra in ([0], [0, 0, 0, 0], [1, 0, 0, 0], [0xFF] * 8):
        yield np.append(data, np.array(extra, np.uint8))
    for _ in range(20):
        yield rng.integers(0, 256, int(rng.integers(0, 2 * data.size)), dtype=np.uint8)


@pytest.mark.parametrize("layout", [None, *LAYOUTS], ids=str)
def test_corrupted_entropy_streams_are_rejected_alike(layout):
    symbols = gaussian_indices(4 * 1024 + 300, 9, 33, spread=4.0)
    data = entropy_encode(symbols, 9) if layout is None else forced(symbols, 9, layout)
    outcomes = [assert_same(lambda bad=bad: entropy_decode(bad, symbols.size, 9))
                for bad in _mutations(data, np.random.default_rng(5), 120)]  # fmt: skip
    assert outcomes.count("PayloadError") >= 0.9 * len(outcomes)


def test_entropy_twins_reject_absent_symbols_like_the_kernel():
    symbols = gaussian_indices(3000, 9, 34, spread=4.0)
    counts = np.bincount(symbols, minlength=9)
    counts[int(symbols[0])] -= 1
    counts[(int(symbols[0]) + 1) % 9] += 1
    counts[8] += counts[0]
    counts[0] = 0
    for kernels in ("numba", "twin"):
        with twins() if kernels == "twin" else _nothing(), pytest.raises(ValueError):
            entropy_encode(symbols, 9, counts=counts)


# ---------------------------------------------------------------------------------------------- Elias
OMEGA_VALUES = {
    "small": np.arange(1, 5000, dtype=np.uint64),
    "large": (
        np.random.default_rng(3).integers(1, 2**63, 500, dtype=np.uint64)
        >> (np.arange(500, dtype=np.uint64) % np.uint64(60))
    )
    | np.uint64(1),
    "extremes": np.array([1, 2**32 - 1, 2**32, 2**57, 2**63, 2**64 - 1, 4095, 4096], np.uint64),
}


@pytest.mark.parametrize("case", sorted(OMEGA_VALUES))
def test_omega_twins_give_the_kernels_bytes_and_values(case):
    values = OMEGA_VALUES[case]
    assert_same(lambda: elias_omega_lengths(values))
    assert_same(lambda: elias_omega_encode(values))
    data, nbits = elias_omega_encode(values)
    assert assert_same(lambda: elias_omega_decode(data, values.size, 2**64 - 1, nbits)) == "ok"
    longer = np.append(data, np.array([7, 7], np.uint8))
    assert assert_same(lambda: elias_omega_decode_prefix(longer, values.size, 2**64 - 1)) == "ok"
    assert_same(lambda: elias_omega_decode(data, values.size, int(values.max()) - 1))


@pytest.mark.parametrize("case", sorted(LEVEL_CASES))
def test_code_s_twins_give_the_kernels_bytes_and_levels(case):
    levels, s = LEVEL_CASES[case]
    for encode, decode in ((code_s_encode, code_s_decode), (code_s_dense_encode, code_s_dense_decode)):
        for lv in (levels, levels.astype(np.int32)):
            assert_same(lambda lv=lv, encode=encode: encode(lv))
        data, nbits = encode(levels)
        for total in (None, nbits):
            assert (
                assert_same(lambda total=total, decode=decode, data=data: decode(data, levels.size, s, total)) == "ok"
            )


def test_corrupted_elias_streams_are_rejected_alike():
    levels = random_levels(500, 4, 0.3, 9)
    rng = np.random.default_rng(6)
    values = np.concatenate([np.arange(1, 200, dtype=np.uint64), OMEGA_VALUES["extremes"]])
    data, nbits = elias_omega_encode(values)
    for bad in _mutations(data, rng, 150):
        assert_same(lambda bad=bad: elias_omega_decode(bad, values.size, 2**64 - 1, nbits))
        assert_same(lambda bad=bad: elias_omega_decode(bad, values.size, 2**40))
        assert_same(lambda bad=bad: elias_omega_decode_prefix(bad, values.size, 2**64 - 1))
    for encode, decode in ((code_s_encode, code_s_decode), (code_s_dense_encode, code_s_dense_decode)):
        data, nbits = encode(levels)
        rejected = 0
        for bad in _mutations(data, rng, 150):
            for total in (None, nbits):
                rejected += (
                    assert_same(lambda bad=bad, total=total, decode=decode: decode(bad, levels.size, 4, total)) != "ok"
                )
        assert rejected > 0
    bomb_bits = "10" + "101" + "111111" + "1" + "0" * 63
    bomb_bits += "1" * (-len(bomb_bits) % 8 + 8)
    bomb = np.frombuffer(int(bomb_bits, 2).to_bytes(len(bomb_bits) // 8, "big"), np.uint8)
    assert assert_same(lambda: elias_omega_decode(bomb, 1, 2**64 - 1)) == "PayloadError"
    assert assert_same(lambda: code_s_decode(bomb, 10, 4)) == "PayloadError"
    assert assert_same(lambda: code_s_dense_decode(bomb, 10, 4)) == "PayloadError"


# ---------------------------------------------------------------------------------------------- no compile
WIRE_SPECS = ["ecdq", "ecdq:bits=1", "qsgd:coding=entropy", "qsgd:coding=elias", "terngrad:coding=elias",
              "dqsg:coding=entropy", "dqsg:coding=elias"]  # fmt: skip


def test_entropy_and_elias_codecs_compile_nothing_with_a_cold_cache_and_give_the_kernels_bytes(tmp_path):
    import hashlib

    import torch

    from fedquant.codecs import get_codec

    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path), "FEDQUANT_KERNELS": "twin"}
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, "5000", *WIRE_SPECS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["compiled"] == []
    for spec in WIRE_SPECS:  # here the compiled kernels
        codec = get_codec(spec)
        x = torch.randn(5000, generator=torch.Generator().manual_seed(7))
        payload = codec.encode(x, seed=11)
        y = codec.decode(payload, seed=11)
        expected = [hashlib.sha256(payload).hexdigest(), hashlib.sha256(y.numpy().tobytes()).hexdigest()]
        assert result["digests"][spec] == expected, spec


@pytest.mark.parametrize("precision", [1, 8, 12, 15, 16])
def test_direct_table_twin_gives_the_kernels_table(precision):
    # the twin builds it in place in uint32; a single symbol (f = 2**16 at precision 16) wraps as
    # the kernel's store of f << 16 into uint32 does
    from fedquant.wire import rans, rans_twin

    rng = np.random.default_rng(precision)
    for k in (1, 2, min(300, 1 << precision)):
        counts = rng.integers(1, 1000, k).astype(np.int64)
        freq = rans.quantize_counts(counts, int(counts.sum()), precision)
        symbols = np.sort(rng.choice(1 << 16, k, replace=False)).astype(np.uint16)
        kernel = rans.direct_table(symbols, freq, precision)
        twin = rans_twin.direct_table(symbols, freq, precision)
        for a, b in zip(kernel, twin, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), (precision, k)
