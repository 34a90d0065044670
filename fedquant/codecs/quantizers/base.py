"""The quantizer stage: a flat float32 tensor to side data plus a stream of symbols, and back.

A quantizer declares what it sends and leaves the bytes to the other stages:

* **side data** (:meth:`Quantizer.side_fields`): typed arrays that precede the symbols, e.g. one
  float32 scale per bucket, or each bucket's levels;
* **symbols**: one integer in ``0 .. num_symbols() - 1`` per element (e.g. ``q + s`` for a signed
  grid level ``q``), written by the symbol coder of the ``coding`` parameter
  (:mod:`fedquant.codecs.coders`): fixed width, Elias (symmetric alphabets only) or rANS.

The body layout (side fields in order, then the symbol stream) is
:mod:`fedquant.codecs.coders.layout`'s, the same for every quantizer. A quantizer whose kernels
fuse rounding with bit packing returns the packed bytes directly when the coder asks for a fixed
width (:attr:`Quantized.packed`), and may decode packed bytes in one pass
(:meth:`Quantizer.dequantize_packed`); the plain route goes through unpacked symbols.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from fedquant.codecs.buckets import check_bucket_scales, effective_bucket_size, num_buckets
from fedquant.codecs.coders.symbols import coder_takes_counts, stream_bytes
from fedquant.codecs.dispatch import KernelDispatch
from fedquant.codecs.params import Configurable, Param
from fedquant.errors import PayloadError
from fedquant.wire.bitpack import unpack_bits
from fedquant.wire.body import BodyReader, require_items

if TYPE_CHECKING:
    from fedquant.codecs.deferred import DeferredValues

CODINGS = ("fixed", "elias", "entropy")


class NonFiniteInput(ValueError):
    """Raised by :meth:`Quantizer.quantize` of a quantizer that :meth:`~Quantizer.checks_finite` on a NaN or Inf."""


def require_finite(stats: np.ndarray) -> None:
    """NonFiniteInput unless every per-bucket statistic is finite (a NaN or Inf in a bucket makes its max one)."""
    if stats.size and not np.isfinite(stats).all():
        raise NonFiniteInput("the tensor contains NaN or Inf")


@dataclass(frozen=True)
class SideField:
    """One typed array of side data that precedes the symbols in a body.

    Attributes
    ----------
    what : str
        Name for error messages ("bucket scales").
    dtype : str
        Wire dtype, little-endian NumPy notation (``"<f4"``, ``"<f2"``).
    count : int
        Number of items.
    """

    what: str
    dtype: str
    count: int


@dataclass
class Quantized:
    """What a quantizer produced for one tensor.

    Attributes
    ----------
    side : list of np.ndarray
        One array per :class:`SideField`, in order (converted to the field's dtype when written).
    symbols : np.ndarray, optional
        Unpacked symbols, one per element, each below ``num_symbols()``.
    packed : np.ndarray, optional
        The symbols already packed at the fixed width the coder asked for (uint8), instead of
        ``symbols``.
    counts : np.ndarray, optional
        The histogram of ``symbols`` (``num_symbols()`` int64 counts), when the quantizer's
        kernel counted them in its own pass (:meth:`Quantizer.wants_counts`); the entropy coder
        then skips its own counting pass.
    stream : list of np.ndarray, optional
        The symbol section as the quantizer codes it itself (uint8 parts, in order), for
        quantizers with :attr:`Quantizer.own_stream`.
    """

    side: list[np.ndarray]
    symbols: np.ndarray | None = None
    packed: np.ndarray | None = None
    counts: np.ndarray | None = None
    stream: list[np.ndarray] | None = None


class Quantizer(Configurable, KernelDispatch):
    """Base of the quantizer stage.

    Subclasses set the class attributes, declare ``params`` (``coding`` is added from
    ``codings``) and implement :meth:`num_symbols`, :meth:`side_fields`, :meth:`quantize` and
    :meth:`dequantize`.

    Attributes
    ----------
    codings : tuple of str
        Symbol codings this quantizer offers; the first is the default. Empty for a quantizer
        without a symbol stream (the float baselines).
    symmetric : bool
        Whether the symbols are ``q + h`` for signed levels ``q`` in ``[-h, h]``,
        ``num_symbols() = 2h + 1`` (Elias coding of the signed levels needs this).
    unbiased : bool
        Whether ``E[dequantize(quantize(x))] = x``.
    implied_transforms : tuple of str
        Wire transforms this quantizer always runs behind (EDEN: ``("rht",)``); ``get_codec``
        adds them when a spec does not name them.
    paper, wire : str
        Provenance and what goes on the wire, in words.
    own_stream : bool
        Whether the quantizer codes its symbol section itself (:attr:`Quantized.stream` and
        :meth:`read_stream`) instead of one stream of the shared coders: ECDQ codes each dither
        context with its own table.
    force_torch : bool
        Run the torch implementation on CPU tensors too (tests of path equality).
    """

    codings: ClassVar[tuple[str, ...]] = ("fixed", "entropy")
    symmetric: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    implied_transforms: ClassVar[tuple[str, ...]] = ()
    own_stream: ClassVar[bool] = False
    paper: ClassVar[str] = ""
    wire: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("params")
        if own is None and "codings" not in cls.__dict__:
            return  # inherits both: the parent's coding parameter already fits
        params = dict(cls.params)
        if own is None or "coding" not in own:  # derive it from this class's codings, not a parent's
            params.pop("coding", None)
            if cls.codings:
                choices = tuple(cls.codings)
                params["coding"] = Param(str, choices[0], f"symbol stream: {', '.join(choices)}", choices=choices)
        cls.params = params

    #: The wire rotation its kernels apply themselves (a copy from :meth:`with_rotation`), or None.
    rotation = None

    def fuses(self, rotation) -> bool:
        """Whether the kernels can apply ``rotation`` (``rht``'s :class:`~fedquant.codecs.transforms.rht.FusedRotation`)
        themselves, chunk by chunk, in :meth:`quantize` and the dequantize methods. Default: no.

        A quantizer that says yes, once bound (:meth:`with_rotation`), quantizes the tensor
        *before* the rotation (``rotation.padded`` values after it) and dequantizes straight to
        the tensor after the inverse rotation (``rotation.numel`` values), setting
        ``rotation.finite``; the bytes are those of the unfused pipeline.
        """
        return False

    def with_rotation(self, rotation) -> Quantizer:
        """A copy bound to ``rotation`` (see :meth:`fuses`)."""
        bound = copy.copy(self)
        bound.rotation = rotation
        return bound

    #: Set by a dequantize method, on the copy of one decode call (:meth:`for_decode`), when it
    #: checked every value it returned for NaN or Inf in its own pass: the codec then skips its
    #: pass over the result.
    values_finite = False

    def for_decode(self) -> Quantizer:
        """A copy for one decode call, on which the dequantize methods record what they checked
        (``values_finite``); the quantizer a codec holds is shared by every call and thread."""
        bound = copy.copy(self)
        bound.values_finite = False
        return bound

    # ------------------------------------------------------------------ declarations
    @abstractmethod
    def num_symbols(self) -> int:
        """Size of the symbol alphabet (0: no symbol stream)."""

    @abstractmethod
    def side_fields(self, numel: int) -> list[SideField]:
        """The side data a tensor of ``numel`` elements sends before its symbols."""

    def check_side(self, side: list[np.ndarray]) -> None:
        """PayloadError if decoded side data is invalid (e.g. a negative scale). Default: no check."""
        return None

    def checks_finite(self) -> bool:
        """Whether :meth:`quantize` itself rejects a NaN or Inf in its input (:class:`NonFiniteInput`).

        True for quantizers whose bucket statistics (a maximum, a mean of absolute values) are
        finite exactly when the bucket is: they check those few values, and the codec skips its
        own pass over the input (one read of it, about a third of a copy's time). Default False.
        """
        return False

    def wants_counts(self) -> bool:
        """Whether :meth:`quantize` should return the symbol histogram (:attr:`Quantized.counts`).

        True when the symbols go to an entropy coder that takes a histogram counted elsewhere.
        """
        return getattr(self, "coding", None) == "entropy" and coder_takes_counts()

    # ------------------------------------------------------------------ error declarations
    def error_bound(self, numel: int) -> float | None:
        """A bound on the relative error ``E||Q(x) - x||^2 / ||x||^2`` over every ``x`` of ``numel`` elements.

        For an unbiased quantizer this is its variance ``omega``; a biased one with a bound below
        1 is contractive. Error feedback (``ef+``) reads it: it refuses a biased quantizer whose
        bound exceeds 1 (its residual could grow every round) and one that declares none
        (``None``, the default), and scales unbiased ones by ``1 / (1 + omega)``
        (:mod:`fedquant.codecs.transforms.error_feedback`). Every quantizer should declare it.
        """
        return None

    def expected_error(self, flat: torch.Tensor) -> float | None:
        """``E[||Q(x) - x||^2 | x] / ||x||^2`` for this input (``flat``: 1-D float32, any device).

        Default: :meth:`error_bound` of its size. Quantizers whose error has a closed form given
        the input (stochastic rounding, subtractive dither) override it with the exact value,
        which is what error feedback scales by (a worst-case bound would shrink every update).
        """
        return self.error_bound(flat.numel())

    # ------------------------------------------------------------------ size model and rate ladder
    def body_bytes(self, numel: int) -> int:
        """Bytes of the body for ``numel`` elements, without encoding anything.

        The side fields' declared sizes plus the symbol stream's
        (:func:`~fedquant.codecs.coders.symbols.stream_bytes`): exact for ``coding="fixed"``,
        an upper bound for ``"elias"`` and ``"entropy"``, whose sizes depend on the values
        (:attr:`size_model` says which).
        """
        side = sum(f.count * np.dtype(f.dtype).itemsize for f in self.side_fields(numel))
        k = self.num_symbols()
        return side + (stream_bytes(numel, k, getattr(self, "coding", "fixed")) if k else 0)

    @property
    def size_model(self) -> str:
        """What :meth:`body_bytes` promises: ``"exact"``, ``"bound"`` (never exceeded) or ``"estimate"``.

        ``"estimate"``: the size on Gaussian (rotated) data, for a quantizer whose alphabet itself
        follows the values (ECDQ); a rate controller corrects it with the sizes it sees.
        """
        return "exact" if getattr(self, "coding", "fixed") == "fixed" else "bound"

    def rate_ladder(self) -> tuple[Quantizer, ...]:
        """The settings of this quantizer's family a rate controller may choose, finest (``self``) first.

        Default: ``self`` alone (nothing to choose).
        """
        return (self,)

    @property
    def rate(self) -> float:
        """The number that names this setting in metrics (``levels``, ``bits``, float width); 0.0: none."""
        return 0.0

    # ------------------------------------------------------------------ the two directions
    @abstractmethod
    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        """Quantize a contiguous 1-D float32 tensor (CPU or CUDA, finite).

        ``packed_width`` is the fixed width the coder will pack symbols at (None for other
        codings); a quantizer with a fused kernel may then return :attr:`Quantized.packed`.
        """

    @abstractmethod
    def dequantize(self, side: list[np.ndarray], symbols: np.ndarray, numel: int, seed: int) -> torch.Tensor:
        """Values (1-D float32, CPU) from side data and ``numel`` unpacked symbols.

        Symbols come checked below ``num_symbols()``; side data has passed :meth:`check_side`.
        """

    def dequantize_packed(
        self, side: list[np.ndarray], packed: np.ndarray, width: int, numel: int, seed: int
    ) -> torch.Tensor:
        """Values from symbols packed at ``width`` bits (exactly ``packed_size(numel, width)`` bytes).

        Default: unpack, check the alphabet, :meth:`dequantize`. Quantizers with a fused kernel
        override it (and must reject symbols ``>= num_symbols()`` themselves).
        """
        symbols = unpack_bits(packed, width, numel)
        check_alphabet(symbols, self.num_symbols(), self.name)
        return self.dequantize(side, symbols, numel, seed)

    def defers_packed(self) -> bool:
        """Whether :meth:`defer_packed` gives deferred values (default: no)."""
        return False

    def defers_rotated(self) -> bool:
        """Whether :meth:`defer_packed` also defers behind ``rht`` (the quantizer then always fuses the
        rotation, :meth:`fuses`, and its deferred values come back through it). Default: no."""
        return False

    def defer_packed(
        self, side: list[np.ndarray], packed: np.ndarray, width: int, numel: int, seed: int
    ) -> DeferredValues:
        """What :meth:`dequantize_packed` decodes, as :class:`~fedquant.codecs.deferred.DeferredValues`
        (quantizers whose :meth:`defers_packed` is True)."""
        raise NotImplementedError(f"{self.name} does not defer its decoded values")

    def read_stream(self, side: list[np.ndarray], body: BodyReader, numel: int, seed: int) -> torch.Tensor:
        """Values from the symbol section this quantizer wrote itself (:attr:`own_stream`): the rest
        of ``body``, untrusted, read through its bounds checks."""
        raise NotImplementedError(f"{self.name} does not code its own symbol section")

    def max_stream_bytes(self, numel: int) -> int:
        """The most bytes the symbol section of :attr:`own_stream` quantizers can hold for ``numel``.

        The server rejects a body longer than its side fields plus this before computing its
        checksum; a bound that a valid encoder could exceed would drop honest replies.
        """
        raise NotImplementedError(f"{self.name} does not code its own symbol section")


def relative_error(total_squared_error: torch.Tensor | float, flat: torch.Tensor) -> float:
    """``total_squared_error / ||flat||^2`` as a float (0 for a zero tensor)."""
    energy = float(flat.double().square().sum())
    return float(total_squared_error) / energy if energy > 0 else 0.0


def check_alphabet(symbols: np.ndarray, num_symbols: int, codec: str) -> None:
    """PayloadError if any symbol is ``>= num_symbols``."""
    if symbols.size and int(symbols.max()) >= num_symbols:
        raise PayloadError(f"{codec} payload holds a symbol {int(symbols.max())} outside 0..{num_symbols - 1}")


class LevelsLadder:
    """Mixin of the quantizers whose rate is their ``levels`` parameter.

    The ladder steps down from ``levels`` through the powers of two and their predecessors
    (16, 15, 8, 7, 4, 3, 2, 1: each step saves a bit of fixed width or nearly), never below the
    parameter's declared minimum.
    """

    def rate_ladder(self) -> tuple[Quantizer, ...]:
        top = int(self.levels)
        low = int(self.params["levels"].minimum or 1)
        below = {v for k in range(1, top.bit_length() + 1) for v in (2**k, 2**k - 1) if low <= v < top}
        return (self, *(self.with_params(levels=v) for v in sorted(below, reverse=True)))

    @property
    def rate(self) -> float:
        return float(self.levels)


#: The rates below its own that a rate controller may take a ``bits`` quantizer down to.
BITS_LADDER = (8.0, 6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.25)


class BitsLadder:
    """Mixin of the quantizers whose rate is their real ``bits`` parameter (EDEN, ECDQ).

    The ladder steps down :data:`BITS_LADDER` below ``bits``, keeping the rates the quantizer
    accepts with its other parameters (EDEN: fractional rates only at fixed width; ECDQ's E8
    lattice: not below its least rate).
    """

    def rate_ladder(self) -> tuple[Quantizer, ...]:
        below = []
        for b in BITS_LADDER:
            if b < self.bits:
                try:
                    below.append(self.with_params(bits=b))
                except ValueError:
                    continue
        return (self, *below)

    @property
    def rate(self) -> float:
        return float(self.bits)


class BucketScaledQuantizer(Quantizer):
    """Base of the quantizers whose side data is one float32 scale per bucket (``bucket_size`` param)."""

    def side_fields(self, numel: int) -> list[SideField]:
        return [SideField("bucket scales", "<f4", num_buckets(numel, effective_bucket_size(self.bucket_size, numel)))]

    def check_side(self, side: list[np.ndarray]) -> None:
        check_bucket_scales(side[0], self.name)

    def bucket_scales(self, side: list[np.ndarray], numel: int) -> tuple[int, np.ndarray]:
        """``(d, scales)`` of decoded side data: the bucket size and the scales as float32."""
        d = effective_bucket_size(self.bucket_size, numel)
        scales = np.ascontiguousarray(side[0], dtype=np.float32)
        require_items(scales, num_buckets(numel, d), "bucket scales")  # the kernels index it unchecked
        return d, scales
