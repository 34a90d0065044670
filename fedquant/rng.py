"""Seeds and counter-based random streams.

fedquant never touches a global RNG. One base seed, owned by the server, yields an independent
seed per (round, client, tensor) through :func:`derive_seed`. Codecs turn a seed into random
numbers with a counter-based generator (SplitMix64 of ``seed`` and the element index), so

* the stream for a seed is bit-identical on CPU and CUDA and in every process (the dithered
  codecs need the server to regenerate exactly the dither a client added), and
* any slice of the stream can be computed on its own, which lets fused kernels draw their
  random numbers inline and in parallel.

The uniform variates carry 24 random bits, the precision of a float32 mantissa, so converting
them to float32 is exact.
"""

from __future__ import annotations

import hashlib
import struct

import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24
UNIFORM_SCALE = 1.0 / (1 << UNIFORM_BITS)


def derive_seed(base_seed: int, *keys: int | str) -> int:
    """Derive an independent 63-bit seed from a base seed and a path of keys.

    Parameters
    ----------
    base_seed : int
        The experiment's base seed (any Python int).
    *keys : int or str
        A path such as ``(round, node_id)`` or ``(round, node_id, "conv1.weight")``. Different
        paths give statistically independent seeds; the same path always gives the same seed,
        in any process (unlike Python's ``hash``).

    Returns
    -------
    int
        A seed in ``[0, 2**63)``.
    """
    h = hashlib.blake2b(digest_size=8, person=b"fedquant-seed")
    h.update(str(int(base_seed)).encode())
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"seed keys must be int or str, got {type(key).__name__}")
        tag = b"i" if isinstance(key, int) else b"s"
        h.update(tag + str(key).encode() + b"\x00")
    return struct.unpack("<Q", h.digest())[0] >> 1


def splitmix64(x: int) -> int:
    """The SplitMix64 finalizer on a Python int (reference for the vectorized versions)."""
    z = x & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """Scramble a seed into the 64-bit key that offsets the counter stream."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return splitmix64(seed & MASK64)


def _signed(v: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    return v - (1 << 64) if v >= (1 << 63) else v


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts int64 arithmetically)."""
    return (z >> k).bitwise_and_((1 << (64 - k)) - 1)


assert UNIFORM_BITS <= 33, "uniform() reads its bits before the last xorshift (_premixed)"


def _premixed(seed: int, n: int, offset: int, device) -> torch.Tensor:
    """:func:`random_bits` before SplitMix64's last ``z ^= z >> 31``, which leaves the top 31 bits as
    they are: the top bits :func:`uniform` keeps (and the sign bit) can be read here."""
    key = stream_key(seed)
    z = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=device)
    z.mul_(_signed(GOLDEN_GAMMA)).add_(_signed(key))  # in place: the same wrapping int64 arithmetic
    z ^= _shr(z, 30)
    z.mul_(_signed(MIX1))
    z ^= _shr(z, 27)
    return z.mul_(_signed(MIX2))


def random_bits(seed: int, n: int, *, offset: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """64-bit hashes ``splitmix64(key(seed) + (offset + i + 1) * gamma)`` for ``i < n`` as int64.

    Identical bits on every device: only wrapping integer multiply, xor and shifts are used.
    """
    z = _premixed(seed, n, offset, device)
    z ^= _shr(z, 31)
    return z


def rotation_negative(seed: int, n: int, *, offset: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The random signs of a rotation: whether position ``offset + i`` is flipped (bool), ``i < n``.

    Position ``p`` is flipped where bit ``p mod 64`` (LSB first) of the 64-bit hash
    ``random_bits(seed, 1, offset=p // 64)`` is set: one hash per 64 signs, whose bits go straight
    into the floats' sign bits (a hash per sign cost two 64-bit multiplies per element).
    """
    first = offset // 64
    words = random_bits(seed, (offset + n + 63) // 64 - first, offset=first, device=device)
    bits = (words.unsqueeze(1) >> torch.arange(64, device=device)).bitwise_and_(1)
    start = offset - 64 * first
    return bits.view(-1)[start : start + n].bool()


def rotation_negative_reference(seed: int, n: int, offset: int = 0) -> list[bool]:
    """Pure-Python version of :func:`rotation_negative`, for tests and for porting to other kernels."""
    key = stream_key(seed)
    return [
        bool(splitmix64((key + (p // 64 + 1) * GOLDEN_GAMMA) & MASK64) >> (p % 64) & 1)
        for p in range(offset, offset + n)
    ]


def uniform(seed: int, n: int, *, offset: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` float32 variates on ``[0, 1)`` with 24 random bits each, from the stream of ``seed``.

    Parameters
    ----------
    seed : int
        Stream seed (e.g. from :func:`derive_seed`).
    n : int
        Number of variates.
    offset : int, optional
        Position of the first variate in the stream; ``uniform(s, n, offset=k)`` equals
        ``uniform(s, k + n)[k:]``.
    device : torch.device or str, optional
        Where to compute them. The values are bit-identical on every device.

    Returns
    -------
    torch.Tensor
        float32 tensor of shape ``(n,)``.
    """
    bits = _shr(_premixed(seed, n, offset, device), 64 - UNIFORM_BITS)  # the top bits, as in random_bits
    return bits.to(torch.float32) * UNIFORM_SCALE


def uniform_reference(seed: int, n: int, offset: int = 0) -> list[float]:
    """Pure-Python version of :func:`uniform`, for tests and for porting to other kernels."""
    key = stream_key(seed)
    out = []
    for i in range(offset + 1, offset + n + 1):
        z = splitmix64((key + i * GOLDEN_GAMMA) & MASK64)
        out.append((z >> (64 - UNIFORM_BITS)) * UNIFORM_SCALE)
    return out
