"""The CPU numba compiles the kernels for, as the kernels that write LLVM IR themselves ask it.

numba compiles for ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` where they are set, else for the
host, and its on-disk cache keys machine code by both: a kernel that picks its instructions here
never loads code made for another CPU. The IR kernels use an x86 instruction only where these
say the target has it, and portable IR (or plain numba) elsewhere, so every kernel compiles on
any CPU numba supports (ARM, x86 without AVX-512 or BMI2) and gives the same bits there.
"""

from __future__ import annotations

#: CPUs with BMI2 whose ``pdep``/``pext`` are microcoded (tens to hundreds of cycles, depending on
#: the mask): AMD before Zen 3. The packers keep their shifts there.
SLOW_BIT_DEPOSIT = ("znver1", "znver2", "bdver4")


def cpu_name() -> str:
    """LLVM's name of the target CPU (``NUMBA_CPU_NAME``, else the host's), e.g. ``"icelake-server"``."""
    from numba.core import config

    if config.CPU_NAME is not None:
        return config.CPU_NAME
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_name()


def cpu_features() -> frozenset[str]:
    """The target's features as LLVM writes them (``"+avx512f"``, ``"-bmi2"``, ...): ``NUMBA_CPU_FEATURES``,
    else the host's."""
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return frozenset(features.split(","))


def has_avx512f() -> bool:
    """Whether the target has AVX-512F (``vpermps`` on 16 floats, for the level rounding)."""
    return "+avx512f" in cpu_features()


def has_avx512_vbmi2() -> bool:
    """Whether the target compresses bytes in a register (``vpcompressb``, AVX-512 VBMI2 with VL): the
    splitting kernels then store the packed bytes with a masked store, since the memory form of
    ``vpcompressb`` is microcoded on AMD Zen 4 (14x slower there, measured)."""
    features = cpu_features()
    return "+avx512vbmi2" in features and "+avx512vl" in features


def has_fast_bmi2() -> bool:
    """Whether the target has BMI2's ``pdep``/``pext`` at one instruction a cycle (for the packers):
    the feature, on a CPU not in :data:`SLOW_BIT_DEPOSIT`."""
    return "+bmi2" in cpu_features() and cpu_name() not in SLOW_BIT_DEPOSIT
