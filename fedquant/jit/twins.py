"""Kernels and their twins: the parallel/serial switch, and the twin that runs while the cache is cold.

* :func:`parallel_kernel`: THE parallel/serial switch. A kernel is written once, with ``prange``
  loops, and compiled twice: a parallel version for inputs of at least ``PARALLEL_MIN`` elements
  and a serial one (``prange`` runs as ``range``) below, because waking numba's thread pool costs
  more than the work on a busy machine, and federated models have many small tensors.
* :func:`with_twin`: a plain ``njit`` kernel called from Python, with a NumPy twin that runs while
  the compiled kernels are not ready (:mod:`fedquant.jit.cache`).

The parallel/serial switch
--------------------------
Two ways to get a serial small path were measured against one source function and rejected:

* capping the thread count to 1 around the call: from Python, a call wrapped in
  ``numba.set_num_threads`` took 4.5 us, more than waking the pool (3.2 us on an idle machine);
  from inside the kernel, the jitted ``numba.set_num_threads`` makes the function uncacheable
  (numba: "uses dynamic globals");
* jitting the same Python function twice with ``cache=True`` (``parallel=True`` and not): both
  land in one cache index (file named after the function's qualified name and line, key without
  the ``parallel`` flag), and the next process loads the wrong machine code and crashes.

:func:`parallel_kernel` instead jits the function as is with ``parallel=True`` and a copy of it,
renamed ``<name>__serial``, without: two cache files, one source. The wrapper picks by element
count (about 0.3 us). Measured on 2 cores: a 16-element toy kernel took 0.3 us serial against
3.2 us parallel; ``bucket_max_abs`` of 16 elements, with the machine busy, 1.6-2.8 us serial
against 57-68 us parallel.

>>> @parallel_kernel
... def double(x):
...     out = np.empty_like(x)
...     for i in prange(x.size):
...         out[i] = 2 * x[i]
...     return out
>>> double(np.ones(10, np.float32))          # < PARALLEL_MIN elements: double.serial
>>> double(np.ones(1 << 20, np.float32))     # double.parallel

Helpers called from kernels stay plain ``njit`` functions (a switched kernel is a Python
function, not callable from jitted code).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from numba import njit

from fedquant.jit import cache

PARALLEL_MIN = 1 << 16
SERIAL_SUFFIX = "__serial"
#: Largest call (elements) that runs a twin while the cache is cold; above, the kernel compiles.
TWIN_MAX = 1 << 21


def _serial_twin(fn: Callable) -> Callable:
    """A copy of ``fn`` under another qualified name (hence its own numba cache file)."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + SERIAL_SUFFIX, fn.__defaults__, fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + SERIAL_SUFFIX
    twin.__doc__ = fn.__doc__
    return twin


def use_twin(work) -> bool:
    """Whether a call on ``work`` (an array, or an element count) runs a kernel's twin.

    True while the compiled kernels are not ready (:func:`~fedquant.jit.cache.kernels_ready`)
    and ``work`` has at most ``TWIN_MAX`` elements: above, a twin in Python would take longer than
    compiling the kernel (``FEDQUANT_KERNELS=twin`` runs the twins at any size).
    """
    if cache.READY or cache.kernels_ready():
        return False
    return getattr(work, "size", work) <= TWIN_MAX or cache.mode() == "twin"


def with_twin(twin: Callable, *, count_arg: int = 0) -> Callable:
    """Decorate a plain ``njit`` kernel called from Python: ``twin`` runs instead when :func:`use_twin`.

    ``twin`` takes the same arguments and gives the same results (bytes, statuses); ``count_arg``
    is the position of the argument that gives the element count. The dispatcher stays
    reachable as ``.kernel`` (the warm-up and the tests call it), the twin as ``.twin``.
    """

    def build(kernel: Callable) -> Callable:
        @functools.wraps(kernel.py_func)
        def call(*args):
            return (twin if use_twin(args[count_arg]) else kernel)(*args)

        call.kernel = kernel
        call.twin = twin
        return call

    return build


def parallel_kernel(fn: Callable | None = None, *, count_arg: int = 0, twin: Callable | None = None) -> Callable:
    """Compile a kernel with ``prange`` loops as a parallel and a serial version; calls pick by size.

    Parameters
    ----------
    fn : callable
        The kernel's Python source (decorator use: ``@parallel_kernel`` or
        ``@parallel_kernel(count_arg=1)``).
    count_arg : int
        Position of the argument that gives the element count: an array (its ``size``) or an
        int. Calls with at least ``PARALLEL_MIN`` elements run the parallel version.
    twin : callable, optional
        A plain NumPy function with the same arguments and results, run instead while the
        compiled kernels are not ready (:func:`~fedquant.jit.cache.kernels_ready`:
        numba's cache still cold). Give one to a kernel that stages call outside
        :class:`~fedquant.codecs.dispatch.KernelDispatch`, whose torch twins cover the others.

    Returns
    -------
    callable
        ``kernel(*args)``, with the two numba dispatchers as ``kernel.parallel`` and
        ``kernel.serial`` (and ``kernel.twin``).

    Nothing compiles here: numba compiles each version on its first call with new argument types.
    """

    def build(fn: Callable) -> Callable:
        par = njit(cache=True, parallel=True)(fn)
        seq = njit(cache=True)(_serial_twin(fn))

        @functools.wraps(fn)
        def kernel(*args):
            work = args[count_arg]
            if twin is not None and use_twin(work):
                return twin(*args)
            return (par if getattr(work, "size", work) >= PARALLEL_MIN else seq)(*args)

        kernel.parallel = par
        kernel.serial = seq
        kernel.twin = twin
        return kernel

    return build if fn is None else build(fn)


def module_dispatchers(module: types.ModuleType) -> list:
    """The numba dispatchers defined in ``module``: plain ``njit`` ones and both versions of each switched kernel."""
    from numba.core.registry import CPUDispatcher

    found = []
    for fn in vars(module).values():
        for candidate in (fn, *(getattr(fn, a, None) for a in ("parallel", "serial", "kernel"))):
            if isinstance(candidate, CPUDispatcher):
                found.append(candidate)
    return found
