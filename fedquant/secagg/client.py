"""The client side of the protocol: a state machine from one stage's request to its reply.

:meth:`SecAggClient.handle` takes the content of a server message and returns the content of
the reply. Its state survives between stages as a ConfigRecord (:meth:`SecAggClient.state`,
:meth:`SecAggClient.from_state`), which is how a Flower mod keeps it in ``Context.state``.
A request that breaks the protocol raises :class:`~fedquant.secagg.messages.ProtocolError`
(the mod turns it into an error reply: the server sees a dropout). In particular the client

* answers each stage once, in order, within one session (a replayed request is refused);
* refuses to reveal both secrets of one node, or any share when fewer than the threshold of its
  holders survive;
* drops out (raises) when a peer's share pair does not decrypt, rather than masking with a
  partial set of peers that the server could not reconcile;
* with an identity (the active-server defence): takes part only in signed rounds, checks every
  peer's advertised keys against its Ed25519 signature (the server cannot substitute keys),
  signs the survivor set it is told once, and reveals shares only against a survivor set signed
  by at least ``threshold`` of its members and matching the unmask request (a server that tells
  nodes different survivor sets cannot collect both secrets of any node).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from fedquant.secagg import crypto, masks
from fedquant.secagg.crypto import COMMITMENT_BYTES, IDENTITY_BYTES, PUBLIC_KEY_BYTES, SEED_BYTES, SHARE_BYTES
from fedquant.secagg.messages import (
    CONSISTENCY,
    MASKED_RECORD,
    MAX_NODES,
    RECORD,
    SESSION_BYTES,
    ProtocolError,
    advertise_message,
    consistency_message,
    masked_record,
    read_bytes,
    read_bytes_list,
    read_int,
    read_ints,
    read_node_ids,
    request_record,
    section,
)

KEYS_BYTES = 2 * PUBLIC_KEY_BYTES + COMMITMENT_BYTES
MAX_SEGMENT_SIZE = 1 << 31

#: ``encode(request content, {segment: (size, bits)}) -> {segment: uint32 values}``: what the
#: client sums (train, then encode on the round's grid).
Encoder = Callable[[RecordDict, dict[str, tuple[int, int]]], dict[str, np.ndarray]]


def split_keys(keys: bytes) -> tuple[bytes, bytes, bytes]:
    """An advertisement: (encryption key, mask key, commitment)."""
    return keys[:PUBLIC_KEY_BYTES], keys[PUBLIC_KEY_BYTES : 2 * PUBLIC_KEY_BYTES], keys[2 * PUBLIC_KEY_BYTES :]


def share_associated(session: bytes, src: int, dst: int) -> bytes:
    """Associated data of a share pair: binds it to the session and its direction."""
    return session + src.to_bytes(8, "little") + dst.to_bytes(8, "little")


def share_key(own_seed: bytes, peer_public: bytes, session: bytes, src: int, dst: int) -> bytes:
    """The AEAD key of the one share pair ``src`` sends ``dst`` in a session."""
    return crypto.agree(own_seed, peer_public, b"fedquant-secagg share " + share_associated(session, src, dst))


@dataclass
class SecAggClient:
    """One client's protocol state (see the module doc).

    Attributes
    ----------
    node_id : int
        This client's node id.
    """

    node_id: int
    stage: str = ""  # the last stage answered
    session: bytes = b""
    server_round: int = 0
    threshold: int = 0
    encryption_seed: bytes = b""
    mask_seed: bytes = b""
    self_seed: bytes = b""
    peers: list[int] = field(default_factory=list)  # live holders at share-keys, itself included
    peer_keys: list[bytes] = field(default_factory=list)
    held_nodes: list[int] = field(default_factory=list)  # whose share pairs this client holds
    held_seed_shares: list[bytes] = field(default_factory=list)
    held_key_shares: list[bytes] = field(default_factory=list)
    signed: bool = False
    consistency: list[int] = field(default_factory=list)  # the survivor set this client signed
    # The active-server defence (kept across rounds): this client's Ed25519 identity key, and the
    # identity public keys of the nodes it may meet, from a source the server cannot forge.
    identity: bytes = b""
    directory_nodes: list[int] = field(default_factory=list)
    directory_keys: list[bytes] = field(default_factory=list)

    @classmethod
    def with_identity(cls, node_id: int, identity: bytes, directory: dict[int, bytes]) -> SecAggClient:
        """A client of signed rounds: its 32-byte Ed25519 key and its peers' public keys by node id."""
        if len(identity) != IDENTITY_BYTES or any(len(k) != IDENTITY_BYTES for k in directory.values()):
            raise ValueError(f"identity keys are {IDENTITY_BYTES} bytes")
        nodes = sorted(directory)
        return cls(node_id, identity=identity, directory_nodes=nodes, directory_keys=[directory[n] for n in nodes])

    def _identity_of(self, node: int) -> bytes:
        if node not in self.directory_nodes:
            raise ProtocolError(f"node {node} is not in this client's identity directory")
        return self.directory_keys[self.directory_nodes.index(node)]

    # ------------------------------------------------------------------ persistence
    def state(self) -> ConfigRecord:
        """The state as a ConfigRecord (for ``Context.state``)."""
        return ConfigRecord({k: v for k, v in vars(self).items()})

    @classmethod
    def from_state(cls, record: ConfigRecord) -> SecAggClient:
        return cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in record.items()})

    # ------------------------------------------------------------------ dispatch
    def handle(self, content: RecordDict, encode: Encoder | None = None) -> RecordDict:
        """The reply content to one request.

        Raises
        ------
        ProtocolError
            If the request breaks the protocol; the client's state is then reset (it takes no
            further part in the round).
        """
        record = content.config_records.get(RECORD) if isinstance(content, RecordDict) else None
        stage = record.get("stage") if record is not None else None
        try:
            if stage == "advertise":
                return self._advertise(content)
            after_collect = CONSISTENCY if self.signed else "unmask"
            expected = {"advertise": "share-keys", "share-keys": "collect", "collect": after_collect,
                        CONSISTENCY: "unmask"}.get(self.stage)  # fmt: skip
            if stage != expected:
                raise ProtocolError(f"node {self.node_id}: request for stage {stage!r}, expected {expected!r}")
            if stage == "share-keys":
                return self._share_keys(section(content, stage, self.session))
            if stage == "collect":
                if encode is None:
                    raise ProtocolError("the collect stage needs an encoder")
                return self._collect(content, section(content, stage, self.session), encode)
            if stage == CONSISTENCY:
                return self._consistency(section(content, stage, self.session))
            return self._unmask(section(content, stage, self.session))
        except ProtocolError:
            self._reset()
            raise
        except crypto.CryptoError as err:  # defence in depth: every key is checked before use
            self._reset()
            raise ProtocolError(f"node {self.node_id}: stage {stage!r}: {err}") from None

    def _reset(self) -> None:
        keep = {k: getattr(self, k) for k in ("node_id", "identity", "directory_nodes", "directory_keys")}
        self.__dict__.update(vars(SecAggClient(**keep)))

    def _reply(self, **fields: object) -> RecordDict:
        return RecordDict({RECORD: request_record(self.stage, self.session, self.server_round, **fields)})

    # ------------------------------------------------------------------ stages
    def _advertise(self, content: RecordDict) -> RecordDict:
        record = section(content, "advertise", None)
        session = read_bytes(record, "session", SESSION_BYTES)
        server_round = read_int(record, "round", 0, 1 << 62)
        holders = read_node_ids(record, "holders")
        if self.node_id not in holders:
            raise ProtocolError(f"node {self.node_id} is not among its own share holders")
        threshold = read_int(record, "threshold", 2, len(holders))
        if 2 * threshold <= len(holders):
            raise ProtocolError(f"threshold {threshold} is not a majority of {len(holders)} holders")
        signed = record.get("signed", False) is True
        if self.identity and not signed:
            raise ProtocolError(f"node {self.node_id} takes part in signed rounds only (it has an identity key)")
        if signed and not self.identity:
            raise ProtocolError(f"node {self.node_id} has no identity key to sign with")
        self._reset()
        self.stage, self.session, self.server_round, self.threshold = "advertise", session, server_round, threshold
        self.signed = signed
        self.encryption_seed, self.mask_seed, self.self_seed = (crypto.random_seed() for _ in range(3))
        keys = crypto.public_key(self.encryption_seed) + crypto.public_key(self.mask_seed)
        keys += crypto.commitment(self.self_seed)
        if not signed:
            return self._reply(keys=keys)
        message = advertise_message(session, server_round, self.node_id, keys)
        return self._reply(keys=keys, signature=crypto.sign(self.identity, message))

    def _share_keys(self, record: ConfigRecord) -> RecordDict:
        nodes = read_node_ids(record, "nodes")
        keys = read_bytes_list(record, "keys", KEYS_BYTES, len(nodes))
        if nodes != sorted(nodes) or self.node_id not in nodes:
            raise ProtocolError("share-keys: 'nodes' must be sorted and hold this node")
        if len(nodes) < self.threshold:
            raise ProtocolError(f"share-keys: {len(nodes)} live holders, fewer than the threshold {self.threshold}")
        mine = keys[nodes.index(self.node_id)]
        if mine[: 2 * PUBLIC_KEY_BYTES] != crypto.public_key(self.encryption_seed) + crypto.public_key(self.mask_seed):
            raise ProtocolError("share-keys: the server relayed a wrong key for this node")
        publics = [k[: 2 * PUBLIC_KEY_BYTES] for k in keys]
        if len(set(publics)) != len(publics):
            raise ProtocolError("share-keys: two nodes advertise the same keys")
        if self.signed:
            signatures = record.get("signatures")
            if not isinstance(signatures, list) or len(signatures) != len(nodes):
                raise ProtocolError("share-keys: a signed round needs one advertise signature per node")
            for peer, peer_keys, signature in zip(nodes, keys, signatures):
                message = advertise_message(self.session, self.server_round, peer, peer_keys)
                if peer != self.node_id and not crypto.verifies(self._identity_of(peer), signature, message):
                    raise ProtocolError(f"share-keys: the keys of node {peer} are not signed by its identity "
                                        "(the server substituted them)")  # fmt: skip
        for peer, peer_keys in zip(nodes, keys):
            for key in split_keys(peer_keys)[:2]:
                try:
                    crypto.check_public_key(key)
                except crypto.CryptoError as err:  # the server should have dropped it at advertise
                    raise ProtocolError(f"share-keys: the server relayed a refused key of node {peer}: {err}") from None
        seed_shares = crypto.split_secret(self.self_seed, self.threshold, len(nodes))
        key_shares = crypto.split_secret(self.mask_seed, self.threshold, len(nodes))
        destinations, ciphertexts = [], []
        for index, (peer, peer_keys) in enumerate(zip(nodes, keys)):
            if peer == self.node_id:
                continue
            key = share_key(self.encryption_seed, split_keys(peer_keys)[0], self.session, self.node_id, peer)
            plaintext = seed_shares[index] + key_shares[index]
            ciphertexts.append(crypto.encrypt(key, plaintext, share_associated(self.session, self.node_id, peer)))
            destinations.append(peer)
        own = nodes.index(self.node_id)
        self.peers, self.peer_keys = nodes, keys
        self.held_nodes = [self.node_id]
        self.held_seed_shares, self.held_key_shares = [seed_shares[own]], [key_shares[own]]
        self.stage = "share-keys"
        return self._reply(destinations=destinations, ciphertexts=ciphertexts)

    def _collect(self, content: RecordDict, record: ConfigRecord, encode: Encoder) -> RecordDict:
        sources = read_node_ids(record, "sources")
        ciphertexts = read_bytes_list(record, "ciphertexts", crypto.CIPHERTEXT_BYTES, len(sources))
        if not set(sources) <= set(self.peers) - {self.node_id}:
            raise ProtocolError("collect: a source is not one of this node's holders")
        if len(sources) + 1 < self.threshold:
            raise ProtocolError(f"collect: {len(sources) + 1} live holders, fewer than the threshold")
        for src, sealed in zip(sources, ciphertexts):
            peer_public = split_keys(self.peer_keys[self.peers.index(src)])[0]
            key = share_key(self.encryption_seed, peer_public, self.session, src, self.node_id)
            try:
                plaintext = crypto.decrypt(key, sealed, share_associated(self.session, src, self.node_id))
            except crypto.CryptoError as err:
                raise ProtocolError(f"collect: the share pair from node {src} does not decrypt ({err})") from None
            self.held_nodes.append(src)
            self.held_seed_shares.append(plaintext[:SHARE_BYTES])
            self.held_key_shares.append(plaintext[SHARE_BYTES:])
        names = record.get("segments")
        sizes = read_ints(record, "segment-sizes", 64)
        bits = read_ints(record, "segment-bits", 64)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise ProtocolError("collect: 'segments' must be a list of distinct names")
        if not len(names) == len(sizes) == len(bits) or not names:
            raise ProtocolError("collect: segment names, sizes and bits differ in length")
        if any(not 1 <= b <= 32 for b in bits) or any(not 1 <= s <= MAX_SEGMENT_SIZE for s in sizes):
            raise ProtocolError("collect: segment size or bit width out of range")
        spec = {n: (s, b) for n, s, b in zip(names, sizes, bits)}
        values = encode(content, spec)
        masked = {}
        for name, (size, width) in spec.items():
            x = np.asarray(values[name])
            if x.shape != (size,) or x.dtype != np.uint32 or (width < 32 and int(x.max(initial=0)) >> width):
                raise ValueError(f"the encoder's segment '{name}' must be {size} uint32 values below 2**{width}")
            total = masks.apply(x, masks.self_mask(self.self_seed, self.session, name, size, width), 1, width)
            for src in sources:
                peer_mask_key = split_keys(self.peer_keys[self.peers.index(src)])[1]
                p = masks.pairwise_mask(self.mask_seed, peer_mask_key, self.session, name, size, width)
                total = masks.apply(total, p, masks.sign(self.node_id, src), width)
            masked[name] = total
        self.stage = "collect"
        reply = self._reply()
        reply.array_records[MASKED_RECORD] = masked_record(masked, {n: b for n, (_, b) in spec.items()})
        return reply

    def _consistency(self, record: ConfigRecord) -> RecordDict:
        survivors = read_node_ids(record, "survivors")
        if survivors != sorted(survivors) or self.node_id not in survivors:
            raise ProtocolError("consistency: 'survivors' must be sorted and hold this node")
        if len(survivors) < self.threshold:
            raise ProtocolError(f"consistency: {len(survivors)} survivors, fewer than the threshold {self.threshold}")
        self.consistency, self.stage = survivors, CONSISTENCY
        message = consistency_message(self.session, self.server_round, survivors)
        return self._reply(signature=crypto.sign(self.identity, message))

    def _check_signed_survivors(self, record: ConfigRecord, survivors: list[int], dropped: list[int]) -> None:
        """The unmask request must match the survivor set this client signed, and ``threshold`` of its
        members must have signed that same set (no node signs two sets, and two sets of a majority meet)."""
        signers = read_node_ids(record, "signers")
        signatures = record.get("signatures")
        if not isinstance(signatures, list) or len(signatures) != len(signers):
            raise ProtocolError("unmask: one signature per signer expected")
        message = consistency_message(self.session, self.server_round, self.consistency)
        known = set(self.consistency) & set(self.peers) & set(self.directory_nodes)  # signers among its holders
        valid = sum(1 for n, sig in zip(signers, signatures)
                    if n in known and crypto.verifies(self._identity_of(n), sig, message))  # fmt: skip
        if valid < self.threshold:
            raise ProtocolError(f"unmask: the survivor set this node signed carries {valid} valid signatures, "
                                f"fewer than the threshold {self.threshold}: the server told nodes different sets")
        signed = set(self.consistency)
        if set(survivors) != set(self.held_nodes) & signed or set(dropped) != set(self.held_nodes) - signed:
            raise ProtocolError("unmask: the survivors and dropped nodes differ from the signed survivor set")

    def _unmask(self, record: ConfigRecord) -> RecordDict:
        survivors = read_node_ids(record, "survivors")
        dropped = read_node_ids(record, "dropped")
        if self.signed:
            self._check_signed_survivors(record, survivors, dropped)
        if set(survivors) & set(dropped):
            raise ProtocolError("unmask: a node is listed as both survivor and dropped")
        if self.node_id not in survivors:
            raise ProtocolError("unmask: this node sent its input but is not listed as a survivor")
        if not set(survivors) | set(dropped) <= set(self.held_nodes):
            raise ProtocolError("unmask: asked for the shares of a node whose shares this node does not hold")
        if len(survivors) < self.threshold:
            raise ProtocolError(f"unmask: {len(survivors)} survivors, fewer than the threshold {self.threshold}")
        index = {n: i for i, n in enumerate(self.held_nodes)}
        self.stage = "unmask"
        reply = self._reply(
            **{
                "seed-nodes": survivors,
                "seed-shares": [self.held_seed_shares[index[n]] for n in survivors],
                "key-nodes": dropped,
                "key-shares": [self.held_key_shares[index[n]] for n in dropped],
            }
        )
        self._reset()  # one unmask per session: a replay finds no state
        return reply


__all__ = ["KEYS_BYTES", "MAX_NODES", "SEED_BYTES", "Encoder", "SecAggClient"]
