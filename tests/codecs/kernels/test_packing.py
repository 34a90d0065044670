"""The kernels' bit packers write and read the wire's layout (:mod:`fedquant.wire.bitpack`) on every path:
whole bytes of symbols (widths 1, 2, 4), BMI2 groups where the CPU has them, shifts elsewhere."""

import numpy as np
import pytest
from numba import njit

from fedquant.codecs.kernels import common
from fedquant.jit import target
from fedquant.wire import pack_bits, unpack_bits

#: Counts around a group (8 symbols), a 64-bit word of packed bytes and the kernels' chunk.
COUNTS = [0, 1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 63, 64, 65, 1001, common.CHUNK + 13]
GUARD = 0xAB


def _symbols(rng, width, n):
    return rng.integers(0, 1 << width, n).astype(np.uint8 if width <= 8 else np.uint16)


@pytest.mark.parametrize("width", range(1, 17))
def test_pack_into_writes_the_wire_layout_and_no_byte_beyond_it(width):
    rng = np.random.default_rng(width)
    for n in COUNTS:
        codes = _symbols(rng, width, n)
        expected = pack_bits(codes, width)
        out = np.full(expected.size + 11, GUARD, np.uint8)
        common.pack_into(codes, n, width, out, 3)
        assert np.array_equal(out[3 : 3 + expected.size], expected), n
        assert (out[:3] == GUARD).all() and (out[3 + expected.size :] == GUARD).all(), n


@pytest.mark.parametrize("width", range(1, 17))
def test_unpack_from_reads_the_wire_layout_into_exactly_count_symbols(width):
    rng = np.random.default_rng(100 + width)
    for n in COUNTS:
        codes = _symbols(rng, width, n)
        data = np.concatenate([np.full(5, GUARD, np.uint8), pack_bits(codes, width)])
        back = np.full(n + 9, 7, codes.dtype)
        common.unpack_from(data, 5, n, width, back)
        assert np.array_equal(back[:n], codes) and (back[n:] == 7).all(), n
        assert np.array_equal(unpack_bits(data[5:], width, n), codes)


@pytest.mark.parametrize("width", range(1, 8))
def test_symbols_wider_than_the_width_are_cut_to_it_as_the_shifts_cut_them(width):
    # The packers mask each symbol: a stray high bit must not spill into its neighbours.
    rng = np.random.default_rng(200 + width)
    codes = rng.integers(0, 256, 8 * 40).astype(np.uint8)
    out = np.zeros(40 * width, np.uint8)
    common.pack_into(codes, codes.size, width, out, 0)
    assert np.array_equal(out, pack_bits(codes & ((1 << width) - 1), width))


def test_without_fast_bmi2_the_groups_go_by_shifts_to_the_same_bytes(monkeypatch):
    # CPUs without BMI2 (ARM, old x86) or with a microcoded one (AMD before Zen 3)
    monkeypatch.setattr(target, "has_fast_bmi2", lambda: False)
    pack = njit(common._pack_groups.py_func)  # new dispatchers: lowered now, under the patched target
    unpack = njit(common._unpack_groups.py_func)
    rng = np.random.default_rng(5)
    for width in range(1, 8):
        for groups in (0, 1, 2, 3, 50):
            codes = _symbols(rng, width, 8 * groups)
            packed = np.zeros(groups * width, np.uint8)
            pack(codes, groups, width, packed)
            assert np.array_equal(packed, pack_bits(codes, width)), (width, groups)
            back = np.zeros(codes.size, np.uint8)
            unpack(packed, groups, width, back)
            assert np.array_equal(back, codes), (width, groups)
    ir_text = "".join(pack.inspect_llvm().values()) + "".join(unpack.inspect_llvm().values())
    assert "llvm.x86.bmi" not in ir_text


def test_the_bmi2_groups_are_compiled_exactly_where_the_target_has_them_fast():
    unpack = njit(common._unpack_groups.py_func)
    unpack(np.zeros(3 * 6, np.uint8), 3, 6, np.zeros(24, np.uint8))
    ir_text = "".join(unpack.inspect_llvm().values())
    assert ("llvm.x86.bmi.pdep.64" in ir_text) == target.has_fast_bmi2()


@pytest.mark.parametrize(
    "name, features, fast",
    [
        ("icelake-server", "+avx512f,+bmi2", True),
        ("znver3", "+bmi2", True),
        ("znver2", "+bmi2", False),  # microcoded pdep/pext
        ("haswell", "-bmi2", False),
        ("generic", "", False),
    ],
)
def test_fast_bmi2_is_the_feature_on_a_cpu_that_does_not_microcode_it(monkeypatch, name, features, fast):
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", name)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    assert target.has_fast_bmi2() is fast
    assert target.has_avx512f() is ("+avx512f" in features)
