"""The randomized Hadamard rotation (``rht+``): kernels, transform and codecs behind it."""

import math

import numpy as np
import pytest
import torch

from fedquant import PayloadError
from fedquant.codecs import Codec, available_codecs, codec_class, get_codec
from fedquant.codecs.kernels import hadamard
from fedquant.codecs.quantizers.base import Quantized, Quantizer
from fedquant.codecs.side_info import SideInfoQuantizer
from fedquant.codecs.transforms.rht import MAX_BLOCK_LOG2, RandomizedHadamard, block_layout, block_runs
from fedquant.rng import derive_seed, rotation_negative_reference, stream_key
from fedquant.wire import read_payload, write_payload
from tests.helpers import cuda, decode_kwargs, reseal, sample_tensor

# Single blocks below and above a cache tile, several blocks, padded tails, and a layout large
# enough for the parallel kernels (2**16 + 8 >= PARALLEL_MIN).
LENGTHS = [1, 2, 3, 7, 8, 10, 1000, 4097, hadamard.TILE, 2 * hadamard.TILE + 1, (1 << 16) + 5, 3 * (1 << 16) + 100]
PORTED = [name for name in available_codecs() if issubclass(codec_class(name), Quantizer)]


def _rht(max_log2: int | None = None) -> RandomizedHadamard:
    """The transform, with another largest block (one beyond a cache tile runs the high pass)."""
    return RandomizedHadamard() if max_log2 is None else RandomizedHadamard(max_log2=max_log2)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().view(np.uint32)


def _sylvester(k: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(k):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


# ---------------------------------------------------------------- layout
def test_block_layout():
    assert block_layout(0) == ()
    assert block_layout(10) == (4,)
    assert block_layout(1 << 20) == (MAX_BLOCK_LOG2,) * (1 << (20 - MAX_BLOCK_LOG2))
    assert block_layout(3 << 19) == (MAX_BLOCK_LOG2,) * (3 << (19 - MAX_BLOCK_LOG2))
    assert block_layout((1 << 17) + 5) == (MAX_BLOCK_LOG2,) * (1 << (17 - MAX_BLOCK_LOG2)) + (3,)
    assert block_layout((1 << 17) + 5, 16) == (16, 16, 3)
    assert block_layout(1000, 8, 0) == (8, 8, 8, 7, 6, 5, 3)
    rht = RandomizedHadamard()
    for n in LENGTHS:
        # Only the tail is padded, to the next power of two: less than itself and than half a block.
        assert 0 <= rht.output_numel(n) - n < min(n, 1 << (MAX_BLOCK_LOG2 - 1))
        assert rht.output_numel(n) == sum(1 << k for k in rht.blocks(n))


@pytest.mark.parametrize(("max_log2", "min_log2"), [(9, None), (8, 0), (9, 3), (16, None), (4, 2)])
def test_block_runs_are_the_block_layout_run_length_encoded(max_log2, min_log2):
    for n in [*LENGTHS, 0, 13, 511, 513, 1023, 25_000_000]:
        runs = block_runs(n, max_log2, min_log2)
        expanded = tuple(k for k, count in runs for _ in range(count))
        assert expanded == block_layout(n, max_log2, min_log2)
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # maximal runs
        assert hadamard.runs_numel(runs) == sum(1 << k for k in expanded)


# ---------------------------------------------------------------- the rotation
def test_matches_dense_hadamard_with_the_seeded_signs():
    """Block by block, forward is H D x / sqrt(L) with D from the sub-stream derive_seed(seed, "rht")."""
    n, seed = 1000, 77
    for rht in (_rht(), _rht(10)):  # blocks of 512 and a padded one of 488; one block of 1024 with 24 zeros
        x = sample_tensor((n,), seed=1)
        y = rht.forward(x, seed).double()
        total = rht.output_numel(n)
        assert total == 1024
        negative = torch.tensor(rotation_negative_reference(derive_seed(seed, "rht"), total))
        signs = torch.where(negative, -1.0, 1.0).double()
        v = signs * torch.cat([x.double(), torch.zeros(total - n, dtype=torch.float64)])
        o = 0
        for k in rht.blocks(n):
            expected = _sylvester(k) @ v[o : o + (1 << k)] / math.sqrt(1 << k)
            assert torch.allclose(y[o : o + (1 << k)], expected, rtol=0, atol=1e-5)
            o += 1 << k


@pytest.mark.parametrize("max_log2", [None, 16, 62])
@pytest.mark.parametrize("n", LENGTHS)
def test_orthonormal_and_inverse(n, max_log2):
    rht = _rht(max_log2)
    x = sample_tensor((n,), seed=n) * 3
    y = rht.forward(x, 11)
    assert y.dtype == torch.float32 and y.numel() == rht.output_numel(n)
    # Each output goes through one rounding per stage (at most 18 here): relative error ~ 18 * 2**-24.
    assert math.isclose(float(y.double().norm()), float(x.double().norm()), rel_tol=1e-5)
    back = rht.inverse(y, n, 11)
    assert back.shape == (n,)
    assert torch.allclose(back, x, rtol=0, atol=2e-5 * float(x.abs().max()))


def test_deterministic_by_seed_and_seeds_differ():
    rht = RandomizedHadamard()
    x = sample_tensor((5000,), seed=3)
    a, b, c = rht.forward(x, 5), rht.forward(x.clone(), 5), rht.forward(x, 6)
    assert np.array_equal(_bits(a), _bits(b))
    assert not torch.allclose(a, c, atol=0.1)
    # The decoder must use the right seed: the wrong one gives garbage.
    assert not torch.allclose(rht.inverse(a, 5000, 6), x, atol=0.1)


def test_signs_are_independent_of_the_quantizer_stream():
    # The quantizers draw from stream_key(seed); the rotation from a derived seed's stream.
    seed = 1234
    assert stream_key(RandomizedHadamard.sign_seed(seed)) != stream_key(seed)
    one = torch.ones(1)
    flips = [float(RandomizedHadamard().forward(one, s)) for s in range(64)]
    expected = [-1.0 if rotation_negative_reference(derive_seed(s, "rht"), 1)[0] else 1.0 for s in range(64)]
    assert flips == expected and 16 < flips.count(-1.0) < 48


@pytest.mark.parametrize("offset, n", [(0, 512), (0, 8), (3, 61), (40, 24), (63, 130), (64, 64), (100, 1000), (5, 0)])
def test_kernel_signs_match_the_reference_at_any_span(offset, n):
    """The numba flips (64 per hash, one at a time before the first multiple of 64 and after the
    last) give the reference's signs for spans starting and ending anywhere, as small blocks and
    the high pass's rows do."""
    seed = 2**61 + 3
    expected = np.array(rotation_negative_reference(seed, n, offset))
    x = np.full(n, 1.5, np.float32)
    hadamard._flip_signs(x, np.uint64(stream_key(seed)), offset)
    assert np.array_equal(x < 0, expected) and np.all(np.abs(x) == 1.5)
    masks = np.full(n, 7, np.uint32)
    hadamard.sign_masks(masks, np.uint64(stream_key(seed)), offset)
    assert np.array_equal(masks, np.where(expected, 0x80000000, 0).astype(np.uint32))


@pytest.mark.parametrize("max_log2", [None, 16, 62])
@pytest.mark.parametrize("n", LENGTHS)
def test_torch_path_is_byte_identical_to_numba(n, max_log2):
    x = sample_tensor((n,), seed=n + 1)
    cpu, tor = _rht(max_log2), _rht(max_log2)
    tor.force_torch = True
    y = cpu.forward(x, 21)
    assert np.array_equal(_bits(y), _bits(tor.forward(x, 21)))
    noisy = y + 0.01 * sample_tensor((y.numel(),), seed=5)  # what a decoder gets
    assert np.array_equal(_bits(cpu.inverse(noisy, n, 21)), _bits(tor.inverse(noisy, n, 21)))


def test_overflowing_rotation_is_refused_at_encode():
    """Four values of 3e38 overflow float32 exactly where the signs line up with a row of H (then
    one output is 2 x 3e38): refused at encode then, and only then."""
    x = torch.full((4,), 3e38)
    (k,) = RandomizedHadamard().blocks(4)
    refused = 0
    for seed in range(1, 17):
        negative = torch.tensor(rotation_negative_reference(RandomizedHadamard.sign_seed(seed), 1 << k))
        v = torch.where(negative, -1.0, 1.0).double() * torch.cat([x.double(), torch.zeros((1 << k) - 4).double()])
        overflows = bool((_sylvester(k) @ v / math.sqrt(1 << k)).abs().max() > torch.finfo(torch.float32).max)
        if overflows:
            refused += 1
            with pytest.raises(ValueError, match="overflows"):
                get_codec("rht+fp32").encode(x, seed=seed)
        else:
            get_codec("rht+fp32").encode(x, seed=seed)  # no output past float32's range: accepted
    assert 0 < refused < 16


FUSED_SPECS = [
    "eden:bits=1",
    "eden:bits=2",
    "eden:bits=3",
    "rht:min_log2=0+eden:bits=2,bucket_size=64",
    "eden:bits=1.037",
    "eden:bits=0.5",
    "rht:min_log2=0+eden:bits=2.5,bucket_size=128",
    "rht+qsgd:levels=7",
    "rht+terngrad",
    "rht:min_log2=2+qsgd:bucket_size=128,norm=l2",
    "rht+dqsg",
    "rht+ndqsg",
    "rht:min_log2=0+ndqsg:rho=5,alpha=0.5",
    "rht+dqsg:levels=2,coding=entropy",
    "rht:min_log2=0+dqsg:levels=200,bucket_size=128,coding=entropy",
    "rht+ndqsg:coding=entropy",
    "rht:min_log2=0+ndqsg:rho=301,alpha=0.5,coding=entropy",
]


def _unfused(codec: Codec) -> Codec:
    """The same pipeline with a quantizer that declines the rotation: the transform's own kernels run."""
    unfused = get_codec(codec.spec)
    unfused.quantizer.fuses = lambda rotation: False
    return unfused


@pytest.mark.parametrize("spec", FUSED_SPECS)
@pytest.mark.parametrize("n", [1, 10, 1000, 4097, 3 * (1 << 14) + 515, (1 << 16) + 5])
def test_kernels_that_rotate_as_they_go_give_the_bytes_of_the_transform(spec, n):
    codec = get_codec(spec)
    rotation = codec.wire_transforms[-1].fused(n, 3)
    assert rotation is not None and codec.quantizer.fuses(rotation)
    x = sample_tensor((n,), seed=n) * 3
    side = x + 0.05 * sample_tensor((n,), seed=n + 1) if codec.needs_side_info else None
    payload = codec.encode(x, seed=3)
    assert payload == _unfused(codec).encode(x, seed=3)
    decoded = codec.decode(payload, seed=3, side_info=side)
    assert np.array_equal(_bits(decoded), _bits(_unfused(codec).decode(payload, seed=3, side_info=side)))


def test_fused_kernels_refuse_what_the_transform_refuses():
    for spec in ("eden:bits=1", "rht+qsgd", "rht+dqsg", "rht+ndqsg"):
        codec = get_codec(spec)
        with pytest.raises(ValueError, match="overflows"):
            codec.encode(torch.full((600,), 3e38), seed=1)
        with pytest.raises(ValueError, match="NaN or Inf"):
            codec.encode(torch.tensor([1.0, float("inf"), 2.0]), seed=1)
    ndqsg = get_codec("rht+ndqsg")
    payload = ndqsg.encode(torch.ones(600), seed=1)
    with pytest.raises(ValueError, match="overflows"):  # side information the rotation cannot take
        ndqsg.decode(payload, seed=1, side_info=torch.full((600,), float("nan")))


@pytest.mark.parametrize("spec", ["eden:bits=1", "rht+qsgd:levels=7", "rht+dqsg"])
@pytest.mark.parametrize("scale", [1e30, 1e37, 3e38])
def test_fused_decoding_refuses_what_the_transform_refuses(spec, scale):
    codec = get_codec(spec)
    p = read_payload(codec.encode(sample_tensor((1024,), seed=2), seed=4))
    body = bytearray(p.body)  # the first two bucket scales (steps), made huge
    if spec.startswith("eden"):
        huge = np.full(2, (np.array([scale], np.float32).view(np.uint32) >> 16)[0], "<u2")
    else:
        huge = np.full(2, scale, "<f4")
    body[: huge.nbytes] = huge.tobytes()
    payload = write_payload(p.spec, p.dtype, p.shape, [bytes(body)])
    outcomes = []
    for c in (codec, _unfused(codec)):
        try:
            outcomes.append(_bits(c.decode(payload, seed=4)).tobytes())
        except PayloadError as err:
            outcomes.append(str(err))
    assert outcomes[0] == outcomes[1]


def _outcome(call):
    """What a call gives: its result's bytes, or its error's type and message."""
    try:
        out = call()
    except (ValueError, PayloadError) as err:
        return type(err).__name__, str(err)
    return out if isinstance(out, bytes) else _bits(out).tobytes()


@pytest.mark.parametrize("spec", ["rht+dqsg:levels=2,coding=entropy", "rht:min_log2=0+ndqsg:rho=5,coding=entropy"])
def test_fused_entropy_route_refuses_what_the_unfused_one_refuses(spec):
    codec = get_codec(spec)
    unfused = _unfused(codec)
    pair = (codec, unfused)
    assert codec.quantizer.fuses(codec.wire_transforms[-1].fused(1030, 4))
    inputs = [torch.full((600,), 3e38), torch.tensor([1.0, float("inf"), 2.0]), torch.full((1030,), float("nan"))]
    for x in inputs:
        fused = _outcome(lambda x=x: codec.encode(x, seed=1))
        assert isinstance(fused, tuple) and fused == _outcome(lambda x=x: unfused.encode(x, seed=1))
    x = sample_tensor((1030,), seed=2)
    side = x + 0.01 * sample_tensor((1030,), seed=3) if codec.needs_side_info else None
    p = read_payload(codec.encode(x, seed=4))
    sides = [side]
    if codec.needs_side_info:
        sides += [torch.full((1030,), float("nan")), torch.where(x > 1, float("inf"), x), torch.full((1030,), 3e38)]
    for scale in (1.0, 1e30, 3e38):  # the first two bucket steps made huge: decoded values overflow
        body = bytearray(p.body)
        if scale != 1.0:
            body[:8] = np.full(2, scale, "<f4").tobytes()
        payload = write_payload(p.spec, p.dtype, p.shape, [bytes(body)])
        for y in sides:
            outcomes = [_outcome(lambda c=c, y=y, b=payload: c.decode(b, seed=4, side_info=y)) for c in pair]
            assert outcomes[0] == outcomes[1]
            if y is not side and scale == 1.0:  # side information that is not finite, or overflows in the rotation
                assert isinstance(outcomes[0], tuple)


@cuda
@pytest.mark.parametrize("max_log2", [None, 16])
@pytest.mark.parametrize("n", [10, 4097, 3 * (1 << 16) + 100])
def test_cuda_matches_cpu_bytes(n, max_log2):
    rht = _rht(max_log2)
    x = sample_tensor((n,), seed=n)
    y = rht.forward(x, 9)
    y_cuda = rht.forward(x.cuda(), 9)
    assert y_cuda.device.type == "cuda" and np.array_equal(_bits(y), _bits(y_cuda))
    assert np.array_equal(_bits(rht.inverse(y, n, 9)), _bits(rht.inverse(y.cuda(), n, 9)))
    codec = get_codec("rht+fp32")
    assert codec.encode(x.cuda(), seed=9) == codec.encode(x, seed=9)


# ---------------------------------------------------------------- in a codec
def test_spec_and_registry():
    codec = get_codec("ef+rht+fp32")
    assert isinstance(codec, Codec) and codec.name == "rht+fp32" and codec.spec == "ef+rht+fp32"
    assert isinstance(codec.wire_transforms[0], RandomizedHadamard)
    assert get_codec(codec.spec) == codec


@pytest.mark.parametrize("shape", [(0,), (1,), (37, 53), (3, 5, 70), (1 << 16) + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_round_trip(shape, dtype):
    codec = get_codec("rht+fp32")
    x = sample_tensor(shape, seed=2, dtype=dtype)
    payload = codec.encode(x, seed=3)
    n = x.numel()
    assert read_payload(payload).spec == "rht+fp32"
    assert len(read_payload(payload).body) == 4 * RandomizedHadamard().output_numel(n)
    out = codec.decode(payload, seed=3)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-3  # float16 input comes back through a float16 cast
    assert torch.allclose(out.float(), x.float(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("name", PORTED)
def test_every_ported_quantizer_round_trips_behind_rht(name):
    codec = get_codec("rht+" + name)
    plain = get_codec(name)
    x = sample_tensor((70, 30), seed=4)
    payload = codec.encode(x, seed=8)
    assert codec.encode(x, seed=8) == payload
    out = codec.decode(payload, seed=8, **decode_kwargs(codec, x))
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = plain.decode(plain.encode(x, seed=8), seed=8, **decode_kwargs(plain, x))
    # A rotation keeps the error's norm: on Gaussian data the error is the unrotated codec's,
    # give or take the padding (2100 -> 2112 elements) and chance.
    err, ref_err = float((out - x).norm()), float((ref - x).norm())
    assert err <= 2 * ref_err + 1e-5 * float(x.norm())


def test_error_feedback_in_front_of_rht():
    codec = get_codec("ef+rht+fp16")
    x = sample_tensor((300,), seed=6)
    payload, state = codec.encode_stateful(x, 4, None)
    out = codec.decode(payload, seed=4)
    assert torch.allclose(state["ef"], x - out, atol=1e-7)
    assert payload == codec.without_state().encode(x, seed=4)


class ModuloQuantizer(SideInfoQuantizer):
    """A toy Wyner–Ziv quantizer: sends ``round(x / step) mod 16``; the decoder picks the level
    congruent to it nearest to its side information (within 8 steps of ``x``)."""

    name = "modulo"
    codings = ("fixed",)
    step = 0.01

    def num_symbols(self):
        return 16

    def side_fields(self, numel):
        return []

    def quantize(self, flat, seed, packed_width):
        return Quantized([], symbols=torch.remainder(torch.round(flat / self.step), 16).to(torch.uint8).numpy())

    def dequantize(self, side, symbols, numel, seed):
        guess = torch.round(self.side_info / self.step)
        k = torch.from_numpy(symbols.astype(np.int64)).to(torch.float32)
        return (guess + torch.remainder(k - guess + 8, 16) - 8) * self.step


def test_side_info_is_rotated_like_the_tensor():
    codec = Codec(ModuloQuantizer(), [RandomizedHadamard()])
    assert codec.needs_side_info and codec.name == "rht+modulo"
    x = sample_tensor((1000,), seed=7)
    side = x + 0.01 * sample_tensor((1000,), seed=8)  # rotated, the noise stays N(0, 0.01^2)
    payload = codec.encode(x, seed=2)
    out = codec.decode(payload, seed=2, side_info=side)
    # Each rotated coordinate is within step/2 of the true one: the error norm is at most
    # step/2 * sqrt(1024); a side information in the wrong domain would miss by whole units.
    assert float((out - x).norm()) <= 0.005 * 32
    with pytest.raises(ValueError, match="side_info"):
        codec.decode(payload, seed=2)


def test_bad_payloads_are_payload_errors():
    codec = get_codec("rht+fp32")
    x = sample_tensor((100,), seed=9)
    payload = codec.encode(x, seed=1)
    for bad in (b"", payload[:-1], payload[:20], payload + b"\x00"):
        with pytest.raises(PayloadError):
            codec.decode(bad, seed=1)
    with pytest.raises(PayloadError):  # the same floats without the rotation
        get_codec("fp32").decode(payload, seed=1)
    with pytest.raises(PayloadError):
        codec.decode(get_codec("fp32").encode(x, seed=1), seed=1)
    p = read_payload(payload)
    # Values that overflow when rotated back.
    huge = np.full(128, 3e38, np.float32).tobytes()
    with pytest.raises(PayloadError, match="NaN or Inf"):
        codec.decode(write_payload(p.spec, p.dtype, p.shape, [huge]), seed=1)
    # A body sized for the unpadded length, and a shape whose padded length differs.
    for shape, body in (((100,), p.body[:400]), ((129,), p.body), ((64,), p.body)):
        with pytest.raises(PayloadError):
            codec.decode(write_payload(p.spec, p.dtype, shape, [body]), seed=1)
    # A flipped body bit is caught by the CRC; resealed, it decodes to other finite values.
    flipped = bytearray(payload)
    flipped[-10] ^= 1
    with pytest.raises(PayloadError):
        codec.decode(bytes(flipped), seed=1)
    assert torch.isfinite(codec.decode(reseal(flipped), seed=1)).all()
