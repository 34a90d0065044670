"""The non-float rule: integer and bool entries of a reply, checked before any decoding (reason ``non-float``).

Non-float entries travel as they are (the encoding rule leaves them out), and Flower's strategies
average them like floats: an int64 counter set to 4.6e18 by one client of four became 1.15e18 in
the global model, and every int or bool entry came back as float64. Per kind:

* **integer** entries (counters such as BatchNorm's ``num_batches_tracked``, step counts) are
  *bounded like float ones*: the L2 norm of their change ``trained - received`` is held against its
  own reference (the same :class:`~fedquant.strategies.admission.references.MedianReference` and factors as
  the float update, but apart, so counters do not mix with weights): above ``norm_factor`` times
  it the reply is rejected, above ``clip_factor`` times it the change is scaled down and rounded.
  When the round's honest clients leave an entry unchanged, its reference is 0 and any change is
  rejected. Counters that honestly differ between clients (more data, more steps) pass.
* **bool** entries (masks, flags) have no meaningful mean: they are *compared for equality*. A
  reply's bool entries must equal those a strict majority of the round's replies carry; without
  a strict majority, those the server sent. Odd replies are rejected.

After aggregation :mod:`fedquant.strategies.dtypes` gives them back the dtype sent.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedquant.records import RecordError, check_plain_entry
from fedquant.strategies.admission.reasons import REASON_NON_FLOAT, REASON_PAYLOAD
from fedquant.strategies.admission.references import References
from fedquant.strategies.admission.rules.base import Reject, Rule, Setup
from fedquant.strategies.admission.rules.norms import verdict
from fedquant.strategies.reply_decoder import RejectedReply, single_array_record


class NonFloat(Rule):
    """Rejects replies whose bool entries are not the round's, bounds the change of their integer entries."""

    reason = REASON_NON_FLOAT
    clips = True

    @classmethod
    def build(cls, setup: Setup) -> NonFloat | None:
        return cls(setup) if setup.rules.check_non_float else None

    def screen_entries(
        self,
        references: References,
        replies: Mapping[int, Message],
        received: Callable[[int], Mapping[str, np.ndarray]],
        reject: Reject,
    ) -> tuple[dict[int, Message], int]:
        """The replies whose integer and bool entries pass, and how many had their integer change clipped."""
        if not replies:
            return dict(replies), 0
        sent = received(next(iter(replies)))
        ints, bools = non_float_names(sent)
        if not ints and not bools:
            return dict(replies), 0
        changes: dict[int, float] = {}
        digests: dict[int, bytes] = {}
        kept: dict[int, Message] = {}
        for node, reply in replies.items():
            try:
                changes[node] = integer_change(reply.content, received(node), ints)
                digests[node] = bool_digest(reply.content, received(node), bools)
            except RejectedReply as err:
                reject(node, (REASON_PAYLOAD, str(err)))
                continue
            kept[node] = reply
        majority = bool_majority(digests, sent_bool_digest(sent, bools))
        reference = references.integer_changes.value(list(changes.values())) if ints else None
        admitted: dict[int, Message] = {}
        clipped = 0
        admitted_changes: list[float] = []
        for node, reply in kept.items():
            if bools and digests[node] != majority:
                reject(node, (REASON_NON_FLOAT, "its bool entries differ from those of the round's majority"))
                continue
            problem, scale = self._verdict(changes[node], reference)
            if problem is not None:
                reject(node, (REASON_NON_FLOAT, f"integer entries: {problem}"))
                continue
            if scale < 1:
                scale_integers(reply.content, received(node), ints, scale)
                clipped += 1
            admitted[node] = reply
            admitted_changes.append(changes[node] * scale)
        if ints:
            references.integer_changes.end_round(admitted_changes)
        return admitted, clipped

    def _verdict(self, norm: float, reference: float | None) -> tuple[str | None, float]:
        if reference is not None and reference == 0 and norm > 0 and self.rules.relative_norms:
            return "changed where the round's reference change is 0", 1.0
        return verdict(self.rules, norm, reference)


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
