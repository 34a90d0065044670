"""A value per node id with one eviction rule, shared by every cross-round memory of the server.

A leaf module (no fedquant imports) so that admission's references and the drift ledger keep
their per-node state under the same rule without importing each other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class NodeMemory(Generic[V]):
    """A value per node id, at most ``max_clients`` of them: the least recently written forgotten first.

    The one eviction rule of admission's per-node memories (persistence's CUSUM, for instance).
    """

    def __init__(self, max_clients: int) -> None:
        self.max_clients = max_clients
        self._values: OrderedDict[object, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, node: object) -> bool:
        return node in self._values

    def __iter__(self) -> Iterator[object]:
        return iter(self._values)

    def get(self, node: object, default: V) -> V:
        """The node's value (``default`` when not seen, or forgotten)."""
        return self._values.get(node, default)

    def put(self, node: object, value: V) -> None:
        """Write the node's value, now its most recent; forget the oldest beyond ``max_clients``."""
        self._values.pop(node, None)
        self._values[node] = value
        while len(self._values) > self.max_clients:
            self._values.popitem(last=False)
