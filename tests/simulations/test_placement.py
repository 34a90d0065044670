"""What a simulated client reports about where it ran."""

from __future__ import annotations

import os
import socket
import sys
import types

from simulations.placement import worker_identity


def test_host_and_pid_without_ray(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert worker_identity() == {"host": socket.gethostname(), "pid": os.getpid()}


def test_ray_node_id_inside_a_ray_worker(monkeypatch):
    context = types.SimpleNamespace(get_node_id=lambda: "ab12")
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert worker_identity()["ray-node-id"] == "ab12"
    monkeypatch.setattr(fake_ray, "is_initialized", lambda: False)  # imported but not connected: no node
    assert "ray-node-id" not in worker_identity()
