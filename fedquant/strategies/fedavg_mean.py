"""FedAvg's weighted mean of a round, taken from the decoded updates instead of every reply's dense arrays.

Flower's ``FedAvg.aggregate_train`` deserializes each reply's arrays, multiplies them by the
reply's weight share and adds them up: for a compressed round the server would first have to
rebuild ``received + update`` of every reply as an ArrayRecord (bytes), to be read back into
NumPy. Where the inner strategy aggregates exactly as FedAvg does (:func:`aggregates_like_fedavg`),
:class:`~fedquant.strategies.QuantizedStrategy` instead

1. calls the inner strategy's own ``aggregate_train`` on the same replies with their arrays left
   out (:func:`without_arrays`: an empty ArrayRecord each), so its checks, logs, failures and
   metrics are its own; FedAvg's arrays are then the empty record;
2. puts in its place :func:`weighted_mean`: ``sum_i (w_i / W) x_i`` with FedAvg's weights
   ``w_i`` (its ``weighted_by_key``) and ``x_i = received_i + update_i``, computed as
   ``sum_g (sum_{i in g} w_i / W) received_g + sum_i (w_i / W) update_i`` (``g`` the distinct
   models the clients received: one without downlink compression) in float64, each decoded
   float32 update read once and no dense reply built, then cast to the dtype FedAvg returns.

The result equals FedAvg's in exact arithmetic; in floating point it is the more accurate one
(FedAvg adds the weighted replies in float32), the two agreeing to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg, Strategy

from fedquant.codecs.kernels.norms import add_scaled, add_scaled_float32
from fedquant.records import numpy_array
from fedquant.strategies.admission.rules.metrics import single_metric_record
from fedquant.strategies.reply_decoder import DecodedReply


def aggregates_like_fedavg(strategy: Strategy) -> bool:
    """Whether ``strategy`` aggregates train replies with FedAvg's own ``aggregate_train`` (FedAvg,
    FedProx, subclasses that do not override it): its arrays are then the weighted mean of the
    replies' arrays, and nothing else depends on them."""
    return isinstance(strategy, FedAvg) and type(strategy).aggregate_train is FedAvg.aggregate_train


def without_arrays(reply: Message) -> Message:
    """A copy of ``reply`` whose ArrayRecords are empty (its metrics and other records are kept)."""
    content = RecordDict(
        {name: ArrayRecord() if isinstance(record, ArrayRecord) else record for name, record in reply.content.items()}
    )
    return Message(content=content, metadata=reply.metadata)


def fedavg_weights(replies: Sequence[Message], weight_key: str) -> tuple[list[float], float]:
    """The weights ``w_i`` FedAvg gives the replies and their total ``W`` (its shares are ``w_i / W``,
    ``aggregate_arrayrecords``'s arithmetic)."""
    weights = [single_metric_record(r.content)[weight_key] for r in replies]
    return weights, sum(weights)


def _fedavg_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of FedAvg's mean of arrays of ``dtype`` (``value * weight``: ints and bools become float64)."""
    return (np.zeros(1, dtype) * 0.5).dtype


def weighted_mean(
    decoded: Sequence[DecodedReply],
    received: Sequence[Mapping[str, np.ndarray]],
    shares: Sequence[float],
    scratch: dict[str, np.ndarray] | None = None,
    summed: Mapping[str, np.ndarray] | None = None,
    total: float = 1.0,
) -> ArrayRecord:
    """``sum_i shares[i] x (received[i] + update of decoded[i])``, entry by entry, as FedAvg's ArrayRecord.

    Parameters
    ----------
    decoded : sequence of DecodedReply
        The admitted replies, in the order FedAvg would see them.
    received : sequence of mapping of str to numpy.ndarray
        What each of them was sent (replies sent the same model share one mapping).
    shares : sequence of float
        Their weight shares (:func:`fedavg_weights`).
    scratch : dict of str to numpy.ndarray, optional
        Float64 buffers of the entries' shapes that nothing needs any more (the round's consensus):
        taken (popped) as the entries' sums instead of new memory, which costs more to fault in
        than to write.
    summed : mapping of str to numpy.ndarray, optional
        For some encoded entries (flat), ``total`` times ``sum_i shares[i] update_i`` (the vote's
        running sums, :meth:`~fedquant.strategies.admission.vote.VoteSums.weighted_sum_of`), taken
        (scaled in place) instead of reading every update again.
    total : float
        What ``summed`` is divided by.

    Entries come in the order of the first reply's model, each in the dtype FedAvg gives it.
    """
    out: dict[str, Array] = {}
    for name, first in received[0].items():
        if summed is not None and name in summed:
            acc = np.multiply(summed[name], 1.0 / total, out=summed[name])
            bases: dict[int, list] = {}
            for sent, share in zip(received, shares, strict=True):
                bases.setdefault(id(sent), [sent[name], 0.0])[1] += share
            out[name] = numpy_array(
                _with_bases(acc, list(bases.values()), _fedavg_dtype(first.dtype)).reshape(first.shape)
            )
            continue
        target = _buffer(scratch, name, first.shape)
        acc: np.ndarray | None = None  # float64, flat
        base_shares: dict[int, list] = {}  # id(received model) -> [its entry, the shares of the replies sent it]
        dtype = None
        for reply, sent, share in zip(decoded, received, shares, strict=True):
            if name in reply.updates:
                acc = _add(acc, reply.updates[name].numpy().reshape(-1), share, target)
                base_shares.setdefault(id(sent), [sent[name], 0.0])[1] += share
                dtype = sent[name].dtype if dtype is None else dtype
            else:
                value = reply.plain_values[name]
                acc = _add(acc, value.astype(np.float64).reshape(-1), share, target)
                dtype = value.dtype if dtype is None else dtype
        out[name] = numpy_array(_with_bases(acc, list(base_shares.values()), _fedavg_dtype(dtype)).reshape(first.shape))
    return ArrayRecord(out)


def _buffer(scratch: dict[str, np.ndarray] | None, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """``scratch[name]`` flat, taken out of ``scratch``, when it is a float64 array of ``shape`` (else None)."""
    buffer = None if scratch is None else scratch.pop(name, None)
    if buffer is None or buffer.dtype != np.float64 or buffer.shape != shape or not buffer.flags.c_contiguous:
        return None
    return buffer.reshape(-1)


def _add(acc: np.ndarray | None, values: np.ndarray, share: float, first: np.ndarray | None = None) -> np.ndarray:
    """``acc + share x values`` in float64, in place; the first term (``acc`` None) is written into
    ``first`` (new memory when None), not added to zeros."""
    if acc is None:
        return np.multiply(values, share, out=first, dtype=np.float64)
    if values.dtype == np.float32:
        add_scaled(acc, values, share)
    else:
        acc += share * values.astype(np.float64)
    return acc


def _with_bases(acc: np.ndarray, bases: list[list], dtype: np.dtype) -> np.ndarray:
    """``acc + sum share x base`` over the received models, in ``dtype`` (one rounding)."""
    if len(bases) == 1 and bases[0][0].dtype == np.float32 and dtype == np.float32:
        out = np.empty(acc.size, np.float32)
        add_scaled_float32(acc, np.ascontiguousarray(bases[0][0]).reshape(-1), bases[0][1], out)
        return out
    acc = acc.astype(np.float64, copy=False)  # the vote's float32 sums must not round a float64 model
    for base, share in bases:
        acc = _add(acc, np.ascontiguousarray(base).reshape(-1), share)
    return acc.astype(dtype)
