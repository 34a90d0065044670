"""The Ray instance a simulation starts listens on loopback only (the project's rule for servers).

``python -m simulations.run`` runs one round on 2 supernodes in a subprocess (a fresh Ray, an
environment without the variable the fix sets); while it runs, every TCP socket in LISTEN state
owned by that process or any of its descendants (the driver's core worker, gcs_server, raylet,
the runtime-env agent, the workers) is recorded. Without :func:`simulations.loopback.ray_loopback_only`
Ray binds gcs_server, raylet and the workers to ``::`` (all interfaces) and the runtime-env agent
to the machine's address.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

from simulations.loopback import RAY_CLUSTER_ENV, ray_loopback_only
from tests.timeouts import scaled

ROOT = Path(__file__).resolve().parents[2]


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` and their IPv4-mapped form ``::ffff:127.x.y.z``."""
    address = ipaddress.ip_address(host.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def listening(root: psutil.Process) -> dict[tuple[int, str], set[str]]:
    """``(pid, name) -> {"ip:port"}`` of the TCP sockets in LISTEN state of ``root`` and its descendants."""
    found: dict[tuple[int, str], set[str]] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for proc in procs:
        try:
            name = proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.setdefault((proc.pid, name), set()).add(f"{conn.laddr.ip}:{conn.laddr.port}")
        except psutil.Error:
            continue
    return found


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.1.1"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2", "fd00::2"]))


@pytest.fixture
def ray_cluster_flag(monkeypatch):
    """Ray's constant as on Linux by default (clusters on), the variable unset; both restored after."""
    from ray._private import ray_constants

    assert ray._private.worker._global_node is None, "a Ray is running in this process"
    monkeypatch.delenv(RAY_CLUSTER_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    return ray_constants


def test_helper_makes_the_node_ip_loopback(ray_cluster_flag):
    from ray._private import services

    ray_loopback_only()
    assert os.environ[RAY_CLUSTER_ENV] == "0" and ray_cluster_flag.ENABLE_RAY_CLUSTER is False
    assert is_loopback(services.get_node_ip_address())


def test_helper_keeps_an_explicit_setting(ray_cluster_flag, monkeypatch):
    monkeypatch.setenv(RAY_CLUSTER_ENV, "1")
    ray_loopback_only()
    assert os.environ[RAY_CLUSTER_ENV] == "1" and ray_cluster_flag.ENABLE_RAY_CLUSTER is True


def test_loading_the_client_app_applies_it_before_ray_starts():
    """``flwr run``: Flower's simulation process imports Ray, loads the ClientApp, then starts Ray."""
    env = {k: v for k, v in os.environ.items() if k != RAY_CLUSTER_ENV} | {"PYTHONPATH": str(ROOT)}
    code = ("import os, ray._private.ray_constants as c; import simulations.client_app; "
            f"print(c.ENABLE_RAY_CLUSTER, os.environ.get({RAY_CLUSTER_ENV!r}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "0"], out.stdout


@pytest.mark.slow
def test_simulation_ray_listens_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != RAY_CLUSTER_ENV}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "simulations.run", "--num-supernodes", "2", "--num-cpus", "1",
           "--run-config", f'rounds=1 out-dir="{tmp_path}"']  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    seen: dict[tuple[int, str], set[str]] = {}
    deadline = time.monotonic() + scaled(240)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for key, addrs in listening(root).items():
                seen.setdefault(key, set()).update(addrs)
            time.sleep(0.3)
    finally:
        if proc.poll() is None:
            for child in root.children(recursive=True):
                child.kill()
            proc.kill()
        output = proc.communicate()[0]
    assert proc.returncode == 0, output[-3000:]
    names = {name for _, name in seen}
    # The check saw Ray itself, not only the driver: its GCS and raylet listen while the run lasts.
    assert {"gcs_server", "raylet"} <= names, (names, output[-3000:])
    exposed = {f"{name}[{pid}]": sorted(a for a in addrs if not is_loopback(a.rsplit(":", 1)[0]))
               for (pid, name), addrs in seen.items()}  # fmt: skip
    assert not {k: v for k, v in exposed.items() if v}, seen
