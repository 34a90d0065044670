"""Payload fuzzing shared by ``tests/test_fuzz.py`` and ``python -m benchmarks.fuzz``.

Every case starts from a valid payload of one *family* (a codec spec, one per codec and coding
it offers) and mutates it: bit flips, truncation, extension, splices of two payloads, byte
overwrites in the body, header rewrites (dtype, shape, spec, body length, version) and forged
Elias / rANS sections behind the real bucket scales. Most mutations rebuild the envelope with a
valid CRC, which otherwise stops almost everything before the body parsers. Case ``i`` of a
family is a pure function of ``(seed, family, i)``, so a failing case can be replayed alone.

Cases run in worker subprocesses (``python -m benchmarks.fuzzing``, jobs as JSON on stdin, one
result line per case on stdout), so a crash of the decoder kills a worker, not the caller: the
parent reports the case in flight as ``crash``, or as ``hang`` when no result comes within the
timeout, and starts a new worker after it. A worker measures each decode's peak allocation
(tracemalloc, which sees NumPy buffers) and peak resident memory (Linux ``VmHWM``, which sees
torch's too) against ``MEMORY_FACTOR * (payload bytes + expected float32 tensor bytes)`` plus a
small constant.

Outcomes: ``ok-finite`` (a finite tensor of the expected shape and dtype), ``payload-error``
(:class:`fedquant.PayloadError`), and the failures ``other-exception``, ``crash``, ``hang``,
``memory``, ``nonfinite`` and ``bad-output`` (a tensor of the wrong shape or dtype).
"""

from __future__ import annotations

import json
import math
import os
import queue
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

OUTCOMES = ("ok-finite", "payload-error", "other-exception", "crash", "hang", "memory", "nonfinite", "bad-output")
FAILURES = OUTCOMES[2:]
MEMORY_FACTOR = 4
TRACED_SLACK = 1 << 20  # bytes of Python/NumPy bookkeeping any decode may allocate
RSS_SLACK = 32 << 20  # resident-memory noise: allocator arenas, numba code loaded on first use
STARTUP_TIMEOUT = 300.0  # seconds for a worker's imports and kernel loading, before its first result
REPO = Path(__file__).resolve().parent.parent

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
    """Byte offset of the index section in a body: after the per-bucket scales, steps or levels."""
    from fedquant.codecs.level_codec import LEVEL_DTYPES, LevelCodec

    size = getattr(codec, "bucket_size", None)
    if size is None:
        return 0  # fp32 / fp16: no index section
    nb = -(-numel // (size if size > 0 else max(numel, 1)))
    if isinstance(codec, LevelCodec):
        return nb * codec.num_levels() * np.dtype(LEVEL_DTYPES[codec.level_dtype]).itemsize
    return nb * 4


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
        except ValueError:  # beyond what this codec sends (float16 levels of 3e38): not a base
            continue
        out.append(Base(payload, tuple(x.shape), x.dtype, seed, side, coded_offset(codec, x.numel())))
    return codec, out


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
    """A count table (consistent with ``count`` or not) followed by random rANS words."""
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
    nwords = int(rng.choice([0, 1, 2, 3, int(rng.integers(0, 40))]))
    words = rng.integers(0, 2**32, nwords, dtype=np.uint64).astype("<u4")
    if nwords >= 2 and rng.random() < 0.5:  # a valid initial state in [2**31, 2**63)
        words[0] = rng.integers(1, 2**31)
    return head.tobytes() + words.tobytes()


def _forge_body(rng: np.random.Generator, spec: str, base: Base, body: bytes) -> bytes:
    numel = math.prod(base.shape)
    prefix = body[: base.offset]
    r = rng.random()
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


# ---------------------------------------------------------------------------------------------- one case
class _Proc:
    """Peak resident memory of this process (Linux): reset ``VmHWM``, read it back; files kept open."""

    def __init__(self) -> None:
        try:
            self.clear = open("/proc/self/clear_refs", "wb", buffering=0)  # noqa: SIM115 - reused per case
            self.status = open("/proc/self/status", "rb", buffering=0)  # noqa: SIM115
            self.reset()
        except OSError:
            self.clear = self.status = None

    @property
    def available(self) -> bool:
        return self.clear is not None

    def reset(self) -> None:
        self.clear.write(b"5")

    def kib(self, key: bytes) -> int:
        self.status.seek(0)
        text = self.status.read()
        start = text.index(key) + len(key)
        return int(text[start : text.index(b"kB", start)])


@dataclass
class Family:
    """A worker's state for one family: codec, valid payloads, the other families' specs."""

    spec: str
    codec: object
    bases: list[Base]
    all_specs: list[str]  # canonical specs of every family, for header rewrites
    proc: _Proc | None = None


def run_case(fam: Family, seed: int, family_index: int, i: int, inject: dict | None = None) -> tuple[str, str]:
    """Mutate, decode and classify case ``i`` of a family: ``(outcome, detail)``."""
    import torch

    from fedquant.codecs.base import numel_limit
    from fedquant.errors import PayloadError
    from fedquant.wire.payload import read_payload

    rng = np.random.default_rng([seed, family_index, i])
    base = fam.bases[int(rng.integers(len(fam.bases)))]
    other = fam.bases[int(rng.integers(len(fam.bases)))]
    kind, payload = mutate(rng, fam.spec, base, other, fam.all_specs)
    shape = base.shape if rng.random() < 0.75 else None
    dtype = base.dtype if rng.random() < 0.5 else None
    injected = next((k for k, v in (inject or {}).items() if v == [fam.spec, i]), None)
    if injected == "crash":
        import ctypes

        ctypes.string_at(0)  # a deliberate segfault: the harness must report it
    elif injected == "hang":
        time.sleep(3600)
    elif injected == "nonfinite":  # a valid payload whose decoded tensor is then replaced by Inf
        kind, payload, shape, dtype = "valid", base.payload, base.shape, base.dtype

    expected_numel = math.prod(shape) if shape is not None else numel_limit(len(payload))
    bound = MEMORY_FACTOR * (len(payload) + 4 * expected_numel)
    proc = fam.proc if fam.proc is not None and fam.proc.available else None
    if proc is not None:
        proc.reset()
    rss_before = proc.kib(b"VmRSS:") if proc is not None else 0
    tracemalloc.reset_peak()
    traced_before = tracemalloc.get_traced_memory()[0]
    try:
        out = fam.codec.decode(payload, base.seed, base.side_info, shape=shape, dtype=dtype)
        error = None
    except PayloadError as err:
        out, error = None, err
    except Exception as err:  # noqa: BLE001 - classifying every escape is the point
        return "other-exception", f"{kind}: {type(err).__name__}: {err}"[:300]
    traced = tracemalloc.get_traced_memory()[1] - traced_before
    grown = (proc.kib(b"VmHWM:") - rss_before) * 1024 if proc is not None else 0
    if traced > bound + TRACED_SLACK or grown > bound + RSS_SLACK:
        return "memory", f"{kind}: allocated {traced} B (traced), {grown} B resident; bound {bound} B"
    if error is not None:
        return "payload-error", ""
    if injected == "nonfinite":
        out = torch.full_like(out, math.inf)
    declared = read_payload(payload)
    want_shape = shape if shape is not None else declared.shape
    want_dtype = dtype if dtype is not None else declared.dtype
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want_shape) or out.dtype != want_dtype:
        got = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__
        return "bad-output", f"{kind}: got {got}, expected {(tuple(want_shape), want_dtype)}"
    if not bool(torch.isfinite(out).all()):
        return "nonfinite", f"{kind}: decoded tensor holds NaN or Inf"
    return "ok-finite", ""


def canonical_specs(specs: list[str]) -> list[str]:
    """The spec each family's payloads carry (``"qsgd:bucket_size=512,coding=elias,..."``)."""
    from fedquant.codecs import get_codec

    return [get_codec(s).spec for s in specs]


def load_family(spec: str, all_specs: list[str], proc: _Proc | None = None) -> Family:
    """Build a family and warm up its decoder (kernels load on first use)."""
    codec, valid = bases(spec)
    for b in valid:
        codec.decode(b.payload, b.seed, b.side_info, shape=b.shape, dtype=b.dtype)
    return Family(spec, codec, valid, all_specs, proc)


def worker_main() -> None:
    """Worker process: read ``{"seed", "jobs": [[spec, start, stop], ...], "inject"}`` from stdin."""
    job = json.load(sys.stdin)
    names = families()
    canonical = canonical_specs(names)
    proc = _Proc()
    tracemalloc.start()
    out = sys.stdout
    for spec, start, stop in job["jobs"]:
        try:
            fam = load_family(spec, canonical, proc)
        except Exception as err:  # noqa: BLE001 - reported to the parent, which skips the family
            out.write(f"LOADFAIL\t{spec}\t{type(err).__name__}: {err}\n".replace("\n", " ").rstrip() + "\n")
            out.flush()
            continue
        out.write(f"LOADED\t{spec}\n")  # the parent allows STARTUP_TIMEOUT until this line
        out.flush()
        index = names.index(spec)
        for i in range(start, stop):
            outcome, detail = run_case(fam, job["seed"], index, i, job.get("inject"))
            out.write(f"{spec}\t{i}\t{outcome}\t{detail.replace(chr(10), ' ')}\n")
            out.flush()
    out.write("DONE\n")
    out.flush()


# ---------------------------------------------------------------------------------------------- parent
@dataclass
class Report:
    """Counts per family and outcome, and the failing cases (family, case, outcome, detail)."""

    counts: dict[str, Counter] = field(default_factory=dict)
    failures: list[tuple[str, int, str, str]] = field(default_factory=list)
    worker_errors: list[str] = field(default_factory=list)

    def add(self, spec: str, i: int, outcome: str, detail: str) -> None:
        self.counts.setdefault(spec, Counter())[outcome] += 1
        if outcome in FAILURES:
            self.failures.append((spec, i, outcome, detail))

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def table(self) -> str:
        """Counts per family x outcome, with a total row."""
        width = max([len(s) for s in self.counts] + [12])
        head = f"{'family':<{width}}" + "".join(f"{o:>17}" for o in OUTCOMES)
        lines = [head, "-" * len(head)]
        total: Counter = Counter()
        for spec, c in self.counts.items():
            total.update(c)
            lines.append(f"{spec:<{width}}" + "".join(f"{c[o]:>17,}" for o in OUTCOMES))
        lines.append("-" * len(head))
        lines.append(f"{'total':<{width}}" + "".join(f"{total[o]:>17,}" for o in OUTCOMES))
        return "\n".join(lines)


def _plan(specs: list[str], cases: int, workers: int) -> list[list[list]]:
    """Split ``cases`` over families (as evenly as possible) and the jobs over workers."""
    per, extra = divmod(cases, len(specs))
    jobs = [[s, 0, per + (k < extra)] for k, s in enumerate(specs)]
    jobs = [j for j in jobs if j[2] > 0]
    lanes: list[list[list]] = [[] for _ in range(max(1, workers))]
    for k, j in enumerate(jobs):
        lanes[k % len(lanes)].append(j)
    return lanes


def _start_worker(jobs: list[list], seed: int, inject: dict | None, env: dict) -> tuple:
    """A worker process, a queue of its stdout lines (``None`` at EOF) and a list that gets its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.fuzzing"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    proc.stdin.write(json.dumps({"seed": seed, "jobs": jobs, "inject": inject}))
    proc.stdin.close()
    lines: queue.Queue = queue.Queue()
    err_chunks: list[str] = []

    def pump_stdout() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def pump_stderr() -> None:
        err_chunks.append(proc.stderr.read())

    threading.Thread(target=pump_stdout, daemon=True).start()
    threading.Thread(target=pump_stderr, daemon=True).start()
    return proc, lines, err_chunks


def _lane(
    jobs: list[list],
    seed: int,
    inject: dict | None,
    case_timeout: float,
    report: Report,
    lock: threading.Lock,
) -> None:
    """Run a list of jobs in worker processes, restarting after each crash or hang."""
    # One thread per worker: workers run side by side, and a parallel kernel's thread start costs
    # more than a small tensor's decode.
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        NUMBA_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
    )
    remaining = [list(j) for j in jobs]
    while remaining:
        proc, lines, err_chunks = _start_worker(remaining, seed, inject, env)
        loading = True  # imports, kernels and the family's valid payloads: slow on a cold cache
        outcome = None
        while True:
            try:
                line = lines.get(timeout=STARTUP_TIMEOUT if loading else case_timeout)
            except queue.Empty:
                outcome = "hang"
                proc.kill()
                break
            if line is None:
                outcome = "crash"
                break
            if line == "DONE\n":
                remaining = []
                break
            if line.startswith("LOADED\t"):
                loading = False
                continue
            if line.startswith("LOADFAIL\t"):  # a harness problem: the family has no valid payloads
                with lock:
                    report.worker_errors.append(f"family {remaining[0][0]} failed to load: {line.split(chr(9), 2)[2]}")
                remaining.pop(0)
                continue
            spec, i, result, detail = line.rstrip("\n").split("\t", 3)
            with lock:
                report.add(spec, int(i), result, detail)
            remaining[0][1] = int(i) + 1
            if remaining[0][1] >= remaining[0][2]:
                remaining.pop(0)
                loading = True
        rc = proc.wait()
        if outcome is None:
            continue
        if not remaining:  # the worker died after its last case: a harness problem, not a case
            with lock:
                report.worker_errors.append(f"worker exited with {rc} after its last case")
            break
        spec, i = remaining[0][0], remaining[0][1]
        detail = f"worker exit status {rc}" if outcome == "crash" else f"no result within {case_timeout:.0f} s"
        tail = "".join(err_chunks)[-300:].replace("\n", " ") if outcome == "crash" else ""
        with lock:
            report.add(spec, i, outcome, f"{detail} {tail}".strip())
        remaining[0][1] = i + 1
        if remaining[0][1] >= remaining[0][2]:
            remaining.pop(0)


def run_fuzz(
    cases: int,
    *,
    seed: int = 0,
    workers: int = 2,
    specs: list[str] | None = None,
    case_timeout: float = 20.0,
    inject: dict | None = None,
    progress: Callable[[int, Report], None] | None = None,
) -> Report:
    """Fuzz ``cases`` mutated payloads spread over ``specs`` (default: every family) in workers.

    Parameters
    ----------
    cases : int
        Total number of cases.
    seed : int
        Master seed; the same seed gives the same cases.
    workers : int
        Worker processes running at once.
    specs : list of str, optional
        Families to fuzz (default :func:`families`).
    case_timeout : float
        Seconds without a result after which the case in flight counts as a hang.
    inject : dict, optional
        Self-test of the harness: ``{"crash": [spec, i], "hang": [spec, i], "nonfinite": [spec, i]}``
        makes those cases segfault, hang or return Inf.
    progress : callable, optional
        Called about every 2 seconds with ``(cases, report)``.
    """
    report = Report()
    lock = threading.Lock()
    specs = specs or families()
    threads = [
        threading.Thread(target=_lane, args=(lane, seed, inject, case_timeout, report, lock), daemon=True)
        for lane in _plan(specs, cases, workers)
        if lane
    ]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(timeout=2.0)
        if progress is not None:
            with lock:
                progress(cases, report)
    return report


def replay(spec: str, i: int, seed: int = 0) -> tuple[str, str]:
    """Run one case in this process (to debug a failure the table reports)."""
    names = families()
    tracemalloc.start()
    try:
        return run_case(load_family(spec, canonical_specs(names), _Proc()), seed, names.index(spec), i)
    finally:
        tracemalloc.stop()


if __name__ == "__main__":
    worker_main()
