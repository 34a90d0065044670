"""Reading and writing codec bodies: typed sections with bounds checks before any allocation."""

from __future__ import annotations

import numpy as np

from fedquant.errors import PayloadError


def require_items(array, count: int, what: str) -> None:
    """PayloadError unless ``array`` holds at least ``count`` items.

    The numba kernels do not check their indices (bounds checks would cost throughput): every
    entry point that hands them a buffer from a payload checks its size with this first.
    """
    size = len(array)
    if size < count:
        raise PayloadError(f"{what} holds {size} items, decoding needs {count}")


class Deferred:
    """A body section that a kernel writes straight into the payload: ``nbytes`` bytes, produced by
    ``fill(dst)`` into a writable uint8 array of that size (any alignment).

    For large sections that would otherwise be computed into a fresh array and then copied into
    the payload (``rht+fp32``'s rotated floats): :func:`~fedquant.wire.payload.write_payload`
    calls ``fill`` on the payload's own memory. :meth:`materialize` gives the bytes instead.
    """

    def __init__(self, nbytes: int, fill) -> None:
        self.nbytes = int(nbytes)
        self.fill = fill

    def materialize(self) -> memoryview:
        dst = np.empty(self.nbytes, np.uint8)
        self.fill(dst)
        return memoryview(dst)


class BodyWriter:
    """Collects the sections of a body in order, without copying them."""

    def __init__(self) -> None:
        self.parts: list[memoryview | Deferred] = []

    def add(self, data: bytes | bytearray | memoryview | np.ndarray | Deferred) -> None:
        """Append raw bytes, a (C-contiguous) NumPy array's bytes, or a :class:`Deferred` section."""
        if isinstance(data, Deferred):
            self.parts.append(data)
            return
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.parts.append(memoryview(data).cast("B"))

    def add_array(self, array: np.ndarray | Deferred, dtype: np.dtype | str) -> None:
        """Append ``array`` converted to ``dtype`` (little-endian on the wire); a :class:`Deferred`
        section must already produce that dtype's bytes."""
        if isinstance(array, Deferred):
            self.add(array)
            return
        self.add(np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class BodyReader:
    """Reads sections of an untrusted body; every read is checked against what is left.

    Parameters
    ----------
    body : memoryview
        The body bytes.
    codec : str
        Codec name, used in error messages.
    """

    def __init__(self, body: memoryview, codec: str) -> None:
        self.body = body
        self.codec = codec
        self.pos = 0

    @property
    def remaining(self) -> int:
        return self.body.nbytes - self.pos

    def take(self, nbytes: int, what: str) -> memoryview:
        """The next ``nbytes`` bytes, or PayloadError naming ``what`` if the body is short."""
        if nbytes < 0 or nbytes > self.remaining:
            raise PayloadError(
                f"{self.codec} payload body is truncated: {what} needs {nbytes} bytes, {self.remaining} left"
            )
        out = self.body[self.pos : self.pos + nbytes]
        self.pos += nbytes
        return out

    def take_array(self, dtype: np.dtype | str, count: int, what: str) -> np.ndarray:
        """The next ``count`` items of ``dtype`` as a read-only array (no copy)."""
        dt = np.dtype(dtype).newbyteorder("<")
        raw = self.take(count * dt.itemsize, what)
        return np.frombuffer(raw, dtype=dt, count=count)

    def take_rest(self) -> memoryview:
        """Everything left in the body."""
        return self.take(self.remaining, "rest")

    def expect_end(self) -> None:
        """PayloadError if bytes are left over."""
        if self.remaining:
            raise PayloadError(f"{self.codec} payload body has {self.remaining} unexpected trailing bytes")
