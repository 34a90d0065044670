"""SecAgg+ over Flower Messages: exact aggregates with dropouts, what the server sees, bad replies."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, Message, RecordDict

from fedquant.codecs.summable import WEIGHT_BITS, SumGrid, decode_sum, encode_update, expected_mean_error
from fedquant.secagg import (
    LoopbackGrid,
    ProtocolError,
    SecAggClient,
    SecAggConfig,
    SecAggServer,
    Segment,
    run_secure_sum,
)
from fedquant.secagg.messages import MASKED_RECORD, RECORD
from tests.flower_fakes import set_task_identity

GRID_RECORD = "fedquant.secagg.grid"
PREFIX = "fedquant.secagg.grid."


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()


class Round:
    """A secure round of the summable codec between N client state machines and one server."""

    def __init__(self, n: int = 20, d: int = 2000, config: SecAggConfig | None = None, seed: int = 0) -> None:
        self.config = config or SecAggConfig(bits=3, clip=10.0)
        rng = np.random.default_rng(seed)
        common = rng.standard_normal(d) * 0.02
        self.nodes = [1000 + 7 * i for i in range(n)]
        self.updates = {nid: torch.tensor(common + 0.02 * rng.standard_normal(d), dtype=torch.float32)
                        for nid in self.nodes}
        previous = torch.stack(list(self.updates.values())).mean(0).numpy()
        self.grid = self.config.scale_rule().grid(d, n, rotation_seed=99, previous_mean=previous)
        self.segments = [Segment("update", self.grid.padded_numel, self.grid.bits), Segment("weight", 1, WEIGHT_BITS)]
        self.encoded = {}
        self.clients = {nid: SecAggClient(nid) for nid in self.nodes}
        self.encoders = {nid: self._encoder(nid) for nid in self.nodes}

    def dither_seed(self, nid: int) -> int:
        return 5000 + nid

    def _encoder(self, nid: int):
        def encode(content: RecordDict, spec: dict) -> dict:
            grid = SumGrid.from_config(content.config_records[GRID_RECORD], PREFIX)  # what the client was sent
            enc = encode_update(self.updates[nid], grid, self.dither_seed(nid), rng=np.random.default_rng(nid))
            self.encoded[nid] = enc
            assert spec == {"update": (grid.padded_numel, grid.bits), "weight": (1, WEIGHT_BITS)}
            return {"update": enc.values, "weight": np.array([enc.weight_units], np.uint32)}

        return encode

    def extra(self, stage: str, node: int):
        if stage == "collect":
            return RecordDict({GRID_RECORD: ConfigRecord(self.grid.to_config(PREFIX))})
        return None

    def run(self, drop_after=None, tamper=None, server_round: int = 3):
        self.server = SecAggServer(self.config, self.nodes, self.segments, server_round=server_round)
        self.transport = LoopbackGrid(self.clients, self.encoders, drop_after, tamper)
        return run_secure_sum(self.server, self.transport.send_and_receive, self.extra)

    def check_exact(self, result) -> None:
        survivors = result.survivors
        want = sum(self.encoded[n].integers for n in survivors) & (self.grid.modulus - 1)
        assert np.array_equal(result.sums["update"], want.astype(np.uint32))
        assert int(result.sums["weight"][0]) == sum(self.encoded[n].weight_units for n in survivors)


def test_full_protocol_with_two_dropouts_after_key_sharing_aggregates_exactly(caplog):
    r = Round()
    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        result = r.run(drop_after={r.nodes[3]: "share-keys", r.nodes[11]: "share-keys"})
    assert result is not None, r.server.failure
    assert set(result.dropped) == {r.nodes[3], r.nodes[11]} and len(result.survivors) == 18
    r.check_exact(result)
    decoded = decode_sum(result.sums["update"], r.grid, [r.dither_seed(n) for n in result.survivors],
                         int(result.sums["weight"][0]))
    mean = torch.stack([r.updates[n] for n in result.survivors]).mean(0)
    err = float(((decoded - mean).double() ** 2).sum())
    assert err < 1.3 * expected_mean_error(r.grid, 18, 18)
    assert f"node {r.nodes[3]} dropped" in caplog.text and f"node {r.nodes[11]} dropped" in caplog.text
    # Every stage's messages were real Flower Messages, and the masked inputs are packed at b bits.
    masked = [m for m in r.transport.replies if MASKED_RECORD in m.content.array_records]
    assert len(masked) == 18
    for m in masked:
        array = m.content.array_records[MASKED_RECORD]["update"]
        assert len(array.data) == (r.grid.padded_numel * r.grid.bits + 7) // 8


def test_dropouts_at_every_stage_and_a_sparse_neighbourhood():
    config = SecAggConfig(bits=3, clip=10.0, neighbours=8, threshold=0.6)
    r = Round(n=16, config=config)
    result = r.run(drop_after={r.nodes[0]: "advertise", r.nodes[5]: "share-keys", r.nodes[9]: "collect"})
    assert result is not None, r.server.failure
    assert r.nodes[0] not in result.survivors + result.dropped  # dropped before sharing: never masked
    assert set(result.dropped) == {r.nodes[5]} and r.nodes[9] in result.survivors  # its input arrived
    r.check_exact(result)
    assert all(len(h) == 9 for h in r.server.holders.values())


def test_below_the_threshold_the_round_fails_cleanly(caplog):
    r = Round(n=10, config=SecAggConfig(bits=3, clip=10.0, threshold=0.8))
    with caplog.at_level(logging.ERROR, logger="fedquant.secagg"):
        result = r.run(drop_after={n: "share-keys" for n in r.nodes[:3]})
    assert result is None and r.server.stage == "failed"
    assert "fewer than the threshold" in r.server.failure and "nothing aggregated" in caplog.text
    assert r.server.totals == {}


def test_the_server_never_holds_an_unmasked_update():
    """Inspect every reply the server received: masked inputs look uniform and carry no trace of the
    input, and for every node the server got shares of one secret only (seed for survivors, mask key
    for dropped), so even with the survivors' self-mask seeds their pairwise masks stay on."""
    r = Round(n=12, d=3000)
    result = r.run(drop_after={r.nodes[2]: "share-keys"})
    assert result is not None
    bits, modulus = r.grid.bits, r.grid.modulus
    seen_seed, seen_key = set(), set()
    for reply in r.transport.replies:
        node = reply.metadata.src_node_id
        assert set(reply.content.array_records) <= {MASKED_RECORD}
        if MASKED_RECORD in reply.content.array_records:
            from fedquant.wire.bitpack import unpack_bits

            data = reply.content.array_records[MASKED_RECORD]["update"].data
            masked = unpack_bits(np.frombuffer(data, np.uint8), bits, r.grid.padded_numel).astype(np.int64)
            plain = r.encoded[node].values.astype(np.int64)
            assert np.count_nonzero(masked == plain) < 5 * r.grid.padded_numel / modulus + 10
            assert abs(np.corrcoef(masked, plain)[0, 1]) < 5 / np.sqrt(masked.size)
            hist = np.bincount(masked >> (bits - 3), minlength=8)  # top 3 bits: uniform
            expected = masked.size / 8
            assert float(np.sum((hist - expected) ** 2 / expected)) < 7 + 6 * np.sqrt(14)
        record = reply.content.config_records[RECORD]
        assert set(record) <= {"stage", "session", "round", "keys", "destinations", "ciphertexts",
                               "seed-nodes", "seed-shares", "key-nodes", "key-shares"}
        seen_seed |= set(record.get("seed-nodes", []))
        seen_key |= set(record.get("key-nodes", []))
    assert not seen_seed & seen_key
    assert seen_key == set(result.dropped) and seen_seed == set(result.survivors)
    # With a survivor's self-mask seed removed, what remains is still masked (pairwise masks).
    from fedquant.secagg import masks

    node = result.survivors[0]
    masked_reply = next(m for m in r.transport.replies
                        if m.metadata.src_node_id == node and MASKED_RECORD in m.content.array_records)
    from fedquant.wire.bitpack import unpack_bits

    y = unpack_bits(np.frombuffer(masked_reply.content.array_records[MASKED_RECORD]["update"].data, np.uint8),
                    bits, r.grid.padded_numel).astype(np.uint32)
    seed = r.server._rebuild(node, r.server.seed_shares[node], lambda s: True)
    unself = masks.apply(y, masks.self_mask(seed, r.server.session, "update", y.size, bits), -1, bits)
    plain = r.encoded[node].values.astype(np.int64)
    assert abs(np.corrcoef(unself.astype(np.int64), plain)[0, 1]) < 5 / np.sqrt(y.size)


# ----------------------------------------------------------------------------------------- bad input
def _edit(stage, node, victim, want_stage, change):
    def tamper(s, n, reply):
        if s == want_stage and n == victim and not reply.has_error():
            return change(reply)
        return reply

    return tamper


def _config_change(**fields):
    def change(reply):
        record = reply.content.config_records[RECORD]
        for key, value in fields.items():
            record[key] = value(record[key]) if callable(value) else value
        return reply

    return change


def test_wrong_length_masked_vector_is_a_dropout(caplog):
    r = Round(n=10)
    victim = r.nodes[4]

    def shorten(reply):
        arr = reply.content.array_records[MASKED_RECORD]["update"]
        reply.content.array_records[MASKED_RECORD]["update"] = Array(
            dtype="uint8", shape=(len(arr.data) - 1,), stype=arr.stype, data=arr.data[:-1])
        return reply

    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        result = r.run(tamper=_edit(None, None, victim, "collect", shorten))
    assert result is not None and victim in result.dropped
    r.check_exact(result)
    assert f"node {victim} dropped" in caplog.text and "bytes" in caplog.text


@pytest.mark.parametrize(
    "what",
    ["share-index", "share-bytes", "share-length"],
)
def test_malformed_shares_are_rejected_or_outvoted(what, caplog):
    r = Round(n=10)
    victim = r.nodes[1]

    def damage(share: bytes) -> bytes:
        if what == "share-index":
            return (int.from_bytes(share[:4], "little") + 1).to_bytes(4, "little") + share[4:]
        if what == "share-bytes":
            return share[:10] + bytes([share[10] ^ 0xFF]) + share[11:]
        return share[:-1]

    change = _config_change(**{"seed-shares": lambda shares: [damage(s) for s in shares]})
    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        result = r.run(tamper=_edit(None, None, victim, "unmask", change))
    assert result is not None, r.server.failure  # the other holders' shares suffice
    r.check_exact(result)
    if what == "share-index":  # discarded one by one: the victim's other shares still count
        assert f"node {victim}: the seed share of node" in caplog.text and "discarded" in caplog.text
    elif what == "share-length":
        assert f"node {victim} dropped" in caplog.text


def test_replayed_and_stale_messages_are_rejected(caplog):
    r = Round(n=8)
    old = Round(n=8)
    old.run()
    stale = {m.metadata.src_node_id: m for m in old.transport.replies
             if m.content.config_records[RECORD]["stage"] == "share-keys"}
    replayed = {}

    def tamper(stage, node, reply):
        if stage == "advertise" and node == r.nodes[0]:
            replayed["advertise"] = reply
        if stage == "share-keys" and node == r.nodes[0]:  # answer share-keys with the advertise reply
            return Message(replayed["advertise"].content, reply_to=_request(r, node, "share-keys"))
        if stage == "share-keys" and node == r.nodes[1]:  # a reply from another session
            return Message(stale[node].content, reply_to=_request(r, node, "share-keys"))
        if stage == "collect" and node == r.nodes[2]:  # a reply to the previous stage's message
            return Message(reply.content, reply_to=_request(r, node, "share-keys"))
        return reply

    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        result = r.run(tamper=tamper)
    assert result is not None, r.server.failure
    assert {r.nodes[0], r.nodes[1]}.isdisjoint(result.survivors + result.dropped)
    assert r.nodes[2] in result.dropped
    r.check_exact(result)
    assert "expected 'share-keys'" in caplog.text and "another session" in caplog.text and "replayed" in caplog.text


def _request(r: Round, node: int, stage: str) -> Message:
    return [m for m in r.transport.requests
            if m.metadata.dst_node_id == node and m.content.config_records[RECORD]["stage"] == stage][-1]


def test_duplicate_unknown_and_error_replies():
    r = Round(n=8)

    def tamper(stage, node, reply):
        if stage == "advertise" and node == r.nodes[0]:
            r.transport.replies.append(reply)  # a second copy, delivered below
        return reply

    sent_twice = []

    class Doubling(LoopbackGrid):
        def send_and_receive(self, messages):
            out = super().send_and_receive(messages)
            if out and out[0].content.config_records[RECORD]["stage"] == "advertise" and not sent_twice:
                sent_twice.append(True)
                out.append(out[0])  # node 0 twice
                out.append(Message(out[1].content, reply_to=messages[1]))
                out[-1].metadata.__dict__["_src_node_id"] = 4242  # a node that was not asked
            return out

    r.server = SecAggServer(r.config, r.nodes, r.segments)
    r.transport = Doubling(r.clients, r.encoders)
    result = run_secure_sum(r.server, r.transport.send_and_receive, r.extra)
    assert result is not None and r.nodes[0] not in result.survivors + result.dropped
    r.check_exact(result)


def _run_until_unmask(r: Round):
    """Advertise, share-keys and collect of a full round; returns the server, waiting for unmask."""
    from fedquant.secagg.driver import sort_replies, stage_messages

    server = SecAggServer(r.config, r.nodes, r.segments, server_round=4)
    transport = LoopbackGrid(r.clients, r.encoders)
    while server.stage != "unmask":
        sent = stage_messages(server, r.extra)
        server.receive(sort_replies(sent, transport.send_and_receive(list(sent.values())), server.server_round))
    return server, transport


def test_client_refuses_to_reveal_both_secrets_and_replays():
    r = Round(n=6)
    client = SecAggClient(77)
    request = RecordDict({RECORD: ConfigRecord({"stage": "unmask", "session": b"x" * 16, "round": 1,
                                                "survivors": [77], "dropped": [77]})})
    with pytest.raises(ProtocolError, match="expected"):
        client.handle(request)  # no session: unmask before advertise
    # A client that sent its input (stage collect, this session) is asked for both secrets of a peer.
    server, transport = _run_until_unmask(r)
    node, peer = r.nodes[0], r.nodes[1]
    assert r.clients[node].stage == "collect" and peer in r.clients[node].held_nodes
    both = RecordDict({RECORD: ConfigRecord({"stage": "unmask", "session": server.session, "round": 4,
                                             "survivors": [node, peer, *r.nodes[2:]], "dropped": [peer]})})
    with pytest.raises(ProtocolError, match="both survivor and dropped"):
        r.clients[node].handle(both)
    assert r.clients[node].stage == ""  # refused: its state is gone, it takes no further part
    # Another client answers the real unmask request once; the same request again finds no state.
    other = r.nodes[2]
    request = stage_messages_for(server, other)
    reply = r.clients[other].handle(request)
    assert reply.config_records[RECORD]["stage"] == "unmask"
    with pytest.raises(ProtocolError, match="request for stage 'unmask', expected None"):
        r.clients[other].handle(request)


def stage_messages_for(server: SecAggServer, node: int) -> RecordDict:
    return server.requests()[node]


def test_client_state_survives_a_config_record_round_trip():
    r = Round(n=6)
    server = SecAggServer(r.config, r.nodes, r.segments)
    transport = LoopbackGrid(r.clients, r.encoders)
    for _ in range(2):  # advertise, share-keys
        from fedquant.secagg.driver import sort_replies, stage_messages

        sent = stage_messages(server, r.extra)
        replies = transport.send_and_receive(list(sent.values()))
        server.receive(sort_replies(sent, replies, server.server_round))
    for nid in r.nodes:  # what a mod does between messages: keep the state in Context.state
        r.clients[nid] = SecAggClient.from_state(ConfigRecord(r.clients[nid].state()))
    result = run_secure_sum(server, transport.send_and_receive, r.extra)
    assert result is not None
    r.check_exact(result)
