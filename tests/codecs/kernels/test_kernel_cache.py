"""A cold numba cache costs no first call: the twins run while one background process builds it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedquant.codecs import available_codecs, codec_class, get_codec
from fedquant.codecs.kernels import common
from fedquant.codecs.kernels.warmup import warm_specs
from fedquant.jit import cache
from tests.timeouts import scaled

ROOT = Path(__file__).resolve().parents[3]
SPECS = ["qsgd", "eden:bits=2", "eden:bits=1.5", "dqsg", "orq", "signsgd", "rht+qsgd:levels=7"]
N = common.PARALLEL_MIN + 1001  # the parallel kernels, the slowest to compile

FRESH_PROCESS = """
import hashlib, json, sys
import torch
from numba.core import event
from fedquant.codecs import get_codec

compiled = []
class Count(event.Listener):
    def on_start(self, ev): compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev): pass

digests = {}
with event.install_listener("numba:compile", Count()):
    for spec in sys.argv[2:]:
        codec = get_codec(spec)
        x = torch.randn(int(sys.argv[1]), generator=torch.Generator().manual_seed(7))
        payload = codec.encode(x, seed=11)
        y = codec.decode(payload, seed=11)
        digests[spec] = [hashlib.sha256(payload).hexdigest(), hashlib.sha256(y.numpy().tobytes()).hexdigest()]
print(json.dumps({"digests": digests, "compiled": compiled}))
"""


def _stop_warmup(folder: Path) -> list[int]:
    """SIGTERM every warm-up building a cache under ``folder``; their process ids."""
    stopped = []
    for pid_file in folder.rglob("fedquant-warmup.pid"):
        pid = int(pid_file.read_text())
        if b"fedquant.codecs.kernels.warmup" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
    return stopped


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


def test_a_cold_cache_compiles_nothing_on_the_first_call_and_gives_the_kernels_bytes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_CACHE_DIR": str(tmp_path), "FEDQUANT_KERNELS": "auto"}
    try:
        out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(N), *SPECS], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
        result = json.loads(out.stdout.strip().splitlines()[-1])
        # ... and a warm-up process was started for that cache folder
        deadline = time.monotonic() + scaled(60)
        while not list(tmp_path.rglob("fedquant-warmup.pid")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(tmp_path.rglob("fedquant-warmup.pid")), "no background warm-up started"
    finally:
        stopped = _stop_warmup(tmp_path)
    # SIGTERM ends it, even while it compiles (a SystemExit raised in llvmlite's callbacks was ignored)
    deadline = time.monotonic() + scaled(30)
    while any(map(_running, stopped)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stopped and not any(map(_running, stopped)), "the warm-up outlived its SIGTERM"
    assert not list(tmp_path.rglob("fedquant-warmup.pid"))
    assert result["compiled"] == []
    for spec in SPECS:  # here FEDQUANT_KERNELS=numba (conftest): the compiled kernels
        codec = get_codec(spec)
        x = torch.randn(N, generator=torch.Generator().manual_seed(7))
        payload = codec.encode(x, seed=11)
        y = codec.decode(payload, seed=11)
        expected = [hashlib.sha256(payload).hexdigest(), hashlib.sha256(y.numpy().tobytes()).hexdigest()]
        assert result["digests"][spec] == expected, spec


@pytest.fixture
def cold(monkeypatch, tmp_path):
    """This process as if its cache (in ``tmp_path``) were cold, in ``auto`` mode."""
    monkeypatch.setenv(cache.MODE_ENV, "auto")
    monkeypatch.setattr(cache, "READY", False)
    monkeypatch.setattr(cache, "_last_check", 0.0)
    monkeypatch.setattr(cache, "_spawned", None)
    monkeypatch.setattr(cache, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_the_marker_switches_to_the_compiled_kernels(cold, monkeypatch):
    lock = cache.try_lock(cold)  # "another process's warm-up is running": nothing is started here
    try:
        assert not cache.kernels_ready() and cache._spawned is None
        cache.marker_path(cold).write_text("warm")
        monkeypatch.setattr(cache, "_last_check", 0.0)
        assert cache.kernels_ready() and cache.READY
    finally:
        lock.close()


def test_an_ended_warm_up_without_a_marker_falls_back_to_compiling(cold, monkeypatch):
    class Ended:
        def poll(self):
            return 1

    monkeypatch.setattr(cache, "_spawned", Ended())
    assert cache.kernels_ready()


def test_the_modes(cold, monkeypatch):
    monkeypatch.setenv(cache.MODE_ENV, "twin")
    cache.marker_path(cold).write_text("warm")
    assert not cache.kernels_ready()
    monkeypatch.setenv(cache.MODE_ENV, "numba")
    assert cache.kernels_ready()
    monkeypatch.setenv(cache.MODE_ENV, "fast")
    monkeypatch.setattr(cache, "READY", False)
    with pytest.raises(ValueError, match="FEDQUANT_KERNELS"):
        cache.kernels_ready()


COMPILE_SOME = """
import json, sys
from pathlib import Path
import numpy as np
from numba.core import event
import fedquant
from fedquant.codecs.kernels import common
from fedquant.wire import elias

assert Path(fedquant.__file__).parent == Path(sys.argv[1]), fedquant.__file__
compiled = []
class Count(event.Listener):
    def on_start(self, ev): compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev): pass

with event.install_listener("numba:compile", Count()):
    common.bucket_max_abs.serial(np.ones(100, np.float32), 16)
    elias._omega_encode_kernel.kernel(np.arange(1, 100, dtype=np.uint64))
used = (common.bucket_max_abs.serial, elias._omega_encode_kernel.kernel)
hits = sum(sum(fn.stats.cache_hits.values()) for fn in used)
print(json.dumps({"compiled": compiled, "hits": hits}))
"""


KERNELS = {"bucket_max_abs__serial", "_omega_encode_kernel"}  # one of codecs/kernels, one of wire


def _copy_package(to: Path) -> Path:
    """A copy of the ``fedquant`` sources under ``to`` (fresh file times, no caches); its package folder."""
    package = to / "fedquant"
    shutil.copytree(ROOT / "fedquant", package, copy_function=shutil.copy, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def _compile_some(package: Path, cache_root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package.parent), "FEDQUANT_CACHE_DIR": str(cache_root),
           "FEDQUANT_KERNELS": "numba"}  # fmt: skip
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", COMPILE_SOME, str(package)], cwd=package.parent, env=env,
                         capture_output=True, text=True, timeout=scaled(300), check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three fresh processes compile: 20-50 s on 2 busy cores
def test_two_copies_of_the_package_share_one_kernel_cache_keyed_by_the_sources_contents(tmp_path):
    shared = tmp_path / "user-cache"
    first = _compile_some(_copy_package(tmp_path / "checkout"), shared)
    assert KERNELS <= set(first["compiled"]) and first["hits"] == 0
    # Another copy at another path (a `flwr run` copy of an app): it loads the first one's machine code.
    second = _compile_some(_copy_package(tmp_path / "apps" / "app.1234"), shared)
    assert second == {"compiled": [], "hits": 2}
    assert len(list((shared / "kernels").iterdir())) == 1  # one folder: this machine, these sources
    # An edit of one kernel source (here a comment) makes every cached kernel stale: the other module's too.
    edited = _copy_package(tmp_path / "edited")
    with open(edited / "codecs" / "kernels" / "common.py", "a") as source:
        source.write("# edited\n")
    third = _compile_some(edited, shared)
    assert KERNELS <= set(third["compiled"])
    assert len([p for p in (shared / "kernels").iterdir() if p.is_dir()]) == 2


def test_the_cache_folder_is_the_users_unless_the_environment_names_one(monkeypatch, tmp_path):
    from fedquant.jit import locator

    monkeypatch.delenv(locator.CACHE_ENV, raising=False)
    monkeypatch.setattr("numba.core.config.CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert locator.cache_root() == tmp_path / "xdg" / "fedquant" / "kernels"
    monkeypatch.setattr("numba.core.config.CACHE_DIR", str(tmp_path / "numba"))
    assert locator.cache_root() == tmp_path / "numba" / "fedquant" / "kernels"
    monkeypatch.setenv(locator.CACHE_ENV, str(tmp_path / "mine"))
    assert locator.cache_root() == tmp_path / "mine" / "kernels"
    assert locator.cache_folder() == tmp_path / "mine" / "kernels" / locator.cache_key()


def test_one_warm_up_at_a_time_per_machine(tmp_path):
    root = tmp_path / "kernels"
    one, other = root / "key-one", root / "key-two"  # two versions of the kernels
    for folder in (one, other):
        folder.mkdir(parents=True)
    held = cache.try_lock(one)
    try:
        assert held is not None and cache.try_lock(other) is None
    finally:
        held.close()
    again = cache.try_lock(other)
    assert again is not None
    again.close()


@pytest.mark.parametrize(("n", "offset"), [(1, 0), (1000, 7), (common.PARALLEL_MIN + 3, 12345)])
def test_the_uniform_stream_twin_is_the_kernel(n, offset):
    key = common.kernel_key(99)
    assert np.array_equal(common.uniform_stream.twin(key, n, offset), common.uniform_stream.serial(key, n, offset))


def test_the_warm_up_covers_every_codec_and_coding():
    specs = set(warm_specs())
    for name in available_codecs():
        assert name in specs and f"rht+{name}" in specs
        assert all(f"{name}:coding={c}" in specs for c in codec_class(name).codings[1:])
