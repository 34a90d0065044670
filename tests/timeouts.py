"""Timeouts for the slow tests that hold on a loaded machine and still end.

A fixed limit measured on an idle machine fails under load (the deployment test passed alone in
127 s and timed out at 300 s while other jobs ran). Limits here grow with the load average per
core at the time of the wait (at most ``MAX_FACTOR`` times), and a wait on a run that keeps
writing its logs is extended while it makes progress, up to a hard cap.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

MAX_FACTOR = 6.0


def load_factor() -> float:
    """The 1-minute load average per core, between 1 and ``MAX_FACTOR``."""
    return min(MAX_FACTOR, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """``seconds`` times the current :func:`load_factor`."""
    return seconds * load_factor()


def _size(paths: Iterable[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def wait_while_progressing(
    condition: Callable[[], bool], timeout_s: float, what: str, logs: dict[str, Path], stall_s: float = 60.0
) -> float:
    """Poll ``condition`` until true; returns the seconds waited.

    Fails (``TimeoutError`` with the logs' tails) once ``scaled(timeout_s)`` has passed and the
    logs have not grown for ``scaled(stall_s)``, or after ``3 * scaled(timeout_s)`` in any case.
    """
    from benchmarks.local_processes import tails

    start = last_progress = time.monotonic()
    size = _size(logs.values())
    while not condition():
        now = time.monotonic()
        grown = _size(logs.values())
        if grown != size:
            size, last_progress = grown, now
        limit = scaled(timeout_s)
        if (now - start > limit and now - last_progress > scaled(stall_s)) or now - start > 3 * limit:
            raise TimeoutError(f"timed out after {now - start:.0f} s waiting for {what} (load factor "
                               f"{load_factor():.1f})\n{tails(logs)}")  # fmt: skip
        time.sleep(0.5)
    return time.monotonic() - start
