"""Bounds on a decoded update: norm clipping, integer and bool entries, the dtypes of the aggregate.

Non-float entries travel as they are (the encoding rule leaves them out), and Flower's strategies
average them like floats: an int64 counter set to 4.6e18 by one client of four became 1.15e18 in
the global model, and every int or bool entry came back as float64. Per kind:

* **integer** entries (counters such as BatchNorm's ``num_batches_tracked``, step counts) are
  *bounded like float ones*: the L2 norm of their change ``trained - received`` is held against its
  own reference (the same :class:`~fedquant.strategies.admission.MedianReference` and factors as
  the float update, but apart, so counters do not mix with weights): above ``norm_factor`` times
  it the reply is rejected, above ``clip_factor`` times it the change is scaled down and rounded.
  When the round's honest clients leave an entry unchanged, its reference is 0 and any change is
  rejected. Counters that honestly differ between clients (more data, more steps) pass.
* **bool** entries (masks, flags) have no meaningful mean: they are *compared for equality*. A
  reply's bool entries must equal those a strict majority of the round's replies carry; without
  a strict majority, those the server sent. Odd replies are rejected.

After the inner strategy aggregated, :func:`restore_dtypes` gives integer and bool entries back
the dtype the server sent (integers rounded, bools by majority of weight), so the rules above
still apply in the next round and the model keeps its types.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels.norms import cosine_with, dot_terms, dot_terms_many, sum_squares
from fedquant.records import RecordError, check_plain_entry, numpy_array
from fedquant.strategies.reply_decoder import DecodedReply, RejectedReply, Updates, single_array_record


def _check_plain_entry(name: str, array: Array, sent: np.ndarray) -> np.ndarray:
    try:
        return check_plain_entry(name, array, sent)
    except RecordError as err:
        raise RejectedReply(str(err)) from err


def non_float_names(received: Mapping[str, np.ndarray]) -> tuple[list[str], list[str]]:
    """The integer and the bool entries of the model sent."""
    ints = [k for k, v in received.items() if v.dtype.kind in "iu"]
    bools = [k for k, v in received.items() if v.dtype.kind == "b"]
    return ints, bools


def integer_change(content: RecordDict, received: Mapping[str, np.ndarray], names: list[str]) -> float:
    """L2 norm (float64) of ``trained - received`` over the integer entries ``names`` of a reply.

    Raises
    ------
    RejectedReply
        When an entry is missing or not a valid array of the dtype and shape sent.
    """
    _, record = single_array_record(content)
    total = 0.0
    for name in names:
        if name not in record:
            raise RejectedReply(f"the ArrayRecord has no '{name}'")
        value = _check_plain_entry(name, record[name], received[name])
        total += float(np.sum((value.astype(np.float64) - received[name].astype(np.float64)) ** 2))
    return math.sqrt(total)


def scale_integers(content: RecordDict, received: Mapping[str, np.ndarray], names: list[str], scale: float) -> None:
    """Replace the integer entries by ``received + round(scale x change)`` (clipping), in place."""
    name_of_record, record = next(iter(content.array_records.items()))
    entries = dict(record.items())
    for name in names:
        sent = received[name]
        change = entries[name].numpy().astype(np.float64) - sent.astype(np.float64)
        entries[name] = Array(np.require(sent + np.rint(scale * change).astype(sent.dtype), requirements="C"))
    content[name_of_record] = ArrayRecord(entries)


def bool_digest(content: RecordDict, received: Mapping[str, np.ndarray], names: list[str]) -> bytes:
    """A digest of a reply's bool entries (equal entries, equal digests)."""
    _, record = single_array_record(content)
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        if name not in record:
            raise RejectedReply(f"the ArrayRecord has no '{name}'")
        digest.update(np.ascontiguousarray(_check_plain_entry(name, record[name], received[name])).tobytes())
    return digest.digest()


def sent_bool_digest(received: Mapping[str, np.ndarray], names: list[str]) -> bytes:
    """The digest of the bool entries as the server sent them."""
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        digest.update(np.ascontiguousarray(received[name]).tobytes())
    return digest.digest()


def bool_majority(digests: Mapping[int, bytes], sent: bytes) -> bytes:
    """The digest a strict majority of replies carry, else the one of what was sent."""
    if not digests:
        return sent
    value, count = Counter(digests.values()).most_common(1)[0]
    return value if 2 * count > len(digests) else sent


def clip_update(decoded: DecodedReply, received: Mapping[str, np.ndarray], scale: float) -> DecodedReply:
    """The reply with every float entry's update scaled by ``scale`` (< 1): ``received + scale x update``."""
    plain = dict(decoded.plain)
    values = dict(decoded.plain_values)
    for name, value in decoded.plain_values.items():
        sent = received[name]
        if sent.dtype.kind != "f":
            continue
        base = sent.astype(np.float64)
        clipped = base + scale * (value.astype(np.float64) - base)
        values[name] = np.require(clipped.astype(sent.dtype), requirements="C")
        plain[name] = numpy_array(values[name])
    updates = {name: update * scale for name, update in decoded.updates.items()}
    return DecodedReply(decoded.record_name, plain, values, updates, decoded.update_norm * scale)


def restore_dtypes(arrays: ArrayRecord | None, dtypes: Mapping[str, np.dtype]) -> ArrayRecord | None:
    """The aggregate with integer and bool entries back in the dtype sent (rounded, clipped to range)."""
    if arrays is None:
        return None
    out: dict[str, Array] = {}
    changed = False
    for name, array in arrays.items():
        want = dtypes.get(name)
        if want is None or want.kind not in "iub" or array.dtype == str(want):
            out[name] = array
            continue
        value = array.numpy()
        if want.kind == "b":
            restored = value >= 0.5
        else:
            info = np.iinfo(want)
            high = np.nextafter(np.float64(info.max), 0.0)  # float(int64 max) rounds up, out of range
            rounded = np.rint(np.nan_to_num(value.astype(np.float64), posinf=high, neginf=info.min))
            restored = np.clip(rounded, info.min, high).astype(want)
        out[name] = Array(np.require(restored, requirements="C"))
        changed = True
    return ArrayRecord(out) if changed else arrays


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


def consensus_terms(
    update: Mapping[str, np.ndarray | DeferredValues], consensus: Mapping[str, np.ndarray]
) -> dict[str, tuple[float, float]]:
    """``(<u, c>, <u, u>)`` per entry both hold (float64, one pass over each): what
    :func:`consensus_cosine` needs of the update, for any ``self_weight`` (a caller that asks for
    two cosines of one update passes these to both instead of reading it twice). An entry may be
    deferred (:func:`float_update` with ``deferred``): its values are computed in the pass."""
    terms = {}
    for k in update:
        if k not in consensus or not _same_layout(update[k], consensus[k]):
            continue
        c = np.ascontiguousarray(consensus[k]).ravel()  # float32 (the vote's running sum) or float64
        if isinstance(update[k], DeferredValues):
            terms[k] = update[k].dot_terms(c)
        else:
            terms[k] = dot_terms(np.ascontiguousarray(update[k], dtype=np.float32).ravel(), c)
    return terms


def consensus_terms_many(
    updates: Sequence[Mapping[str, np.ndarray | DeferredValues]], consensus: Mapping[str, np.ndarray]
) -> list[dict[str, tuple[float, float]]]:
    """:func:`consensus_terms` of each of ``updates``, reading each entry of the consensus once for all
    of them where their values are in memory (:func:`~fedquant.codecs.kernels.norms.dot_terms_many`);
    a deferred entry not written out yet computes its values in a pass of its own, as there."""
    found: list[dict[str, tuple[float, float]]] = [{} for _ in updates]
    for name, entry in consensus.items():
        c = np.ascontiguousarray(entry).ravel()
        batch, arrays = [], []
        for i, update in enumerate(updates):
            value = update.get(name)
            if value is None or not _same_layout(value, entry):
                continue
            if isinstance(value, DeferredValues):
                stored = value.written()
                if stored is None:
                    found[i][name] = value.dot_terms(c)
                    continue
                value = stored
            batch.append(i)
            arrays.append(np.ascontiguousarray(value, dtype=np.float32).ravel())
        for i, terms in zip(batch, dot_terms_many(arrays, c), strict=True):
            found[i][name] = terms
    return [{k: terms[k] for k in update if k in terms} for update, terms in zip(updates, found, strict=True)]


def consensus_cosine(
    update: Mapping[str, np.ndarray | DeferredValues],
    consensus: Mapping[str, np.ndarray],
    self_weight: float,
    consensus_squares: Mapping[str, float] | None = None,
    terms: Mapping[str, tuple[float, float]] | None = None,
) -> float | None:
    """Cosine between an update and ``consensus + self_weight x update``, over the entries both hold;
    None when either is zero. ``self_weight`` 1 adds the update to a consensus without it, -1 leaves
    it out of one that holds it (leave-one-out), 0 takes the consensus as it is.
    ``consensus_squares`` (:func:`squares_of`) saves a pass over the consensus per call, ``terms``
    (:func:`consensus_terms` of this update and consensus) the pass over the update."""
    if terms is None:
        terms = consensus_terms(update, consensus)
    dot = square = own = 0.0
    for k, (uc, uu) in terms.items():
        c = consensus[k]
        cc = consensus_squares[k] if consensus_squares is not None else _squares(np.ascontiguousarray(c).ravel())
        parts = cosine_with(uc, uu, cc, float(self_weight))
        dot, square, own = dot + parts[0], square + parts[1], own + parts[2]
    if not (square > 0 and own > 0):
        return None
    return dot / math.sqrt(square * own)


def squares_of(consensus: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``<c, c>`` of each entry of a consensus (float64 sums), for :func:`consensus_cosine`."""
    return {k: _squares(np.ascontiguousarray(v).ravel()) for k, v in consensus.items()}


def _squares(c: np.ndarray) -> float:
    return float(sum_squares(c)) if c.dtype == np.float32 else float(np.dot(c, c))


def _same_layout(update: np.ndarray | DeferredValues, consensus: np.ndarray) -> bool:
    if isinstance(update, DeferredValues):
        return update.numel == consensus.size
    return update.shape == consensus.shape
