"""Helpers for scripts and tests that start local servers: free ports, waits with timeouts, stopping by PID."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    """Whether something accepts connections on ``127.0.0.1:port``."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def tails(logs: dict[str, Path], lines: int = 15) -> str:
    """The last ``lines`` lines of each log, headed by its name."""
    parts = []
    for name, path in logs.items():
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        parts.append(f"--- {name} ---\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, logs: dict[str, Path]) -> None:
    """Poll ``condition`` every 0.5 s; raise ``TimeoutError`` with the logs' tails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}\n{tails(logs)}")
        time.sleep(0.5)


def stop(pids: Iterable[int], timeout_s: float = 10) -> None:
    """Terminate the processes and all their descendants by PID; kill what is left after ``timeout_s``."""
    targets: list[psutil.Process] = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            targets += parent.children(recursive=True) + [parent]
        except psutil.NoSuchProcess:
            pass
    for target in targets:
        try:
            target.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(targets, timeout=timeout_s)
    for target in alive:
        try:
            target.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
