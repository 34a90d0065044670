"""Check and decode one untrusted train reply into its update (server side)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.threads import current_kernel_threads, kernel_threads
from fedquant.records import RecordCodec, RecordError, rebuilt_array


class RejectedReply(Exception):
    """A reply that cannot be aggregated; the message says why."""


class Updates(Mapping[str, torch.Tensor]):
    """A reply's decoded updates by entry name: float32 tensors of the shapes sent.

    Some may be held as :class:`~fedquant.codecs.deferred.DeferredValues` (their values computed
    in each pass, never stored, :meth:`deferred`): looking one up writes it out (once).
    """

    def __init__(self, values: Mapping[str, torch.Tensor | DeferredValues], shapes: Mapping[str, tuple[int, ...]]):
        self._values = dict(values)
        self._shapes = shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._values[name]
        if isinstance(value, DeferredValues):
            value = self._values[name] = value.materialize().reshape(self._shapes[name])
        return value

    def deferred(self, name: str) -> DeferredValues | None:
        """Entry ``name`` while it is deferred (None once written out, or if it never was)."""
        value = self._values.get(name)
        return value if isinstance(value, DeferredValues) else None

    def __contains__(self, name: object) -> bool:  # Mapping's would look the entry up (writing it out)
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass
class DecodedReply:
    """A reply decoded: the updates of its encoded entries, its other entries as they travelled.

    Attributes
    ----------
    record_name : str
        Key of the reply's ArrayRecord (kept when the record is replaced).
    plain : dict of str to Array
        The entries that travel as they are (the trained values), in the record's order.
    plain_values : dict of str to numpy.ndarray
        Their values, as checked.
    updates : mapping of str to torch.Tensor
        The decoded updates of the encoded entries (float32; an :class:`Updates`, whose deferred
        entries are written out when looked up).
    update_norm : float
        L2 norm of the whole update over every float entry (decoded updates of the encoded
        entries, ``trained - received`` of the others): squares added in float64, from the
        float32 values (no float64 copy of an update).

    ``received + update`` of the encoded entries is checked (it fits the model's dtype) but not
    built: :meth:`dense` builds the record for an inner strategy that needs every reply's arrays.
    """

    record_name: str
    plain: dict[str, Array]
    plain_values: dict[str, np.ndarray]
    updates: Mapping[str, torch.Tensor]
    update_norm: float

    def dense(self, received: Mapping[str, np.ndarray]) -> ArrayRecord:
        """The reply's dense arrays, in the order sent: ``received + update`` (in the received dtype)
        for the encoded entries, the plain entries as they are."""
        out: dict[str, Array] = {}
        for name, sent in received.items():
            if name in self.updates:
                out[name] = rebuilt_array(name, sent, self.updates[name].numpy())
            else:
                out[name] = self.plain[name]
        return ArrayRecord(out)


def single_array_record(content: RecordDict) -> tuple[str, ArrayRecord]:
    """The name and the record of a reply's one ArrayRecord; RejectedReply for none or several."""
    records = [(name, record) for name, record in content.items() if isinstance(record, ArrayRecord)]
    if len(records) != 1:  # (the content's items: content.array_records writes every record back)
        raise RejectedReply(f"expected exactly one ArrayRecord, found {len(records)}")
    return records[0]


def decode_reply(
    content: RecordDict,
    received: Mapping[str, np.ndarray],
    codec: RecordCodec,
    client_seed: int,
    squares: Callable[[str, np.ndarray, np.ndarray], float] | None = None,
) -> DecodedReply:
    """Check one reply against what its client received and rebuild dense arrays.

    Parameters
    ----------
    content : RecordDict
        The reply's content (untrusted).
    received : mapping of str to numpy.ndarray
        The arrays the server sent to this client, in order.
    codec : RecordCodec
        The client's assigned record codec (its decode plan's, see ``DecodePlan.reply_codec``).
    client_seed : int
        The client's seed for this round.
    squares : callable, optional
        How each decoded update is checked and its squared norm taken (``RecordCodec.decode``'s
        hook; default its own check), e.g. :meth:`~fedquant.strategies.admission.vote.VoteSums.squares`;
        it also receives the updates that codecs can defer (``decode(..., defer=True)``).

    Raises
    ------
    RejectedReply
        With a sentence naming the problem.
    """
    record_name, record = single_array_record(content)
    try:
        plain = codec.check_layout(record, received)
        decoded = codec.decode(record, client_seed, received, rebuild=False, squares=squares, defer=squares is not None)
    except RecordError as err:
        raise RejectedReply(str(err)) from err
    squared_norm = 0.0
    for name, sent in received.items():  # in order: the same float64 sum whatever decoded first
        if name in decoded.updates:
            squared_norm += decoded.squared_norms[name]
        elif plain[name].dtype.kind == "f":
            squared_norm += float(np.sum((plain[name].astype(np.float64) - sent.astype(np.float64)) ** 2))
    kept = {name: record[name] for name in received if name not in decoded.updates}
    values = {name: plain[name] for name in kept}
    updates = Updates(decoded.updates, {name: received[name].shape for name in decoded.updates})
    return DecodedReply(record_name, kept, values, updates, math.sqrt(squared_norm))


def decode_threads_for(replies: int, available: int | None = None) -> int:
    """Kernel threads per reply when a round decodes ``replies`` replies one after another.

    One as soon as there are at least as many replies as threads: a round's decode work is then
    large enough that per-reply parallel kernels gain little, and on a loaded server their
    spinning workers oversubscribe the cores (the issue measured 6-48x FedAvg's time with two
    threads under load). A round of fewer replies keeps the ``available`` threads
    (default: numba's current count).
    """
    available = current_kernel_threads() if available is None else available
    return 1 if replies >= available else available


@contextmanager
def decode_threads(replies: int) -> Iterator[int]:
    """Within the block, the codecs' kernels run on :func:`decode_threads_for` ``(replies)`` threads,
    and torch's intra-op threads (the decoders' reductions and casts) on no more."""
    torch_threads = torch.get_num_threads()
    try:
        with kernel_threads(decode_threads_for(replies)) as count:
            if count < torch_threads:
                torch.set_num_threads(count)
            yield count
    finally:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def float_update(
    decoded: DecodedReply, received: Mapping[str, np.ndarray], deferred: bool = False
) -> dict[str, np.ndarray | DeferredValues]:
    """The reply's whole float update per entry (float32), in the order sent: the decoded update of
    the encoded entries (no copy; with ``deferred``, the entries still deferred as they are), ``trained
    - received`` of the plain ones."""
    out = {}
    for name, sent in received.items():
        if sent.dtype.kind != "f":
            continue
        if name in decoded.updates:
            later = decoded.updates.deferred(name) if deferred and isinstance(decoded.updates, Updates) else None
            out[name] = later if later is not None else decoded.updates[name].reshape(sent.shape).numpy()
        else:
            value = decoded.plain_values[name]
            out[name] = (value.astype(np.float64) - sent.astype(np.float64)).astype(np.float32)
    return out
