"""Server half of downlink compression: encode the model each sampled client is sent.

Scheme (built for clients that skip rounds, as in cross-device FL):

* Every train message stands for a *reference model*: the exact float arrays the client rebuilds
  from it, kept by the server under an id (the last ``references`` of them).
* A client that holds a reference the server still keeps gets the difference
  ``current model - reference``, encoded with ``codec`` (e.g. ``qsgd:levels=16``); one that
  holds none (first round, a long absence, an evicted or unknown reference) gets the model itself,
  encoded with ``full_codec`` (default ``fp16``, a weight-suited codec).
* Clients with the same reference in the same round get the same bytes (one seed per
  round and group), so they all rebuild the same model and the server keeps one copy per
  group, not per client.
* A client reports in its reply the id of the model it rebuilt. The server believes the claim only
  when it equals the id it sent that node this round; otherwise (error reply, no reply, a forged or
  unknown id) the node's next message holds the full model. A claim never selects what the server
  decodes against: replies are decoded against the model the server itself rebuilt for that node.

Each difference is taken to what the client actually holds, so the error of the last message is
part of the next difference: that is error feedback on the server side, with no residual to keep.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, Message

from fedquant.codecs import Codec, get_codec
from fedquant.protocol import (
    KEY_DOWNLINK_BASE,
    KEY_DOWNLINK_CODEC,
    KEY_DOWNLINK_REFERENCE,
    KEY_DOWNLINK_SEED,
    METRIC_DOWNLINK_REFERENCE,
    NO_REFERENCE,
    REFERENCE_ID_BITS,
    is_payload,
)
from fedquant.records import RecordCodec
from fedquant.rng import derive_seed

DEFAULT_FULL_CODEC = "fp16"
DEFAULT_REFERENCES = 8


@dataclass(frozen=True)
class DownlinkSend:
    """One encoded train message (shared by all clients of a round that hold the same reference).

    Attributes
    ----------
    wire : ArrayRecord
        What the message carries (payload entries and plain entries).
    model : ArrayRecord
        The dense model the client rebuilds: what its update is computed against and what the
        server decodes its reply against.
    config : dict
        The ``fedquant.downlink-*`` ConfigRecord entries.
    reference : int
        Id of ``model``.
    base : int
        Id of the reference the payloads are a difference to (``NO_REFERENCE``: the model itself).
    mse : float
        Mean squared error of ``model`` against the server's model over the encoded elements.
    """

    wire: ArrayRecord
    model: ArrayRecord
    config: dict[str, int | str]
    reference: int
    base: int
    mse: float


def _check_codec(spec: str | Codec, what: str) -> Codec:
    codec = get_codec(spec)
    if codec.stateful:
        raise ValueError(
            f"{what} {codec.spec!r}: no 'ef+' downlink codec; each difference already includes the error of "
            "the last message sent (server-side error feedback)"
        )
    if codec.needs_side_info:
        raise ValueError(f"{what} {codec.spec!r} needs decoder side information, which a client does not have")
    return codec


def _same_layout(a: ArrayRecord, b: ArrayRecord) -> bool:
    if list(a.keys()) != list(b.keys()):
        return False
    return all(a[k].dtype == b[k].dtype and tuple(a[k].shape) == tuple(b[k].shape) for k in a.keys())


class DownlinkCompressor:
    """Encodes the model sent to each client and tracks which reference model each node holds.

    Parameters
    ----------
    codec : str or Codec
        Codec of the differences to a reference (any codec without side information).
    full_codec : str or Codec
        Codec of the model itself, for clients that hold no usable reference (default ``fp16``;
        ``fp32`` is lossless).
    seed : int
        Base seed; the ``g``-th group of round ``r`` (clients sent the same model and holding the same
        reference, numbered in message order) uses ``derive_seed(seed, "downlink", r, g)``, each
        tensor ``tensor_seed`` of that.
    min_numel : int
        Float tensors with fewer elements travel as they are (the uplink's rule).
    references : int
        How many reference models the server keeps (most recent first); a node holding an older
        one is sent the full model.
    """

    def __init__(
        self,
        codec: str | Codec,
        full_codec: str | Codec = DEFAULT_FULL_CODEC,
        seed: int = 0,
        min_numel: int = 1,
        references: int = DEFAULT_REFERENCES,
    ) -> None:
        if isinstance(references, bool) or not isinstance(references, int) or references < 1:
            raise ValueError(f"downlink_references must be a positive int, got {references!r}")
        self.codec = _check_codec(codec, "downlink_codec")
        self.full_codec = _check_codec(full_codec, "downlink_full_codec")
        self.difference = RecordCodec(self.codec, min_numel)
        self.full = RecordCodec(self.full_codec, min_numel)
        self.seed = seed
        self.min_numel = min_numel
        self.references = references
        self.held: dict[int, int] = {}  # node id -> reference id it confirmed
        self._models: dict[int, ArrayRecord] = {}  # reference id -> model
        self._created: dict[int, int] = {}  # reference id -> round
        self._pending: dict[int, dict[int, int]] = {}  # round -> node id -> reference id sent
        self._cache: dict[tuple[int, int, int], DownlinkSend] = {}

    def __repr__(self) -> str:
        return f"DownlinkCompressor({self.codec.spec!r}, full={self.full_codec.spec!r}, references={self.references})"

    def send(self, server_round: int, node_id: int, arrays: ArrayRecord) -> DownlinkSend:
        """The encoded message for ``node_id`` carrying the server's model ``arrays``."""
        base_id = self.held.get(node_id, NO_REFERENCE)
        base = self._models.get(base_id)
        if base is None or not _same_layout(base, arrays):
            base_id, base = NO_REFERENCE, None
        key = (server_round, id(arrays), base_id)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == server_round}
            self._cache[key] = self._encode(server_round, len(self._cache), arrays, base_id, base)
        sent = self._cache[key]
        self._pending.setdefault(server_round, {})[node_id] = sent.reference
        self._models[sent.reference] = sent.model
        self._created[sent.reference] = server_round
        return sent

    def _encode(
        self, server_round: int, group: int, arrays: ArrayRecord, base_id: int, base: ArrayRecord | None
    ) -> DownlinkSend:
        codec = self.full if base is None else self.difference
        # One seed (and reference id) per group of the round: (model sent, reference held).
        seed = derive_seed(self.seed, "downlink", server_round, group)
        reference = derive_seed(seed, "reference") >> (63 - REFERENCE_ID_BITS)
        wire = codec.encode(arrays, seed, base).arrays
        model = codec.decode(wire, seed, base).arrays  # exactly what the client computes
        sq_error, numel = 0.0, 0
        for name, array in wire.items():
            if not is_payload(array):
                continue
            diff = model[name].numpy().astype(np.float64) - arrays[name].numpy().astype(np.float64)
            sq_error += float(np.dot(diff.ravel(), diff.ravel()))
            numel += diff.size
        config = {
            KEY_DOWNLINK_CODEC: codec.codec.spec,
            KEY_DOWNLINK_SEED: seed,
            KEY_DOWNLINK_BASE: base_id,
            KEY_DOWNLINK_REFERENCE: reference,
        }
        return DownlinkSend(wire, model, config, reference, base_id, sq_error / numel if numel else 0.0)

    def confirm(self, server_round: int, replies: Iterable[Message]) -> None:
        """Read (and remove) each reply's reference claim; update which node holds which model.

        A node holds the model sent this round only when its reply carried content and claims
        exactly that id; every other node sampled this round is marked as holding none.
        """
        claims: dict[int, object] = {}
        for reply in replies:
            if reply.has_error():
                continue
            node_id = reply.metadata.src_node_id
            claim = None
            for record in reply.content.metric_records.values():
                value = record.pop(METRIC_DOWNLINK_REFERENCE, None)
                claim = value if claim is None else claim
            claims[node_id] = None if node_id in claims else claim  # two replies: believe neither
        for node_id, reference in self._pending.pop(server_round, {}).items():
            claim = claims.get(node_id)
            if isinstance(claim, int) and not isinstance(claim, bool) and claim == reference:
                self.held[node_id] = reference
            else:
                self.held.pop(node_id, None)
        self._evict()

    def _evict(self) -> None:
        """Keep the newest ``references`` models among those a node holds or is about to confirm."""
        in_use = set(self.held.values()) | {r for sent in self._pending.values() for r in sent.values()}
        keep = sorted(in_use & set(self._models), key=lambda r: self._created[r], reverse=True)[: self.references]
        for reference in set(self._models) - set(keep):
            del self._models[reference]
            del self._created[reference]
        self.held = {node: ref for node, ref in self.held.items() if ref in self._models}

    @property
    def kept(self) -> int:
        """How many reference models the server holds now."""
        return len(self._models)
