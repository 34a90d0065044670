"""The record codec: ArrayRecord <-> ArrayRecord, the one per-tensor policy of both directions.

Which tensors of a record travel encoded, with which codec and seed, how a payload entry is
marked, how a receiver checks an untrusted record and how many bytes a record will take are
written once, here. The client mod encodes its update and rebuilds a compressed model with it;
the strategy decodes replies, encodes the model it sends and predicts reply sizes with it. Both
halves import this module and it imports neither.

The policy: a tensor of the *base* layout (the arrays the sender started from: the model a
client received, or the reference model a downlink difference is taken to) is encoded when it
is a float tensor of at least ``min_numel`` elements, with ``tensor_codecs[name]`` or else
``codec``, at seed ``tensor_seed(seed, name)``. Its entry is then a payload
(:func:`~fedquant.protocol.payload_array`), of ``values - base`` in float32 when there is a base,
of the value itself otherwise; every other entry is the value, as it is.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedquant.codecs import Codec, get_codec
from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels.norms import add_sum_squares, checked_sum_squares, sum_squares
from fedquant.protocol import (
    DEFAULT_MIN_NUMEL,
    FLOAT_DTYPES,
    KEY_CLIENT_MSE,
    KEY_CODEC,
    KEY_MIN_NUMEL,
    KEY_SEED,
    KEY_TENSOR_CODECS,
    PAYLOAD_DTYPE,
    is_payload,
    parse_tensor_codecs,
    payload_array,
    tensor_codecs_entry,
    tensor_seed,
)

NUMPY_STYPE = "numpy.ndarray"
# Largest .npy header accepted on an entry that travels as is (np.save writes 128 bytes, or a
# multiple of 64 beyond that for very long shapes).
MAX_NPY_HEADER = 4096

#: ``(tensor name, shape, transform names) -> that tensor's stored state`` (see ``encode``).
StateLoader = Callable[[str, tuple[int, ...], Sequence[str]], Mapping[str, torch.Tensor]]


class RecordError(ValueError):
    """A record that does not decode or does not match its base; the message names the entry."""


@dataclass
class EncodedRecord:
    """What :meth:`RecordCodec.encode` produced.

    Attributes
    ----------
    arrays : ArrayRecord
        The wire record: payload entries and plain entries, in the order of the values.
    state : dict
        ``{tensor: {transform: state}}`` of the stateful transforms (``ef+``), to keep for the next call.
    squared_error : float
        Sum of squared errors of the encoded tensors that were measured (``measure=True``), each
        as its codec's error on what its wire stages encoded.
    measured_numel : int
        Elements those tensors hold (0: nothing measured).
    """

    arrays: ArrayRecord
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    squared_error: float = 0.0
    measured_numel: int = 0


@dataclass
class DecodedRecord:
    """What :meth:`RecordCodec.decode` rebuilt.

    Attributes
    ----------
    arrays : ArrayRecord
        Dense arrays: ``base + decoded difference`` (in the base's dtype) or the decoded tensor
        for payload entries, the plain entries unchanged. Without the rebuild
        (``decode(..., rebuild=False)``) only the entries that are not in ``updates``.
    updates : dict of str to torch.Tensor
        The decoded differences to the base (float32), of the payload entries (empty without a base);
        with ``decode(..., defer=True)`` some may be :class:`~fedquant.codecs.deferred.DeferredValues`.
    squared_norms : dict of str to float
        ``sum(update**2)`` of each of ``updates``, accumulated in float64 (no float64 copy, see
        :mod:`fedquant.codecs.kernels.norms`).
    """

    arrays: ArrayRecord
    updates: dict[str, torch.Tensor]
    squared_norms: dict[str, float] = field(default_factory=dict)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _numpy(array: Array | np.ndarray) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.numpy()


@dataclass(frozen=True)
class RecordCodec:
    """The per-tensor policy and a codec for each encoded tensor: ArrayRecord <-> ArrayRecord.

    Parameters
    ----------
    codec : Codec
        Codec of every encoded tensor that ``tensor_codecs`` does not name.
    min_numel : int
        Float tensors with fewer elements travel as they are.
    tensor_codecs : mapping of str to Codec
        Per-tensor overrides of ``codec`` by tensor name (``fedquant.tensor-codecs``).
    """

    codec: Codec
    min_numel: int = DEFAULT_MIN_NUMEL
    tensor_codecs: Mapping[str, Codec] = field(default_factory=dict)

    # ------------------------------------------------------------------ the policy
    def encodes(self, array: Array | np.ndarray) -> bool:
        """Whether an entry of the base layout travels encoded: float, at least ``min_numel`` elements, not empty."""
        numel = _numel(array.shape)
        return str(np.dtype(array.dtype)) in FLOAT_DTYPES and numel >= self.min_numel and numel > 0

    def codec_for(self, name: str) -> Codec:
        """The codec of tensor ``name``: its override, else ``codec``."""
        return self.tensor_codecs.get(name, self.codec)

    def codecs(self) -> list[Codec]:
        """Every codec this record codec may use (``codec`` first)."""
        return [self.codec, *self.tensor_codecs.values()]

    # ------------------------------------------------------------------ the config that carries it
    def config_entries(self, seed: int, measure: bool) -> dict[str, int | str | bool]:
        """The train message's ConfigRecord entries that ask a client to encode with this codec.

        ``seed`` is the client's seed of the round, ``measure`` whether it reports the MSE.
        """
        entries: dict[str, int | str | bool] = {
            KEY_CODEC: self.codec.spec,
            KEY_SEED: seed,
            KEY_MIN_NUMEL: self.min_numel,
            KEY_CLIENT_MSE: measure,
        }
        if self.tensor_codecs:
            entries[KEY_TENSOR_CODECS] = tensor_codecs_entry({n: c.spec for n, c in self.tensor_codecs.items()})
        return entries

    @classmethod
    def from_config(
        cls, config: Mapping[str, object], get: Callable[[str], Codec] = get_codec
    ) -> tuple[RecordCodec, int, bool]:
        """The record codec, seed and MSE switch a ConfigRecord asks for (inverse of :meth:`config_entries`).

        ``get`` builds a codec from a spec (a caching ``get_codec``). Raises KeyError, ValueError
        or TypeError on a malformed config.
        """
        tensor_codecs = {n: get(s) for n, s in parse_tensor_codecs(config.get(KEY_TENSOR_CODECS, "{}")).items()}
        record = cls(get(str(config[KEY_CODEC])), int(config[KEY_MIN_NUMEL]), tensor_codecs)
        return record, int(config[KEY_SEED]), bool(config.get(KEY_CLIENT_MSE, True))

    # ------------------------------------------------------------------ size model
    def predict_bytes(self, layout: ArrayRecord) -> int:
        """Bytes of the record this codec sends for ``layout`` (as ``ArrayRecord.count_bytes`` counts them).

        From each codec's size model, nothing is encoded: exact for fixed-width coding, an upper
        bound for Elias and entropy coding. Plain entries keep their serialized size.
        """
        total = 0
        for name, array in layout.items():
            if self.encodes(array):
                total += self.codec_for(name).predict_bytes(tuple(array.shape)) + len(name)
            else:
                total += len(array.data) + len(name)
        return total

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        values: Mapping[str, Array],
        seed: int,
        base: Mapping[str, Array] | None = None,
        *,
        state: StateLoader | None = None,
        measure: bool = False,
        device: torch.device | str = "cpu",
    ) -> EncodedRecord:
        """Encode a record: the tensors the policy selects become payloads, the others stay.

        Parameters
        ----------
        values : mapping of str to Array
            The record to send (a client's trained arrays, the server's model).
        seed : int
            The record's seed; each tensor uses ``tensor_seed(seed, name)``.
        base : mapping of str to Array, optional
            What the receiver holds (same keys): the payloads then hold ``values - base`` in
            float32 and the policy reads the base's entries.
        state : callable, optional
            Loads a tensor's stored state for codecs that keep client state (``ef+``).
        measure : bool
            Measure each codec's error (one more decode per tensor; not for codecs whose decoder
            needs information the encoder does not have).
        device : torch.device or str
            Where tensors are encoded (the bytes do not depend on it).

        Raises
        ------
        RecordError
            When a value's shape differs from its base's, naming the tensor.
        """
        out: dict[str, Array] = {}
        result = EncodedRecord(ArrayRecord())
        for name, value in values.items():
            reference = None if base is None else base[name]
            if not self.encodes(value if reference is None else reference):
                out[name] = value
                continue
            tensor = self._difference(name, value, reference).to(device)
            codec = self.codec_for(name)
            previous = (
                state(name, tuple(tensor.shape), [t.name for t in codec.stateful_transforms])
                if (state is not None and codec.stateful)
                else None
            )
            encoded = codec.encode_measured(tensor, tensor_seed(seed, name), previous, measure=measure)
            if encoded.state:
                result.state[name] = encoded.state
            if encoded.squared_error is not None:
                result.squared_error += encoded.squared_error
                result.measured_numel += tensor.numel()
            out[name] = payload_array(encoded.payload)
        result.arrays = ArrayRecord(out)
        return result

    @staticmethod
    def _difference(name: str, value: Array, reference: Array | None) -> torch.Tensor:
        new = value.numpy()
        if reference is None:
            return torch.from_numpy(np.require(new, requirements="C"))  # keeps 0-d shapes
        old = reference.numpy()
        if new.shape != old.shape:
            raise RecordError(f"'{name}' came back as {list(new.shape)}, received {list(old.shape)}")
        # np.asarray: a 0-d difference is a NumPy scalar, which torch.from_numpy refuses.
        return torch.from_numpy(np.asarray(new.astype(np.float32) - old.astype(np.float32)))

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        wire: ArrayRecord,
        seed: int,
        base: Mapping[str, Array | np.ndarray] | None = None,
        *,
        rebuild: bool = True,
        squares: Callable[[str, np.ndarray, np.ndarray | DeferredValues], float] | None = None,
        defer: bool = False,
    ) -> DecodedRecord:
        """Rebuild the dense record a wire record stands for.

        Payload entries (:func:`~fedquant.protocol.is_payload`) are decoded, at their base's shape
        and added to it when there is a base; the others are kept. An untrusted record is first
        checked against its base with :meth:`check_layout`. With ``rebuild=False`` the decoded
        differences are kept in ``updates`` without ``base + difference`` in ``arrays`` (a
        caller that aggregates the differences themselves), checked all the same: the sum is
        computed, not stored, and must not overflow: by :func:`checked_squares`, or by ``squares``
        (same arguments and contract: the squared norm of the flat update, :class:`RecordError`
        when ``base + difference`` overflows), which may do more in the same pass. With ``defer``
        (and ``squares``, which must then take them), the differences of the codecs that can
        defer their values (:meth:`fedquant.codecs.Codec.decode_deferred`) are kept as
        :class:`~fedquant.codecs.deferred.DeferredValues` in ``updates``.

        Raises
        ------
        RecordError
            When the base lacks a tensor, a payload does not decode, or ``base + difference``
            overflows the base's dtype (naming the tensor).
        """
        out: dict[str, Array] = {}
        updates: dict[str, torch.Tensor] = {}
        squared_norms: dict[str, float] = {}
        for name, array in wire.items():
            if not is_payload(array):
                out[name] = array
                continue
            if base is not None and name not in base:
                raise RecordError(f"'{name}': the reference model has no such tensor")
            codec = self.codec_for(name)
            reference = None if base is None else _numpy(base[name])
            try:
                if reference is None:
                    value = codec.decode(array.data, tensor_seed(seed, name)).numpy()
                else:
                    deferring = getattr(codec, "decode_deferred", None) if defer and not rebuild else None
                    deferred = (
                        None
                        if deferring is None
                        else deferring(array.data, tensor_seed(seed, name), shape=reference.shape)
                    )
                    if deferred is not None:
                        updates[name] = deferred
                        squared_norms[name] = squares(name, reference, deferred)
                        continue
                    # every value is checked below, as part of base + difference
                    update = codec.decode(
                        array.data,
                        tensor_seed(seed, name),
                        shape=reference.shape,
                        dtype=torch.float32,
                        check_finite=False,
                    )
                    updates[name] = update
                    if rebuild:
                        out[name], squared_norms[name] = _rebuilt(name, reference, update.numpy())
                    else:
                        squared_norms[name] = (squares or checked_squares)(name, reference, update.numpy())
                    continue
            except RecordError:
                raise
            except ValueError as err:  # PayloadError is a ValueError
                raise RecordError(f"'{name}': {err}") from err
            except Exception as err:  # untrusted bytes must never stop the caller; name the surprise
                raise RecordError(f"'{name}': decoding failed with {type(err).__name__}: {err}") from err
            out[name] = numpy_array(value)
        return DecodedRecord(ArrayRecord(out), updates, squared_norms)

    def check_layout(self, wire: ArrayRecord, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Check an untrusted record against the base it was made from; the plain entries' values.

        The keys must be the base's, in order; an entry must be a payload exactly where the policy
        puts one (a sender cannot choose), and every other entry a NumPy array of the base's
        shape and kind (a float may come back as another float dtype), no larger than its shape
        needs, finite.

        Raises
        ------
        RecordError
            Naming the first entry that breaks a rule.
        """
        if list(wire.keys()) != list(base.keys()):
            raise RecordError(f"ArrayRecord keys {list(wire.keys())} differ from those sent {list(base.keys())}")
        plain: dict[str, np.ndarray] = {}
        for name, sent in base.items():
            array = wire[name]
            if self.encodes(sent):
                if not is_payload(array) or array.dtype != PAYLOAD_DTYPE:
                    raise RecordError(f"'{name}' must carry a fedquant payload, got an Array of stype '{array.stype}'")
            else:
                plain[name] = check_plain_entry(name, array, sent)
        return plain


def _flat_update(name: str, reference: np.ndarray, update: np.ndarray) -> np.ndarray:
    flat = update.reshape(-1)
    if flat.size != reference.size:  # the fused kernels index both by the update's length, unchecked
        raise RecordError(f"'{name}': the update holds {flat.size} elements, the received tensor {reference.size}")
    return flat


def checked_squares(name: str, reference: np.ndarray, update: np.ndarray) -> float:
    """``sum(update**2)`` (float64) after checking that ``reference + update`` fits the reference's
    dtype, as :func:`rebuilt_array` would compute it (:class:`RecordError` when it overflows)."""
    flat = _flat_update(name, reference, update)
    if reference.dtype == np.float32:
        squares, nonfinite = checked_sum_squares(np.ascontiguousarray(reference).reshape(-1), flat)
    else:
        _, squares, nonfinite = _summed_in_own_dtype(reference, flat)
    _refuse_overflow(name, reference.dtype, nonfinite)
    return float(squares)


def rebuilt_array(name: str, reference: np.ndarray, update: np.ndarray) -> Array:
    """``reference + update`` in the reference's dtype as an Array (:func:`_rebuilt` without the norm)."""
    return _rebuilt(name, reference, update)[0]


def _rebuilt(name: str, reference: np.ndarray, update: np.ndarray) -> tuple[Array, float]:
    """``reference + update`` in the reference's dtype as an Array, and ``sum(update**2)`` (float64).

    A float32 reference takes one fused pass (:func:`~fedquant.codecs.kernels.norms.add_sum_squares`)
    that writes the sum straight into the Array's bytes; other dtypes add in the wider of float32 and their own dtype.
    Raises :class:`RecordError` when the sum overflows the reference's dtype.
    """
    flat = _flat_update(name, reference, update)
    if reference.dtype == np.float32:
        header = npy_header(reference.dtype, reference.shape)
        value = np.empty(reference.shape, np.float32)
        squares, nonfinite = add_sum_squares(np.ascontiguousarray(reference).reshape(-1), flat, value.reshape(-1))
    else:
        value, squares, nonfinite = _summed_in_own_dtype(reference, flat)
        header = None
    _refuse_overflow(name, reference.dtype, nonfinite)
    return numpy_array(value, header), float(squares)


def _summed_in_own_dtype(reference: np.ndarray, flat: np.ndarray) -> tuple[np.ndarray, float, int]:
    """``reference + update`` in the reference's dtype and shape (not float32), ``sum(update**2)`` and
    how many of the sums are not finite (overflow is the caller's to refuse).

    Added elementwise over the flat values (a deferred update is written out flat, whatever the
    tensor's rank), in float32 for a float16 reference (then rounded once to float16) and in the
    reference's own dtype for a float64 one (whose weights must not be rounded to float32).
    """
    wide = np.promote_types(reference.dtype, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        value = np.add(reference.reshape(-1), flat, dtype=wide).astype(reference.dtype, copy=False)
    value = value.reshape(reference.shape)
    return value, sum_squares(flat), int(value.size - np.count_nonzero(np.isfinite(value)))


def _refuse_overflow(name: str, dtype: np.dtype, nonfinite: int) -> None:
    if nonfinite:
        raise RecordError(f"'{name}': received + update overflows {dtype} to Inf")


@lru_cache(maxsize=256)
def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes | None:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array (format 1.0; None if it needs 2.0)."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    try:
        np.lib.format.write_array_header_1_0(buffer, header)
    except ValueError:
        return None
    return buffer.getvalue()


def numpy_array(value: np.ndarray, header: bytes | None = None) -> Array:
    """``Array(value)`` (the bytes ``np.save`` writes) with one copy of the data instead of np.save's
    chunked writes; ``header`` is :func:`npy_header` of ``value`` when the caller has it."""
    value = np.require(value, requirements="C")  # keeps 0-d shapes
    if header is None:
        header = npy_header(value.dtype, value.shape)
    if header is None or value.dtype.hasobject:
        return Array(value)
    data = b"".join((header, memoryview(value.reshape(-1).view(np.uint8))))
    return Array(dtype=str(value.dtype), shape=tuple(int(d) for d in value.shape), stype=NUMPY_STYPE, data=data)


def _as_saved(array: Array, shape: tuple[int, ...]) -> np.ndarray | None:
    """The array's value when its bytes are exactly what :func:`numpy_array` (and ``np.save``)
    writes for its declared dtype and ``shape`` (a copy), else None (then ``Array.numpy`` parses
    the header): the header is compared as bytes instead of parsed, a tenth of the time for a
    small tensor."""
    try:
        dtype = np.dtype(array.dtype)
    except TypeError:
        return None
    header = None if dtype.hasobject else npy_header(dtype, shape)
    data = array.data
    if header is None or len(data) != len(header) + dtype.itemsize * math.prod(shape) or not data.startswith(header):
        return None
    return np.frombuffer(data, dtype, offset=len(header)).reshape(shape).copy()


def _same_kind(dtype: str, sent: np.dtype) -> bool:
    """A float tensor may come back in another float dtype (a float32 model trained on float64
    arrays that FedAdam returned); any other tensor must keep its dtype."""
    if sent.kind == "f":
        return dtype in FLOAT_DTYPES
    return dtype == str(sent)


def check_plain_entry(name: str, array: Array, sent: np.ndarray) -> np.ndarray:
    """The value of an entry sent as it is: a NumPy array of ``sent``'s dtype kind and shape, finite floats.

    Raises :class:`RecordError` naming the problem (the bytes are untrusted).
    """
    if array.stype != NUMPY_STYPE:
        raise RecordError(f"'{name}' must travel as a NumPy array, got stype '{array.stype}'")
    want = f"{sent.dtype}{list(sent.shape)}"
    if not _same_kind(array.dtype, sent.dtype) or tuple(array.shape) != sent.shape:
        raise RecordError(f"'{name}' declares {array.dtype}{list(array.shape)}, expected {want}")
    if len(array.data) > 8 * sent.size + MAX_NPY_HEADER:
        raise RecordError(f"'{name}' holds {len(array.data)} bytes, more than its shape needs")
    value = _as_saved(array, sent.shape)
    if value is None:
        try:
            value = array.numpy()
        except (ValueError, TypeError, EOFError, OSError) as err:
            raise RecordError(f"'{name}' is not a valid NumPy array: {err}") from err
    if str(value.dtype) != array.dtype or value.shape != sent.shape:
        raise RecordError(f"'{name}' holds {value.dtype}{list(value.shape)}, expected {want}")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise RecordError(f"'{name}' contains NaN or Inf")
    return value
