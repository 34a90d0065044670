"""The JIT runtime under the codecs and the wire coders: where numba caches the kernels, when they run compiled.

* :mod:`~fedquant.jit.locator`: one kernel cache per machine, shared by every copy of the
  package (installed here, before any kernel module is imported);
* :mod:`~fedquant.jit.cache`: ``FEDQUANT_KERNELS`` and the background warm-up (twins until warm);
* :mod:`~fedquant.jit.twins`: ``parallel_kernel`` and ``with_twin``;
* :mod:`~fedquant.jit.target`: the CPU the kernels are compiled for.

It imports nothing from ``codecs`` or ``wire``, which both import it.
"""

from fedquant.jit import locator

locator.install()

from fedquant.jit import cache, target  # noqa: E402  (after install: nothing compiles at import)
from fedquant.jit.twins import (  # noqa: E402
    PARALLEL_MIN,
    SERIAL_SUFFIX,
    TWIN_MAX,
    module_dispatchers,
    parallel_kernel,
    use_twin,
    with_twin,
)

__all__ = [
    "PARALLEL_MIN",
    "SERIAL_SUFFIX",
    "TWIN_MAX",
    "cache",
    "locator",
    "module_dispatchers",
    "parallel_kernel",
    "target",
    "use_twin",
    "with_twin",
]
