"""The arrays decoders write their values to: fresh ones, or memory a server reuses round after round.

A server decodes every reply of a round into an array of its own and keeps them all until the
round is aggregated (the direction rules read each update again once the consensus is known).
Fresh memory can cost more than the decode itself: the first write to each 4 KiB page of a new
array is a page fault (measured: docs/kernels.md, Decode buffers).

:class:`BufferPool` keeps the arrays of a round's decodes and lends them again in the next
round: within :meth:`BufferPool.lending`, :func:`output_array` takes from the pool instead of
allocating. An array goes back to the pool only when nothing else refers to it (no tensor, view
or slice of it is alive: CPython's reference count says so), so a decoded update that someone
kept is never overwritten. Memory held between rounds is at most what the last round lent.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

#: Smaller arrays come from the allocator's heap, where their pages are already mapped.
MIN_POOLED_BYTES = 1 << 16

_LENDER: ContextVar[BufferPool | None] = ContextVar("fedquant_buffer_pool", default=None)


def output_array(numel: int, dtype: type = np.float32) -> np.ndarray:
    """A new 1-D array of ``numel`` elements for a decoder's output (contents undefined): from the
    pool lending in this context (:meth:`BufferPool.lending`), else ``np.empty``."""
    pool = _LENDER.get()
    return np.empty(numel, dtype) if pool is None else pool.take(numel, dtype)


def _reference_counts(arrays: list[np.ndarray]) -> list[int]:
    return [sys.getrefcount(array) for array in arrays]


#: What :func:`_reference_counts` gives for an array held by nothing but its list.
_UNSHARED = _reference_counts([np.empty(1, np.uint8)])[0]


class BufferPool:
    """Decoder output memory kept from one round to the next (see the module docstring).

    Thread-safe: several threads may take arrays within one lending.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}  # size in bytes -> owning uint8 arrays
        self._lent: list[np.ndarray] = []

    @contextmanager
    def lending(self) -> Iterator[BufferPool]:
        """Within the block, :func:`output_array` takes from this pool (in this thread or task, and
        the threads it starts with a copy of its context). First :meth:`reclaim`\\ s the arrays lent
        before."""
        self.reclaim()
        token = _LENDER.set(self)
        try:
            yield self
        finally:
            _LENDER.reset(token)

    def take(self, numel: int, dtype: type = np.float32) -> np.ndarray:
        """A 1-D array of ``numel`` elements of ``dtype``: a free one of the same size in bytes, or a new one."""
        dtype = np.dtype(dtype)
        size = numel * dtype.itemsize
        if size < MIN_POOLED_BYTES:
            return np.empty(numel, dtype)
        with self._lock:
            free = self._free.get(size)
            memory = free.pop() if free else np.empty(size, np.uint8)
            self._lent.append(memory)
        return memory.view(dtype)  # a view: every array made from it refers to ``memory``

    def reclaim(self) -> None:
        """Return to the pool the lent arrays nothing else refers to any more; forget the others,
        and the free arrays no lending took since the last reclaim."""
        with self._lock:
            lent, self._lent = self._lent, []
            self._free = {}
            for memory, count in zip(lent, _reference_counts(lent), strict=True):
                if count <= _UNSHARED:
                    self._free.setdefault(memory.size, []).append(memory)

    def release(self) -> None:
        """Let go of every array the pool holds, free or lent (a lent one stays its holder's); the
        next lending allocates afresh."""
        with self._lock:
            self._free, self._lent = {}, []

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds, free or lent."""
        with self._lock:
            return sum(m.size for free in self._free.values() for m in free) + sum(m.size for m in self._lent)
