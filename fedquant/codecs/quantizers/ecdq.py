"""ECDQ: entropy-coded subtractive dithered quantization, coded given the dither (``ecdq:bits=B``).

Always behind ``rht+`` (rotated coordinates are close to iid Gaussian). One step per tensor,
``step = c ||y|| / sqrt(n)``, and a lattice ``L`` (``lattice=z``: the integers, per coordinate;
``lattice=e8``: the E8 lattice, per block of 8 coordinates). Each point ``y / step`` gets a
dither ``u`` from the seed, uniform modulo ``L``, the index ``lambda = Q_L(y / step + u)`` (the
nearest lattice point) and the decoder returns ``step (lambda - u)``. The error is uniform on
``L``'s Voronoi cell and independent of the input (Schuchman 1964; Zamir & Feder 1992), so

* the estimate is **unbiased for every input** (no averaging over rotations needed), and
* its error is known exactly: vNMSE ``= G c**2`` (``G`` the lattice's normalized second moment:
  1/12 for Z, 929/12960 = 0.0717 for E8), times ``numel / n`` after the rotation's padding,
  whatever the data: :meth:`ECDQQuantizer.vnmse`; :meth:`~ECDQQuantizer.expected_error` (exact
  for a given input) and :meth:`~ECDQQuantizer.error_bound` (``omega``, over every input) are what
  error feedback reads.

Rate. The decoder knows the dither, so the index is coded **given the dither**: an ideal coder
needs ``H(lambda | u) = I(X; X + N)`` bits, ``N`` uniform on the cell (Zamir & Feder), which on
Gaussian coordinates is within ``1/2 log2(2 pi e G)`` bits of the unbiased rate–distortion bound
``1/2 log2(1 + 1/vNMSE)``: 0.254 bits for Z, 0.146 for E8 (the space-filling loss; E8's cell is
rounder, 0.65 dB). ``bits`` sets ``c``: for Z, ``I(X; X + c N) = bits`` on ``X ~ N(0, 1)``
(:func:`gaussian_rate`, exact); for E8, the rate of the context model below measured on Gaussian
data (:data:`E8_RATES`, from ``python -m benchmarks.ecdq_calibration``). The payload then takes
about ``bits + 0.005`` bits per coordinate on large Gaussian tensors, fewer on heavier-tailed
rotated data, with the same error.

Entropy model (``coding=entropy``, the default). Every symbol has a *fine context*: its dither's
bin (the top 6 bits of its uniform), and for E8 its coset and group (below). The encoder measures
the histogram of (fine context, symbol) in its first pass and picks ``K = 2**log2k`` (1..64) dither
contexts, the number that codes the tensor in the fewest bits (information plus tables): bins are
merged ``64 / K`` at a time, and contexts ``k`` and ``K - 1 - k`` share a table with the symbol
mirrored (the rotated coordinates are symmetric, and the mirrored dither is the other bin). Each
table is an exact count table + rANS section of :func:`fedquant.wire.entropy.entropy_encode`, its
symbols in element order (:class:`~fedquant.codecs.kernels.ecdq.ContextSpace`).

* Z: symbol ``q + h`` (``h`` the largest ``|q|``), one table group.
* E8: per block its coset bit in ``E8 = D8 u (D8 + 1/2)`` (a binary table), then the 8 symbols
  ``m + h - 1`` of ``lambda = m + coset / 2``: coordinates 1-7 in tables by (coset, context), the
  8th by (coset, context, the parity it must have: ``sum m`` is even in ``D8``), so the decoder
  reads the cosets, the seven, then the eighth (:mod:`fedquant.codecs.kernels.e8`).

``coding=fixed`` packs the same symbols at ``bit_width(2h + 1)`` bits (E8: and one bit per block
for the coset): the same values, many more bits.

Wire layout (body)::

    step        float32     (0 for an all-zero tensor)
    h           uint16      Z: largest |q|; E8: ceil(max |lambda - 1|); symbols in 0..2h
    entropy:    uint8       log2k (0..6), then one stage (Z) or three (E8: cosets, coordinates 1-7,
                            coordinate 8), each: uint32 byte length of every table of the stage that
                            holds symbols (the decoder knows which from the dither and what it has
                            decoded), then those tables' entropy_encode sections in table order
    fixed:      E8 only: uint8[packed_size(blocks, 1)] cosets;
                uint8[packed_size(n, bit_width(2h + 1))] symbols, LSB first

Below one bit, ``keep=p`` quantizes only a shared-seed subsample of the rotated coordinates (a
fraction ``p``, the mask from a stream of its own: :mod:`~fedquant.codecs.quantizers.subsample`), as
above at ``bits / p`` bits per kept coordinate, and the decoder scales them by ``1 / p``: vNMSE
``(1 + D) / p - 1``. The body is that of the kept coordinates, in order; nothing else is sent.

E8 works on blocks of 8: a rotated tensor of 1, 2 or 4 elements is padded with zeros to 8 inside
the quantizer. The step keeps ``h <= H_MAX`` (an input whose largest rotated coordinate exceeds
about ``H_MAX c`` times the RMS gets a larger step, and a larger error). Implementations: numba
kernels on CPU tensors (:mod:`fedquant.codecs.kernels.ecdq`, :mod:`fedquant.codecs.kernels.e8`),
torch twins on CUDA (and with ``force_torch``); both give the same bytes (the float64 sum of
squares is taken in different orders, so the float32 step could differ when the two sums straddle
a float32 rounding boundary, with probability about ``2**-29``).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import numpy as np
import torch

from fedquant.codecs.buffers import output_array
from fedquant.codecs.coders.layout import max_entropy_bytes
from fedquant.codecs.coders.symbols import omega_bits
from fedquant.codecs.kernels import e8
from fedquant.codecs.kernels import ecdq as kernels
from fedquant.codecs.kernels.common import kernel_key
from fedquant.codecs.kernels.ecdq import SCALAR, ContextSpace, chunk_offsets
from fedquant.codecs.params import Param
from fedquant.codecs.quantizers import subsample
from fedquant.codecs.quantizers.base import BitsLadder, Quantized, Quantizer, SideField
from fedquant.errors import PayloadError
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader
from fedquant.wire.entropy import entropy_decode, entropy_encode_runs

MAX_BITS = 8.0
LATTICES = ("auto", "e8", "z")
#: ``lattice=auto`` takes E8 from this rate up, Z below (E8's context model codes the coset bit
#: without context, which costs more than E8's rounder cells save below about half a bit) ...
E8_MIN_BITS = 0.55
#: ... and for rotated tensors of at least this many elements: E8 sends about six more count
#: tables than Z (some 1,800 bits), which its 15% lower error (0.12 bits per coordinate at equal
#: error) pays for from about 2**14 elements (measured on Gaussian data at 1 and 2 bits: a wash
#: at 16,384, 5-6% less error at equal rate at 32,768).
E8_MIN_NUMEL = 1 << 15
#: Largest ``h``: symbols 0..2 H_MAX fit 16 bits and the entropy coder's alphabet.
H_MAX = (1 << 15) - 1
#: The encoder measures the (context, symbol) histogram for its choice of contexts while ``h``
#: stays within this bound (else it codes one context): Z, E8 (E8 has 512 fine contexts).
HIST_MAX_H = {"z": 512, "e8": 256}
#: Chunk groups of the histogram pass (each holds its own histogram).
HIST_GROUPS = {"z": 16, "e8": 4}
SECOND_MOMENT = {"z": 1 / 12, "e8": e8.SECOND_MOMENT}
FLOAT32_MAX = float(np.finfo(np.float32).max)
_TINY32 = float(np.finfo(np.float32).smallest_subnormal)
#: Bits a table costs besides its symbols and counts: the uint32 length, the rANS final state.
TABLE_OVERHEAD_BITS = 32 + 64

#: ``(c, bits per coordinate)`` of E8's entropy-coded section on 2**21 Gaussian coordinates
#: (cosets, tables and their count tables; no envelope), written by
#: ``python -m benchmarks.ecdq_calibration``.
E8_RATES: tuple[tuple[float, float], ...] = (
    (0.01, 8.71200),
    (0.0125923, 8.37585),
    (0.0158567, 8.04022),
    (0.0199673, 7.70508),
    (0.0251435, 7.37058),
    (0.0316616, 7.03638),
    (0.0398694, 6.70257),
    (0.0502049, 6.36916),
    (0.0632197, 6.03611),
    (0.0796084, 5.70311),
    (0.100246, 5.37013),
    (0.126233, 5.03763),
    (0.158957, 4.70563),
    (0.200164, 4.37422),
    (0.252053, 4.04281),
    (0.317394, 3.71209),
    (0.399673, 3.38315),
    (0.503282, 3.05573),
    (0.63375, 2.73063),
    (0.79804, 2.41039),
    (1.00492, 2.09664),
    (1.26543, 1.79239),
    (1.59347, 1.50364),
    (2.00655, 1.24015),
    (2.52672, 1.00841),
    (3.18173, 0.81563),
    (4.00655, 0.66184),
    (5.04518, 0.54709),
    (6.35307, 0.46438),
    (8, 0.40828),
)


# ---------------------------------------------------------------- the rate on Gaussian data
@functools.cache
def gaussian_rate(c: float) -> float:
    """``I(X; X + c N)`` in bits for ``X ~ N(0, 1)``, ``N ~ U[-1/2, 1/2]``: scalar ECDQ's ``H(q | u)``.

    ``h(X + c N) - log2 c``, where ``X + c N`` has the density ``(Phi(y + c/2) - Phi(y - c/2)) / c``,
    integrated numerically (Simpson, steps of ``min(c, 1) / 64``, tails to 12 sigma).
    """
    if not c > 0:
        raise ValueError(f"step constant must be > 0, got {c}")
    half = 0.5 * c + 12.0
    points = 2 * int(math.ceil(half / (min(c, 1.0) / 64))) + 1
    y = torch.linspace(-half, half, points, dtype=torch.float64)
    f = (torch.special.ndtr(y + 0.5 * c) - torch.special.ndtr(y - 0.5 * c)) / c
    g = torch.where(f > 0, -f * torch.log2(f.clamp_min(1e-300)), torch.zeros_like(f))
    w = torch.ones(points, dtype=torch.float64)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return float((w * g).sum() * (y[1] - y[0]) / 3) - math.log2(c)


def e8_rate(c: float) -> float:
    """Bits per coordinate of E8's context model at step constant ``c`` on Gaussian data: :data:`E8_RATES`
    interpolated in ``log c``; beyond the table, its end slopes (high rate: ``-log2 c`` plus a constant)."""
    logs = np.log([p[0] for p in E8_RATES])
    rates = np.array([p[1] for p in E8_RATES])
    x = math.log(c)
    if x <= logs[0]:
        return float(rates[0] - (x - logs[0]) / math.log(2))
    if x >= logs[-1]:
        slope = (rates[-1] - rates[-2]) / (logs[-1] - logs[-2])
        return float(max(rates[-1] + slope * (x - logs[-1]), 0.0))
    return float(np.interp(x, logs, rates))


@functools.cache
def step_constant(bits: float, lattice: str = "z") -> float:
    """``c`` whose rate on Gaussian data is ``bits`` (bisection on ``log c``; the rate falls as ``c`` grows)."""
    rate = gaussian_rate if lattice == "z" else e8_rate
    lo, hi = math.log(1e-4), math.log(1e3)
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        if rate(math.exp(mid)) > bits:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


@functools.lru_cache(maxsize=1024)
def typical_index_range(n: int, c: float) -> int:
    """The median of ``max |q|`` over ``n`` Gaussian coordinates at step constant ``c`` (scalar lattice).

    ``q = round(z / c + u)``, ``u ~ U[-1/2, 1/2]``, so ``P(|q| >= j) = E_u erfc(c (j - 1/2 - u) / sqrt 2)``;
    the median is the largest ``j`` with ``n P(|q| >= j) >= ln 2`` (``P(max < j) ~ exp(-n P)``).
    """
    dither = [(i + 0.5) / 16 - 0.5 for i in range(16)]

    def expected_beyond(j: int) -> float:
        return n * sum(math.erfc(c * (j - 0.5 - u) / math.sqrt(2)) for u in dither) / 16

    lo, hi = 0, H_MAX
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if expected_beyond(mid) >= math.log(2) else (lo, mid - 1)
    return lo


# ---------------------------------------------------------------- choice of the dither contexts
def _omega_bits(values: np.ndarray) -> np.ndarray:
    """Length of the Elias omega codeword of each positive integer."""
    v = values.astype(np.int64)
    out = np.ones(v.shape, np.int64)
    while True:
        more = v > 1
        if not more.any():
            return out
        length = np.frexp(v.astype(np.float64))[1].astype(np.int64)  # bit length
        out += np.where(more, length, 0)
        v = np.where(more, length - 1, 1)


def coded_bits(tables: np.ndarray) -> float:
    """Estimated bits of the entropy-coded tables ``(T, alphabet)``: each non-empty table's information
    ``n H``, its count table (Elias omega of the number of symbols present, their gaps and counts) and
    ``TABLE_OVERHEAD_BITS``."""
    rows, cols = np.nonzero(tables)
    if not rows.size:
        return 0.0
    counts = tables[rows, cols]
    c = counts.astype(np.float64)
    sizes = np.bincount(rows, weights=c)
    sizes = sizes[sizes > 0]
    info = float((sizes * np.log2(sizes)).sum() - (c * np.log2(c)).sum())
    first = np.ones(rows.size, bool)
    first[1:] = rows[1:] != rows[:-1]
    gaps = np.where(first, cols + 1, cols - np.roll(cols, 1))
    present = np.bincount(rows)
    present = present[present > 0]
    table_bits = _omega_bits(present).sum() + _omega_bits(gaps).sum() + _omega_bits(counts).sum()
    return info + float(table_bits) + TABLE_OVERHEAD_BITS * present.size


def choose_contexts(hist: np.ndarray, space: ContextSpace) -> int:
    """``log2k`` (0..6) whose tables code the histogram ``(fine contexts, alphabet)`` in the fewest bits.

    Tries ``log2k = 0, 1, ...`` and stops at the first that costs more than the one before (more
    contexts first save information, then cost more in tables than they save).
    """
    mirrored = space.mirrored(hist)
    best, best_cost = 0, math.inf
    for log2k in range(kernels.FINE_BITS + 1):
        cost = coded_bits(space.folded(hist, log2k, mirrored))
        if cost >= best_cost:
            break
        best, best_cost = log2k, cost
    return best


# ---------------------------------------------------------------- stages of tables on the wire
def write_stage(
    parts: list[np.ndarray], symbols: np.ndarray, sizes: np.ndarray, alphabet: int, counts: np.ndarray | None = None
) -> None:
    """Append a stage: the uint32 lengths of its non-empty tables, then their sections.

    ``counts`` (``(tables, alphabet)``, optional): each table's exact histogram, when the encoder's
    own pass took it (the entropy coder then skips its histogram pass)."""
    coded = entropy_encode_runs(symbols, sizes, alphabet, counts)
    sections = [section for section, size in zip(coded, sizes, strict=True) if size]
    parts.append(np.array([s.size for s in sections], "<u4").view(np.uint8))
    parts.extend(sections)


def read_stage(body: BodyReader, sizes: np.ndarray, alphabet: int) -> np.ndarray:
    """The symbols of a stage (tables of ``sizes`` symbols, in order), each checked by the entropy decoder."""
    lengths = body.take_array("<u4", int(np.count_nonzero(sizes)), "table lengths").astype(np.int64)
    out = np.empty(int(sizes.sum()), _symbol_dtype(alphabet))
    start, k = 0, 0
    for size in sizes:
        if size:
            data = np.frombuffer(body.take(int(lengths[k]), "table section"), np.uint8)
            out[start : start + size] = entropy_decode(data, int(size), alphabet)
            k += 1
        start += size
    return out


def read_packed(body: BodyReader, count: int, width: int, what: str) -> np.ndarray:
    """``packed_size(count, width)`` bytes, their padding bits checked zero."""
    packed = np.frombuffer(body.take(packed_size(count, width), what), np.uint8)
    used = (count * width) % 8
    if used and packed.size and int(packed[-1]) >> used:
        raise PayloadError(f"ecdq payload has nonzero padding bits after its {what}")
    return packed


# ---------------------------------------------------------------- the quantizer
class ECDQQuantizer(BitsLadder, Quantizer):
    """Entropy-coded dithered quantization: one step per tensor, subtractive dither, a model given the dither.

    Parameters
    ----------
    bits : float
        Target rate in bits per coordinate on Gaussian (rotated) data, in ``(0, 8]``: sets the
        step constant ``c`` (``step = c ||y|| / sqrt(n)``, vNMSE ``G c**2``). The error is fixed
        by ``bits`` on any data; the rate follows the data (heavier tails after the rotation
        cost fewer bits).
    lattice : {"auto", "e8", "z"}
        ``e8``: dithered E8 lattice on blocks of 8 coordinates, 0.65 dB rounder cells (about 15%
        less error than ``z`` at the same rate from 0.7 to 8 bits); ``z``: the scalar quantizer;
        ``auto`` (default): ``e8`` from ``E8_MIN_BITS`` = 0.55 bits for rotated tensors of at least
        ``E8_MIN_NUMEL`` = 32,768 elements, ``z`` otherwise (:meth:`lattice_for`).
    coding : {"entropy", "fixed"}
        ``entropy`` (default) codes the symbols with one table per dither context; ``fixed`` packs
        them at ``bit_width(2h + 1)`` bits (same values, many more bits).
    keep : float, optional
        Below one bit: send a shared-seed subsample of this fraction of the rotated coordinates,
        at ``bits / keep`` bits per kept coordinate (``bits`` stays the whole tensor's rate), and
        decode the kept values scaled by ``1 / keep``, zeros elsewhere
        (:mod:`~fedquant.codecs.quantizers.subsample`). Unbiased, vNMSE ``(1 + D) / keep - 1``
        for the kept coordinates' ``D``. None (default) or 1: every coordinate, today's bytes.

    Notes
    -----
    Unbiased for every input and seed-reproducible; the decoder regenerates the dither from the
    seed. See the module docstring for the wire layout and the rate theory.
    """

    name = "ecdq"
    params: ClassVar[dict[str, Param]] = {
        "bits": Param(float, 1.0, "target bits per coordinate on Gaussian data, real in (0, 8]", 0.0, MAX_BITS),
        "lattice": Param(str, "auto", "e8 (blocks of 8), z (scalar) or auto (e8 for large tensors)", choices=LATTICES),
        "keep": Param(float, None, "fraction of the rotated coordinates sent, real in (0, 1]", subsample.MIN_KEEP, 1.0),
    }
    codings = ("entropy", "fixed")
    implied_transforms: ClassVar[tuple[str, ...]] = ("rht",)
    unbiased = True
    own_stream = True
    paper = "Zamir & Feder 1992 (ECDQ); subtractive dither, Schuchman 1964; E8: Conway & Sloane"
    wire = "float32 step, uint16 index range, lattice indices entropy-coded per dither context (or fixed width)"

    def _validate(self) -> None:
        if not self.bits > 0:
            raise ValueError(f"ecdq: parameter 'bits' must be > 0 (bits per coordinate), got {self.bits!r}")
        if self.keep == 1.0:  # every coordinate: the spec (and the bytes) of no subsample
            object.__setattr__(self, "keep", None)
            self._config["keep"] = None
        rate = self.coded_bits
        if self.keep is not None and rate > MAX_BITS:
            raise ValueError(
                f"ecdq: parameter 'keep' must be >= bits / {MAX_BITS:g} = {self.bits / MAX_BITS:.4g} (bits / keep, the"
                f" rate of the kept coordinates, is at most {MAX_BITS:g}), got {self.keep!r}"
            )
        if self.lattice == "e8" and rate < E8_RATES[-1][1]:
            raise ValueError(
                f"ecdq: lattice=e8 reaches {E8_RATES[-1][1]:.2f} bits at the least; use lattice=z for bits={self.bits}"
                + (f", keep={self.keep}" if self.keep is not None else "")
            )
        kinds = (self.lattice,) if self.lattice != "auto" else ("z", "e8") if rate >= E8_MIN_BITS else ("z",)
        self.constants = {k: step_constant(rate, k) for k in kinds}  # the step constant c per lattice

    @property
    def coded_bits(self) -> float:
        """Bits per coded coordinate: ``bits``, or ``bits / keep`` on the kept coordinates of a subsample."""
        return self.bits if self.keep is None else self.bits / self.keep

    def kept_count(self, numel: int) -> int:
        """The expected number of coded coordinates of a rotated tensor of ``numel`` (all without ``keep``)."""
        return numel if self.keep is None else round(subsample.probability(self.keep) * numel)

    def _subsampled(self, kept_error: float) -> float:
        """vNMSE of the tensor when its kept coordinates have ``kept_error``: ``(1 + D) / p - 1``."""
        return kept_error if self.keep is None else (1 + kept_error) / subsample.probability(self.keep) - 1

    def lattice_for(self, n: int) -> str:
        """The lattice a rotated tensor of ``n`` elements is quantized on (``auto``: by rate and size)."""
        if self.lattice != "auto":
            return self.lattice
        return "e8" if "e8" in self.constants and n >= E8_MIN_NUMEL else "z"

    # ------------------------------------------------------------------ declarations
    def vnmse(self, n: int | None = None) -> float:
        """Error variance per coordinate over ``||y||^2 / n`` for a rotated tensor of ``n`` elements
        (default: a large one): ``G c**2``, exact for every input whose largest rotated coordinate is
        below about ``H_MAX c`` times the RMS (beyond, the step grows); with ``keep``, ``(1 + G c**2) / keep - 1``
        in expectation over the mask."""
        kind = self.lattice_for(self.kept_count(n)) if n is not None else "e8" if "e8" in self.constants else "z"
        return self._subsampled(SECOND_MOMENT[kind] * self.constants[kind] ** 2)

    def error_bound(self, numel: int) -> float:
        """``omega``, the largest ``E||Q(x) - x||^2 / ||x||^2`` over every ``x`` of ``numel`` elements.

        ``G step**2`` per element with ``step = max(c rms, max|x| / (H_MAX - 4))`` and
        ``max|x|**2 <= ||x||**2``: ``G max(c**2, numel / (H_MAX - 4)**2)``, with a margin for the
        float32 rounding of the step. The first term holds for tensors below about
        ``1e9 c**2`` elements.
        """
        kinds = (self.lattice_for(numel),) if self.keep is None else tuple(self.constants)  # the mask sets the lattice
        kept = max(SECOND_MOMENT[k] * max(self.constants[k] ** 2, numel / (H_MAX - 4) ** 2) for k in kinds)
        return self._subsampled(kept * (1 + 2.0**-20))

    def expected_error(self, flat: torch.Tensor) -> float:
        """Exact for this (rotated) input: ``G n step**2 / ||x||**2`` with the step the encoder will use
        (the error is independent of the input; 0 for a zero tensor). With ``keep``: ``(1 + that) / p - 1``,
        the expectation over the mask (the step taken from the whole tensor's RMS)."""
        n = flat.numel()
        if self.uses_kernels(flat):
            sumsq, maxabs = kernels.norm_and_max(np.ascontiguousarray(flat.numpy()))
        else:
            sumsq, maxabs = kernels.torch_norm_and_max(flat)
        kind = self.lattice_for(self.kept_count(n))
        step, _ = self.step_for(float(sumsq), float(maxabs), n, kind)
        return self._subsampled(SECOND_MOMENT[kind] * n * step * step / float(sumsq)) if step else 0.0

    def num_symbols(self) -> int:
        return 0  # the alphabet is the tensor's own (2h + 1), in its own symbol section

    def side_fields(self, numel: int) -> list[SideField]:
        fields = [SideField("ECDQ step", "<f4", 1), SideField("index range", "<u2", 1)]
        if self.coding == "entropy":
            fields.append(SideField("dither contexts (log2)", "<u1", 1))
        return fields

    def check_side(self, side: list[np.ndarray]) -> None:
        step = float(side[0][0])
        if not (math.isfinite(step) and step >= 0):
            raise PayloadError(f"ecdq payload has an invalid step {step!r}")
        if int(side[1][0]) > H_MAX:
            raise PayloadError(f"ecdq payload declares an index range {int(side[1][0])}, beyond {H_MAX}")
        if self.coding == "entropy" and int(side[2][0]) > kernels.FINE_BITS:
            raise PayloadError(f"ecdq payload declares 2**{int(side[2][0])} dither contexts, at most {kernels.FINE}")

    # ------------------------------------------------------------------ size model
    @property
    def size_model(self) -> str:
        return "estimate"  # the index range and the stream follow the values, at either coding

    def body_bytes(self, numel: int) -> int:
        """Bytes of the body for ``numel`` rotated Gaussian coordinates (an estimate, see :attr:`size_model`).

        The index range is the median of the largest ``|q|`` on ``n`` Gaussian coordinates
        (:func:`typical_index_range`; E8 one more). Fixed width packs at ``bit_width(2h + 1)``
        bits (E8: and a coset bit per block), so a range at the edge of a power of two may cost
        one bit per coordinate more; entropy coding takes ``bits`` per coordinate (the rate ``c``
        is set for) plus, per stage, one count table of the ``2h + 1`` symbols.
        """
        side = sum(f.count * np.dtype(f.dtype).itemsize for f in self.side_fields(numel))
        numel = self.kept_count(numel)
        if numel == 0:
            return side
        kind = self.lattice_for(numel)
        n = -(-numel // 8) * 8 if kind == "e8" else numel
        h = typical_index_range(n, self.constants[kind]) + (kind == "e8")
        if self.coding == "fixed":
            cosets = packed_size(n // 8, 1) if kind == "e8" else 0
            return side + cosets + packed_size(n, bit_width(2 * h + 1))
        stages = [(n // 8, 2), (n - n // 8, 2 * h + 1), (n // 8, 2 * h + 1)] if kind == "e8" else [(n, 2 * h + 1)]
        tables = sum(_table_bits(count, alphabet) for count, alphabet in stages)
        return side + math.ceil((n * self.coded_bits + tables) / 8)

    # ------------------------------------------------------------------ the step
    def step_for(self, sumsq: float, maxabs: float, n: int, kind: str | None = None) -> tuple[float, float]:
        """``(step, 1 / step)`` as float64 values of the float32 step sent; ``(0, 0)`` for a zero tensor.

        ``c`` (of the tensor's lattice, or of ``kind``) times the RMS, rounded to float32, at least
        ``maxabs / (H_MAX - 4)`` so that ``h <= H_MAX``. ValueError if the decoded values (with
        ``keep``: times ``1 / p``) could overflow float32.
        """
        if n == 0 or maxabs == 0:
            return 0.0, 0.0
        step = self.constants[kind or self.lattice_for(n)] * math.sqrt(sumsq / n)
        limit = FLOAT32_MAX if self.keep is None else FLOAT32_MAX * subsample.probability(self.keep)
        if step > FLOAT32_MAX or maxabs + 3 * step > limit:
            raise ValueError("ecdq.encode: values within a few steps of the float32 range cannot be quantized")
        step = float(np.float32(step))
        floor = maxabs / (H_MAX - 4)
        if step < floor:  # the smallest float32 at or above the floor
            rounded = np.float32(floor)
            step = float(rounded if float(rounded) >= floor else np.nextafter(rounded, np.float32(np.inf)))
        step = max(step, _TINY32)
        if not math.isfinite(step) or maxabs + 3 * step > limit:
            raise ValueError("ecdq.encode: values within a few steps of the float32 range cannot be quantized")
        return step, 1.0 / step

    def _histogram_bound(self, h: int, kind: str) -> bool:
        return self.coding == "entropy" and h <= HIST_MAX_H[kind]

    # ------------------------------------------------------------------ encode
    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        kernel = self.uses_kernels(flat)
        if self.keep is not None:  # the kept coordinates, in order; the dither is theirs (positions 0..m-1)
            flat = flat[subsample.kept_mask(seed, flat.numel(), self.keep, kernel=kernel, device=flat.device)]
        n = flat.numel()
        if kernel:
            y = np.ascontiguousarray(flat.numpy())
            sumsq, maxabs = kernels.norm_and_max(y)
        else:
            y = flat
            sumsq, maxabs = kernels.torch_norm_and_max(flat)
        step, inv = self.step_for(float(sumsq), float(maxabs), n)
        if self.lattice_for(n) == "z":
            side, stream = (self._z_kernel if kernel else self._z_torch)(y, float(maxabs), inv, seed)
        else:
            side, stream = self._e8_kernel(y, float(maxabs), inv, seed) if kernel else self._e8_torch(y, inv, seed)
        return Quantized([np.array([step], np.float32), *side], stream=stream)

    def _side(self, h: int, log2k: int) -> list[np.ndarray]:
        if h > H_MAX:
            raise RuntimeError(f"ecdq: index range {h} beyond {H_MAX} despite the step floor")
        side = [np.array([h], np.uint16)]
        return [*side, np.array([log2k], np.uint8)] if self.coding == "entropy" else side

    def _z_kernel(self, y: np.ndarray, maxabs: float, inv: float, seed: int):
        n, key = y.size, kernel_key(seed)
        half = int(maxabs * inv) + 2  # bounds |q|
        half = half if self._histogram_bound(half, "z") else -1
        groups = max(1, min(HIST_GROUPS["z"], kernels.num_chunks(n)))
        h, fine_counts, hist = kernels.scan(y, inv, key, half, groups)
        h = int(h)
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            out = np.zeros(packed_size(n, width), np.uint8)
            kernels.pack(y, inv, key, h, width, out)
            return self._side(h, 0), [out]
        log2k, counts = 0, None
        if half >= 0:
            hist = hist[:, half - h : half + h + 1]
            log2k = choose_contexts(hist, SCALAR)
            counts = SCALAR.folded(hist, log2k)
        table, _ = SCALAR.tables(log2k)
        offsets, sizes = chunk_offsets(fine_counts, table, SCALAR.num_tables(log2k))
        symbols = np.empty(n, _symbol_dtype(2 * h + 1))
        kernels.order_symbols(y, inv, key, h, table, kernels.fold_signs(log2k), offsets, sizes, symbols)
        stream: list[np.ndarray] = []
        write_stage(stream, symbols, sizes, 2 * h + 1, counts)
        return self._side(h, log2k), stream

    def _z_torch(self, flat: torch.Tensor, maxabs: float, inv: float, seed: int):
        n = flat.numel()
        u, bins = kernels.torch_dither(seed, n, flat.device)
        q = kernels.torch_indices(flat, inv, u)
        h = int(q.abs().max()) if n else 0
        if self.coding == "fixed":
            symbols = (q + h).to(torch.int32).cpu().numpy().astype(np.uint16)
            return self._side(h, 0), [pack_bits(symbols, bit_width(2 * h + 1))]
        half = int(maxabs * inv) + 2
        log2k = 0
        if n and self._histogram_bound(half, "z"):
            log2k = choose_contexts(kernels.torch_histogram(bins, q, half)[:, half - h : half + h + 1], SCALAR)
        table, _ = SCALAR.tables(log2k)
        _, sizes = chunk_offsets(kernels.torch_fine_counts(bins, kernels.FINE, n), table, SCALAR.num_tables(log2k))
        order, flipped = kernels.torch_table_order(bins, log2k)
        symbols = torch.where(flipped, h - q, h + q)[order].to(torch.int32).cpu().numpy().astype(np.uint16)
        stream: list[np.ndarray] = []
        write_stage(stream, symbols, sizes, 2 * h + 1)
        return self._side(h, log2k), stream

    def _e8_kernel(self, y: np.ndarray, maxabs: float, inv: float, seed: int):
        key = kernel_key(seed)
        y = _padded8(y)
        n = y.size
        m = np.empty(n, np.int16)  # k-major per chunk (e8.lattice_counts)
        coset = np.empty(n // 8, np.uint8)
        off = int(maxabs * inv) + 4  # |lambda_k - t_k| <= 1 and 0 <= t_k - y_k inv < 2: bounds |m| + 1 and h + 1
        width = 2 * off + 1 if self._histogram_bound(off, "e8") else 0
        groups = max(1, min(HIST_GROUPS["e8"], kernels.num_chunks(n)))
        top, fine_counts, hist = e8.lattice_counts(y, inv, key, off, width, groups, m, coset)
        h = (int(top) + 1) // 2
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            out = np.zeros(packed_size(n, width), np.uint8)
            e8.pack_kmajor(m, coset, h, width, out)
            return self._side(h, 0), [pack_bits(coset, 1), out]
        with_hist = self._histogram_bound(h, "e8") and n > 0
        if with_hist and not width:  # the a-priori bound was too wide; h is within it: count again
            off = h + 1
            _, fine_counts, hist = e8.lattice_counts(y, inv, key, off, 2 * off + 1, groups, m, coset)
        fine_counts, hist = e8.symbol_parity(fine_counts, hist if with_hist else None, h, off)
        log2k, counts = 0, None
        if with_hist:
            log2k = choose_contexts(hist, e8.E8)
            counts = e8.E8.folded(hist, log2k)
        table, flipped = e8.E8.tables(log2k)
        offsets, sizes = chunk_offsets(fine_counts, table, e8.E8.num_tables(log2k))
        symbols = np.empty(n, _symbol_dtype(2 * h + 1))
        e8.order_kmajor(m, coset, key, h, table, *e8.folding(h, log2k), offsets, sizes, symbols)
        return self._side(h, log2k), _e8_stages(coset, symbols, sizes, h, counts)

    def _e8_torch(self, flat: torch.Tensor, inv: float, seed: int):
        y = _padded8(flat)
        n = y.numel()
        z, bins = e8.torch_uniforms(seed, n, y.device)
        m, coset = e8.torch_lattice(y, inv, z)
        h = (int((2 * m + coset.unsqueeze(1) - 2).abs().max()) + 1) // 2 if n else 0
        s = (m + h - 1).reshape(-1)
        cosets = coset.to(torch.uint8).cpu().numpy()
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            return self._side(h, 0), [pack_bits(cosets, 1), pack_bits(s.to(torch.int32).cpu().numpy(), width)]
        contexts = e8.torch_fine_contexts(m, coset, bins, h)
        log2k = 0
        if n and self._histogram_bound(h, "e8"):
            width = 2 * h + 1
            hist = torch.bincount(contexts * width + s, minlength=e8.E8.size * width).view(-1, width)
            log2k = choose_contexts(hist.cpu().numpy(), e8.E8)
        table, _ = e8.E8.tables(log2k)
        sizes = np.bincount(table[contexts.cpu().numpy()], minlength=e8.E8.num_tables(log2k))
        order, flipped = kernels.torch_table_order(contexts, log2k, e8.E8)
        b = coset.repeat_interleave(8)
        coded = torch.where(flipped, 2 * h - b - s, s)[order].to(torch.int32).cpu().numpy().astype(np.uint16)
        return self._side(h, log2k), _e8_stages(cosets, coded, sizes, h)

    # ------------------------------------------------------------------ decode
    def dequantize(self, side, symbols, numel, seed) -> torch.Tensor:
        raise NotImplementedError("ecdq decodes its own symbol section (read_stream)")

    def max_stream_bytes(self, numel: int) -> int:
        """With ``keep``, any count up to ``numel`` may be kept, on either lattice the rate allows."""
        kinds = (self.lattice_for(numel),) if self.keep is None else tuple(self.constants)
        return max(self._max_stream_bytes(numel, kind) for kind in kinds)

    def _max_stream_bytes(self, numel: int, kind: str) -> int:
        width = bit_width(2 * H_MAX + 1)
        if kind == "z":
            symbols, tables, fixed = numel, SCALAR.num_tables(kernels.FINE_BITS), packed_size(numel, width)
        else:  # a coset stage of one symbol per block, then the 8 coordinates of every block
            n, blocks = -(-numel // 8) * 8, -(-numel // 8)
            symbols, tables = blocks + n, 1 + e8.E8.num_tables(kernels.FINE_BITS)
            fixed = packed_size(blocks, 1) + packed_size(n, width)
        if self.coding == "fixed":
            return fixed
        sections = min(tables, symbols)  # only non-empty tables are written, each after its uint32 length
        return 4 * sections + max_entropy_bytes(symbols, 2 * H_MAX + 1, sections)

    def read_stream(self, side: list[np.ndarray], body: BodyReader, numel: int, seed: int) -> torch.Tensor:
        if self.keep is None:
            return self._read_coded(side, body, numel, seed)
        mask = subsample.kept_mask(seed, numel, self.keep, kernel=self.uses_kernels())
        return subsample.expand(self._read_coded(side, body, int(mask.sum()), seed), mask, self.keep)

    def _read_coded(self, side: list[np.ndarray], body: BodyReader, numel: int, seed: int) -> torch.Tensor:
        """The ``numel`` coded values (every coordinate, or the kept ones)."""
        step = float(side[0][0])
        h = int(side[1][0])
        log2k = int(side[2][0]) if self.coding == "entropy" else 0
        if self.lattice_for(numel) == "z":
            read = self._z_read_kernel if self.uses_kernels() else self._z_read_torch
            return read(body, numel, seed, step, h, log2k)
        n = -(-numel // 8) * 8
        read = self._e8_read_kernel if self.uses_kernels() else self._e8_read_torch
        return read(body, n, seed, step, h, log2k)[:numel]

    def _z_read_kernel(self, body: BodyReader, n: int, seed: int, step: float, h: int, log2k: int) -> torch.Tensor:
        key = kernel_key(seed)
        out = output_array(n)
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            bad = kernels.values_from_packed(read_packed(body, n, width, "indices"), width, out, key, step, h)
            _refuse(bad, "indices beyond the declared range")
            return torch.from_numpy(out)
        table, _ = SCALAR.tables(log2k)
        offsets, sizes = chunk_offsets(kernels.count_bins(n, key), table, SCALAR.num_tables(log2k))
        symbols = read_stage(body, sizes, 2 * h + 1)
        kernels.values_from_tables(symbols, key, step, h, table, kernels.fold_signs(log2k), offsets, sizes, out)
        return torch.from_numpy(out)

    def _z_read_torch(self, body: BodyReader, n: int, seed: int, step: float, h: int, log2k: int) -> torch.Tensor:
        u, bins = kernels.torch_dither(seed, n, "cpu")
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            codes = torch.from_numpy(unpack_bits(read_packed(body, n, width, "indices"), width, n).astype(np.int64))
            _refuse(int((codes > 2 * h).sum()), "indices beyond the declared range")
            return kernels.torch_values(codes - h, u, step)
        table, _ = SCALAR.tables(log2k)
        _, sizes = chunk_offsets(kernels.torch_fine_counts(bins, kernels.FINE, n), table, SCALAR.num_tables(log2k))
        symbols = read_stage(body, sizes, 2 * h + 1)
        order, flipped = kernels.torch_table_order(bins, log2k)
        s = torch.empty(n, dtype=torch.int64)
        s[order] = torch.from_numpy(symbols.astype(np.int64))
        return kernels.torch_values(torch.where(flipped, h - s, s - h), u, step)

    def _e8_read_kernel(self, body: BodyReader, n: int, seed: int, step: float, h: int, log2k: int) -> torch.Tensor:
        key = kernel_key(seed)
        blocks = n // 8
        out = output_array(n)
        if self.coding == "fixed":
            coset = unpack_bits(read_packed(body, blocks, 1, "cosets"), 1, blocks).astype(np.uint8)
            width = bit_width(2 * h + 1)
            packed = read_packed(body, n, width, "indices")
            bad = e8.values_from_packed(packed, width, coset, out, key, h, step)
            _refuse(bad, "indices beyond the declared range or blocks of odd sum")
            return torch.from_numpy(out)
        coset = read_stage(body, np.array([blocks], np.int64), 2)
        table, _ = e8.E8.tables(log2k)
        base, sign = e8.folding(h, log2k)
        tables = e8.E8.num_tables(log2k)
        offsets, sizes = chunk_offsets(e8.count_first(coset, key, n), table, tables)
        first = read_stage(body, sizes[: tables // 2], 2 * h + 1)
        m = np.empty(n, np.int16)
        fine_last, bad = e8.place_first(first, coset, key, h, table, base, sign, offsets, sizes, m)
        offsets, sizes = chunk_offsets(fine_last, table, tables)
        last = read_stage(body, sizes[tables // 2 :], 2 * h + 1)
        bad += e8.finish(last, coset, key, h, step, table, base, sign, offsets, sizes, m, out)
        _refuse(bad, "symbols beyond the declared range or of the wrong parity")
        return torch.from_numpy(out)

    def _e8_read_torch(self, body: BodyReader, n: int, seed: int, step: float, h: int, log2k: int) -> torch.Tensor:
        blocks = n // 8
        z, bins = e8.torch_uniforms(seed, n, "cpu")
        if self.coding == "fixed":
            coset = torch.from_numpy(unpack_bits(read_packed(body, blocks, 1, "cosets"), 1, blocks).astype(np.int64))
            width = bit_width(2 * h + 1)
            packed = read_packed(body, n, width, "indices")
            s = torch.from_numpy(unpack_bits(packed, width, n).astype(np.int64)).view(-1, 8)
            m = s - h + 1
            bad = int((s > 2 * h - coset.unsqueeze(1)).sum()) + int((m.sum(1) & 1).sum())
            _refuse(bad, "indices beyond the declared range or blocks of odd sum")
            return e8.torch_values(m, coset, z, step)
        coset = torch.from_numpy(read_stage(body, np.array([blocks], np.int64), 2).astype(np.int64))
        tables = e8.E8.num_tables(log2k)
        contexts = (bins.view(blocks, 8) + coset.unsqueeze(1) * kernels.FINE).mul_(2)  # group 0, parity 0
        top = 2 * h - coset.unsqueeze(1)  # the largest symbol of each block's coset
        m = torch.empty(blocks, 8, dtype=torch.int64)
        first = slice(0, tables // 2)
        m[:, :7], bad = self._torch_stage(body, contexts[:, :7], top.expand(blocks, 7), h, log2k, first)
        parity = m[:, :7].sum(1) & 1
        contexts = contexts[:, 7:] + 4 * kernels.FINE + ((parity + h - 1) & 1).unsqueeze(1)  # the symbol's parity
        m[:, 7:], more = self._torch_stage(body, contexts, top, h, log2k, slice(tables // 2, None))
        bad += more + int(((m[:, 7] - parity) & 1).sum())
        _refuse(bad, "symbols beyond the declared range or of the wrong parity")
        return e8.torch_values(m, coset, z, step)

    def _torch_stage(self, body, contexts, top, h, log2k, stage) -> tuple[torch.Tensor, int]:
        """One stage of E8 symbols for the elements of fine ``contexts`` (blocks, k) whose largest symbol is
        ``top``: their ``m`` (blocks, k) and how many symbols are out of range."""
        shape = contexts.shape
        contexts = contexts.reshape(-1)  # element order
        table, _ = e8.E8.tables(log2k)
        sizes = np.bincount(table[contexts.numpy()], minlength=e8.E8.num_tables(log2k))[stage]
        coded = torch.from_numpy(read_stage(body, sizes, 2 * h + 1).astype(np.int64))
        order, flipped = kernels.torch_table_order(contexts, log2k, e8.E8)
        code = torch.empty(contexts.numel(), dtype=torch.int64)
        code[order] = coded
        top = top.reshape(-1)
        s = torch.where(flipped, top - code, code)
        return (s - h + 1).view(shape), int((code > top).sum())


def _table_bits(count: int, alphabet: int) -> int:
    """Bits of one table beside its symbols' information: every symbol present (gaps of 1), even counts."""
    present = min(alphabet, count)
    return TABLE_OVERHEAD_BITS + omega_bits(present) + present * (1 + omega_bits(max(1, count // present)))


def _padded8(y):
    """``y`` (NumPy or torch) with zeros appended up to a multiple of 8 elements."""
    pad = -y.shape[0] % 8
    if not pad:
        return y
    if isinstance(y, np.ndarray):
        return np.concatenate([y, np.zeros(pad, y.dtype)])
    return torch.cat([y, y.new_zeros(pad)])


def _e8_stages(
    coset: np.ndarray, symbols: np.ndarray, sizes: np.ndarray, h: int, counts: np.ndarray | None = None
) -> list[np.ndarray]:
    """The three stages of E8's entropy-coded section: cosets, coordinates 1-7, coordinate 8
    (``counts``: each table's histogram, if the encoder took them)."""
    stream: list[np.ndarray] = []
    tables = sizes.size
    write_stage(stream, coset, np.array([coset.size], np.int64), 2)
    first = int(sizes[: tables // 2].sum())
    half = (None, None) if counts is None else (counts[: tables // 2], counts[tables // 2 :])
    write_stage(stream, symbols[:first], sizes[: tables // 2], 2 * h + 1, half[0])
    write_stage(stream, symbols[first:], sizes[tables // 2 :], 2 * h + 1, half[1])
    return stream


def _symbol_dtype(alphabet: int) -> type:
    """Bytes for alphabets up to 256: the entropy coder's vector rounds take uint8 symbols only."""
    return np.uint8 if alphabet <= 256 else np.uint16


def _refuse(bad: int, what: str) -> None:
    if bad:
        raise PayloadError(f"ecdq payload holds {int(bad)} {what}")
