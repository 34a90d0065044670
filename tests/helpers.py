"""Helpers shared by the tests."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from fedquant.codecs import available_codecs

#: Quantizers ``ef+`` refuses: no declared error bound (tests/codecs/test_error_bounds.py checks the refusal).
EF_REFUSED = frozenset({"ndqsg"})


def ef_codec_names() -> list[str]:
    """Every registered codec ``ef+`` takes, in registry order."""
    return [name for name in available_codecs() if name not in EF_REFUSED]


def reseal(data: bytes | bytearray) -> bytes:
    """Recompute a payload's CRC-32 after tampering, so that deeper checks are reached."""
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def sample_tensor(shape=(37, 53), seed=0, dtype=torch.float32) -> torch.Tensor:
    """A reproducible Gaussian tensor (own generator, never the global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def decode_kwargs(codec, x: torch.Tensor) -> dict:
    """Side information for codecs that need it: a noisy copy of ``x``."""
    if codec.needs_side_info:
        return {"side_info": x.float() + 0.01 * sample_tensor(tuple(x.shape), seed=99)}
    return {}


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
