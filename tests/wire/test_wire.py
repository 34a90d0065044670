import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.wire import BodyReader, pack_bits, packed_size, read_payload, unpack_bits, write_payload
from fedquant.wire.payload import header_size
from tests.helpers import reseal


@pytest.mark.parametrize("width", list(range(1, 17)))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_round_trip_at_exact_width(width, n):
    rng = np.random.default_rng(width * 1000 + n)
    values = rng.integers(0, 2**width, size=n)
    packed = pack_bits(values, width)
    assert packed.dtype == np.uint8 and packed.size == packed_size(n, width) == (n * width + 7) // 8
    assert np.array_equal(unpack_bits(packed, width, n), values)


def test_pack_layout_is_lsb_first():
    assert pack_bits(np.array([1, 0, 1, 1]), 1).tolist() == [0b1101]
    assert pack_bits(np.array([3, 1, 2]), 2).tolist() == [0b100111]
    assert pack_bits(np.array([5, 6, 7]), 3).tolist() == [0b11110101, 0b1]


def test_unpack_rejects_wrong_length():
    with pytest.raises(PayloadError, match="need"):
        unpack_bits(np.zeros(3, np.uint8), 4, 7)


def test_envelope_round_trip_and_size():
    body = [b"abc", memoryview(b"defg")]
    data = write_payload("qsgd:levels=4", torch.bfloat16, (2, 3), body)
    assert len(data) == header_size(2, "qsgd:levels=4") + 7
    p = read_payload(data)
    assert (p.spec, p.dtype, p.shape, bytes(p.body)) == ("qsgd:levels=4", torch.bfloat16, (2, 3), b"abcdefg")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: b"", "empty"),
        (lambda d: d[:5], "truncated"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: d + b"\x00", "trailing"),
        (lambda d: b"XY" + d[2:], "magic"),
        (lambda d: reseal(d[:2] + b"\x09" + d[3:]), "version"),
        (lambda d: reseal(d[:3] + b"\x77" + d[4:]), "dtype"),
        (lambda d: reseal(d[:4] + b"\x40" + d[5:]), "dimensions"),
        (lambda d: d[:-6] + bytes([d[-6] ^ 1]) + d[-5:], "checksum"),
        (lambda d: bytes([d[0]]) + d[1:9] + bytes([d[9] ^ 4]) + d[10:], "checksum"),
    ],
)
def test_envelope_rejects_damage(mutate, message):
    data = write_payload("fp32", torch.float32, (3,), [b"\x00" * 12])
    with pytest.raises(PayloadError, match=message):
        read_payload(mutate(data))


def test_body_reader_checks_before_reading():
    reader = BodyReader(memoryview(b"\x00" * 10), "qsgd")
    assert reader.take_array("<f4", 2, "scales").tolist() == [0.0, 0.0]
    with pytest.raises(PayloadError, match="indices needs 8 bytes, 2 left"):
        reader.take_array("<f4", 2, "indices")
    with pytest.raises(PayloadError, match="2 unexpected trailing"):
        reader.expect_end()
