"""Pairwise and self masks in ``Z_{2^b}``, expanded from seeds with AES-256-CTR.

Client ``i`` adds ``+p_ij`` for every peer ``j > i`` and ``-p_ij`` for every ``j < i`` (``p_ij``
from the X25519 agreement of their mask keys, the same on both sides), and its own self mask
from a private seed. In the sum of all inputs the pairwise masks cancel; the server removes
the self masks of the survivors (seeds rebuilt from shares) and the pairwise masks between a
dropped client and the survivors (its mask key rebuilt from shares).
"""

from __future__ import annotations

import numpy as np

from fedquant.secagg.crypto import agree, expand_mask, hkdf


def _info(kind: bytes, session: bytes, segment: str) -> bytes:
    return b"fedquant-secagg " + kind + b"\x00" + session + b"\x00" + segment.encode()


def pairwise_mask(
    mask_seed: bytes, peer_public: bytes, session: bytes, segment: str, count: int, bits: int
) -> np.ndarray:
    """``p_ij`` of one segment: ``count`` uint32 values below ``2**bits``."""
    return expand_mask(agree(mask_seed, peer_public, _info(b"pairwise", session, segment)), count, bits)


def self_mask(seed: bytes, session: bytes, segment: str, count: int, bits: int) -> np.ndarray:
    """The self mask of one segment from the client's private 16-byte seed."""
    return expand_mask(hkdf(seed, _info(b"self", session, segment)), count, bits)


def apply(total: np.ndarray, mask: np.ndarray, sign: int, bits: int) -> np.ndarray:
    """``(total + sign * mask) mod 2**bits`` in uint32 (wrapping arithmetic)."""
    out = total + mask if sign > 0 else total - mask
    return out if bits == 32 else out & np.uint32((1 << bits) - 1)


def sign(node: int, peer: int) -> int:
    """+1 if ``node`` adds the pair's mask, -1 if it subtracts it."""
    return 1 if node < peer else -1
