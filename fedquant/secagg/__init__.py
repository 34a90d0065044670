"""Secure aggregation (SecAgg+) for the Message API over summable, compressed updates.

The protocol is two pure state machines: :class:`SecAggServer` (four stages of requests and
replies, every reply checked) and :class:`SecAggClient` (one reply per request, state kept in a
ConfigRecord). :func:`run_secure_sum` runs them over Flower Messages with any
``send_and_receive``. What is summed comes from :mod:`fedquant.codecs.summable`; the user-facing
options are :class:`SecAggConfig`. See ``docs/secure-aggregation.md``.
"""

from fedquant.secagg.client import SecAggClient
from fedquant.secagg.config import SecAggConfig, SecAggConfigError
from fedquant.secagg.driver import LoopbackGrid, handle_message, run_secure_sum
from fedquant.secagg.groups import GroupedServer
from fedquant.secagg.messages import ProtocolError
from fedquant.secagg.server import SecAggServer, SecureSum, Segment

__all__ = [
    "GroupedServer",
    "LoopbackGrid",
    "ProtocolError",
    "SecAggClient",
    "SecAggConfig",
    "SecAggConfigError",
    "SecAggServer",
    "Segment",
    "SecureSum",
    "handle_message",
    "run_secure_sum",
]
