"""ECDQ: entropy-coded subtractive dithered quantization with a dither-conditioned model (``ecdq:bits=B``).

Always behind ``rht+`` (rotated coordinates are close to iid Gaussian). One step per tensor,
``step = c(B) ||y|| / sqrt(n)``; each coordinate ``y_i`` gets the index
``q_i = round(y_i / step + u_i)`` with a subtractive dither ``u_i ~ U[-1/2, 1/2)`` from the
seed, and the decoder returns ``step (q_i - u_i)``. The error ``step (q_i - u_i) - y_i`` is
uniform on ``[-step/2, step/2]`` and independent of the input (Schuchman 1964), so

* the estimate is **unbiased for every input** (no averaging over rotations needed), and
* its error is known exactly: vNMSE ``= c**2 / 12`` (times ``numel / n`` after the rotation's
  padding), whatever the data: :meth:`ECDQQuantizer.vnmse`, the codec's ``omega`` for
  error feedback.

Rate. The decoder knows the dither, so the index is coded **given the dither**: the rate of an
ideal coder is ``H(Q | U) = I(X; X + N)`` with ``N`` uniform over a step (Zamir & Feder 1992),
which on Gaussian coordinates is within ``1/2 log2(2 pi e / 12) = 0.254`` bits of the unbiased
rate–distortion bound ``1/2 log2(1 + 1/vNMSE)`` (the space-filling loss of a scalar cell). The
step constant ``c(B)`` solves ``I(X; X + c N) = B`` for ``X ~ N(0, 1)``
(:func:`gaussian_rate`); the payload then measures about ``B + 0.005`` bits per coordinate on
Gaussian data (contexts, tables, envelope), less on heavier-tailed rotated data, with the same
error.

Entropy model (``coding=entropy``). Each coordinate's dither falls in one of ``K = 2**log2k``
equal bins (its uniform's top bits); contexts ``k`` and ``K - 1 - k`` share one table, the
index negated in the upper one (``p(q | u) = p(-q | -u)`` for symmetric coordinates), and each
of the ``K / 2`` tables (one for ``K = 1``) is an exact count table + rANS section of
:func:`fedquant.wire.entropy.entropy_encode`, its symbols in element order. The encoder
measures the fine histogram of (dither bin, index) in its first pass and picks the ``K`` in
1..64 that gives the fewest bits (information plus table costs): large tensors at low rates
take many contexts, small tensors or high rates few. ``coding=fixed`` packs the same indices at
``bit_width(2h + 1)`` bits, ``h`` the largest ``|q|``.

Wire layout (body)::

    step        float32     (0 for an all-zero tensor)
    h           uint16      largest |index| (indices in -h..h, symbols q + h in 0..2h)
    entropy:    uint8       log2k (0..6)
                uint32[T]   byte length of each table's section (T = max(1, K / 2))
                T sections  entropy_encode of the table's symbols (q + h, or h - q in folded
                            contexts), element order
    fixed:      uint8[packed_size(n, bit_width(2h + 1))]   symbols q + h, LSB first

The step keeps ``|q| <= H_MAX`` (for inputs whose largest coordinate exceeds ``H_MAX c`` times
the RMS, a larger step than ``c`` RMS is used, and the error is larger). Implementations: the
numba kernels of :mod:`fedquant.codecs.kernels.ecdq` on CPU tensors, their torch twins on CUDA
(and with ``force_torch``); both give the same bytes (the float64 sum of squares is taken in
different orders, so the float32 step could differ when the two sums straddle a float32
rounding boundary, with probability about ``2**-29``).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import numpy as np
import torch

from fedquant.codecs.kernels import ecdq as kernels
from fedquant.codecs.kernels.common import kernel_key
from fedquant.codecs.params import Param
from fedquant.codecs.quantizers.base import Quantized, Quantizer, SideField
from fedquant.errors import PayloadError
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader
from fedquant.wire.entropy import entropy_decode, entropy_encode

MAX_BITS = 8.0
#: Largest index magnitude: symbols 0..2 H_MAX fit 16 bits and the entropy coder's alphabet.
H_MAX = (1 << 15) - 1
#: The encoder measures the (dither bin, index) histogram for its choice of contexts while
#: ``|q|`` stays within this bound (else it codes one context).
HIST_MAX_HALF = 512
#: Chunk groups of the histogram pass (each holds its own histogram).
HIST_GROUPS = 16
FLOAT32_MAX = float(np.finfo(np.float32).max)
_TINY32 = float(np.finfo(np.float32).smallest_subnormal)
#: Bits each table costs besides its symbols and counts: the uint32 length, the rANS final state.
TABLE_OVERHEAD_BITS = 32 + 64


# ---------------------------------------------------------------- the rate of ECDQ on Gaussian data
@functools.cache
def gaussian_rate(c: float) -> float:
    """``I(X; X + c N)`` in bits for ``X ~ N(0, 1)``, ``N ~ U[-1/2, 1/2]``: ECDQ's ``H(Q | U)``.

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


@functools.cache
def step_constant(bits: float) -> float:
    """``c`` with ``gaussian_rate(c) = bits`` (bisection on ``log c``; the rate falls as ``c`` grows)."""
    lo, hi = math.log(1e-4), math.log(1e3)
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        if gaussian_rate(math.exp(mid)) > bits:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


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
    """Estimated bits of the entropy-coded section for counts ``tables`` ``(T, alphabet)``: each
    table's information ``n H``, its count table (Elias omega of the gaps and counts) and
    ``TABLE_OVERHEAD_BITS``."""
    total = float(TABLE_OVERHEAD_BITS * tables.shape[0])
    for counts in tables:
        present = np.flatnonzero(counts)
        if not present.size:
            continue
        c = counts[present].astype(np.float64)
        n = c.sum()
        total += float(n * math.log2(n) - (c * np.log2(c)).sum())
        gaps = np.diff(present, prepend=-1)
        total += float(_omega_bits(np.array([present.size])).sum() + _omega_bits(gaps).sum())
        total += float(_omega_bits(counts[present]).sum())
    return total


def folded_tables(hist: np.ndarray, log2k: int) -> np.ndarray:
    """Counts per table ``(T, alphabet)`` for ``2**log2k`` contexts from the fine histogram ``(FINE, alphabet)``."""
    table, flipped = kernels.fine_to_table(log2k)
    out = np.zeros((kernels.tables_of(log2k), hist.shape[1]), np.int64)
    for b in range(kernels.FINE):
        out[table[b]] += hist[b, ::-1] if flipped[b] else hist[b]
    return out


def choose_contexts(hist: np.ndarray) -> int:
    """``log2k`` (0..6) whose tables code the histogram ``(FINE, 2h + 1)`` in the fewest bits."""
    costs = [coded_bits(folded_tables(hist, k)) for k in range(kernels.FINE_BITS + 1)]
    return int(np.argmin(costs))


# ---------------------------------------------------------------- the quantizer
class ECDQQuantizer(Quantizer):
    """Entropy-coded dithered quantization: one step per tensor, subtractive dither, a model given the dither.

    Parameters
    ----------
    bits : float
        Target rate in bits per coordinate on Gaussian (rotated) data, in ``(0, 8]``: sets the
        step constant ``c`` (``step = c ||y|| / sqrt(n)``, vNMSE ``c**2 / 12``). The error is fixed
        by ``bits`` on any data; the rate follows the data (heavier tails after the rotation
        cost fewer bits).
    coding : {"entropy", "fixed"}
        ``entropy`` (default) codes the indices with one table per dither context; ``fixed`` packs
        them at ``bit_width(2h + 1)`` bits (same values, many more bits).

    Notes
    -----
    Unbiased for every input and seed-reproducible; the decoder regenerates the dither from the
    seed. See the module docstring for the wire layout and the rate theory.
    """

    name = "ecdq"
    params: ClassVar[dict[str, Param]] = {
        "bits": Param(float, 1.0, "target bits per coordinate on Gaussian data, real in (0, 8]", 0.0, MAX_BITS),
    }
    codings = ("entropy", "fixed")
    implied_transforms: ClassVar[tuple[str, ...]] = ("rht",)
    unbiased = True
    own_stream = True
    paper = "Zamir & Feder 1992 (ECDQ); subtractive dither, Schuchman 1964"
    wire = "float32 step, uint16 largest index, indices entropy-coded per dither context (or fixed width)"

    def _validate(self) -> None:
        if not self.bits > 0:
            raise ValueError(f"ecdq: parameter 'bits' must be > 0 (bits per coordinate), got {self.bits!r}")
        self.c = step_constant(self.bits)

    # ------------------------------------------------------------------ declarations
    def vnmse(self) -> float:
        """Error variance per coordinate over ``||y||^2 / n``: ``c**2 / 12``, exact for every input whose
        largest rotated coordinate is below ``H_MAX c`` times the RMS (else smaller steps would overflow
        the index range and the step grows)."""
        return self.c * self.c / 12.0

    def num_symbols(self) -> int:
        return 0  # the alphabet is the tensor's own (2h + 1), in its own symbol section

    def side_fields(self, numel: int) -> list[SideField]:
        fields = [SideField("ECDQ step", "<f4", 1), SideField("largest index", "<u2", 1)]
        if self.coding == "entropy":
            fields.append(SideField("dither contexts (log2)", "<u1", 1))
        return fields

    def check_side(self, side: list[np.ndarray]) -> None:
        step = float(side[0][0])
        if not (math.isfinite(step) and step >= 0):
            raise PayloadError(f"ecdq payload has an invalid step {step!r}")
        if int(side[1][0]) > H_MAX:
            raise PayloadError(f"ecdq payload declares indices up to {int(side[1][0])}, beyond {H_MAX}")
        if self.coding == "entropy" and int(side[2][0]) > kernels.FINE_BITS:
            raise PayloadError(f"ecdq payload declares 2**{int(side[2][0])} dither contexts, at most {kernels.FINE}")

    # ------------------------------------------------------------------ the step
    def step_for(self, sumsq: float, maxabs: float, n: int) -> tuple[float, float]:
        """``(step, 1 / step)`` as float64 values of the float32 step sent; ``(0, 0)`` for a zero tensor.

        ``c`` times the RMS, rounded to float32, at least ``maxabs / (H_MAX - 1)`` so that
        ``|q| <= H_MAX``. ValueError if the decoded values could overflow float32.
        """
        if n == 0 or maxabs == 0:
            return 0.0, 0.0
        step = float(np.float32(self.c * math.sqrt(sumsq / n)))
        floor = maxabs / (H_MAX - 1)
        if step < floor:  # the smallest float32 at or above the floor
            rounded = np.float32(floor)
            step = float(rounded if float(rounded) >= floor else np.nextafter(rounded, np.float32(np.inf)))
        step = max(step, _TINY32)
        if not math.isfinite(step) or step * (maxabs / step + 1.5) > FLOAT32_MAX:
            raise ValueError("ecdq.encode: values within a few steps of the float32 range cannot be quantized")
        return step, 1.0 / step

    # ------------------------------------------------------------------ encode
    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        n = flat.numel()
        if self.uses_kernels(flat):
            y = np.ascontiguousarray(flat.numpy())
            sumsq, maxabs = kernels.norm_and_max(y)
            step, inv = self.step_for(float(sumsq), float(maxabs), n)
            return self._encode_kernel(y, float(maxabs), step, inv, kernel_key(seed))
        sumsq, maxabs = kernels.torch_norm_and_max(flat)
        step, inv = self.step_for(sumsq, maxabs, n)
        return self._encode_torch(flat, maxabs, step, inv, seed)

    def _hist_half(self, maxabs: float, inv: float) -> int:
        """Bound on ``|q|`` for the histogram pass, or -1 to skip the histogram."""
        if self.coding != "entropy":
            return -1
        bound = int(maxabs * inv) + 2
        return bound if bound <= HIST_MAX_HALF else -1

    def _encode_kernel(self, y: np.ndarray, maxabs: float, step: float, inv: float, key: np.uint64) -> Quantized:
        n = y.size
        half = self._hist_half(maxabs, inv)
        groups = max(1, min(HIST_GROUPS, kernels.num_chunks(n)))
        h, fine_counts, hist = kernels.scan(y, inv, key, half, groups)
        h = self._checked_h(int(h))
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            out = np.zeros(packed_size(n, width), np.uint8)
            kernels.pack(y, inv, key, h, width, out)
            return Quantized(self._side(step, h), stream=[out])
        log2k = choose_contexts(hist[:, half - h : half + h + 1]) if half >= 0 else 0
        offsets, sizes = kernels.chunk_offsets(fine_counts, log2k)
        table, flipped = kernels.fine_to_table(log2k)
        symbols = np.empty(n, np.uint8 if 2 * h + 1 <= 256 else np.uint16)
        kernels.order_symbols(y, inv, key, h, table, flipped, offsets, symbols)
        return Quantized(self._side(step, h, log2k), stream=self._sections(symbols, sizes, h))

    def _encode_torch(self, flat: torch.Tensor, maxabs: float, step: float, inv: float, seed: int) -> Quantized:
        n = flat.numel()
        u, bins = kernels.torch_dither(seed, n, flat.device)
        q = kernels.torch_indices(flat, inv, u)
        h = self._checked_h(int(q.abs().max()) if n else 0)
        if self.coding == "fixed":
            symbols = (q + h).to(torch.int32).cpu().numpy().astype(np.uint16)
            return Quantized(self._side(step, h), stream=[pack_bits(symbols, bit_width(2 * h + 1))])
        half = self._hist_half(maxabs, inv)
        log2k = 0
        if half >= 0 and n:
            log2k = choose_contexts(kernels.torch_histogram(bins, q, half)[:, half - h : half + h + 1])
        _, sizes = kernels.chunk_offsets(kernels.torch_fine_counts(bins), log2k)
        symbols = kernels.torch_order_symbols(q, bins, h, log2k)
        return Quantized(self._side(step, h, log2k), stream=self._sections(symbols, sizes, h))

    def _checked_h(self, h: int) -> int:
        if h > H_MAX:
            raise RuntimeError(f"ecdq: index {h} beyond {H_MAX} despite the step floor")
        return h

    def _side(self, step: float, h: int, log2k: int | None = None) -> list[np.ndarray]:
        side = [np.array([step], np.float32), np.array([h], np.uint16)]
        return side if log2k is None else [*side, np.array([log2k], np.uint8)]

    def _sections(self, symbols: np.ndarray, sizes: np.ndarray, h: int) -> list[np.ndarray]:
        """The lengths array and each table's entropy-coded section."""
        parts, start = [], 0
        for size in sizes:
            parts.append(entropy_encode(symbols[start : start + size], 2 * h + 1))
            start += size
        lengths = np.array([p.size for p in parts], "<u4")
        return [lengths.view(np.uint8), *parts]

    # ------------------------------------------------------------------ decode
    def dequantize(self, side, symbols, numel, seed, side_info) -> torch.Tensor:
        raise NotImplementedError("ecdq decodes its own symbol section (read_stream)")

    def read_stream(
        self, side: list[np.ndarray], body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None
    ) -> torch.Tensor:
        step = float(side[0][0])
        h = int(side[1][0])
        kernel = self.uses_kernels()
        if self.coding == "fixed":
            width = bit_width(2 * h + 1)
            packed = np.frombuffer(body.take(packed_size(numel, width), "packed indices"), np.uint8)
            used = (numel * width) % 8
            if used and packed.size and int(packed[-1]) >> used:
                raise PayloadError("ecdq payload has nonzero padding bits after the last index")
            if kernel:
                out = np.empty(numel, np.float32)
                bad = kernels.values_from_packed(packed, width, out, kernel_key(seed), step, h)
            else:
                codes = unpack_bits(packed, width, numel).astype(np.int64)
                bad = int((codes > 2 * h).sum())
                u, _ = kernels.torch_dither(seed, numel, "cpu")
                out = kernels.torch_values(torch.from_numpy(codes - h), u, step)
            if bad:
                raise PayloadError(f"ecdq payload holds {bad} indices beyond the declared largest {h}")
            return torch.from_numpy(out) if kernel else out
        log2k = int(side[2][0])
        if kernel:
            fine_counts = kernels.count_bins(numel, kernel_key(seed))
        else:
            u, bins = kernels.torch_dither(seed, numel, "cpu")
            fine_counts = kernels.torch_fine_counts(bins)
        offsets, sizes = kernels.chunk_offsets(fine_counts, log2k)
        symbols = self._read_sections(body, sizes, h, numel)
        if not kernel:
            return kernels.torch_values_from_tables(symbols, u, bins, step, h, log2k)
        table, flipped = kernels.fine_to_table(log2k)
        out = np.empty(numel, np.float32)
        kernels.values_from_tables(symbols, kernel_key(seed), step, h, table, flipped, offsets, out)
        return torch.from_numpy(out)

    def _read_sections(self, body: BodyReader, sizes: np.ndarray, h: int, numel: int) -> np.ndarray:
        """The table-ordered symbols of all sections (each decoded and checked by the entropy decoder)."""
        lengths = body.take_array("<u4", sizes.size, "section lengths").astype(np.int64)
        if int(lengths.sum()) != body.remaining:
            raise PayloadError(
                f"ecdq sections declare {int(lengths.sum())} bytes, the body holds {body.remaining} after them"
            )
        symbols = np.empty(numel, np.uint8 if 2 * h + 1 <= 256 else np.uint16)
        start = 0
        for length, size in zip(lengths, sizes):
            data = np.frombuffer(body.take(int(length), "table section"), np.uint8)
            part = entropy_decode(data, int(size), 2 * h + 1)
            symbols[start : start + size] = part
            start += size
        return symbols
