"""The protocol's messages as Flower records, and the checked readers for everything received.

Every message (both directions) holds one ConfigRecord ``RECORD`` with the stage, the round's
16-byte session id and the round number; a masked input adds one ArrayRecord ``MASKED_RECORD``
with one ``uint8`` Array per segment, packed at the segment's bit width (no NumPy header, so
``count_bytes`` counts the packed bytes and the key).

=========== ==================================================== =================================================
stage        server -> client                                     client -> server
=========== ==================================================== =================================================
advertise   ``holders`` (its share holders, itself included),    ``keys``: encryption key, mask key (X25519,
            ``threshold``                                        32 bytes each), commitment to the self-mask seed
share-keys  ``nodes``, ``keys``: its live holders and their keys  ``destinations``, ``ciphertexts``: one share
                                                                 pair per other holder
collect     ``sources``, ``ciphertexts``: the pairs sent to it;  the ``MASKED_RECORD``
            ``segments``, ``segment-sizes``, ``segment-bits``
unmask      ``survivors``, ``dropped`` among its holders         ``seed-nodes``/``seed-shares`` (survivors),
                                                                 ``key-nodes``/``key-shares`` (dropped)
=========== ==================================================== =================================================

A reader raises :class:`ProtocolError` with a sentence naming the problem; the server logs it
with the node id and treats the node as dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedquant.wire.bitpack import pack_bits, packed_size, unpack_bits

RECORD = "fedquant.secagg"
MASKED_RECORD = "fedquant.secagg.masked"
MASKED_STYPE = "fedquant.secagg.masked"
STAGES = ("advertise", "share-keys", "collect", "unmask")
#: The active-server defence's extra stage, between collect and unmask (signed rounds only).
CONSISTENCY = "consistency"
#: Every stage in protocol order.
ORDER = ("advertise", "share-keys", "collect", CONSISTENCY, "unmask")


def advertise_message(session: bytes, server_round: int, node: int, keys: bytes) -> bytes:
    """What a client signs at advertise: its keys, bound to the session, round and its node id."""
    ids = server_round.to_bytes(8, "little") + node.to_bytes(8, "little")
    return b"fedquant-secagg advertise" + session + ids + keys


def consistency_message(session: bytes, server_round: int, survivors: Sequence[int]) -> bytes:
    """What a client signs at the consistency stage: the survivor set it was told."""
    ids = b"".join(n.to_bytes(8, "little") for n in sorted(survivors))
    return b"fedquant-secagg survivors" + session + server_round.to_bytes(8, "little") + ids
SESSION_BYTES = 16
MAX_NODES = 1 << 16


class ProtocolError(ValueError):
    """A message that breaks the protocol: wrong stage, session, type, length or content."""


def request_record(stage: str, session: bytes, server_round: int, **fields: object) -> ConfigRecord:
    """The ConfigRecord of one stage's message."""
    return ConfigRecord({"stage": stage, "session": session, "round": server_round, **fields})


def section(content: RecordDict, stage: str, session: bytes | None) -> ConfigRecord:
    """The protocol ConfigRecord of a message, checked for its stage and session."""
    if not isinstance(content, RecordDict):
        raise ProtocolError("message content is not a RecordDict")
    record = content.config_records.get(RECORD)
    if record is None:
        raise ProtocolError(f"message has no '{RECORD}' ConfigRecord")
    got = record.get("stage")
    if got != stage:
        raise ProtocolError(f"message is for stage {got!r}, expected {stage!r}")
    if session is not None and record.get("session") != session:
        raise ProtocolError("message belongs to another session (replayed or stale)")
    return record


def read_int(record: ConfigRecord, key: str, low: int, high: int) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{key}' must be an int")
    if not low <= value <= high:
        raise ProtocolError(f"'{key}' = {value} is outside {low}..{high}")
    return value


def read_bytes(record: ConfigRecord, key: str, length: int) -> bytes:
    value = record.get(key)
    if not isinstance(value, bytes) or len(value) != length:
        raise ProtocolError(f"'{key}' must be {length} bytes")
    return value


def read_ints(record: ConfigRecord, key: str, max_len: int = MAX_NODES) -> list[int]:
    """A list of distinct non-negative ints (node ids, sizes)."""
    value = record.get(key)
    if not isinstance(value, list) or len(value) > max_len:
        raise ProtocolError(f"'{key}' must be a list of at most {max_len} ints")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise ProtocolError(f"'{key}' must hold non-negative ints")
    return list(value)


def read_node_ids(record: ConfigRecord, key: str, max_len: int = MAX_NODES) -> list[int]:
    ids = read_ints(record, key, max_len)
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"'{key}' names a node twice")
    return ids


def read_bytes_list(record: ConfigRecord, key: str, length: int, count: int) -> list[bytes]:
    value = record.get(key)
    if not isinstance(value, list) or len(value) != count:
        raise ProtocolError(f"'{key}' must be a list of {count} byte strings")
    if any(not isinstance(v, bytes) or len(v) != length for v in value):
        raise ProtocolError(f"every entry of '{key}' must be {length} bytes")
    return list(value)


def masked_record(values: dict[str, np.ndarray], bits: dict[str, int]) -> ArrayRecord:
    """The masked input: one packed uint8 Array per segment."""
    record = ArrayRecord()
    for name, v in values.items():
        data = pack_bits(v, bits[name]).tobytes()
        record[name] = Array(dtype="uint8", shape=(len(data),), stype=MASKED_STYPE, data=data)
    return record


def read_masked(content: RecordDict, segments: Sequence[tuple[str, int, int]]) -> dict[str, np.ndarray]:
    """The masked segments of a reply, each checked for its exact packed length (uint32 values)."""
    record = content.array_records.get(MASKED_RECORD)
    if record is None or len(content.array_records) != 1:
        raise ProtocolError(f"reply must hold exactly one ArrayRecord '{MASKED_RECORD}'")
    if sorted(record.keys()) != sorted(name for name, _, _ in segments):
        raise ProtocolError(f"masked segments {sorted(record.keys())} differ from the requested ones")
    out = {}
    for name, size, bits in segments:
        array = record[name]
        need = packed_size(size, bits)
        if not isinstance(array, Array) or array.dtype != "uint8" or array.stype != MASKED_STYPE:
            raise ProtocolError(f"segment '{name}' is not a packed uint8 Array")
        if tuple(array.shape) != (need,) or not isinstance(array.data, bytes) or len(array.data) != need:
            raise ProtocolError(f"segment '{name}' does not hold the {need} bytes of {size} values of {bits} bits")
        values = unpack_bits(np.frombuffer(array.data, dtype=np.uint8), bits, size).astype(np.uint32)
        if pack_bits(values, bits).tobytes() != array.data:  # the last byte's padding bits must be zero
            raise ProtocolError(f"segment '{name}' is not canonically packed (non-zero padding bits)")
        out[name] = values
    return out
