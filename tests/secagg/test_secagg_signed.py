"""The active-server defence: signed key advertisements and the consistency round, against a lying server."""

from __future__ import annotations

import logging

import pytest
from flwr.app import ConfigRecord, RecordDict

from fedquant.secagg import ProtocolError, SecAggClient, SecAggConfig, SecAggServer
from fedquant.secagg.crypto import identity_public, public_key
from fedquant.secagg.messages import RECORD
from tests.flower_fakes import set_task_identity
from tests.secagg.test_secagg import Round


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()


def _signed_round(n: int = 6, **config) -> Round:
    r = Round(n=n, d=300, config=SecAggConfig(bits=3, clip=10.0, signed=True, **config))
    identities = {nid: bytes([i + 1]) * 32 for i, nid in enumerate(r.nodes)}
    directory = {nid: identity_public(key) for nid, key in identities.items()}
    r.clients = {nid: SecAggClient.with_identity(nid, identities[nid], directory) for nid in r.nodes}
    return r


def _errors(r: Round, stage: str) -> dict[int, str]:
    return {m.metadata.src_node_id: m.error.reason for m in r.transport.replies
            if m.has_error() and m.metadata.reply_to_message_id in _ids(r, stage)}  # fmt: skip


def _ids(r: Round, stage: str) -> set[str]:
    return {m.metadata.message_id for m in r.transport.requests if m.content.config_records[RECORD]["stage"] == stage}


def test_a_signed_round_with_dropouts_sums_exactly():
    r = _signed_round(n=8)
    result = r.run(drop_after={r.nodes[1]: "share-keys", r.nodes[5]: "collect"})
    assert result is not None, r.server.failure
    assert set(result.dropped) == {r.nodes[1]} and r.nodes[5] in result.survivors  # its input arrived
    r.check_exact(result)
    assert len(r.server.survivor_signatures) == 6  # node 5 sent its input, then nothing


def test_a_server_substituting_keys_is_caught_by_every_client():
    """The server swaps node 3's advertised keys for its own (keeping node 3's signature): every client
    that would encrypt shares to it refuses at share-keys, so nothing is shared under the server's keys."""
    r = _signed_round()
    victim = r.nodes[3]
    forged = public_key(b"e" * 16) + public_key(b"m" * 16) + bytes(16)

    class Substituting(SecAggServer):
        def _request_share_keys(self, node):
            record = super()._request_share_keys(node)
            nodes, keys = record["nodes"], list(record["keys"])
            keys[nodes.index(victim)] = forged
            record["keys"] = keys
            return record

    r.server = Substituting(r.config, r.nodes, r.segments, server_round=2)
    from fedquant.secagg import LoopbackGrid, run_secure_sum

    r.transport = LoopbackGrid(r.clients, r.encoders)
    assert run_secure_sum(r.server, r.transport.send_and_receive, r.extra) is None
    errors = _errors(r, "share-keys")
    assert set(errors) == set(r.nodes)
    assert "wrong key for this node" in errors.pop(victim)  # the victim sees its own keys replaced
    assert all(f"keys of node {victim} are not signed" in e for e in errors.values())
    assert not r.server.forward  # no share pair was sealed to anyone


class LyingServer(SecAggServer):
    """Tells ``liar_target`` that ``hidden`` dropped (asking it for hidden's mask key) while every
    other client is told the truth (and asked for hidden's self-mask seed): with both secrets, the
    server would unmask hidden's input (Bonawitz et al. 2017, active adversary)."""

    liar_target = 0
    hidden = 0

    def _request_consistency(self, node):
        record = super()._request_consistency(node)
        if node == self.liar_target:
            record["survivors"] = [n for n in self.survivors if n != self.hidden]
        return record

    def _request_unmask(self, node):
        record = super()._request_unmask(node)
        if node == self.liar_target:
            record["survivors"] = [n for n in record["survivors"] if n != self.hidden]
            record["dropped"] = sorted([*record["dropped"], self.hidden])
        return record


def test_a_server_lying_about_dropouts_is_detected_and_unmasks_nothing(caplog):
    r = _signed_round(n=7)
    target, hidden = r.nodes[0], r.nodes[4]
    r.server = LyingServer(r.config, r.nodes, r.segments, server_round=2)
    r.server.liar_target, r.server.hidden = target, hidden
    from fedquant.secagg import LoopbackGrid, run_secure_sum

    r.transport = LoopbackGrid(r.clients, r.encoders)
    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        run_secure_sum(r.server, r.transport.send_and_receive, r.extra)
    errors = _errors(r, "unmask")
    assert list(errors) == [target] and "told nodes different sets" in errors[target]
    assert hidden not in r.server.key_shares  # the mask key of a survivor never reaches the server
    for reply in r.transport.replies:
        if not reply.has_error():
            assert hidden not in reply.content.config_records[RECORD].get("key-nodes", [])


def test_without_the_defence_the_same_lie_collects_a_survivors_mask_key():
    """The control: unsigned clients answer the lying server (each checks only its own request)."""
    r = Round(n=7, d=300)
    target, hidden = r.nodes[0], r.nodes[4]
    r.server = LyingServer(r.config, r.nodes, r.segments, server_round=2)
    r.server.liar_target, r.server.hidden = target, hidden
    from fedquant.secagg import LoopbackGrid, run_secure_sum

    r.transport = LoopbackGrid(r.clients, r.encoders)
    run_secure_sum(r.server, r.transport.send_and_receive, r.extra)
    revealed = [m.content.config_records[RECORD] for m in r.transport.replies
                if m.metadata.src_node_id == target and not m.has_error()
                and m.content.config_records[RECORD]["stage"] == "unmask"]  # fmt: skip
    assert hidden in revealed[0]["key-nodes"]  # the target sent the survivor's mask-key share
    assert hidden in r.server.seed_shares  # and the others its self-mask seed shares


def test_a_client_with_an_identity_refuses_unsigned_rounds_and_unknown_peers():
    client = SecAggClient.with_identity(1, b"\x01" * 32, {1: identity_public(b"\x01" * 32)})
    request = RecordDict({RECORD: ConfigRecord({"stage": "advertise", "session": bytes(16), "round": 1,
                                                "holders": [1, 2, 3], "threshold": 2, "signed": False})})
    with pytest.raises(ProtocolError, match="signed rounds only"):
        client.handle(request)
    request.config_records[RECORD]["signed"] = True
    keys = client.handle(request).config_records[RECORD]["keys"]
    other = public_key(b"o" * 16) + public_key(b"w" * 16) + bytes(16)
    share = RecordDict({RECORD: ConfigRecord({"stage": "share-keys", "session": bytes(16), "round": 1,
                                              "nodes": [1, 2], "keys": [keys, other],
                                              "signatures": [bytes(64), bytes(64)]})})
    with pytest.raises(ProtocolError, match="node 2 is not in this client's identity directory"):
        client.handle(share)
    assert client.identity == b"\x01" * 32  # a refusal resets the round's state, not the identity


def test_fuzzed_replies_in_signed_rounds_never_raise_and_sums_stay_exact():
    """One reply of one node at one stage (consistency included) mutated per case: the round
    completes with the exact sum of its survivors, or fails cleanly; nothing raises."""
    import numpy as np
    from flwr.app import Message

    from fedquant.secagg.messages import ORDER
    from fedquant.testing.secagg_fuzz import mutate

    outcomes = {"completed": 0, "failed": 0}
    for case in range(15):
        rng = np.random.default_rng([23, case])
        r = _signed_round(n=5)
        stage, victim = ORDER[case % len(ORDER)], r.nodes[int(rng.integers(5))]

        def tamper(s, n, reply, stage=stage, victim=victim, rng=rng, r=r):
            if s != stage or n != victim or reply.has_error():
                return reply
            _, content, _ = mutate(rng, reply.content)
            request = next(m for m in reversed(r.transport.requests) if m.metadata.dst_node_id == n)
            return Message(content, reply_to=request)

        result = r.run(tamper=tamper)
        if result is None:
            outcomes["failed"] += 1
        else:
            outcomes["completed"] += 1
            r.check_exact(result)
    assert outcomes["completed"] >= 7
