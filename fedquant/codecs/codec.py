"""A codec is a pipeline: transforms -> quantizer -> symbol coder -> envelope.

::

    x ──► [stateful transforms] ──► [transforms] ──► quantizer ──► symbol coder ──► envelope ──► bytes
          client only: ef             on the wire:   side data +    fixed | elias |   format, spec,
          (state passed in/out)       rht, ...       symbols        entropy           dtype, shape, CRC

Decoding runs the wire stages backwards. Everything a payload must satisfy (envelope, spec,
shape, dtype, size limits, finite output) is checked here once, for every pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedquant.codecs.coders.layout import decode_body, defer_body, defers_body, encode_body, max_body_bytes
from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.quantizers.base import NonFiniteInput, Quantizer
from fedquant.codecs.transforms.base import NonFiniteOutput, StatefulTransform, Transform
from fedquant.errors import PayloadError
from fedquant.wire.body import BodyReader
from fedquant.wire.payload import DTYPE_CODES, Payload, header_size, read_payload, write_payload

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


class Codec:
    """A quantizer with the transforms in front of it: tensor <-> self-describing payload.

    Build one with :func:`fedquant.codecs.get_codec` (``"ef+qsgd:levels=7,coding=entropy"``).
    The quantizer's parameters read as attributes (``codec.levels``).

    Parameters
    ----------
    quantizer : Quantizer
        The quantizer stage (its ``coding`` parameter selects the symbol coder).
    transforms : sequence of Transform or StatefulTransform
        Outermost first; stateful ones (client state) must come before those on the wire.
    """

    def __new__(
        cls, quantizer: Quantizer | None = None, transforms: Sequence[Transform | StatefulTransform] = ()
    ) -> Codec:
        # A quantizer of another kind (side information) brings its own codec class (no quantizer: unpickling).
        kind = getattr(quantizer, "codec_kind", None)
        return super().__new__(kind if cls is Codec and kind is not None else cls)

    def __init__(self, quantizer: Quantizer, transforms: Sequence[Transform | StatefulTransform] = ()) -> None:
        if not isinstance(quantizer, Quantizer):
            raise TypeError(f"a codec needs a Quantizer, got {type(quantizer).__name__}")
        seen_wire = False
        names = set()
        for t in transforms:
            if not isinstance(t, (Transform, StatefulTransform)):
                raise TypeError(f"not a transform: {t!r}")
            if t.name in names:
                raise ValueError(f"transform {t.name!r} is given twice")
            names.add(t.name)
            if isinstance(t, StatefulTransform) and seen_wire:
                raise ValueError(f"'{t.name}+' keeps client state and must come before the transforms on the wire")
            seen_wire = seen_wire or isinstance(t, Transform)
        self.quantizer = quantizer
        self.stateful_transforms: tuple[StatefulTransform, ...] = tuple(
            t for t in transforms if isinstance(t, StatefulTransform)
        )
        for t in self.stateful_transforms:
            t.bind_codec(quantizer)  # error feedback refuses codecs it could diverge with
        self.wire_transforms: tuple[Transform, ...] = tuple(t for t in transforms if isinstance(t, Transform))

    # ------------------------------------------------------------------ description
    @property
    def name(self) -> str:
        """What the payload names: the wire transforms and the quantizer (``"rht+qsgd"``)."""
        return "+".join([t.name for t in self.wire_transforms] + [self.quantizer.name])

    @property
    def wire_spec(self) -> str:
        """The spec the payload carries: wire transforms and the quantizer's canonical spec."""
        return "+".join([t.spec for t in self.wire_transforms] + [self.quantizer.spec])

    @property
    def spec(self) -> str:
        """Canonical spec of the whole pipeline (``"ef+rht+qsgd:bucket_size=512,..."``)."""
        return "+".join([t.spec for t in self.stateful_transforms] + [self.wire_spec])

    @property
    def config(self) -> dict[str, Any]:
        """The quantizer's parameters."""
        return self.quantizer.config

    @property
    def stateful(self) -> bool:
        """Whether encoding keeps client state (use :meth:`encode_stateful`)."""
        return bool(self.stateful_transforms)

    @property
    def unbiased(self) -> bool:
        return self.quantizer.unbiased and not any(t.biased for t in self.stateful_transforms)

    #: Whether decoding needs side information (the codec kind :class:`~fedquant.codecs.side_info.SideInfoCodec`).
    needs_side_info: bool = False

    @property
    def force_torch(self) -> bool:
        """Whether the quantizer and the transforms run their torch path on CPU tensors too (path-equality tests)."""
        return self.quantizer.force_torch

    @force_torch.setter
    def force_torch(self, value: bool) -> None:
        for stage in (self.quantizer, *self.wire_transforms):
            stage.force_torch = bool(value)

    def without_state(self) -> Codec:
        """The same pipeline without its client-state transforms (what the server decodes with)."""
        return Codec(self.quantizer, self.wire_transforms) if self.stateful else self

    # ------------------------------------------------------------------ variants (a codec is a value)
    def with_params(self, **params: Any) -> Codec:
        """The same pipeline with some quantizer parameters changed (``codec.with_params(levels=4)``)."""
        return self.with_quantizer(self.quantizer.with_params(**params)) if params else self

    def with_quantizer(self, quantizer: Quantizer) -> Codec:
        """The same transforms in front of another quantizer (``ef+rht+`` kept)."""
        return Codec(quantizer, (*self.stateful_transforms, *self.wire_transforms))

    def rate_ladder(self) -> list[Codec]:
        """The settings a rate controller may choose, finest (``self``) first: the quantizer's ladder."""
        return [self if q is self.quantizer else self.with_quantizer(q) for q in self.quantizer.rate_ladder()]

    @property
    def rate(self) -> float:
        """The number that names this setting on its ladder (``levels``, ``bits``, ...; see ``Quantizer.rate``)."""
        return self.quantizer.rate

    # ------------------------------------------------------------------ size model
    def predict_bytes(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the payload of a tensor of ``shape`` (an int: a flat tensor), without encoding one.

        Exact for fixed-width coding (the sizes of every stage are declared); an upper bound for
        Elias and entropy coding (see :func:`~fedquant.codecs.coders.symbols.stream_bytes`).
        """
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if dtype not in DTYPE_CODES:
            raise ValueError(f"{self.name}.predict_bytes: dtype {dtype} is not supported")
        numel = math.prod(shape)
        for t in self.wire_transforms:
            numel = t.output_numel(numel)
        return header_size(len(shape), self.wire_spec) + self.quantizer.body_bytes(numel)

    def __getattr__(self, key: str) -> Any:
        # Quantizer parameters read as codec attributes (codec.levels, codec.coding).
        quantizer = self.__dict__.get("quantizer")
        if quantizer is not None and key in quantizer.config:
            return quantizer.config[key]
        raise AttributeError(f"{type(self).__name__} {self.__dict__.get('quantizer')!r} has no attribute {key!r}")

    def __repr__(self) -> str:
        return f"Codec({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    # ------------------------------------------------------------------ encode
    def encode(self, x: torch.Tensor, seed: int = 0) -> bytes:
        """Encode a tensor into a self-describing payload (stateless: no client-state transform runs).

        Parameters
        ----------
        x : torch.Tensor
            Any shape, float32/float16/bfloat16/float64, CPU or CUDA; need not be contiguous.
        seed : int
            Seed of the codec's random streams (rounding, dither, rotation). Same seed and input
            give identical bytes.

        Returns
        -------
        bytes
            Envelope (format version, wire spec, dtype, shape) + body + CRC-32.
        """
        checked = not self._input_checked_downstream()
        return self._encode_checked(self._flat_input(x, seed, checked), seed, x.dtype, x.shape, checked)

    def encode_stateful(
        self, x: torch.Tensor, seed: int, state: Mapping[str, torch.Tensor | None] | None
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """Encode with the client-state transforms (error feedback) and return their new state.

        Parameters
        ----------
        x : torch.Tensor
            The tensor (as for :meth:`encode`).
        seed : int
            Seed of the codec's random streams.
        state : mapping of str to Tensor or None
            This tensor's state per transform name (``{"ef": residual}``) from the previous
            call; missing or None on the first.

        Returns
        -------
        payload : bytes
            What :meth:`decode` reads (the server needs no state).
        new_state : dict of str to Tensor
            Float32 tensors of ``x``'s shape, on its device, per stateful transform.
        """
        encoded = self.encode_measured(x, seed, state, measure=False)
        return encoded.payload, encoded.state

    def encode_measured(
        self,
        x: torch.Tensor,
        seed: int,
        state: Mapping[str, torch.Tensor | None] | None = None,
        *,
        measure: bool = True,
    ) -> Encoded:
        """Encode (with the client-state transforms and ``state``), and measure the error if asked.

        The error is the wire stages' on what they were given: the update itself, or
        ``update + residual`` behind error feedback (then exactly the new residual). Measuring
        costs one decode, which a stateful pipeline runs anyway; a codec whose decoder needs
        information the encoder lacks (:attr:`measurable` False) reports none when stateless.

        Returns
        -------
        Encoded
            The payload, the new state (empty for a stateless pipeline) and the summed squared
            error (None when not measured).
        """
        if not self.stateful_transforms:
            checked = not self._input_checked_downstream()
            flat = self._flat_input(x, seed, checked)
            payload = self._encode_checked(flat, seed, x.dtype, x.shape, checked)
            if not (measure and self.measurable):
                return Encoded(payload, {}, None)
            decoded = self._decoded_by_encoder(payload, seed, flat, x.shape)
            return Encoded(payload, {}, _squared_error(flat, decoded))
        flat = self._flat_input(x, seed)
        state = state or {}
        kept = []
        for t in self.stateful_transforms:
            flat, keep = t.apply(flat, state.get(t.name), lambda v: self.expected_error(v, seed))
            kept.append(keep)
        payload = self._encode_checked(flat.contiguous(), seed, x.dtype, x.shape)
        decoded = self._decoded_by_encoder(payload, seed, flat, x.shape)
        error = _squared_error(flat, decoded) if measure else None
        new_state = {}
        for t, keep in zip(reversed(self.stateful_transforms), reversed(kept)):
            new_state[t.name] = t.next_state(keep, decoded).reshape(x.shape)
            decoded = keep  # an outer transform sees what the inner one was given
        return Encoded(payload, new_state, error)

    #: Whether a stateless encoder can measure its own error (it can decode its own payload).
    measurable: bool = True

    def _decoded_by_encoder(self, payload: bytes, seed: int, flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """What the decoder will get back, flat float32 on ``flat``'s device (``flat``: the wire stages' input)."""
        return self.decode(payload, seed, shape=shape, device=flat.device).to(torch.float32).reshape(-1)

    def expected_error(self, flat: torch.Tensor, seed: int = 0) -> float | None:
        """The wire pipeline's ``E||decode(encode(x)) - x||^2 / ||x||^2`` for this flat tensor, as declared.

        The quantizer's :meth:`~fedquant.codecs.Quantizer.expected_error` of the tensor after the
        wire transforms (rotations: orthogonal, so the ratio is the same in either coordinates).
        Quantizers that only declare a bound are not given the rotated tensor.
        """
        q = self.quantizer
        numel = flat.numel()
        for t in self.wire_transforms:
            numel = t.output_numel(numel)
        if type(q).expected_error is Quantizer.expected_error:
            return q.error_bound(numel)
        for t in self.wire_transforms:
            flat = t.forward(flat.contiguous(), seed)
        return q.expected_error(flat.contiguous())

    def _quantizer_checks_finite(self) -> bool:
        """Whether the quantizer, given the input as it is (no wire transform first), rejects NaN/Inf itself."""
        return not self.wire_transforms and self.quantizer.checks_finite()

    @property
    def _transform_checks_input(self) -> bool:
        """Whether the first wire transform refuses a non-finite input in its own pass (``rht``).

        The stateless encoders then leave the check to it (one pass over the tensor fewer) and
        name the input as the cause when it refuses (:meth:`_encode_flat`).
        """
        return bool(self.wire_transforms) and self.wire_transforms[0].checks_finite

    def _input_checked_downstream(self) -> bool:
        """Whether a stateless encode may skip its own NaN/Inf pass over the input: what runs on the
        input first refuses a non-finite one in its own pass, the first wire transform
        (:attr:`_transform_checks_input`) or, without wire transforms, the quantizer
        (:meth:`_quantizer_checks_finite`)."""
        return self._transform_checks_input or self._quantizer_checks_finite()

    def _encode_checked(
        self, flat: torch.Tensor, seed: int, dtype: torch.dtype, shape: Sequence[int], checked: bool = True
    ) -> bytes:
        """:meth:`_encode_flat`, with the quantizer's own rejection of NaN/Inf worded as :meth:`_flat_input`'s."""
        try:
            return self._encode_flat(flat, seed, dtype, tuple(shape), checked)
        except NonFiniteInput:
            raise ValueError(self._nonfinite_input()) from None

    def _flat_input(self, x: torch.Tensor, seed: int, check_finite: bool = True) -> torch.Tensor:
        """``x`` flat, float32 and contiguous; ValueError on NaN/Inf when ``check_finite`` (else a later
        stage refuses them, :meth:`_input_checked_downstream`)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}.encode expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPE_CODES:
            raise ValueError(f"{self.name}.encode: dtype {x.dtype} is not supported; use a floating tensor")
        check_seed(seed)
        flat = x.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        if check_finite and not all_finite(flat):
            raise ValueError(self._nonfinite_input())
        return flat.contiguous()

    def _nonfinite_input(self) -> str:
        return f"{self.name}.encode: the tensor contains NaN or Inf"

    def _encode_flat(
        self, flat: torch.Tensor, seed: int, dtype: torch.dtype, shape: tuple[int, ...], checked: bool = True
    ) -> bytes:
        """The payload of ``flat``; ``checked``: whether ``flat`` is known finite (else the first transform checks)."""
        source = flat
        quantizer = self.quantizer
        wire = self.wire_transforms
        try:
            for t in wire[:-1]:
                flat = t.forward(flat, seed).contiguous()
            rotation = wire[-1].fused(flat.numel(), seed, flat) if wire else None
            if rotation is not None and quantizer.fuses(rotation):  # the kernels rotate as they quantize
                body = encode_body(quantizer.with_rotation(rotation), flat, seed, rotation.padded)
            else:
                if wire:
                    flat = wire[-1].forward(flat, seed).contiguous()
                body = encode_body(quantizer, flat, seed)
            # (a kernel may write a section straight into the payload here: wire.body.Deferred)
            return write_payload(self.wire_spec, dtype, shape, body.parts)
        except NonFiniteOutput:
            if not checked and not all_finite(source):
                raise ValueError(self._nonfinite_input()) from None
            raise

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
        check_finite: bool = True,
    ) -> torch.Tensor:
        """Check and decode a payload produced by ``encode`` with the same pipeline.

        Parameters
        ----------
        payload : bytes
            Untrusted bytes.
        seed : int
            The seed given to ``encode`` (dither and rotation are regenerated from it).
        side_info : torch.Tensor, optional
            Decoder side information (same number of elements): only for codecs of the
            side-information kind (:class:`~fedquant.codecs.side_info.SideInfoCodec`), which require it.
        shape, dtype : optional
            What the caller expects; a payload that declares otherwise is rejected.
        device : torch.device or str
            Where the result goes.
        max_numel : int, optional
            Largest element count accepted when ``shape`` is not given (guards allocation).
            Default: :func:`numel_limit` of the payload's size.
        check_finite : bool
            Refuse a payload that decodes to NaN or Inf (one reduction over the result). Only a
            caller that checks every value itself in a later pass (the server adds each decoded
            update to the model it sent and refuses any non-finite sum) may turn this off.

        Returns
        -------
        torch.Tensor
            Same shape and dtype as the encoded tensor.

        Raises
        ------
        PayloadError
            For any malformed, corrupted or mismatched payload, or one that decodes to NaN/Inf.
        """
        p, quantizer, sizes, body, wire, rotation = self._open(payload, seed, side_info, shape, dtype, max_numel)
        flat = decode_body(quantizer, body, sizes[-1], seed)
        body.expect_end()
        expected = sizes[len(wire)]
        if flat.numel() != expected:
            raise PayloadError(f"{self.name} body decoded to {flat.numel()} elements, expected {expected}")
        finite = bool(rotation.finite if rotation is not None else quantizer.values_finite)
        for t, n in zip(reversed(wire), reversed(sizes[: len(wire)])):
            flat, finite = t.inverse_checked(flat, n, seed)
        # Check the tensor as returned: a float32 value beyond the declared float16/bfloat16
        # range becomes Inf in the cast. The last transform may have seen every value already.
        out = flat.reshape(p.shape).to(dtype=p.dtype)
        known = finite and p.dtype in (torch.float32, torch.float64)
        if check_finite and not known and not all_finite(out):
            raise PayloadError(f"{self.name} payload decodes to NaN or Inf values as {p.dtype}")
        return out.to(device=device)

    def decode_deferred(
        self, payload: bytes | bytearray | memoryview, seed: int, *, shape: Sequence[int]
    ) -> DeferredValues | None:
        """The float32 values :meth:`decode` would return, flat, without writing them out.

        A :class:`~fedquant.codecs.deferred.DeferredValues` for the pipelines whose decoder is
        cheap enough to run in every pass over the values (no transforms, a quantizer that defers
        its fixed-width symbols: QSGD, TernGrad, on the CPU kernels), or that writes its values out
        in the first pass (EDEN at integer rates behind its rotation, which adds them to a
        server's sums while they are in cache); None for the others, before
        anything is read (call :meth:`decode` then). The payload must declare ``shape`` and
        float32, and is checked as :meth:`decode` checks it, except for the values: out-of-range
        symbols raise from the first pass over them, and their finiteness is the caller's to
        check (:meth:`DeferredValues.accumulate` counts it).

        Raises
        ------
        PayloadError
            As :meth:`decode`.
        """
        if not defers_body(self.quantizer) or (self.wire_transforms and not self._rotates_deferred()):
            return None
        _, quantizer, sizes, body, wire, _ = self._open(payload, seed, None, shape, torch.float32, None)
        if wire:  # (a rotation the quantizer defers through is fused whenever its kernels run)
            raise RuntimeError(f"{self.name}: the rotation was not fused into the deferring quantizer")
        values = defer_body(quantizer, body, sizes[-1], seed)
        body.expect_end()
        return values

    def _rotates_deferred(self) -> bool:
        """Whether the one wire transform is a rotation the quantizer undoes in its own deferred pass
        (:meth:`Quantizer.defers_rotated`)."""
        wire = self.wire_transforms
        return len(wire) == 1 and wire[0].name == "rht" and self.quantizer.defers_rotated()

    def _open(
        self,
        payload: bytes | bytearray | memoryview,
        seed: int,
        side_info: torch.Tensor | None,
        shape: Sequence[int] | None,
        dtype: torch.dtype | None,
        max_numel: int | None,
    ) -> tuple[Payload, Quantizer, list[int], BodyReader, tuple[Transform, ...], Any]:
        """The checked payload, its body's quantizer, the element counts through the transforms
        (the declared count first), a reader positioned at the body, the wire transforms left to
        invert after the body, and the rotation the body's quantizer applies itself (a fused
        ``rht``: :meth:`Transform.fused`; then the last wire transform is not among those left), or None."""
        check_seed(seed)

        def check_header(p: Payload) -> None:  # before the CRC: cheap rejections first
            if p.codec_name != self.name:
                raise PayloadError(f"payload holds codec '{p.codec_name}', this decoder is '{self.name}'")
            if p.spec != self.wire_spec:
                raise PayloadError(f"payload was encoded as '{p.spec}', this decoder expects '{self.wire_spec}'")
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
                        f"payload declares shape {list(p.shape)}: its nonzero dimensions multiply to {bulk} "
                        f"elements, more than the {limit} allowed"
                    )
            if dtype is not None and dtype != p.dtype:
                raise PayloadError(f"payload declares dtype {p.dtype}, expected {dtype}")
            size = p.numel
            for t in self.wire_transforms:
                size = t.output_numel(size)
            bound = max_body_bytes(self.quantizer, size)
            if p.body.nbytes > bound:
                raise PayloadError(
                    f"{self.name} payload body holds {p.body.nbytes} bytes, more than the {bound} that "
                    f"{p.numel} elements can need"
                )

        p = read_payload(payload, check_header)
        sizes = [p.numel]
        wire = self.wire_transforms
        for t in wire:
            sizes.append(t.output_numel(sizes[-1]))
        rotation = wire[-1].fused(sizes[-2], seed) if wire else None
        if rotation is not None and self.quantizer.fuses(rotation):  # the kernels rotate back as they dequantize
            wire = wire[:-1]
            quantizer = self._body_quantizer(p.numel, seed, side_info, len(wire)).with_rotation(rotation)
        else:
            rotation = None
            quantizer = self._body_quantizer(p.numel, seed, side_info).for_decode()
        body = BodyReader(p.body, self.name)
        return p, quantizer, sizes, body, wire, rotation

    def _body_quantizer(
        self, numel: int, seed: int, side_info: torch.Tensor | None, transforms: int | None = None
    ) -> Quantizer:
        """The quantizer that decodes the body (the side-information kind binds its side information,
        through the first ``transforms`` wire transforms: default all)."""
        if side_info is not None:
            raise ValueError(f"{self.name} takes no side_info; only side-information codecs do")
        return self.quantizer


@dataclass(frozen=True)
class Encoded:
    """One tensor encoded by :meth:`Codec.encode_measured`."""

    payload: bytes
    state: dict[str, torch.Tensor]
    squared_error: float | None


def _squared_error(sent: torch.Tensor, decoded: torch.Tensor) -> float:
    """Sum of squared differences, in float64, of two flat float32 tensors."""
    return float(torch.sum((sent - decoded).double() ** 2))


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element is finite.

    A NaN or Inf anywhere makes the sum NaN or Inf, so a finite sum proves all elements finite
    in one cheap reduction; only a non-finite sum (possibly an overflow of large finite values)
    needs the exact elementwise check.
    """
    if bool(torch.isfinite(x.sum(dtype=torch.float64) if x.dtype == torch.float64 else x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def check_seed(seed: int) -> None:
    """TypeError/ValueError unless ``seed`` is a non-negative int."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
