"""Mutated payloads for fuzzing: the families, their valid payloads and the mutations.

A *family* is a codec spec (one per registered codec and coding it offers, plus a few wire
variants); its *bases* are valid payloads of a handful of tensors. :func:`mutate` turns a base
into one case: bit flips, truncation, extension, splices of two payloads, byte overwrites in
the body, header rewrites (dtype, shape, spec, body length, version) and forged Elias / rANS
sections behind the real bucket scales. Entropy-coded families also get two bases whose rANS
section is laid out in several blocks (:func:`relaid`): 32 lanes of the 32-bit coder and 8 lanes
of the 64-bit one, layouts the encoder itself picks only for streams of millions of symbols (and
the second only for models above 12 bits). Most mutations rebuild the envelope with a valid CRC,
which otherwise stops almost everything before the body parsers. The harness that runs the
cases is :mod:`fedquant.testing.fuzzing`.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

# Mutation kinds and their weights.
KINDS = {
    "valid": 1,
    "flip": 10,
    "truncate": 5,
    "extend": 5,
    "splice": 7,
    "overwrite": 17,
    "header": 20,
    "forge": 35,
}
_KIND_NAMES = list(KINDS)
_KIND_P = np.array(list(KINDS.values()), np.float64) / sum(KINDS.values())
_HUGE = (2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63, 2**64 - 1)


# ---------------------------------------------------------------------------------------------- families
def families() -> list[str]:
    """One codec spec per registered codec and coding it offers, plus a few wire variants."""
    from fedquant.codecs import available_codecs, codec_class

    specs: list[str] = []
    for name in available_codecs():
        params = codec_class(name).params
        codings = params["coding"].choices if "coding" in params and params["coding"].choices else None
        specs += [f"{name}:coding={c}" for c in codings] if codings else [name]
        if "level_dtype" in params:
            specs.append(f"{name}:level_dtype=float16")
    # QSGD's Elias coder picks Code_s (sparse) or Code'_s (dense) per payload: force each regime.
    specs += ["qsgd:bucket_size=0,coding=elias,levels=1", "qsgd:coding=elias,levels=1000", "signsgd:bucket_size=0"]
    # Behind a rotation: the decoder rotates back (and rotates NDQSG's side information).
    specs += ["rht+qsgd:coding=entropy", "rht+dqsg:coding=fixed", "rht+ndqsg:coding=fixed"]
    # A rotation with parameters of its own (larger blocks, binary-digit tail): another wire spec.
    specs += ["rht:max_log2=12,min_log2=4+qsgd:coding=fixed"]
    # EDEN's fractional rates carry two index streams, and below 1 bit a subsampled one.
    specs += ["eden:bits=1.5", "eden:bits=0.5"]
    # ECDQ's E8 lattice (lattice=auto takes the scalar one for tensors this small), also at a wide alphabet.
    specs += ["ecdq:coding=entropy,lattice=e8", "ecdq:coding=fixed,lattice=e8", "ecdq:bits=6,coding=entropy,lattice=e8"]
    # ECDQ below one bit: a shared-seed subsample of the coordinates (the decoder rebuilds the mask).
    specs += ["ecdq:bits=0.5,coding=entropy,keep=0.65", "ecdq:bits=0.5,coding=fixed,keep=0.65,lattice=e8"]
    return specs


@dataclass
class Base:
    """A valid payload and what its decoder is given."""

    payload: bytes
    shape: tuple[int, ...]
    dtype: object  # torch.dtype
    seed: int
    side_info: object  # torch.Tensor or None
    offset: int  # where the body's coded index section starts


def _tensors():
    import torch

    gen = torch.Generator().manual_seed(2024)
    sparse = torch.randn(3, 70, generator=gen) * (torch.rand(3, 70, generator=gen) < 0.2)
    return [
        torch.randn(300, generator=gen),
        sparse,
        (torch.randn(2, 3, 50, generator=gen) * 3).to(torch.float16),
        torch.full((5,), -0.75),
        torch.zeros(64),
        torch.randn(1, generator=gen).to(torch.bfloat16),
        # Values beyond float16 and (rounded) bfloat16 range: a header that rewrites the dtype must
        # not turn them into Inf.
        torch.randn(40, generator=gen) * 1e5,
        torch.tensor([3.3e38, -3.3e38, 1.0, 0.0]),
    ]


def coded_offset(codec, numel: int) -> int:
    """Byte offset of the symbol stream in a body: after the quantizer's side fields (scales, steps, levels)."""
    for transform in codec.wire_transforms:
        numel = transform.output_numel(numel)
    return sum(f.count * np.dtype(f.dtype).itemsize for f in codec.quantizer.side_fields(numel))


def bases(spec: str) -> tuple[object, list[Base]]:
    """The codec of a family and its valid payloads (deterministic)."""
    import torch

    from fedquant.codecs import get_codec

    codec = get_codec(spec)
    out = []
    for j, x in enumerate(_tensors()):
        side = None
        if codec.needs_side_info:
            gen = torch.Generator().manual_seed(99 + j)
            side = x.float() + 0.01 * torch.randn(x.shape, generator=gen)
        seed = 1000 + j
        try:
            payload = codec.encode(x, seed=seed)
            # Near the float32 limit a dithered step or a rotation can overflow on the way back:
            # a payload its own decoder rejects is not a base either.
            codec.decode(payload, seed, side)
        except ValueError:  # beyond what this codec sends (float16 levels of 3e38): not a base
            continue
        out.append(Base(payload, tuple(x.shape), x.dtype, seed, side, coded_offset(codec, x.numel())))
    if "coding=entropy" in spec and codec.quantizer.num_symbols():
        # One section of one alphabet re-laid in blocks of 32 lanes (rans32) and of 8 lanes
        # (rans64); ecdq's many small tables, of alphabets of their own, get the multi-block
        # layouts from forged_entropy instead.
        x = torch.randn(5000, generator=torch.Generator().manual_seed(2025))
        side = x + 0.01 if codec.needs_side_info else None
        for lanes, coder in ((32, "rans32"), (8, "rans64")):
            payload = relaid(codec, codec.encode(x, seed=2000), x.numel(), lanes, coder=coder)
            codec.decode(payload, 2000, side)
            out.append(Base(payload, tuple(x.shape), x.dtype, 2000, side, coded_offset(codec, x.numel())))
    return codec, out


def relaid(codec, payload: bytes, numel: int, lanes: int = 32, block_log2: int = 10, coder: str = "rans32") -> bytes:
    """``payload`` with its rANS section re-coded in blocks of ``2**block_log2`` symbols of ``lanes`` lanes.

    The same symbols and count table: the payload decodes to the same tensor. ``coder`` is
    ``"rans32"`` (models of at most 12 bits: a stream that needs more is laid out in 8 lanes of
    ``"rans64"``) or ``"rans64"``.
    """
    from fedquant.wire.entropy import Layout, choose_layout, encode_section, entropy_decode, quantize_counts

    spec_b, dtype_code, shape, body = _fields(payload)
    offset = coded_offset(codec, numel)
    for transform in codec.wire_transforms:
        numel = transform.output_numel(numel)
    k = codec.quantizer.num_symbols()
    section = np.frombuffer(body[offset:], np.uint8)
    symbols = entropy_decode(section, numel, k)
    counts = np.bincount(symbols, minlength=k)
    present = np.flatnonzero(counts)
    precision = choose_layout(counts[present], numel)[0].precision
    if coder == "rans32" and precision > 12:  # a model rans32 cannot take
        coder, lanes = "rans64", 8
    freq = quantize_counts(counts[present], numel, precision)
    table = section[: section.size - _rans_bytes(section, numel, k)]
    coded = encode_section(symbols, present, freq, Layout(precision, lanes, block_log2, coder), table)
    return envelope(spec_b, dtype_code, shape, body[:offset] + coded.tobytes())


def _rans_bytes(section: np.ndarray, count: int, k: int) -> int:
    """Bytes of an entropy section after its count table."""
    from fedquant.wire.elias import elias_omega_decode_prefix

    (distinct,), _ = elias_omega_decode_prefix(section, 1, min(k, count))
    _, nbits = elias_omega_decode_prefix(section, 1 + 2 * int(distinct), max(k, count))
    return section.size - (nbits + 7) // 8


# ---------------------------------------------------------------------------------------------- envelopes
_FIXED = struct.Struct("<2sBBBH")


def envelope(
    spec: bytes,
    dtype_code: int,
    shape: tuple[int, ...],
    body: bytes,
    *,
    version: int | None = None,
    body_len: int | None = None,
    ndim: int | None = None,
) -> bytes:
    """A payload envelope with any field values (even invalid ones) and a correct CRC-32."""
    from fedquant.wire.payload import FORMAT_VERSION, MAGIC

    head = b"".join(
        [
            _FIXED.pack(
                MAGIC,
                FORMAT_VERSION if version is None else version,
                dtype_code,
                len(shape) if ndim is None else ndim,
                len(spec),
            ),
            b"".join(struct.pack("<Q", min(int(d), 2**64 - 1)) for d in shape),
            spec,
            struct.pack("<Q", len(body) if body_len is None else body_len),
            body,
        ]
    )
    return head + struct.pack("<I", zlib.crc32(head))


def reseal(data: bytes) -> bytes:
    """Recompute the trailing CRC-32 after tampering."""
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4])) if len(data) >= 4 else data


def _fields(payload: bytes) -> tuple[bytes, int, tuple[int, ...], bytes]:
    from fedquant.wire.payload import DTYPE_CODES, read_payload

    p = read_payload(payload)
    return p.spec.encode(), DTYPE_CODES[p.dtype], p.shape, bytes(p.body)


# ---------------------------------------------------------------------------------------------- mutations
def _bits_to_bytes(bits: str, pad: str) -> bytes:
    bits += pad * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


def _omega_bits(rng: np.random.Generator, count: int) -> str:
    """Codewords of random values (small to 64-bit) as a bit string."""
    from fedquant.wire.elias import elias_omega_encode

    top = rng.choice([4, 64, 2**16, 2**40, 2**63])
    values = rng.integers(1, top, count, dtype=np.uint64, endpoint=True)
    data, nbits = elias_omega_encode(values)
    return "".join(format(b, "08b") for b in data.tobytes())[:nbits]


def forged_elias(rng: np.random.Generator) -> bytes:
    """Bit strings that walk the Elias readers' slow paths: long groups, runs of ones, bombs."""
    pieces = []
    for _ in range(int(rng.integers(1, 6))):
        r = rng.random()
        if r < 0.3:
            pieces.append(_omega_bits(rng, int(rng.integers(1, 8))))
        elif r < 0.5:
            pieces.append("1" * int(rng.integers(1, 120)))
        elif r < 0.7:  # group lengths 2, 3, 6, 64: a 64-bit group, then one more group
            tail = "".join(rng.choice(["0", "1"], 63))
            pieces.append("10" + "101" + "111111" + "1" + tail)
        else:
            pieces.append("".join(rng.choice(["0", "1"], int(rng.integers(1, 80)))))
    return _bits_to_bytes("".join(pieces), str(rng.integers(0, 2)))


def forged_entropy(rng: np.random.Generator, count: int) -> bytes:
    """A count table (consistent with ``count`` or not), then a rANS section of random words.

    The section's header is mostly plausible (either coder, a precision the table allows, any
    lanes, sometimes several blocks with lengths that add up or not), and the first words are
    often valid coder states, so the forgeries reach the block decoders (rans32 sections of 32
    lanes with enough words reach its vector rounds).
    """
    from fedquant.wire.elias import elias_omega_encode

    k = int(rng.choice([1, 2, 2, 3, 5, int(rng.integers(1, 2000))]))
    gaps = rng.integers(1, 4, k)
    if rng.random() < 0.6 and count >= k:  # counts that sum to the expected count
        cuts = np.sort(rng.choice(np.arange(1, count), k - 1, replace=False)) if k > 1 else np.array([], int)
        counts = np.diff(np.concatenate([[0], cuts, [count]]))
    else:
        counts = rng.integers(1, rng.choice([4, 2**20, 2**38]), k, dtype=np.int64)
    table = np.empty(1 + 2 * k, np.int64)
    table[0], table[1::2], table[2::2] = k, gaps, counts
    head, _ = elias_omega_encode(table)
    rans32 = rng.random() < 0.6
    if rans32:
        lanes_log2 = int(rng.choice([0, 5, 5, int(rng.integers(0, 6))]))
        top = 12
    else:
        lanes_log2 = int(rng.integers(0, 4))
        top = 24
    if rng.random() < 0.05:
        lanes_log2 = int(rng.integers(0, 256))  # beyond what a coder takes
    low = max(1, (k - 1).bit_length())
    precision = int(rng.integers(low, max(low, top) + 1)) if rng.random() < 0.8 else int(rng.integers(1, 33))
    nwords = int(rng.choice([0, 1, 2, 3, 16, int(rng.integers(0, 80)), int(rng.integers(64, 600))]))
    state_words = 2 << min(lanes_log2, 6)
    if rans32:  # 16-bit words; valid initial states in [2**15, 2**31): high words in [1, 2**15)
        words = rng.integers(0, 2**16, nwords, dtype=np.uint64).astype("<u2")
        if rng.random() < 0.6:
            words[1:state_words:2] = rng.integers(1, 2**15, words[1:state_words:2].size)
    else:  # 32-bit words; valid initial states in [2**31, 2**63): high words below 2**31
        words = rng.integers(0, 2**32, nwords, dtype=np.uint64).astype("<u4")
        if rng.random() < 0.6:
            words[1:state_words:2] = rng.integers(1, 2**31, words[1:state_words:2].size)
    flags = (precision - 1) & 0x1F | (0x20 if rans32 else 0) | (0x40 if rng.random() < 0.02 else 0)
    section = [bytes([flags, lanes_log2 & 0xFF])]
    if rng.random() < 0.3:  # several blocks: a block size, then the lengths of all blocks but the last
        block_log2 = int(rng.integers(10, 14)) if rng.random() < 0.8 else int(rng.integers(0, 256))
        blocks = max(2, -(-count // (1 << min(block_log2, 40)))) if rng.random() < 0.8 else int(rng.integers(1, 6))
        split = rng.integers(0, max(1, nwords), min(blocks - 1, 64))
        lengths = (
            np.diff(np.concatenate([[0], np.sort(split)])) if rng.random() < 0.7 else rng.integers(0, 2**32, split.size)
        )
        section = [bytes([flags | 0x80, lanes_log2 & 0xFF, block_log2 & 0xFF]), lengths.astype("<u4").tobytes()]
    elif rng.random() < 0.1:
        section = [rng.integers(0, 256, int(rng.integers(1, 3)), dtype=np.uint8).tobytes()]
    return head.tobytes() + b"".join(section) + words.tobytes()


def forged_stages(rng: np.random.Generator, count: int) -> bytes:
    """ECDQ's entropy-coded section: one to three stages of uint32 table lengths (mostly matching the
    forged tables that follow) and count tables with random rANS words."""
    out = []
    for _ in range(int(rng.integers(1, 4))):
        tables = int(rng.choice([0, 1, 1, 2, 3, int(rng.integers(1, 40))]))
        sections = [forged_entropy(rng, max(1, count // max(tables, 1))) for _ in range(tables)]
        lengths = np.array([len(x) for x in sections], np.int64)
        if rng.random() < 0.3 and tables:
            lengths[int(rng.integers(tables))] += int(rng.choice([-1, 1, 4, 2**31]))
        out.append(np.clip(lengths, 0, 2**32 - 1).astype("<u4").tobytes() + b"".join(sections))
    return b"".join(out)


def _forge_body(rng: np.random.Generator, spec: str, base: Base, body: bytes) -> bytes:
    numel = math.prod(base.shape)
    prefix = body[: base.offset]
    r = rng.random()
    if spec.startswith("ecdq") and "coding=fixed" not in spec:
        return prefix + (forged_stages(rng, numel) if r < 0.8 else forged_entropy(rng, numel))
    if "coding=elias" in spec:
        variant = bytes([int(rng.choice([0, 1, 0, 1, int(rng.integers(0, 256))]))])
        return prefix + variant + forged_elias(rng)
    if "coding=entropy" in spec:
        return prefix + (forged_entropy(rng, numel) if r < 0.7 else forged_elias(rng))
    # fixed width: random index bytes of about the right length
    length = max(0, len(body) - base.offset + int(rng.integers(-2, 3)))
    return prefix + rng.integers(0, 256, length, dtype=np.uint8).tobytes()


def _rewrite_shape(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[int, ...]:
    dims = list(shape)
    r = rng.random()
    n = math.prod(shape)
    if r < 0.2:
        return (n,) if rng.random() < 0.5 else (1, n)
    if r < 0.35 and dims:
        i = int(rng.integers(len(dims)))
        dims[i] = max(0, dims[i] + int(rng.choice([-1, 1, 8])))
    elif r < 0.55 and dims:
        dims[int(rng.integers(len(dims)))] = int(rng.choice(_HUGE))
        if rng.random() < 0.5:
            dims.insert(int(rng.integers(len(dims) + 1)), 0)
    elif r < 0.7:
        dims.insert(int(rng.integers(len(dims) + 1)), int(rng.choice([0, 1, 2, 3])))
    elif r < 0.8:
        dims = dims[:-1]
    elif r < 0.9:
        dims = [int(rng.integers(0, 4)) for _ in range(int(rng.integers(0, 10)))]
    else:
        rng.shuffle(dims)
    return tuple(dims)


def _rewrite_spec(rng: np.random.Generator, spec: bytes, all_specs: list[str]) -> bytes:
    r = rng.random()
    if r < 0.4:
        return str(rng.choice(all_specs)).encode()
    if r < 0.7 and b"=" in spec:  # change one digit of a parameter value
        digits = [i for i, c in enumerate(spec) if chr(c).isdigit()]
        if digits:
            i = int(rng.choice(digits))
            return spec[:i] + str(rng.integers(0, 10)).encode() + spec[i + 1 :]
    if r < 0.85:
        return spec[: int(rng.integers(0, len(spec) + 1))]
    i = int(rng.integers(len(spec)))
    return spec[:i] + bytes([int(rng.integers(0, 256))]) + spec[i + 1 :]


def mutate(rng: np.random.Generator, spec: str, base: Base, other: Base, all_specs: list[str]) -> tuple[str, bytes]:
    """One mutated payload of ``base``: ``(kind, bytes)``."""
    kind = _KIND_NAMES[int(rng.choice(len(_KIND_NAMES), p=_KIND_P))]
    data = base.payload
    spec_b, dtype_code, shape, body = _fields(data)
    seal = rng.random() < 0.85  # mostly recompute the CRC, so the mutation reaches the parsers
    if kind == "valid":
        return kind, data
    if kind == "flip":
        raw = bytearray(data)
        lo = 0 if rng.random() < 0.3 else len(data) - 4 - len(body)  # mostly in the body
        for _ in range(int(rng.integers(1, 9))):
            bit = int(rng.integers(lo * 8, (len(data) - 4) * 8))
            raw[bit // 8] ^= 0x80 >> (bit % 8)
        return kind, reseal(bytes(raw)) if seal else bytes(raw)
    if kind == "truncate":
        cut = int(rng.integers(0, len(body) + 1))
        if seal:
            return kind, envelope(spec_b, dtype_code, shape, body[:cut])
        return kind, data[: int(rng.integers(0, len(data)))]
    if kind == "extend":
        extra = rng.integers(0, 256, int(rng.choice([1, 3, 4, 8, int(rng.integers(1, 200))])), dtype=np.uint8)
        if rng.random() < 0.5:
            extra[:] = 0
        if seal:
            return kind, envelope(spec_b, dtype_code, shape, body + extra.tobytes())
        return kind, data + extra.tobytes()
    if kind == "splice":
        o_body = _fields(other.payload)[3]
        cut_a = int(rng.integers(0, len(body) + 1))
        cut_b = int(rng.integers(0, len(o_body) + 1))
        if seal:
            return kind, envelope(spec_b, dtype_code, shape, body[:cut_a] + o_body[cut_b:])
        head_a = len(data) - 4 - len(body)
        head_b = len(other.payload) - 4 - len(o_body)
        return kind, data[: head_a + cut_a] + other.payload[head_b + cut_b :]
    if kind == "overwrite":
        raw = bytearray(body)
        for _ in range(int(rng.integers(1, 6))):
            if not raw:
                break
            i = int(rng.integers(len(raw)))
            run = int(rng.integers(1, 9))
            value = int(rng.choice([0, 0xFF, 0x7F, 0x80, int(rng.integers(0, 256))]))
            raw[i : i + run] = bytes([value]) * len(raw[i : i + run])
        return kind, envelope(spec_b, dtype_code, shape, bytes(raw))
    if kind == "header":
        version = body_len = ndim = None
        for _ in range(int(rng.integers(1, 3))):
            field_ = rng.choice(["dtype", "shape", "shape", "spec", "body_len", "version", "ndim"])
            if field_ == "dtype":
                dtype_code = int(rng.integers(0, 4)) if rng.random() < 0.9 else int(rng.integers(4, 256))
            elif field_ == "shape":
                shape = _rewrite_shape(rng, shape)
            elif field_ == "spec":
                spec_b = _rewrite_spec(rng, spec_b, all_specs)
            elif field_ == "body_len":
                body_len = max(0, len(body) + int(rng.choice([-8, -1, 1, 4, 2**32])))
            elif field_ == "version":
                version = int(rng.integers(0, 256))
            else:
                ndim = int(rng.integers(0, 256))
        if rng.random() < 0.3:  # and keep a body that matches the new header's element count
            body = _fields(other.payload)[3]
        return kind, envelope(spec_b, dtype_code, shape[:20], body, version=version, body_len=body_len, ndim=ndim)
    return kind, envelope(spec_b, dtype_code, shape, _forge_body(rng, spec, base, body))
