"""The self-describing payload envelope that every codec's bytes travel in.

Layout (little-endian)::

    magic     2 bytes  b"FQ"
    version   u8       FORMAT_VERSION
    dtype     u8       code of the original tensor's dtype (DTYPE_CODES)
    ndim      u8       number of dimensions, at most MAX_NDIM
    spec_len  u16      length of the codec spec, at most MAX_SPEC_LEN
    shape     ndim x u64
    spec      spec_len bytes of ASCII: the codec's canonical spec, e.g. "qsgd:bucket_size=512,...";
              stages joined by "+", each "name" or "name:key=value,..." ("rht:max_log2=12+qsgd:...")
    body_len  u64
    body      body_len bytes, codec specific
    crc32     u32      zlib CRC-32 of everything before it

Nothing here is ever unpickled or evaluated: the spec is checked against a strict character set
and compared with the decoder's own spec by the codec.
"""

from __future__ import annotations

import ctypes
import math
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedquant.errors import PayloadError
from fedquant.wire.body import Deferred
from fedquant.wire.checksum import crc32

MAGIC = b"FQ"
#: 2: the codec pipeline (every quantizer's spec names its ``coding``; transforms such as ``rht+``
#: prefix the spec). 3: ``coding=entropy`` sections are the interleaved rANS of
#: :mod:`fedquant.wire.entropy` (a header byte, lanes, blocks). 4: entropy-coded sections name
#: their coder (32-bit states with 16-bit words in 32 lanes, or 64-bit states with 32-bit words) in
#: two header bytes. 5: the random signs of ``rht`` (and EDEN's rotation) come 64 to a hash
#: (:func:`fedquant.rng.rotation_negative`), so a rotated payload of version 4 would decode to other
#: values. Older payloads are rejected with a message naming both versions.
FORMAT_VERSION = 5
_CHANGED_IN = {
    3: "version 3 changed the entropy-coded sections (interleaved rANS)",
    4: "version 4 changed the entropy-coded sections (a 32-lane rANS coder with 16-bit words)",
    5: "version 5 changed the rotation's random signs (64 to a hash)",
}
MAX_NDIM = 8
MAX_SPEC_LEN = 512
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_FIXED = struct.Struct("<2sBBBH")
_U64 = struct.Struct("<Q")
_CRC = struct.Struct("<I")
# One stage (checked stage by stage: a pattern for the whole spec would backtrack exponentially on
# forged specs, since values may hold "+").
_STAGE_CHARS = re.compile(r"[a-z0-9_\-]+(:[a-z0-9_]+=[A-Za-z0-9_.+\-]+(,[a-z0-9_]+=[A-Za-z0-9_.+\-]+)*)?")
#: A ``+`` that starts the next stage: one followed by a name (a value such as ``1e+20`` is not).
_STAGE_BREAK = re.compile(r"\+(?=\s*[A-Za-z][A-Za-z0-9_\-]*\s*(?::|\+|$))")


def split_stages(spec: str) -> list[str]:
    """The stages of a spec, outermost first: ``"rht:max_log2=12+qsgd"`` -> ``["rht:max_log2=12", "qsgd"]``."""
    return _STAGE_BREAK.split(spec)


def _valid_spec(spec: str) -> bool:
    return all(_STAGE_CHARS.fullmatch(stage) for stage in split_stages(spec))


@dataclass(frozen=True)
class Payload:
    """A parsed payload envelope: what it declares, and a view of its body."""

    spec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    body: memoryview

    @property
    def codec_name(self) -> str:
        """The spec without parameters: its stages' names joined by ``+`` (``"rht+qsgd"``)."""
        return "+".join(stage.partition(":")[0] for stage in split_stages(self.spec))

    @property
    def numel(self) -> int:
        """Number of elements the shape declares."""
        return math.prod(self.shape)


#: Payloads of at least this many bytes are assembled in memory the kernel may back with 2 MiB pages.
HUGE_PAYLOAD_BYTES = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _bytes_api():
    """``(new, address, madvise)`` from the C API and libc, or None where they are not available."""
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return None
    try:
        new = ctypes.pythonapi.PyBytes_FromStringAndSize
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
        address = ctypes.pythonapi.PyBytes_AsString
        address.restype, address.argtypes = ctypes.c_void_p, (ctypes.py_object,)
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.restype, madvise.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (AttributeError, OSError):
        return None
    return new, address, madvise


_BYTES_API = _bytes_api()


def _joined(head: bytes, body: Sequence, size: int) -> bytes:
    """``head``, the ``body`` sections and the CRC-32 of both: a payload of ``size`` bytes.

    A fresh ``bytes`` of 100 MB is faulted in 4 KiB pages as a join writes it: 47 ms on the
    project's machine. Large payloads instead go into a ``bytes`` whose pages are first advised as
    transparent huge pages (``madvise(MADV_HUGEPAGE)``, what NumPy does for its own large arrays;
    23 ms), made by ``PyBytes_FromStringAndSize(NULL, size)``, which the C API documents for
    exactly this: filled before anyone else sees it. :class:`~fedquant.wire.body.Deferred` sections
    are written there by their kernels; the CRC is then computed over the assembled bytes.
    """
    if size < HUGE_PAYLOAD_BYTES or _BYTES_API is None:
        parts = [p.materialize() if isinstance(p, Deferred) else p for p in body]
        crc = crc32(head)
        for part in parts:
            crc = crc32(part, crc)
        return b"".join([head, *parts, _CRC.pack(crc)])  # the body is copied once, here
    new, address, madvise = _BYTES_API
    out = new(None, size)
    start = address(out)
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + size) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a refusal leaves ordinary pages
    view = np.frombuffer((ctypes.c_char * size).from_address(start), np.uint8)
    pos = 0
    for part in (head, *body):
        n = part.nbytes if isinstance(part, Deferred) else memoryview(part).nbytes
        if isinstance(part, Deferred):
            part.fill(view[pos : pos + n])
        else:
            view[pos : pos + n] = np.frombuffer(part, np.uint8)
        pos += n
    if pos != size - _CRC.size:
        raise RuntimeError(f"payload parts hold {pos} bytes, expected {size - _CRC.size}")
    view[pos:] = np.frombuffer(_CRC.pack(crc32(view[:pos])), np.uint8)
    return out


def header_size(ndim: int, spec: str) -> int:
    """Bytes of envelope around a body: fixed header, shape, spec, body length and CRC."""
    return _FIXED.size + 8 * ndim + len(spec) + _U64.size + _CRC.size


def write_payload(
    spec: str, dtype: torch.dtype, shape: Sequence[int], body: Sequence[bytes | memoryview | Deferred]
) -> bytes:
    """Wrap a codec body (a sequence of buffers, joined in order) in the envelope."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported dtype {dtype}; fedquant encodes {sorted(map(str, DTYPE_CODES))}")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensors of more than {MAX_NDIM} dimensions are not supported, got {len(shape)}")
    spec_bytes = spec.encode("ascii")
    if len(spec_bytes) > MAX_SPEC_LEN or not _valid_spec(spec):
        raise ValueError(f"codec spec {spec!r} cannot go in a payload header")
    body_len = sum(b.nbytes if isinstance(b, Deferred) else memoryview(b).nbytes for b in body)
    head = b"".join(
        [
            _FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), len(spec_bytes)),
            b"".join(_U64.pack(int(d)) for d in shape),
            spec_bytes,
            _U64.pack(body_len),
        ]
    )
    return _joined(head, body, len(head) + body_len + _CRC.size)


def read_payload(
    payload: bytes | bytearray | memoryview, check_header: Callable[[Payload], None] | None = None
) -> Payload:
    """Check a payload's envelope and return what it declares.

    Parameters
    ----------
    payload : bytes
        Untrusted bytes.
    check_header : callable, optional
        Called with the parsed header (and a view of the body) before the checksum, so a caller
        that knows what to expect (codec, shape, largest body) rejects a payload without reading
        all of it: the CRC is the only step whose cost grows with the payload's size.

    Raises
    ------
    PayloadError
        If the bytes are not a payload of this format version, are truncated or extended, fail
        their checksum, or declare an impossible header (or ``check_header`` raises it).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
    view = memoryview(payload).cast("B")
    size = view.nbytes
    if size == 0:
        raise PayloadError("payload is empty")
    if size < _FIXED.size + _U64.size + _CRC.size:
        raise PayloadError(f"payload is truncated: {size} bytes is shorter than any header")
    magic, version, dtype_code, ndim, spec_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise PayloadError("payload does not start with the fedquant magic bytes b'FQ'")
    if version != FORMAT_VERSION:
        why = f": {_CHANGED_IN[version + 1]}" if version + 1 in _CHANGED_IN else ""
        raise PayloadError(
            f"payload format version {version} is not supported (this fedquant reads {FORMAT_VERSION}){why}"
        )
    if dtype_code not in CODE_DTYPES:
        raise PayloadError(f"payload declares unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise PayloadError(f"payload declares {ndim} dimensions, more than the {MAX_NDIM} allowed")
    if spec_len > MAX_SPEC_LEN:
        raise PayloadError(f"payload declares a codec spec of {spec_len} bytes, more than {MAX_SPEC_LEN}")
    head_len = header_size(ndim, "x" * spec_len)
    if size < head_len:
        raise PayloadError(f"payload is truncated: {size} bytes, its header alone needs {head_len}")
    pos = _FIXED.size
    shape = struct.unpack_from(f"<{ndim}Q", view, pos)
    pos += 8 * ndim
    spec_raw = bytes(view[pos : pos + spec_len])
    pos += spec_len
    (body_len,) = _U64.unpack_from(view, pos)
    pos += _U64.size
    expected = head_len + body_len
    if size < expected:
        raise PayloadError(f"payload is truncated: {size} bytes, its header declares {expected}")
    if size > expected:
        raise PayloadError(f"payload has {size - expected} unexpected trailing bytes")
    try:
        spec = spec_raw.decode("ascii")
    except UnicodeDecodeError:
        raise PayloadError("payload codec spec is not ASCII") from None
    if not _valid_spec(spec):
        raise PayloadError(f"payload codec spec {spec!r} is malformed")
    parsed = Payload(spec=spec, dtype=CODE_DTYPES[dtype_code], shape=tuple(shape), body=view[pos : pos + body_len])
    if check_header is not None:
        check_header(parsed)
    (crc,) = _CRC.unpack_from(view, size - _CRC.size)
    if crc32(view[: size - _CRC.size]) != crc:
        raise PayloadError("payload checksum mismatch: the bytes were corrupted in transit")
    return parsed
