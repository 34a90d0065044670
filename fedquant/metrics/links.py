"""Transfer time on a link of a given speed (the upload budget's deadline, ``simulated-upload-seconds``)."""

from __future__ import annotations

import math


def transfer_seconds(num_bytes: int, bytes_per_second: float) -> float:
    """Seconds to move ``num_bytes`` at ``bytes_per_second``; infinite on a dead link (speed <= 0 or NaN)."""
    speed = float(bytes_per_second)
    return num_bytes / speed if speed > 0 else math.inf
