"""A cold numba cache costs no first call: the twins run while one background process builds it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedquant.codecs import available_codecs, codec_class, get_codec
from fedquant.codecs.kernels import cache, common
from fedquant.codecs.kernels.warmup import warm_specs
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
    for pid_file in folder.glob("*/fedquant-warmup.pid"):
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
        while not list(tmp_path.glob("*/fedquant-warmup.pid")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(tmp_path.glob("*/fedquant-warmup.pid")), "no background warm-up started"
    finally:
        stopped = _stop_warmup(tmp_path)
    # SIGTERM ends it, even while it compiles (a SystemExit raised in llvmlite's callbacks was ignored)
    deadline = time.monotonic() + scaled(30)
    while any(map(_running, stopped)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stopped and not any(map(_running, stopped)), "the warm-up outlived its SIGTERM"
    assert not list(tmp_path.glob("*/fedquant-warmup.pid"))
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
    monkeypatch.setattr(cache, "_machine_code_folders", lambda: {})
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


def test_the_marker_depends_on_the_kernel_sources(monkeypatch, tmp_path):
    source = tmp_path / "kernel.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(cache, "KERNEL_SOURCES", (tmp_path,))
    before = cache.warm_key()
    source.write_text("x = 22\n")
    assert cache.warm_key() != before


def test_machine_code_built_from_older_kernel_sources_is_removed_once_per_source_change(monkeypatch, tmp_path):
    # numba checks a cached kernel against its own file only; grid.py's kernels inline common.py's.
    sources, machine_code, other = tmp_path / "kernels", tmp_path / "cache", tmp_path / "cache" / "keep"
    sources.mkdir()
    other.mkdir(parents=True)
    for module in ("grid", "common"):
        (sources / f"{module}.py").write_text("x = 1\n")
    cached = [
        "grid.round_pack_into-95.py311.nbi",
        "grid.round_pack_into-95.py311.1.nbc",
        "common.pack_into-40.py311.nbi",
    ]
    foreign = ["elsewhere.kernel-3.py311.nbi"]  # another package's cache file in a shared folder
    for name in cached + foreign:
        (machine_code / name).write_bytes(b"machine code")
    monkeypatch.setattr(cache, "_machine_code_folders", lambda: {machine_code: sources})
    monkeypatch.setattr(cache, "KERNEL_SOURCES", (sources,))

    assert cache.drop_stale_machine_code() == len(cached)
    assert sorted(p.name for p in machine_code.glob("*.nb*")) == foreign
    (machine_code / cached[0]).write_bytes(b"compiled from these sources")
    assert cache.drop_stale_machine_code() == 0  # same sources: what was compiled since stays
    assert (machine_code / cached[0]).exists()

    time.sleep(0.01)
    (sources / "common.py").write_text("x = 22\n")  # an edit of common.py alone
    assert cache.drop_stale_machine_code() == 1
    assert not (machine_code / cached[0]).exists()
    assert len(list(machine_code.glob("fedquant-sources-*"))) == 1


@pytest.mark.parametrize(("n", "offset"), [(1, 0), (1000, 7), (common.PARALLEL_MIN + 3, 12345)])
def test_the_uniform_stream_twin_is_the_kernel(n, offset):
    key = common.kernel_key(99)
    assert np.array_equal(common.uniform_stream.twin(key, n, offset), common.uniform_stream.serial(key, n, offset))


def test_the_warm_up_covers_every_codec_and_coding():
    specs = set(warm_specs())
    for name in available_codecs():
        assert name in specs and f"rht+{name}" in specs
        assert all(f"{name}:coding={c}" in specs for c in codec_class(name).codings[1:])
