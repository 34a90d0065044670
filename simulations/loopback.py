"""Make the local Ray that Flower's simulation starts listen on loopback only.

Ray (2.55) binds its gRPC servers (gcs_server, raylet, every core worker, the driver's included)
to the wildcard ``::`` and its runtime-env agent to the node's IP address, which ``ray.init``
finds by routing towards the Internet (the machine's LAN address). Passing
``init_args={"_node_ip_address": "127.0.0.1"}`` does not help: ``ray.init`` replaces a loopback
address with that routed one (``ray._private.services.resolve_ip_for_localhost``). Only when
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` is false (read from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, true by default on Linux) does the node IP become the
loopback address, and then every Ray server binds to it (measured: gcs_server, raylet, the
workers on ``::ffff:127.0.0.1``, the runtime-env agent on ``127.0.0.1``). The constant is read
only when Ray is imported, so :func:`ray_loopback_only` sets both the variable (for processes
started later, such as ``flwr-simulation``) and the constant of an already imported Ray.

The flag has no other use in Ray 2.55 than that choice of node IP (and a refusal in ``ray start``
on Windows and macOS). It does not change a simulation that attaches to a running Ray cluster
(``RAY_ADDRESS`` or ``init_args.address``): that cluster's nodes listen where ``ray start`` put them.
"""

from __future__ import annotations

import os
import sys

#: Ray's switch: "0" makes a local Ray use the loopback address as its node IP.
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_loopback_only() -> None:
    """Make a Ray started after this call in this process (and its children) listen on loopback.

    Call it before ``run_simulation`` (or before Flower's simulation process starts Ray: the
    ClientApp module calls it when it is loaded, which Flower does before it starts the Ray
    backend). A value of ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` already in the environment is
    kept (``=1`` restores Ray's all-interfaces binding for a user who needs it). A Ray already
    running in this process keeps its sockets.
    """
    os.environ.setdefault(RAY_CLUSTER_ENV, "0")
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = os.environ[RAY_CLUSTER_ENV].strip().lower() in ("1", "true")
