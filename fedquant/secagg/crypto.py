"""The cryptographic building blocks of the protocol, all from ``cryptography`` and Flower.

Nothing here is a new primitive; each function names the library call it wraps:

* key agreement: X25519 (``cryptography``), keys derived from 16-byte seeds with HKDF-SHA256 so
  that the seed, not a 32-byte scalar, is what gets Shamir-shared;
* key derivation: HKDF-SHA256 with an ``info`` string per purpose and the round's session id;
* share encryption: ChaCha20-Poly1305 AEAD under a key used for one message only (derived per
  session, sender and receiver), so its nonce is fixed at zero and not sent; the ids are also
  the associated data;
* secret sharing: Flower's ``flwr.common.secure_aggregation.crypto.shamir`` (PyCryptodome's
  Shamir over GF(2^128));
* mask expansion: AES-256-CTR keystream (a cryptographic PRG), one key per seed and segment;
* commitments: SHA-256;
* signatures (the active-server defence): Ed25519 (``cryptography``) with long-term identity keys.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

SEED_BYTES = 16
IDENTITY_BYTES = 32  # an Ed25519 private key (its raw seed) or public key
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
COMMITMENT_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
#: Flower's share of a 16-byte secret: a 4-byte index and two 16-byte chunks (PKCS#7-padded).
SHARE_BYTES = 4 + 2 * 16
#: One encrypted share pair (self-mask seed share, mask-key seed share) and its tag.
CIPHERTEXT_BYTES = 2 * SHARE_BYTES + TAG_BYTES
#: Every key encrypts one message (see :func:`encrypt`), so the nonce can be constant.
_NONCE = bytes(NONCE_BYTES)


class CryptoError(ValueError):
    """A key, ciphertext or share that does not verify."""


def random_seed() -> bytes:
    """16 bytes from the OS's CSPRNG."""
    return os.urandom(SEED_BYTES)


def hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 of ``secret`` for one purpose (``info``)."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def private_key(seed: bytes) -> X25519PrivateKey:
    """The X25519 private key of a 16-byte seed."""
    return X25519PrivateKey.from_private_bytes(hkdf(seed, b"fedquant-secagg x25519"))


def public_key(seed: bytes) -> bytes:
    """The raw 32-byte X25519 public key of a seed."""
    return private_key(seed).public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def agree(seed: bytes, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key shared with the owner of ``peer_public``, for one purpose.

    Raises
    ------
    CryptoError
        If the peer key is not a valid X25519 public key (wrong length, low-order point).
    """
    try:
        shared = private_key(seed).exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as err:
        raise CryptoError(f"invalid X25519 public key: {err}") from None
    return hkdf(shared, info)


#: A private key used only to test that a received public key is usable (see :func:`check_public_key`).
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(32)))


def check_public_key(raw: object) -> bytes:
    """``raw`` if it is a usable X25519 public key, else :class:`CryptoError`.

    A key must be 32 bytes and must not be a low-order point (the all-zero key among them): an
    agreement with one gives the all-zero shared secret, which the library refuses (RFC 7748,
    section 6.1). The probe runs the same ``exchange`` the protocol runs later, so a key that
    passes here cannot make a later agreement raise.
    """
    if not isinstance(raw, bytes) or len(raw) != PUBLIC_KEY_BYTES:
        raise CryptoError(f"an X25519 public key is {PUBLIC_KEY_BYTES} bytes")
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        raise CryptoError("low-order X25519 public key (all-zero shared secret)") from None
    return raw


def commitment(secret: bytes) -> bytes:
    """A binding commitment to a random 16-byte secret: the first 16 bytes of its SHA-256."""
    digest = hashes.Hash(hashes.SHA256())
    digest.update(b"fedquant-secagg commit" + secret)
    return digest.finalize()[:COMMITMENT_BYTES]


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 ``ciphertext || tag`` under a key that encrypts this message only.

    The caller derives ``key`` for one (session, sender, receiver), which the protocol uses for
    a single message; a constant nonce is then safe and costs no bytes on the wire.
    """
    return ChaCha20Poly1305(key).encrypt(_NONCE, plaintext, associated)


def decrypt(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """Inverse of :func:`encrypt`; :class:`CryptoError` if it does not authenticate."""
    if len(sealed) < TAG_BYTES:
        raise CryptoError("ciphertext too short")
    try:
        return ChaCha20Poly1305(key).decrypt(_NONCE, sealed, associated)
    except InvalidTag:
        raise CryptoError("ciphertext does not authenticate") from None


def split_secret(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """Shamir shares of a 16-byte secret (Flower's ``create_shares``); share ``i`` has index ``i + 1``."""
    if len(secret) != SEED_BYTES:
        raise ValueError(f"secrets are {SEED_BYTES} bytes")
    return create_shares(secret, threshold, count)


def share_index(share: bytes) -> int:
    """The Shamir x-coordinate a share carries (its first 4 bytes, little-endian)."""
    return int.from_bytes(share[:4], "little")


def join_secret(shares: list[bytes]) -> bytes:
    """The secret from shares (Flower's ``combine_shares``); :class:`CryptoError` if inconsistent."""
    if not shares or any(len(s) != SHARE_BYTES for s in shares):
        raise CryptoError("shares must be non-empty and of the share length")
    if len({share_index(s) for s in shares}) != len(shares):
        raise CryptoError("two shares have the same index")
    try:
        secret = combine_shares(shares)
    except (ValueError, TypeError) as err:
        raise CryptoError(f"shares do not combine: {err}") from None
    if len(secret) != SEED_BYTES:
        raise CryptoError("shares combine to a secret of the wrong length")
    return secret


def expand_mask(key: bytes, count: int, bits: int) -> np.ndarray:
    """``count`` uniform values in ``Z_{2**bits}`` (uint32) from the AES-256-CTR keystream of ``key``.

    Each key is used for one stream only (keys are derived per seed, session and segment), so a
    zero counter block is safe.
    """
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in 1..32, got {bits}")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(4 * count)) + encryptor.finalize()
    values = np.frombuffer(stream, dtype="<u4").astype(np.uint32)
    return values if bits == 32 else values & np.uint32((1 << bits) - 1)


def identity_public(identity: bytes) -> bytes:
    """The raw Ed25519 public key of a 32-byte identity (private) key."""
    key = Ed25519PrivateKey.from_private_bytes(identity).public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign(identity: bytes, message: bytes) -> bytes:
    """Ed25519 signature of ``message`` by a 32-byte identity key."""
    return Ed25519PrivateKey.from_private_bytes(identity).sign(message)


def verifies(public: bytes, signature: object, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature of ``message`` (any malformed input: False)."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES or len(public) != IDENTITY_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
