"""Check and decode one untrusted train reply into a dense ArrayRecord (server side)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedquant.codecs import Codec
from fedquant.protocol import FLOAT_DTYPES, PAYLOAD_DTYPE, PAYLOAD_STYPE, is_encoded, tensor_seed
from fedquant.strategies.decode_plan import SideInformation

NUMPY_STYPE = "numpy.ndarray"
# Largest .npy header accepted on a tensor that travels as is (np.save writes 128 bytes or a
# multiple of 64 beyond that for very long shapes).
MAX_NPY_HEADER = 4096


class RejectedReply(Exception):
    """A reply that cannot be aggregated; the message says why."""


@dataclass
class DecodedReply:
    """A reply rebuilt as dense arrays.

    Attributes
    ----------
    record_name : str
        Key of the reply's ArrayRecord (kept when the record is replaced).
    arrays : ArrayRecord
        Dense arrays: ``received + decoded update`` for encoded entries, the trained values for
        the others.
    updates : dict of str to torch.Tensor
        The decoded updates of the encoded entries (float32), for side information.
    update_norm : float
        L2 norm of the whole update over every float entry (decoded updates of the encoded
        entries, ``trained - received`` of the others), computed in float64.
    """

    record_name: str
    arrays: ArrayRecord
    updates: dict[str, torch.Tensor]
    update_norm: float


def _single_array_record(content: RecordDict) -> tuple[str, ArrayRecord]:
    records = content.array_records
    if len(records) != 1:
        raise RejectedReply(f"expected exactly one ArrayRecord, found {len(records)}")
    return next(iter(records.items()))


def _decode_entry(
    name: str, array: Array, received: np.ndarray, codec: Codec, seed: int, side: SideInformation
) -> tuple[np.ndarray, torch.Tensor]:
    if array.stype != PAYLOAD_STYPE or array.dtype != PAYLOAD_DTYPE:
        raise RejectedReply(f"'{name}' must carry a fedquant payload, got an Array of stype '{array.stype}'")
    side_info = side.get(name, received.size) if codec.needs_side_info else None
    try:
        update = codec.decode(array.data, seed, side_info, shape=received.shape, dtype=torch.float32)
    except ValueError as err:  # PayloadError is a ValueError
        raise RejectedReply(f"'{name}': {err}") from err
    except Exception as err:  # untrusted bytes must never stop the round; name the surprise
        raise RejectedReply(f"'{name}': decoding failed with {type(err).__name__}: {err}") from err
    with np.errstate(over="ignore"):  # overflow is detected just below
        dense = (received.astype(np.float32, copy=False) + update.numpy()).astype(received.dtype, copy=False)
    if not np.isfinite(dense).all():
        raise RejectedReply(f"'{name}': received + update overflows {received.dtype} to Inf")
    return dense, update


def _same_kind(dtype: str, received: np.dtype) -> bool:
    """A float tensor may come back in another float dtype (a float32 model trained on float64
    arrays that FedAdam returned); any other tensor must keep its dtype."""
    if received.kind == "f":
        return dtype in FLOAT_DTYPES
    return dtype == str(received)


def _check_plain_entry(name: str, array: Array, received: np.ndarray) -> np.ndarray:
    if array.stype != NUMPY_STYPE:
        raise RejectedReply(f"'{name}' must travel as a NumPy array, got stype '{array.stype}'")
    want = f"{received.dtype}{list(received.shape)}"
    if not _same_kind(array.dtype, received.dtype) or tuple(array.shape) != received.shape:
        raise RejectedReply(f"'{name}' declares {array.dtype}{list(array.shape)}, expected {want}")
    if len(array.data) > 8 * received.size + MAX_NPY_HEADER:
        raise RejectedReply(f"'{name}' holds {len(array.data)} bytes, more than its shape needs")
    try:
        value = array.numpy()
    except (ValueError, TypeError, EOFError, OSError) as err:
        raise RejectedReply(f"'{name}' is not a valid NumPy array: {err}") from err
    if str(value.dtype) != array.dtype or value.shape != received.shape:
        raise RejectedReply(f"'{name}' holds {value.dtype}{list(value.shape)}, expected {want}")
    if value.dtype.kind == "f" and not np.isfinite(value).all():
        raise RejectedReply(f"'{name}' contains NaN or Inf")
    return value


def decode_reply(
    content: RecordDict,
    received: Mapping[str, np.ndarray],
    codec: Codec,
    client_seed: int,
    min_numel: int,
    side: SideInformation,
    tensor_codecs: Mapping[str, Codec] | None = None,
) -> DecodedReply:
    """Check one reply against what its client received and rebuild dense arrays.

    Parameters
    ----------
    content : RecordDict
        The reply's content (untrusted).
    received : mapping of str to numpy.ndarray
        The arrays the server sent to this client, in order.
    codec : Codec
        The client's assigned codec.
    client_seed : int
        The client's seed for this round.
    min_numel : int
        The round's encoding threshold.
    side : SideInformation
        Side information for codecs that need it (read only here).
    tensor_codecs : mapping of str to Codec, optional
        Per-tensor codecs the server assigned (override ``codec`` for the tensors they name).

    Raises
    ------
    RejectedReply
        With a sentence naming the problem.
    """
    record_name, record = _single_array_record(content)
    if list(record.keys()) != list(received.keys()):
        raise RejectedReply(f"ArrayRecord keys {list(record.keys())} differ from those sent {list(received.keys())}")
    dense: dict[str, Array] = {}
    updates: dict[str, torch.Tensor] = {}
    squared_norm = 0.0
    for name, sent in received.items():
        array = record[name]
        if is_encoded(sent.dtype, sent.size, min_numel):
            tensor_codec = (tensor_codecs or {}).get(name, codec)
            value, updates[name] = _decode_entry(name, array, sent, tensor_codec, tensor_seed(client_seed, name), side)
            dense[name] = Array(np.require(value, requirements="C"))  # keeps 0-d shapes
            squared_norm += float(torch.linalg.vector_norm(updates[name], dtype=torch.float64)) ** 2
        else:
            value = _check_plain_entry(name, array, sent)
            dense[name] = array
            if value.dtype.kind == "f":
                squared_norm += float(np.sum((value.astype(np.float64) - sent.astype(np.float64)) ** 2))
    return DecodedReply(record_name, ArrayRecord(dense), updates, math.sqrt(squared_norm))
