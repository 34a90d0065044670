"""When the codecs call their compiled kernels: once numba's on-disk cache is warm.

numba compiles a kernel on its first call with new argument types and keeps the machine code on
disk (``cache=True``). Compiling is slow, not the kernels: a ``parallel=True`` kernel takes 7-14 s
(numba's parfors passes, then LLVM), a serial one 1-5 s, so a fresh installation's first encode
took 10-40 s per codec. Nothing compiles at import; it is the first call that pays.

Every stage with kernels has a twin that gives the same bytes: the torch code of
:class:`~fedquant.codecs.dispatch.KernelDispatch` (the CUDA path), and for a kernel called
directly the NumPy ``twin`` given to :func:`~fedquant.codecs.kernels.common.parallel_kernel`.
While the cache is cold the codecs run the twins, and one background process per cache folder
builds the cache (``python -m fedquant.codecs.kernels.warmup``, one thread, niced with its
autogroup: :func:`lower_priority`); when it is done every process switches to the compiled
kernels, which then load from disk in milliseconds.
The cache is marked warm per numba and Python version, CPU and the stamps of the kernel sources,
so editing a kernel or upgrading numba warms it again.

``FEDQUANT_KERNELS`` (environment) chooses:

* ``auto`` (default): as above;
* ``numba``: always the compiled kernels, compiling on first use (the tests of the kernels,
  throughput benchmarks, and a cache folder that cannot be written);
* ``twin``: never the compiled kernels and no background build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODE_ENV = "FEDQUANT_KERNELS"
MODES = ("auto", "numba", "twin")
#: Source folders whose numba functions the warm-up compiles (their stamps key the marker).
KERNEL_SOURCES = (Path(__file__).parent, Path(__file__).parents[2] / "wire")
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


def cache_dir() -> Path | None:
    """The folder where numba caches this package's kernels (None if numba offers none)."""
    from fedquant.codecs.kernels.common import uniform24

    try:
        return Path(uniform24._cache._cache_path)  # numba's own choice: __pycache__, NUMBA_CACHE_DIR, ...
    except AttributeError:
        return None


def warm_key() -> str:
    """Hash of what numba's cached machine code depends on: versions, CPU, kernel sources."""
    import numba

    from fedquant.codecs.kernels import target

    stamps = sorted(
        (str(p), p.stat().st_mtime_ns, p.stat().st_size) for folder in KERNEL_SOURCES for p in folder.glob("*.py")
    )
    features = sorted(target.cpu_features())
    text = json.dumps([numba.__version__, sys.version_info[:2], target.cpu_name(), features, stamps])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: One module of each folder of :data:`KERNEL_SOURCES`: its cached jitted functions tell numba's cache folder.
_REPRESENTATIVES = ("fedquant.codecs.kernels.common", "fedquant.wire.rans")


def _machine_code_folders() -> dict[Path, Path]:
    """numba's cache folder of each folder of :data:`KERNEL_SOURCES`, as its cached functions report it."""
    import importlib

    folders = {}
    for source, name in zip(KERNEL_SOURCES, _REPRESENTATIVES):
        for value in vars(importlib.import_module(name)).values():
            path = getattr(getattr(value, "_cache", None), "_cache_path", None)
            if path is not None:
                folders[Path(path)] = source
                break
    return folders


def drop_stale_machine_code() -> int:
    """Delete numba's cached machine code of fedquant's kernels if any kernel source changed since it was built.

    numba checks a cached function against the stamp of *its own* source file only, and the code it
    caches includes the jitted functions it calls: after an edit of ``common.py`` alone, every kernel
    of ``grid.py`` that calls ``pack_into`` would load its old machine code, old ``pack_into``
    included, and run it silently. So the first process that sees a new :func:`warm_key` removes
    every cache file of the modules in :data:`KERNEL_SOURCES` and leaves a stamp of the key; the
    kernels then compile afresh (numba writes each file whole, so another process reading one meanwhile
    misses it and compiles). Returns the number of files removed.
    """
    removed = 0
    try:
        folders = _machine_code_folders()
        stamp = next(iter(folders), None)
        if stamp is None:
            return 0
        stamp = stamp / f"fedquant-sources-{warm_key()}"
        if stamp.exists():
            return 0
        for folder, source in folders.items():
            modules = {p.stem for p in source.glob("*.py")}
            for path in list(folder.glob("*.nbi")) + list(folder.glob("*.nbc")):
                if path.name.split(".", 1)[0] in modules:
                    path.unlink(missing_ok=True)
                    removed += 1
        for old in stamp.parent.glob("fedquant-sources-*"):
            old.unlink(missing_ok=True)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(f"stale machine code removed by process {os.getpid()}: {removed} files\n")
    except OSError:
        pass  # an unwritable cache folder: numba cannot have cached anything stale there either
    return removed


def marker_path(folder: Path | None = None) -> Path | None:
    """The file whose presence says the cache in ``folder`` is warm for :func:`warm_key`."""
    folder = cache_dir() if folder is None else folder
    return None if folder is None else folder / f"fedquant-warm-{warm_key()}"


def failed_path(folder: Path) -> Path:
    return folder / f"fedquant-warmup-failed-{warm_key()}"


def lock_path(folder: Path) -> Path:
    return folder / "fedquant-warmup.lock"


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
        drop_stale_machine_code()
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
    if folder is None:
        return True
    try:
        folder.mkdir(parents=True, exist_ok=True)
        drop_stale_machine_code()
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
    root = Path(__file__).parents[3]  # the folder that holds the imported ``fedquant`` package
    env = dict(os.environ)
    env.update({MODE_ENV: "numba", "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    with open(log_path(folder), "a") as log:
        _spawned = subprocess.Popen(
            [sys.executable, "-m", "fedquant.codecs.kernels.warmup", "--background"],
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
    "drop_stale_machine_code",
    "kernels_ready",
    "marker_path",
    "mode",
    "running_warmup",
    "warm_key",
]
