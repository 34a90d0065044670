"""Where a simulated client ran: host, process and, inside Ray, the Ray node (for multi-node checks)."""

from __future__ import annotations

import os
import socket
import sys


def worker_identity() -> dict[str, str | int]:
    """``host`` and ``pid`` of this process, and ``ray-node-id`` when it is a Ray worker.

    Ray is not imported here: a SuperNode's ClientApp without Ray reports host and pid only.
    """
    info: dict[str, str | int] = {"host": socket.gethostname(), "pid": os.getpid()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        info["ray-node-id"] = ray.get_runtime_context().get_node_id()
    return info
