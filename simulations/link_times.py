"""Simulated link times of a round, as a round stage: download of each train message, upload of each reply.

Per-round metrics (``LinkTimes`` in ``QuantizedStrategy(..., extra_stages=[...])``):

``simulated-download-seconds``  slowest sampled client's download: message bytes / its download speed
``simulated-round-seconds``     max over the replies of download + upload seconds (upload counted only
                                with an ``uplink_bandwidth``); local training time is not simulated
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fedquant.metrics.links import transfer_seconds
from fedquant.strategies.stages import RoundStage, TrainRound

SIMULATED_DOWNLOAD_SECONDS = "simulated-download-seconds"
SIMULATED_ROUND_SECONDS = "simulated-round-seconds"


class LinkTimes(RoundStage):
    """Reports the round's simulated link times from the bytes the round really moved.

    Parameters
    ----------
    downlink_bandwidth, uplink_bandwidth : callable
        ``node_id -> bytes per second`` (uplink optional: without it only downloads count).
    """

    def __init__(
        self, downlink_bandwidth: Callable[[int], float], uplink_bandwidth: Callable[[int], float] | None = None
    ) -> None:
        self.downlink_bandwidth = downlink_bandwidth
        self.uplink_bandwidth = uplink_bandwidth

    def report(self, state: TrainRound) -> dict[str, int | float]:
        """``simulated-download-seconds`` and ``simulated-round-seconds`` of the round."""
        return link_metrics(
            state.traffic.downlink_bytes_of, state.reply_bytes, self.downlink_bandwidth, self.uplink_bandwidth
        )


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
