"""The payload checksum is zlib's CRC-32 whichever implementation computes it."""

import os
import zlib

import numpy as np

from fedquant.wire import checksum


def test_checksum_is_zlib_crc32_on_any_buffer_and_chaining():
    data = os.urandom(1 << 20) + b"tail"
    assert checksum.crc32(data) == zlib.crc32(data)
    view = memoryview(data)[3:-5]
    assert checksum.crc32(view, 12345) == zlib.crc32(view, 12345)
    parts = [data[:7], data[7:100_000], data[100_000:]]
    crc = 0
    for part in parts:
        crc = checksum.crc32(np.frombuffer(part, np.uint8), crc)
    assert crc == zlib.crc32(data)
