"""Where numba keeps fedquant's compiled kernels: one folder per machine, shared by every copy.

numba's own locators cache beside the sources (``__pycache__``) or in a folder named after the
source *path*, so every copy of the package (a checkout, a wheel, each ``flwr run`` copy of an app
under ``~/.flwr/apps/<app>.<hash>/``) compiled the kernels again. :class:`KernelCacheLocator` puts
the kernels of :data:`SOURCE_FILES` in ``<user cache>/fedquant/kernels/<key>/``, the key a hash of
what the machine code depends on: numba and Python versions, the target CPU and its features, and
the *contents* of the kernel sources (not their paths or times). A cached kernel includes the jitted
functions it calls from other modules, so every kernel's source stamp is the digest of all of them:
an edit of any kernel source makes every cached kernel stale, and a new key folder.

``FEDQUANT_CACHE_DIR`` (environment) replaces ``<user cache>/fedquant``, else ``NUMBA_CACHE_DIR``
does (``$NUMBA_CACHE_DIR/fedquant``). Where the folder cannot be written, numba's own locators
take over.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from numba.core import caching
from numba.misc.appdirs import AppDirs

from fedquant.jit import target

CACHE_ENV = "FEDQUANT_CACHE_DIR"
PACKAGE = Path(__file__).resolve().parents[1]  # the imported ``fedquant`` folder
#: Folders whose numba functions this locator caches, and whose sources key the cache.
SOURCE_FOLDERS = (PACKAGE / "codecs" / "kernels", PACKAGE / "wire", PACKAGE / "jit")
#: Modules outside them whose constants the kernels compile in.
SOURCE_EXTRAS = (PACKAGE / "rng.py",)


def source_files() -> list[Path]:
    """The kernel sources, in a fixed order."""
    return sorted({*(p for folder in SOURCE_FOLDERS for p in folder.glob("*.py")), *SOURCE_EXTRAS})


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """SHA-256 of the kernel sources' names (relative to the package) and contents."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def cache_key() -> str:
    """Hash of what the cached machine code depends on: versions, CPU, kernel sources."""
    import numba

    features = sorted(target.cpu_features())
    text = json.dumps([numba.__version__, list(sys.version_info[:2]), sys.abiflags, target.cpu_name(), features,
                       sources_digest()])  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """``$FEDQUANT_CACHE_DIR/kernels``, else ``$NUMBA_CACHE_DIR/fedquant/kernels``, else
    ``<user cache folder>/fedquant/kernels`` (``~/.cache/fedquant/kernels`` on Linux)."""
    from numba.core import config

    if os.environ.get(CACHE_ENV):
        base = Path(os.environ[CACHE_ENV])
    elif config.CACHE_DIR:
        base = Path(config.CACHE_DIR) / "fedquant"
    else:
        base = Path(AppDirs(appname="fedquant", appauthor=False).user_cache_dir)
    return base.expanduser() / "kernels"


def cache_folder() -> Path:
    """This machine's folder for this version of the kernels: ``cache_root() / cache_key()``."""
    return cache_root() / cache_key()


def _is_kernel_source(py_file: str) -> bool:
    path = Path(py_file).resolve()
    return path.parent in SOURCE_FOLDERS or path in SOURCE_EXTRAS


class KernelCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """numba cache locator of fedquant's kernels: :func:`cache_folder`, stamped by :func:`sources_digest`."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        # Module names repeat across folders (a future wire/common.py): one subfolder per source folder.
        self._cache_path = str(cache_folder() / Path(py_file).resolve().parent.relative_to(PACKAGE).as_posix()
                               .replace("/", "."))  # fmt: skip

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        return sources_digest()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _is_kernel_source(py_file):
            return None
        return super().from_function(py_func, py_file)  # None where the folder cannot be written


def _impl_classes() -> list[type]:
    """numba's cache implementations whose locator list this module extends."""
    base = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # _CacheImpl in older numba
    return [base]


def install() -> None:
    """Put :class:`KernelCacheLocator` first in numba's locators (idempotent; other functions pass through it)."""
    for impl in _impl_classes():
        if KernelCacheLocator not in impl._locator_classes:
            impl._locator_classes = [KernelCacheLocator, *impl._locator_classes]
