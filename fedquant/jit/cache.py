"""When the kernels run compiled: once this machine's kernel cache is warm.

numba compiles a kernel on its first call with new argument types and keeps the machine code on
disk (``cache=True``). Compiling is slow, not the kernels: a ``parallel=True`` kernel takes 7-14 s
(numba's parfors passes, then LLVM), a serial one 1-5 s, so a fresh installation's first encode
took 10-40 s per codec. Nothing compiles at import; it is the first call that pays.

Every stage with kernels has a twin that gives the same bytes: the torch code of
:class:`~fedquant.codecs.dispatch.KernelDispatch` (the CUDA path), and for a kernel called
directly the NumPy ``twin`` given to :func:`~fedquant.jit.twins.parallel_kernel`.
While the cache is cold the codecs run the twins, and one background process per machine at a
time builds it (``python -m fedquant.codecs.kernels.warmup``, one thread, niced with its
autogroup: :func:`lower_priority`); when it is done every process switches to the compiled
kernels, which then load from disk in milliseconds. The cache is one folder per machine and
version of the kernels (:mod:`fedquant.jit.locator`: keyed by numba and Python version, CPU and
the kernel sources' contents), shared by every copy of the package, so editing a kernel or
upgrading numba warms a new folder, and a ``flwr run`` copy of an app finds the checkout's.

``FEDQUANT_KERNELS`` (environment) chooses:

* ``auto`` (default): as above;
* ``numba``: always the compiled kernels, compiling on first use (the tests of the kernels,
  throughput benchmarks, and a cache folder that cannot be written);
* ``twin``: never the compiled kernels and no background build.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from fedquant.jit import locator

MODE_ENV = "FEDQUANT_KERNELS"
MODES = ("auto", "numba", "twin")
#: The module that compiles every kernel (it knows the codecs; this runtime does not import them).
WARMUP_MODULE = "fedquant.codecs.kernels.warmup"
RECHECK_SECONDS = 0.2
#: CPU priority of the background warm-up (``nice``), for the process and for its autogroup.
WARMUP_NICE = 10

READY = False  # True once the compiled kernels may be called (fast path of every check)
_last_check = 0.0
_spawned: subprocess.Popen | None = None


def mode() -> str:
    """The ``FEDQUANT_KERNELS`` mode (``auto`` when unset)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}; use one of {', '.join(MODES)}")
    return value


def cache_dir() -> Path:
    """The folder of this version's compiled kernels on this machine (:func:`fedquant.jit.locator.cache_folder`)."""
    return locator.cache_folder()


def warm_key() -> str:
    """Hash of what the cached machine code depends on (:func:`fedquant.jit.locator.cache_key`)."""
    return locator.cache_key()


def marker_path(folder: Path | None = None) -> Path:
    """The file whose presence says the cache in ``folder`` is warm (the folder is per :func:`warm_key`)."""
    return (cache_dir() if folder is None else folder) / "fedquant-warm"


def failed_path(folder: Path) -> Path:
    return folder / "fedquant-warmup-failed"


def lock_path(folder: Path) -> Path:
    """The warm-up lock: one for the machine, beside every version's folder, so one warm-up runs at a time."""
    return folder.parent / "fedquant-warmup.lock"


def pid_path(folder: Path) -> Path:
    """Holds the process id of the running warm-up (removed when it ends)."""
    return folder / "fedquant-warmup.pid"


def log_path(folder: Path) -> Path:
    return folder / "fedquant-warmup.log"


def try_lock(folder: Path):
    """The warm-up lock of ``folder`` as an open file, or None if another process holds it."""
    handle = open(lock_path(folder), "a")  # held open for the warm-up's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def kernels_ready() -> bool:
    """Whether the codecs should call their compiled kernels now (else their twins).

    Cheap: once true it stays true; before that, it looks for the warm marker at most every
    ``RECHECK_SECONDS`` and starts the background warm-up once per process when none runs.
    """
    global READY, _last_check
    if READY:
        return True
    current = mode()
    if current == "numba":
        READY = True
        return True
    if current == "twin":
        return False
    now = time.monotonic()
    if now - _last_check < RECHECK_SECONDS:
        return False
    _last_check = now
    READY = _check_or_start()
    return READY


def _check_or_start() -> bool:
    """True when the cache is warm, or when waiting for it would be pointless (then compile inline)."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if marker_path(folder).exists() or failed_path(folder).exists():
            return True
        if _spawned is not None:
            return _spawned.poll() is not None  # it ended without marking: compile inline
        handle = try_lock(folder)
        if handle is None:  # another process's warm-up is running
            return False
        handle.close()
        start_warmup(folder)
    except OSError:
        return True  # an unwritable cache folder: numba compiles in the process, as without this module
    return False


def start_warmup(folder: Path) -> subprocess.Popen:
    """Start ``python -m fedquant.codecs.kernels.warmup --background`` for ``folder`` (not waited for)."""
    global _spawned
    root = locator.PACKAGE.parent  # the folder that holds the imported ``fedquant`` package
    env = dict(os.environ)
    env.update({MODE_ENV: "numba", "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    with open(log_path(folder), "a") as log:
        _spawned = subprocess.Popen(
            [sys.executable, "-m", WARMUP_MODULE, "--background"],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the process that needed it (and its Ctrl-C)
        )
    lower_priority(_spawned.pid)  # before its imports: they overlap the first call the most
    return _spawned


def lower_priority(pid: int, nice: int = WARMUP_NICE) -> None:
    """Give process ``pid`` (a warm-up) the CPU priority ``nice``, also across sessions.

    ``nice`` alone is not enough on Linux with autogroup scheduling (``sched_autogroup_enabled``,
    the default of most distributions): the warm-up runs in a new session, hence a new autogroup,
    and the scheduler shares the CPU between autogroups by *their* nice value, so a niced
    warm-up competed as an equal with the first call that started it (which ran 1.5-2x slower
    beside it on 2 cores). The autogroup's nice is set too (``/proc/<pid>/autogroup``); each step
    is skipped where the system does not offer it, or when the process has ended.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, pid, max(nice, os.getpriority(os.PRIO_PROCESS, pid)))
    except (AttributeError, OSError):
        pass
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:
        pass


def running_warmup(folder: Path | None = None) -> int | None:
    """Process id of the warm-up building ``folder``'s cache now, if any."""
    folder = cache_dir() if folder is None else folder
    try:
        return int(pid_path(folder).read_text())
    except (OSError, ValueError):
        return None


__all__ = [
    "MODE_ENV",
    "cache_dir",
    "kernels_ready",
    "marker_path",
    "mode",
    "running_warmup",
    "warm_key",
]
