"""The server side of the protocol: four stages, each a batch of requests and a batch of replies.

:class:`SecAggServer` is transport-free: :meth:`~SecAggServer.requests` gives the content to send
to each node for the current stage, :meth:`~SecAggServer.receive` takes the replies that came
back (a missing node has dropped) and advances. Every reply is untrusted: one that fails a check
is logged with its node id and the node is treated as dropped at that stage. After the last
stage :attr:`~SecAggServer.result` holds the modular sums of the survivors' inputs, or
:attr:`~SecAggServer.failure` says why the round could not complete (nothing is aggregated).

Node sets, as in Bell et al. (2020): ``U1`` advertised keys, ``U2`` shared keys, ``U3`` sent a
masked input (the survivors), ``U4`` answered the unmask request. The server never holds an
unmasked input: it sums masked inputs, and rebuilds for each node of ``U2`` either its self-mask
seed (survivors) or its mask key (dropped), never both (the clients refuse that too).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import RecordDict

from fedquant.secagg import crypto, masks
from fedquant.secagg.client import KEYS_BYTES, split_keys
from fedquant.secagg.config import SecAggConfig
from fedquant.secagg.crypto import CIPHERTEXT_BYTES, SHARE_BYTES, SIGNATURE_BYTES
from fedquant.secagg.messages import (
    CONSISTENCY,
    RECORD,
    SESSION_BYTES,
    ProtocolError,
    read_bytes,
    read_bytes_list,
    read_masked,
    read_node_ids,
    request_record,
    section,
)

log = logging.getLogger("fedquant.secagg")


@dataclass(frozen=True)
class Segment:
    """One summed vector: ``size`` values in ``Z_{2**bits}``."""

    name: str
    size: int
    bits: int


@dataclass
class SecureSum:
    """The outcome of a completed round.

    Attributes
    ----------
    sums : dict of str to np.ndarray
        Per segment, the sum of the survivors' inputs modulo ``2**bits`` (uint32).
    survivors : tuple of int
        The nodes whose inputs are in the sums.
    dropped : tuple of int
        Nodes that shared keys but sent no (valid) input; their masks were removed.
    """

    sums: dict[str, np.ndarray]
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass
class SecAggServer:
    """One secure round (see the module doc).

    Parameters
    ----------
    config : SecAggConfig
    nodes : sequence of int
        The nodes sampled for the round.
    segments : sequence of Segment
        What each client sums.
    server_round : int
    rng : random.Random, optional
        Orders the SecAgg+ ring (a fresh OS-seeded one by default).
    """

    config: SecAggConfig
    nodes: Sequence[int]
    segments: Sequence[Segment]
    server_round: int = 0
    rng: random.Random | None = None
    stage: str = "advertise"
    failure: str | None = None
    result: SecureSum | None = None
    session: bytes = field(default_factory=lambda: os.urandom(SESSION_BYTES))
    rejected: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.nodes = sorted(set(self.nodes))
        self.holders = self.config.holders(self.nodes, self.rng or random.Random(os.urandom(16)))
        self.threshold = {n: self.config.threshold_for(len(h)) for n, h in self.holders.items()}
        self.active: set[int] = set(self.nodes)
        self.keys: dict[int, bytes] = {}
        self.peers: dict[int, list[int]] = {}
        self.forward: dict[int, dict[int, bytes]] = {}  # destination -> source -> share pair
        self.sources: dict[int, list[int]] = {}
        self.totals: dict[str, np.ndarray] = {}
        self.survivors: list[int] = []
        self.dropped: list[int] = []
        self.seed_shares: dict[int, list[bytes]] = {}
        self.key_shares: dict[int, list[bytes]] = {}
        self.signatures: dict[int, bytes] = {}  # advertise signatures (signed rounds)
        self.survivor_signatures: dict[int, bytes] = {}  # consistency signatures (signed rounds)

    # ------------------------------------------------------------------ driving
    @property
    def done(self) -> bool:
        return self.stage in ("done", "failed")

    def requests(self) -> dict[int, RecordDict]:
        """The content to send to each active node for the current stage (empty when done)."""
        if self.done:
            return {}
        make = getattr(self, "_request_" + self.stage.replace("-", "_"))
        return {n: RecordDict({RECORD: make(n)}) for n in sorted(self.active)}

    def receive(self, replies: Mapping[int, RecordDict | None]) -> None:
        """Take the current stage's replies (absent or ``None``: dropped) and advance."""
        if self.done:
            return
        accept = getattr(self, "_accept_" + self.stage.replace("-", "_"))
        answered = set()
        for node in sorted(self.active):
            content = replies.get(node)
            if content is None:
                self._drop(node, "no reply" if self.stage != "unmask" else "no unmask reply (its input stays summed)")
                continue
            try:
                accept(node, content)
                answered.add(node)
            except ProtocolError as err:
                self._drop(node, str(err))
        for node in set(replies) - self.active:
            log.warning("secagg round %d %s: ignored a reply from node %d, which was not asked",
                        self.server_round, self.stage, node)
        self.active = answered
        getattr(self, "_finish_" + self.stage.replace("-", "_"))()

    def _drop(self, node: int, reason: str) -> None:
        self.rejected.setdefault(node, f"{self.stage}: {reason}")
        log.warning("secagg round %d %s: node %d dropped: %s", self.server_round, self.stage, node, reason)

    def _fail(self, reason: str) -> None:
        self.stage, self.failure = "failed", reason
        self.totals.clear()
        log.error("secagg round %d failed, nothing aggregated: %s", self.server_round, reason)

    def _record(self, node: int, **fields: object):
        return request_record(self.stage, self.session, self.server_round, **fields)

    def _section(self, content: RecordDict) -> object:
        record = section(content, self.stage, self.session)
        if record.get("round") != self.server_round:
            raise ProtocolError("reply names another round")
        return record

    def _prune(self, live: set[int]) -> set[int]:
        """Drop nodes whose live share holders fall below their threshold, until none do."""
        live = set(live)
        changed = True
        while changed:
            changed = False
            for node in sorted(live):
                if len(live & set(self.holders[node])) < self.threshold[node]:
                    live.discard(node)
                    self._drop(node, "fewer live share holders than the threshold")
                    changed = True
        return live

    # ------------------------------------------------------------------ advertise
    def _request_advertise(self, node: int):
        return self._record(node, holders=self.holders[node], threshold=self.threshold[node],
                            signed=self.config.signed)  # fmt: skip

    def _accept_advertise(self, node: int, content: RecordDict) -> None:
        record = self._section(content)
        keys = read_bytes(record, "keys", KEYS_BYTES)
        if self.config.signed:  # checked by the peers, who hold the identity keys
            self.signatures[node] = read_bytes(record, "signature", SIGNATURE_BYTES)
        publics = keys[: 2 * crypto.PUBLIC_KEY_BYTES]
        for which, key in zip(("encryption", "mask"), split_keys(keys)[:2]):
            try:
                crypto.check_public_key(key)
            except crypto.CryptoError as err:
                raise ProtocolError(f"its {which} key is refused: {err}") from None
        if any(k[: 2 * crypto.PUBLIC_KEY_BYTES] == publics for k in self.keys.values()):
            raise ProtocolError("advertises the keys of another node")
        self.keys[node] = keys

    def _finish_advertise(self) -> None:
        self.active = self._prune(self.active)
        self._next("share-keys")

    def _next(self, stage: str) -> None:
        if len(self.active) < max(self.threshold.values(), default=2):
            self._fail(f"{len(self.active)} nodes left after stage {self.stage}, fewer than the threshold")
        else:
            self.stage = stage

    # ------------------------------------------------------------------ share keys
    def _request_share_keys(self, node: int):
        peers = sorted(self.active & set(self.holders[node]))
        self.peers[node] = peers
        signed = {"signatures": [self.signatures[p] for p in peers]} if self.config.signed else {}
        return self._record(node, nodes=peers, keys=[self.keys[p] for p in peers], **signed)

    def _accept_share_keys(self, node: int, content: RecordDict) -> None:
        record = self._section(content)
        destinations = read_node_ids(record, "destinations")
        ciphertexts = read_bytes_list(record, "ciphertexts", CIPHERTEXT_BYTES, len(destinations))
        if sorted(destinations) != [p for p in self.peers[node] if p != node]:
            raise ProtocolError("share pairs are not addressed to exactly its other live holders")
        for dst, sealed in zip(destinations, ciphertexts):
            self.forward.setdefault(dst, {})[node] = sealed

    def _finish_share_keys(self) -> None:
        self.active = self._prune(self.active)
        self._next("collect")

    # ------------------------------------------------------------------ collect
    def _request_collect(self, node: int):
        sources = sorted(s for s in self.forward.get(node, {}) if s in self.active)
        self.sources[node] = sources
        return self._record(
            node,
            sources=sources,
            ciphertexts=[self.forward[node][s] for s in sources],
            segments=[s.name for s in self.segments],
            **{"segment-sizes": [s.size for s in self.segments], "segment-bits": [s.bits for s in self.segments]},
        )

    def _accept_collect(self, node: int, content: RecordDict) -> None:
        self._section(content)
        values = read_masked(content, [(s.name, s.size, s.bits) for s in self.segments])
        for seg in self.segments:
            total = self.totals.get(seg.name)
            value = values[seg.name]
            self.totals[seg.name] = value if total is None else masks.apply(total, value, 1, seg.bits)

    def _finish_collect(self) -> None:
        self.forward.clear()
        self.survivors = sorted(self.active)
        shared = set(self.sources)
        self.dropped = sorted(shared - self.active)
        self._next(CONSISTENCY if self.config.signed else "unmask")

    # ------------------------------------------------------------------ consistency (signed rounds)
    def _request_consistency(self, node: int):
        return self._record(node, survivors=self.survivors)

    def _accept_consistency(self, node: int, content: RecordDict) -> None:
        self.survivor_signatures[node] = read_bytes(self._section(content), "signature", SIGNATURE_BYTES)

    def _finish_consistency(self) -> None:
        self._next("unmask")

    # ------------------------------------------------------------------ unmask
    def _request_unmask(self, node: int):
        held = set(self.sources[node]) | {node}
        signed = {}
        if self.config.signed:
            signers = sorted(self.survivor_signatures)
            signed = {"signers": signers, "signatures": [self.survivor_signatures[n] for n in signers]}
        return self._record(
            node,
            survivors=[n for n in self.survivors if n in held],
            dropped=[n for n in self.dropped if n in held],
            **signed,
        )

    def _accept_unmask(self, node: int, content: RecordDict) -> None:
        record = self._section(content)
        held = set(self.sources[node]) | {node}
        want_seeds = [n for n in self.survivors if n in held]
        want_keys = [n for n in self.dropped if n in held]
        if read_node_ids(record, "seed-nodes") != want_seeds or read_node_ids(record, "key-nodes") != want_keys:
            raise ProtocolError("unmask reply is not for the requested nodes")
        seed_shares = read_bytes_list(record, "seed-shares", SHARE_BYTES, len(want_seeds))
        key_shares = read_bytes_list(record, "key-shares", SHARE_BYTES, len(want_keys))
        # A share with another holder's index is discarded alone: the owner may have sealed a bad
        # share for an honest holder, so the holder's other shares are kept.
        for kind, store, owners, shares in (("seed", self.seed_shares, want_seeds, seed_shares),
                                            ("key", self.key_shares, want_keys, key_shares)):  # fmt: skip
            for owner, share in zip(owners, shares):
                if crypto.share_index(share) != self.peers[owner].index(node) + 1:
                    log.warning("secagg round %d unmask: node %d: the %s share of node %d carries another "
                                "holder's index; discarded", self.server_round, node, kind, owner)
                    continue
                store.setdefault(owner, []).append(share)

    def _rebuild(self, owner: int, shares: list[bytes], check) -> bytes | None:
        """A secret from ``threshold`` shares, checked against its commitment or public key.

        If a window of shares fails the check (a holder sent a bad share), the next cyclic
        window is tried: up to one window per share, so a run of up to ``len(shares) - t``
        consecutive bad shares is outvoted.
        """
        t = self.threshold[owner]
        if len(shares) < t:
            return None
        for start in range(len(shares)):
            window = [shares[(start + i) % len(shares)] for i in range(t)]
            try:
                secret = crypto.join_secret(window)
            except crypto.CryptoError:
                continue
            if check(secret):
                return secret
        return None

    def _finish_unmask(self) -> None:
        seed_shares, key_shares, totals = self.seed_shares, self.key_shares, self.totals
        for node in self.survivors:
            commit = split_keys(self.keys[node])[2]
            seed = self._rebuild(node, seed_shares.get(node, []), lambda s, c=commit: crypto.commitment(s) == c)
            if seed is None:
                return self._fail(f"cannot rebuild the self-mask seed of node {node} (too few or bad shares)")
            for seg in self.segments:
                mask = masks.self_mask(seed, self.session, seg.name, seg.size, seg.bits)
                totals[seg.name] = masks.apply(totals[seg.name], mask, -1, seg.bits)
        for node in self.dropped:
            public = split_keys(self.keys[node])[1]
            mask_seed = self._rebuild(node, key_shares.get(node, []), lambda s, p=public: crypto.public_key(s) == p)
            if mask_seed is None:
                return self._fail(f"cannot rebuild the mask key of dropped node {node} (too few or bad shares)")
            for peer in self.survivors:
                if node not in self.sources[peer]:
                    continue  # the survivor never masked with this node
                peer_public = split_keys(self.keys[peer])[1]
                for seg in self.segments:
                    p = masks.pairwise_mask(mask_seed, peer_public, self.session, seg.name, seg.size, seg.bits)
                    totals[seg.name] = masks.apply(totals[seg.name], p, -masks.sign(peer, node), seg.bits)
        self.result = SecureSum(sums=dict(totals), survivors=tuple(self.survivors), dropped=tuple(self.dropped))
        self.stage = "done"
        log.info("secagg round %d: summed %d inputs (%d dropped after sharing keys)",
                 self.server_round, len(self.survivors), len(self.dropped))
