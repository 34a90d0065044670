"""The bytes of a Flower Message as Flower serialises it for the wire, beside fedquant's payload bytes.

fedquant's ``uplink-bytes`` / ``downlink-bytes`` count what the ArrayRecords hold
(``count_bytes()``). A message carries more: its metadata, the RecordDict, every ConfigRecord
and MetricRecord (the run config a server sends, the metrics a client reports), each Array's
dtype/shape/stype and each object's ``type|children|length`` header. :func:`message_bytes` counts
all of it: the deflated content of every object in the message, as the SuperLink stores and ships
them. The transport adds its own RPC framing on top (request/response protobufs with 64-hex object
ids: measured 0.8-1.3 kB per message in ``tests/e2e/test_deployment.py``), not counted here.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Array, Message
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects


def message_bytes(message: Message) -> int:
    """Bytes of Flower's serialisation of ``message``: every nested object's deflated content."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def messages_bytes(messages: Iterable[Message]) -> int:
    """:func:`message_bytes` summed over ``messages``; an object shared by several (the model that
    every train message of a round carries) is serialised once and counted once per message."""
    messages = list(messages)  # alive while counting: an Array's id is not reused
    arrays: dict[int, int] = {}
    total = 0
    for message in messages:
        for obj in get_all_nested_objects(message).values():
            if not isinstance(obj, Array):
                total += len(obj.deflate())
                continue
            if id(obj) not in arrays:
                arrays[id(obj)] = len(obj.deflate())
            total += arrays[id(obj)]
    return total


__all__ = ["message_bytes", "messages_bytes"]
