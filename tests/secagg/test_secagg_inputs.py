"""Every key a client sends is checked before anyone uses it; nothing a client sends makes an honest client raise."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Array, ConfigRecord, RecordDict

from fedquant.secagg import ProtocolError, SecAggClient
from fedquant.secagg.crypto import PUBLIC_KEY_BYTES, CryptoError, agree, check_public_key, public_key
from fedquant.secagg.messages import MASKED_RECORD, RECORD
from tests.flower_fakes import set_task_identity
from tests.secagg.test_secagg import Round, _config_change, _edit


@pytest.fixture(autouse=True)
def _identity():
    set_task_identity()

#: The low-order points of Curve25519 (u-coordinates, little-endian), the all-zero key first.
LOW_ORDER = [
    bytes(32),
    bytes([1]) + bytes(31),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    bytes.fromhex("ec" + "ff" * 30 + "7f"),
    bytes.fromhex("ed" + "ff" * 30 + "7f"),
    bytes.fromhex("ee" + "ff" * 30 + "7f"),
]


@pytest.mark.parametrize("position", [0, 1], ids=["encryption-key", "mask-key"])
@pytest.mark.parametrize("point", range(len(LOW_ORDER)))
def test_a_low_order_advertised_key_is_a_dropout_of_its_sender(point, position, caplog):
    r = Round(n=6, d=300)
    victim = r.nodes[2]
    start = position * PUBLIC_KEY_BYTES
    change = _config_change(keys=lambda k: k[:start] + LOW_ORDER[point] + k[start + PUBLIC_KEY_BYTES :])
    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        result = r.run(tamper=_edit(None, None, victim, "advertise", change))
    assert result is not None, r.server.failure
    assert victim not in result.survivors + result.dropped and len(result.survivors) == 5
    r.check_exact(result)
    assert f"node {victim} dropped" in caplog.text and "low-order" in caplog.text
    assert "refused a request" not in caplog.text  # no honest client had to refuse anything


def _advertised(node: int) -> tuple[SecAggClient, bytes, bytes]:
    client = SecAggClient(node)
    session = bytes(range(16))
    request = RecordDict({RECORD: ConfigRecord({"stage": "advertise", "session": session, "round": 1,
                                                "holders": [1, 2, 3], "threshold": 2})})
    keys = client.handle(request).config_records[RECORD]["keys"]
    return client, session, keys


def _share_keys_request(session: bytes, keys: list[bytes]) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({"stage": "share-keys", "session": session, "round": 1,
                                             "nodes": [1, 2, 3], "keys": keys})})


def test_a_lying_server_relaying_a_low_order_key_makes_the_client_refuse_not_raise():
    for bad in LOW_ORDER:
        client, session, keys = _advertised(1)
        peer = public_key(b"p" * 16) + public_key(b"q" * 16) + bytes(16)
        with pytest.raises(ProtocolError, match="refused key of node 3"):
            client.handle(_share_keys_request(session, [keys, peer, bad + bad + bytes(16)]))
        assert client.stage == ""  # refused: the client takes no further part


def test_fuzzed_keys_are_accepted_only_when_every_agreement_works():
    """Random, bit-flipped and high-bit-set keys: refused with CryptoError, or usable by agree()."""
    rng = np.random.default_rng(42)
    valid = public_key(b"v" * 16)
    candidates = [bytes(rng.bytes(32)) for _ in range(300)]
    candidates += [valid[: i // 8] + bytes([valid[i // 8] ^ (1 << (i % 8))]) + valid[i // 8 + 1 :] for i in range(256)]
    candidates += [p[:31] + bytes([p[31] | 0x80]) for p in LOW_ORDER]  # bit 255 is ignored by X25519
    candidates += [b"", bytes(31), bytes(33), "x" * 32, None]
    refused = 0
    for key in candidates:
        try:
            check_public_key(key)
        except CryptoError:
            refused += 1
            continue
        assert len(agree(b"s" * 16, key, b"fuzz")) == 32
    assert refused == len(LOW_ORDER) + 5  # exactly the low-order points and the malformed ones


def test_fuzzed_relayed_keys_never_raise_anything_but_a_protocol_error():
    rng = np.random.default_rng(7)
    outcomes = {"reply": 0, "refused": 0}
    for case in range(120):
        client, session, keys = _advertised(1)
        peer = bytearray(public_key(bytes([case % 251]) * 16) + public_key(b"m" * 16) + bytes(16))
        if case % 3 == 0:
            peer[: 2 * PUBLIC_KEY_BYTES] = LOW_ORDER[case % len(LOW_ORDER)] + rng.bytes(32)
        else:
            pos = int(rng.integers(len(peer)))
            peer[pos] ^= 1 << int(rng.integers(8))
        other = public_key(b"o" * 16) + public_key(b"w" * 16) + bytes(16)
        try:
            reply = client.handle(_share_keys_request(session, [keys, other, bytes(peer)]))
        except ProtocolError:
            outcomes["refused"] += 1
            continue
        assert len(reply.config_records[RECORD]["ciphertexts"]) == 2
        outcomes["reply"] += 1
    assert outcomes["refused"] >= 40 and outcomes["reply"] >= 40


def test_a_masked_vector_with_non_zero_padding_bits_is_a_dropout(caplog):
    r = Round(n=6, d=515)  # 512 + 4 rotated values at an odd bit width leave padding bits in the last byte
    assert (r.grid.padded_numel * r.grid.bits) % 8
    victim = r.nodes[4]

    def pad(reply):
        arr = reply.content.array_records[MASKED_RECORD]["update"]
        data = arr.data[:-1] + bytes([arr.data[-1] | 0x80])
        reply.content.array_records[MASKED_RECORD]["update"] = Array(dtype="uint8", shape=arr.shape,
                                                                     stype=arr.stype, data=data)
        return reply

    with caplog.at_level(logging.WARNING, logger="fedquant.secagg"):
        result = r.run(tamper=_edit(None, None, victim, "collect", pad))
    assert result is not None and victim in result.dropped
    r.check_exact(result)
    assert "padding bits" in caplog.text
