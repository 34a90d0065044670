"""Contract tests that every registered codec must pass (default parameters)."""

import math
import resource
import struct

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import available_codecs, codec_class, get_codec
from fedquant.wire import read_payload, write_payload
from tests.helpers import decode_kwargs, reseal, sample_tensor


def test_every_registered_codec_imports():
    names = available_codecs()
    assert {
        "fp32",
        "fp16",
        "qsgd",
        "terngrad",
        "signsgd",
        "bingrad-b",
        "bingrad-pb",
        "orq",
        "linear",
        "dqsg",
        "ndqsg",
    } <= set(names)
    for name in names:
        assert codec_class(name).name == name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (5,), (3, 700), (2, 3, 4, 5)])
def test_round_trip_keeps_shape_and_dtype(any_codec, shape, dtype):
    x = sample_tensor(shape, seed=1, dtype=dtype)
    y = any_codec.decode(any_codec.encode(x, seed=3), seed=3, **decode_kwargs(any_codec, x))
    assert y.shape == x.shape and y.dtype == x.dtype and torch.isfinite(y).all()


# Dithered or rotated (rht+) codecs: a constant vector is not on their grid, so it decodes only close to itself.
OFF_GRID_CONSTANTS = {"dqsg", "ndqsg", "eden", "ecdq"}


def test_zeros_and_constant_inputs_decode_finite(any_codec):
    """Zeros decode to exact zeros; a constant decodes to itself where the codec's grid holds it,
    else to a finite vector pointing the same way (a positive inner product with the input)."""
    for x in (torch.zeros(1000), torch.full((1000,), 0.25), torch.full((3,), -2.0)):
        y = any_codec.decode(any_codec.encode(x, seed=5), seed=5, **decode_kwargs(any_codec, x))
        assert torch.isfinite(y).all()
        if not torch.count_nonzero(x):
            assert not torch.count_nonzero(y), f"{any_codec.name}: zeros decoded to nonzero values"
        elif set(any_codec.name.split("+")) & (OFF_GRID_CONSTANTS | {"rht"}):
            assert float((y.double() * x.double()).sum()) > 0
        else:
            assert torch.allclose(y, x, atol=1e-6 + 1e-3 * x.abs().max().item()), any_codec.name


def test_zeros_come_back_as_zeros(any_codec):
    x = torch.zeros(2, 300)
    kwargs = {"side_info": torch.zeros(600)} if any_codec.needs_side_info else {}
    y = any_codec.decode(any_codec.encode(x, seed=1), seed=1, **kwargs)
    assert torch.allclose(y, x, atol=1e-6)


def test_non_contiguous_input_equals_its_contiguous_copy(any_codec):
    x = sample_tensor((64, 48), seed=2).t()
    assert not x.is_contiguous()
    assert any_codec.encode(x, seed=9) == any_codec.encode(x.contiguous(), seed=9)


def test_same_seed_same_bytes(any_codec):
    x = sample_tensor((4096,), seed=4)
    assert any_codec.encode(x, seed=123) == any_codec.encode(x.clone(), seed=123)


def test_encode_rejects_non_finite_and_non_float(any_codec):
    with pytest.raises(ValueError, match="NaN or Inf"):
        any_codec.encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="dtype"):
        any_codec.encode(torch.arange(5))
    with pytest.raises(TypeError):
        any_codec.encode([1.0, 2.0])


SELF_CHECKING = [
    "qsgd",
    "qsgd:levels=7,bucket_size=1000",
    "qsgd:coding=entropy",
    "qsgd:coding=elias",
    "terngrad",
    "dqsg",
    "dqsg:bucket_size=0",
    "dqsg:coding=entropy",
    "ndqsg",
    "ndqsg:coding=entropy",
    "signsgd",
    "signsgd:bucket_size=100,coding=entropy",
    "orq",
    "orq:levels=9,refine=2",
    "linear:levels=4,bucket_size=100,coding=entropy",
]


@pytest.mark.parametrize("spec", SELF_CHECKING)
@pytest.mark.parametrize("n", [5, 70_001])
@pytest.mark.parametrize("force_torch", [False, True])
def test_quantizers_that_check_their_input_reject_non_finite_values_everywhere(spec, n, force_torch):
    # these skip the codec's own pass over the input: their bucket maxima (ORQ's and Linear's end
    # levels) are finite exactly when the bucket is (float64 inputs beyond float32 count as Inf)
    codec = get_codec(spec)
    codec.quantizer.force_torch = force_torch
    assert codec.quantizer.checks_finite() and codec._quantizer_checks_finite()
    x = sample_tensor((n,), seed=n)
    for bad in (float("nan"), float("inf"), -float("inf"), 1e39):
        for pos in (0, n // 2, n - 1):
            y = x.double() if bad == 1e39 else x.clone()
            y[pos] = bad
            with pytest.raises(ValueError, match=rf"^{codec.name}.encode: the tensor contains NaN or Inf$"):
                codec.encode(y, seed=1)
            with pytest.raises(ValueError, match="NaN or Inf"):
                codec.encode_measured(y, seed=1)
    codec.encode(x.double() * 1e30, seed=1)  # large but finite as float32


@pytest.mark.parametrize(
    "spec", ["qsgd:norm=l2", "terngrad:clip=2.5", "rht+qsgd", "signsgd:bucket_size=0", "orq:clip=2.5", "bingrad-b"]
)
def test_other_quantizers_leave_the_check_to_the_codec(spec):
    codec = get_codec(spec)
    assert not codec._quantizer_checks_finite()
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(torch.tensor([1.0, float("inf")]))


# ---------------------------------------------------------------- untrusted payloads
def _payload(codec):
    x = sample_tensor((40, 30), seed=6)
    return x, codec.encode(x, seed=8)


def test_rejects_empty_truncated_and_extended(any_codec):
    x, data = _payload(any_codec)
    kwargs = decode_kwargs(any_codec, x)
    for bad in (b"", data[:1], data[:10], data[: len(data) // 2], data[:-1], data + b"\x00", data + data):
        with pytest.raises(PayloadError):
            any_codec.decode(bad, seed=8, **kwargs)


def test_rejects_every_single_bit_flip_in_header_and_body(any_codec):
    x, data = _payload(any_codec)
    kwargs = decode_kwargs(any_codec, x)
    positions = sorted({*range(0, 40), *range(40, len(data), max(1, len(data) // 97))})
    for pos in positions:
        if pos >= len(data):
            continue
        bad = bytearray(data)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(PayloadError):
            any_codec.decode(bytes(bad), seed=8, **kwargs)


def test_rejects_payload_of_another_codec(any_codec):
    other = get_codec("fp16" if any_codec.name == "fp32" else "fp32")
    x = sample_tensor((40, 30), seed=6)
    with pytest.raises(PayloadError, match="codec"):
        any_codec.decode(other.encode(x), **decode_kwargs(any_codec, x))


def test_rejects_wrong_shape_and_dtype(any_codec):
    x, data = _payload(any_codec)
    kwargs = decode_kwargs(any_codec, x)
    with pytest.raises(PayloadError, match="shape"):
        any_codec.decode(data, seed=8, shape=(30, 40), **kwargs)
    with pytest.raises(PayloadError, match="dtype"):
        any_codec.decode(data, seed=8, dtype=torch.float16, **kwargs)


def test_rejects_huge_declared_size_without_allocating(any_codec):
    x, data = _payload(any_codec)
    p = read_payload(data)
    huge = 1 << 40
    forged = write_payload(p.spec, p.dtype, (huge,), [p.body])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kwargs = {"side_info": torch.zeros(1)} if any_codec.needs_side_info else {}
    with pytest.raises((PayloadError, ValueError)) as err:
        any_codec.decode(forged, seed=8, **kwargs)
    assert isinstance(err.value, PayloadError) or "side_info" in str(err.value)
    with pytest.raises(PayloadError, match="shape"):
        any_codec.decode(forged, seed=8, shape=(1200,))
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200_000, f"decoding a forged header grew peak memory by {grown_kib} KiB"


def test_rejects_forged_bodies_of_wrong_length(any_codec):
    x, data = _payload(any_codec)
    p = read_payload(data)
    kwargs = decode_kwargs(any_codec, x)
    for body in (bytes(p.body)[:-1], bytes(p.body) + b"\x00\x00\x00\x00", b""):
        with pytest.raises(PayloadError):
            any_codec.decode(write_payload(p.spec, p.dtype, p.shape, [body]), seed=8, **kwargs)


def test_fp32_is_lossless_and_sized_exactly():
    codec = get_codec("fp32")
    x = sample_tensor((123,), seed=3)
    data = codec.encode(x)
    assert torch.equal(codec.decode(data), x)
    assert len(data) == 123 * 4 + len(data) - len(bytes(read_payload(data).body))


def test_fp32_rejects_nan_smuggled_in_body():
    codec = get_codec("fp32")
    data = bytearray(codec.encode(torch.ones(4)))
    p = read_payload(bytes(data))
    offset = len(data) - 4 - p.body.nbytes
    data[offset : offset + 4] = struct.pack("<f", math.nan)
    with pytest.raises(PayloadError, match="NaN"):
        codec.decode(reseal(data))


def test_fp16_saturates_instead_of_overflowing():
    codec = get_codec("fp16")
    y = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 0.5])))
    assert y.tolist() == [65504.0, -65504.0, 0.5]


def test_all_finite_fast_path_handles_overflowing_sums():
    from fedquant.codecs.codec import all_finite

    big = torch.full((10,), 3e38)
    assert not torch.isfinite(big.sum()) and all_finite(big)
    assert not all_finite(torch.tensor([1.0, float("inf"), -float("inf")]))
    assert not all_finite(torch.tensor([float("nan")]))


def _with_header(data: bytes, *, dtype: torch.dtype | None = None, shape=None, body: bytes | None = None) -> bytes:
    """``data`` with its declared dtype, shape or body replaced (CRC recomputed by write_payload)."""
    p = read_payload(data)
    return write_payload(
        p.spec, dtype or p.dtype, p.shape if shape is None else shape, [bytes(p.body) if body is None else body]
    )


@pytest.mark.parametrize(
    ("spec", "declared", "big"),
    [("fp32", torch.float16, 1e5), ("fp32", torch.bfloat16, 3.4e38), ("qsgd", torch.float16, 1e5)],
)
def test_declared_half_dtype_cannot_smuggle_inf(spec, declared, big):
    codec = get_codec(spec)
    data = _with_header(codec.encode(torch.tensor([big, -big, 1.0])), dtype=declared)
    with pytest.raises(PayloadError, match="NaN or Inf"):
        codec.decode(data)


@pytest.mark.parametrize("shape", [(0, 2**63), (0, 2**64 - 1), (2**40, 0), (0, 2**31, 2**31)])
def test_zero_and_huge_dimensions_are_a_payload_error(shape):
    codec = get_codec("fp32")
    forged = _with_header(codec.encode(torch.ones(3)), shape=shape, body=b"")
    with pytest.raises(PayloadError, match="dimension"):
        codec.decode(forged)
    with pytest.raises(PayloadError, match="shape"):
        codec.decode(forged, shape=(3,))


def test_tiny_payload_without_expected_shape_cannot_allocate_gigabytes():
    from benchmarks.codec_throughput import peak_memory_mib
    from fedquant.wire.elias import elias_omega_encode

    codec = get_codec("qsgd:coding=entropy,bucket_size=0")
    count = 2**31 - 1
    table, _ = elias_omega_encode(np.array([1, codec.levels + 1, count]))  # one symbol: level 0, count times
    forged = _with_header(codec.encode(torch.zeros(5)), shape=(count,), body=b"\x00\x00\x80\x3f" + table.tobytes())
    assert len(forged) < 100

    def attempt():
        with pytest.raises(PayloadError, match="elements"):
            codec.decode(forged)

    assert peak_memory_mib(attempt) < 50
