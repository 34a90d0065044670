"""Simulated link times of a round: download of each train message, upload of each reply.

Per-round metrics (when the strategy has a ``downlink_bandwidth``):

``simulated-download-seconds``  slowest sampled client's download: message bytes / its download speed
``simulated-round-seconds``     max over the replies of download + upload seconds (upload counted only
                                with an ``uplink_bandwidth``); local training time is not simulated
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

SIMULATED_DOWNLOAD_SECONDS = "simulated-download-seconds"
SIMULATED_ROUND_SECONDS = "simulated-round-seconds"


def transfer_seconds(num_bytes: int, bytes_per_second: float) -> float:
    """Seconds to move ``num_bytes`` at ``bytes_per_second``; infinite on a dead link (speed <= 0 or NaN)."""
    speed = float(bytes_per_second)
    return num_bytes / speed if speed > 0 else math.inf


def link_metrics(
    downlink_bytes: Mapping[int, int],
    uplink_bytes: Mapping[int, int],
    downlink_bandwidth: Callable[[int], float],
    uplink_bandwidth: Callable[[int], float] | None,
) -> dict[str, float]:
    """The round's simulated link times.

    Parameters
    ----------
    downlink_bytes : mapping of int to int
        Per sampled node, the bytes of its train message.
    uplink_bytes : mapping of int to int
        Per replying node, the bytes of its reply.
    downlink_bandwidth, uplink_bandwidth : callable
        ``node_id -> bytes per second``.
    """
    down = {n: transfer_seconds(b, downlink_bandwidth(n)) for n, b in downlink_bytes.items()}
    rounds = [
        down.get(n, 0.0) + (transfer_seconds(b, uplink_bandwidth(n)) if uplink_bandwidth is not None else 0.0)
        for n, b in uplink_bytes.items()
    ]
    return {
        SIMULATED_DOWNLOAD_SECONDS: max(down.values(), default=0.0),
        SIMULATED_ROUND_SECONDS: max(rounds, default=0.0),
    }
