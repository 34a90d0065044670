"""The codec base class: parameters, the payload envelope and all checks live here.

A codec subclass declares its parameters and implements two methods on flat float32 tensors:
``_encode(flat, seed) -> BodyWriter`` and ``_decode(body, numel, seed, side_info) -> Tensor``.
Everything a payload must satisfy (envelope, codec and parameters, shape, dtype, size limits,
finite output) is checked here once, for every codec.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from fedquant.codecs.params import Param, format_value
from fedquant.errors import PayloadError
from fedquant.wire.body import BodyReader, BodyWriter
from fedquant.wire.payload import DTYPE_CODES, read_payload, write_payload

DEFAULT_MAX_NUMEL = 1 << 31
#: Without an expected shape, a payload may declare this many elements whatever its size ...
FREE_NUMEL = 1 << 20
#: ... and beyond that at most this many per byte it holds (1/32 bit per element).
NUMEL_PER_BYTE = 256


def numel_limit(payload_bytes: int) -> int:
    """Elements a payload of ``payload_bytes`` may declare when the caller expects no shape.

    Decoding allocates the declared tensor, so without this bound a 90-byte payload could ask
    for gigabytes. Real payloads spend far more than 1/32 bit per element (bucket scales alone
    take 1/16 bit at the default bucket size); a caller that decodes a larger, more compressible
    tensor passes ``shape`` or ``max_numel``.
    """
    return min(DEFAULT_MAX_NUMEL, max(FREE_NUMEL, NUMEL_PER_BYTE * payload_bytes))


class Codec(ABC):
    """Base class of all fedquant codecs.

    Subclasses set the class attributes and implement ``_encode`` / ``_decode``. Parameters are
    given as keyword arguments, checked against ``params`` and stored as attributes.

    Attributes
    ----------
    name : str
        Registry name (``"qsgd"``).
    params : dict of str to Param
        Declared parameters with defaults and bounds.
    unbiased : bool
        Whether ``E[decode(encode(x))] = x``.
    needs_side_info : bool
        Whether ``decode`` requires ``side_info``.
    paper : str
        Where the method comes from, for docs and tables.
    wire : str
        What goes on the wire, in words.
    """

    name: ClassVar[str]
    params: ClassVar[dict[str, Param]] = {}
    unbiased: ClassVar[bool] = False
    needs_side_info: ClassVar[bool] = False
    paper: ClassVar[str] = ""
    wire: ClassVar[str] = ""

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(unknown)}; known: {known}")
        self.config: dict[str, Any] = {}
        for key, param in self.params.items():
            value = param.convert(self.name, key, params.get(key, param.default))
            self.config[key] = value
            setattr(self, key, value)
        self._validate()

    def _validate(self) -> None:
        """Cross-parameter checks; raise ValueError with a sentence naming the problem."""
        return None

    @property
    def spec(self) -> str:
        """Canonical spec string: the name and every parameter, sorted by key."""
        items = ",".join(f"{k}={format_value(v)}" for k, v in sorted(self.config.items()) if v is not None)
        return f"{self.name}:{items}" if items else self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    # ------------------------------------------------------------------ encode
    def encode(self, x: torch.Tensor, seed: int = 0) -> bytes:
        """Encode a tensor into a self-describing payload.

        Parameters
        ----------
        x : torch.Tensor
            Any shape, float32/float16/bfloat16/float64, CPU or CUDA; need not be contiguous.
        seed : int
            Seed of the codec's random stream (rounding or dither). Same seed and input give
            identical bytes.

        Returns
        -------
        bytes
            Envelope (format version, codec spec, dtype, shape) + body + CRC-32.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}.encode expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPE_CODES:
            raise ValueError(f"{self.name}.encode: dtype {x.dtype} is not supported; use a floating tensor")
        _check_seed(seed)
        flat = x.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        if not all_finite(flat):
            raise ValueError(f"{self.name}.encode: the tensor contains NaN or Inf")
        body = self._encode(flat.contiguous(), seed)
        return write_payload(self.spec, x.dtype, tuple(x.shape), body.parts)

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        payload: bytes | bytearray | memoryview,
        seed: int = 0,
        side_info: torch.Tensor | None = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        max_numel: int | None = None,
    ) -> torch.Tensor:
        """Check and decode a payload produced by ``encode`` with the same parameters.

        Parameters
        ----------
        payload : bytes
            Untrusted bytes.
        seed : int
            The seed given to ``encode`` (dithered codecs regenerate their dither from it).
        side_info : torch.Tensor, optional
            Decoder side information (same number of elements), for codecs that use it.
        shape, dtype : optional
            What the caller expects; a payload that declares otherwise is rejected.
        device : torch.device or str
            Where the result goes.
        max_numel : int, optional
            Largest element count accepted when ``shape`` is not given (guards allocation).
            Default: :func:`numel_limit` of the payload's size (at least ``2**20`` elements,
            more for larger payloads, at most ``2**31``).

        Returns
        -------
        torch.Tensor
            Same shape and dtype as the encoded tensor.

        Raises
        ------
        PayloadError
            For any malformed, corrupted or mismatched payload, or one that decodes to NaN/Inf.
        """
        _check_seed(seed)
        p = read_payload(payload)
        if p.codec_name != self.name:
            raise PayloadError(f"payload holds codec '{p.codec_name}', this decoder is '{self.name}'")
        if p.spec != self.spec:
            raise PayloadError(f"payload was encoded as '{p.spec}', this decoder expects '{self.spec}'")
        if shape is not None:
            if tuple(shape) != p.shape:
                raise PayloadError(f"payload declares shape {list(p.shape)}, expected {list(shape)}")
        else:
            # The nonzero dimensions, not the element count: shape (0, 2**63) holds no elements
            # but no tensor can take it.
            limit = numel_limit(memoryview(payload).nbytes) if max_numel is None else max_numel
            bulk = math.prod(d for d in p.shape if d)
            if bulk > limit:
                raise PayloadError(
                    f"payload declares shape {list(p.shape)}: its nonzero dimensions multiply to {bulk} elements, "
                    f"more than the {limit} allowed"
                )
        if dtype is not None and dtype != p.dtype:
            raise PayloadError(f"payload declares dtype {p.dtype}, expected {dtype}")
        numel = p.numel
        side = None
        if side_info is not None:
            side = side_info.detach().reshape(-1).to(torch.float32)
            if side.numel() != numel:
                raise PayloadError(f"{self.name} payload declares {numel} elements, its side_info has {side.numel()}")
        elif self.needs_side_info:
            raise ValueError(f"{self.name}: decoding needs side_info (the decoder's estimate of the update)")
        body = BodyReader(p.body, self.name)
        flat = self._decode(body, numel, seed, side)
        body.expect_end()
        if flat.numel() != numel:
            raise PayloadError(f"{self.name} body decoded to {flat.numel()} elements, header declares {numel}")
        # Check the tensor as returned: a float32 value beyond the declared float16/bfloat16
        # range becomes Inf in the cast.
        out = flat.reshape(p.shape).to(dtype=p.dtype)
        if not all_finite(out):
            raise PayloadError(f"{self.name} payload decodes to NaN or Inf values as {p.dtype}")
        return out.to(device=device)

    # ------------------------------------------------------------------ subclass API
    @abstractmethod
    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        """Encode a contiguous 1-D float32 tensor (on any device) into body sections."""

    @abstractmethod
    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        """Decode a body into a 1-D float32 tensor of ``numel`` elements (raise PayloadError)."""


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element is finite.

    A NaN or Inf anywhere makes the sum NaN or Inf, so a finite sum proves all elements finite
    in one cheap reduction; only a non-finite sum (possibly an overflow of large finite values)
    needs the exact elementwise check.
    """
    if bool(torch.isfinite(x.sum(dtype=torch.float64) if x.dtype == torch.float64 else x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
