"""The two paths of ECDQ (:mod:`fedquant.codecs.quantizers.ecdq`): numba kernels and torch twins.

Both compute, element by element and in float64, the dithered index
``q = rint(y * inv_step + (v - 1/2))`` of each rotated coordinate ``y`` (``v`` the element's
uniform of :func:`fedquant.rng.uniform`'s stream, drawn inline by the kernels with
:func:`~fedquant.codecs.kernels.common.uniform24`; ``rint`` rounds half to even, as
``torch.round``) and the estimate ``float32(step * (q - (v - 1/2)))``, so both paths write the
same symbols and decode to the same values.

The entropy model needs each element's **dither context**: its uniform's top ``FINE_BITS`` bits
(``floor(64 v)``, exact) name one of ``FINE`` bins; a coded tensor groups them into
``K = 2**log2k`` contexts (``bin >> (FINE_BITS - log2k)``) and folds context ``k >= K/2`` onto
``K - 1 - k`` with the index negated (rotated coordinates are symmetric, and ``-u`` is the
dither of the mirrored bin), which leaves ``K / 2`` tables (one for ``K = 1``). Symbols are
``q + h`` (folded: ``h - q``) for the tensor's largest ``|q| = h``, in ``0 .. 2h``; each table's
symbols are sent in element order.

Kernels work in chunks of ``CHUNK`` elements (a multiple of 8: a chunk's packed symbols start on
a byte). Per chunk they count the elements of each fine bin, so that the entropy-coded symbols
can be written to (and read from) each table's stream in parallel: a chunk's position in a table
is the count of that table's elements in the chunks before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from fedquant.codecs.kernels.common import _U_SCALE, CHUNK, _sum_f64, hash24_run, pack_into, uniform24, unpack_from
from fedquant.jit import parallel_kernel, with_twin
from fedquant.rng import uniform

FINE_BITS = 6
FINE = 1 << FINE_BITS
_HALF64 = 0.5
_FINE32 = np.float32(FINE)
_BIN_SHIFT = np.uint32(24 - FINE_BITS)  # a 24-bit hash's top FINE_BITS bits: floor(64 v)
_MAGNITUDE = np.uint32(0x7FFFFFFF)


def num_chunks(n: int) -> int:
    return (n + CHUNK - 1) // CHUNK


# ================================================================ contexts (shared by both paths)
def tables_of(log2k: int) -> int:
    """Dither contexts per table group for ``2**log2k`` contexts (folded in pairs beyond one)."""
    return 1 if log2k == 0 else 1 << (log2k - 1)


@dataclass(frozen=True)
class ContextSpace:
    """The fine contexts of a lattice's symbols and the tables they fall into for ``2**log2k`` contexts.

    A fine context is ``(group, coset, fine bin, parity)`` (index
    ``((group * cosets + coset) * FINE + bin) * parities + parity``): the scalar lattice has only the
    dither bin; E8 (:mod:`fedquant.codecs.kernels.e8`) codes its first seven and its last
    coordinate in two groups, per coset of ``D8`` in ``E8``, the last with the parity its symbol must
    have. Bins ``k >= K/2`` of ``K`` fold onto ``K - 1 - k`` with the symbol mirrored (``2h - coset - s``),
    which flips a symbol's parity in the odd coset.
    """

    groups: int = 1
    cosets: int = 1
    parities: int = 1

    @property
    def size(self) -> int:
        return self.groups * self.cosets * FINE * self.parities

    def num_tables(self, log2k: int) -> int:
        return self.groups * self.cosets * tables_of(log2k) * self.parities

    def coset(self) -> np.ndarray:
        """Coset of each fine context (int64)."""
        return (np.arange(self.size) // (FINE * self.parities)) % self.cosets

    def tables(self, log2k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(table, flipped)`` of each fine context (int64 and bool arrays)."""
        f = np.arange(self.size)
        par = f % self.parities
        rest = f // self.parities
        k = (rest % FINE) >> (FINE_BITS - log2k)
        group_coset = rest // FINE
        contexts = 1 << log2k
        flipped = (k >= contexts // 2) & (log2k > 0)
        j = np.where(flipped, contexts - 1 - k, k)
        coded_parity = par ^ (flipped & (group_coset % self.cosets == 1)) if self.parities == 2 else par
        table = ((group_coset * tables_of(log2k) + j) * self.parities + coded_parity).astype(np.int64)
        return table, flipped

    def mirrored(self, hist: np.ndarray) -> np.ndarray:
        """The fine histogram ``(size, alphabet)`` with every row's symbols mirrored (``2h - coset - s``)."""
        out = hist[:, ::-1].copy()
        odd = self.coset() == 1
        out[odd, :-1] = hist[odd, :-1][:, ::-1]
        out[odd, -1] = 0
        return out

    def folded(self, hist: np.ndarray, log2k: int, mirrored: np.ndarray | None = None) -> np.ndarray:
        """Counts per table ``(tables, alphabet)`` from the fine histogram ``(size, alphabet)`` (and its
        :meth:`mirrored` rows, computed if not given)."""
        table, flipped = self.tables(log2k)
        mirrored = self.mirrored(hist) if mirrored is None else mirrored
        return sum_rows_by(np.where(flipped[:, None], mirrored, hist), table, self.num_tables(log2k))


SCALAR = ContextSpace()


def sum_rows_by(rows: np.ndarray, groups: np.ndarray, count: int) -> np.ndarray:
    """``out[g] = sum of rows[i] with groups[i] == g`` for ``g < count`` (int64 ``(count, columns)``)."""
    order = np.argsort(groups, kind="stable")
    present, starts = np.unique(groups[order], return_index=True)
    out = np.zeros((count, rows.shape[1]), np.int64)
    if present.size:
        out[present] = np.add.reduceat(rows[order], starts, axis=0)
    return out


def fold_signs(log2k: int, space: ContextSpace | None = None) -> np.ndarray:
    """-1 for the folded fine contexts (symbols mirrored), else 1 (int64; the scalar lattice by default)."""
    _, flipped = (space or SCALAR).tables(log2k)
    return np.where(flipped, -1, 1).astype(np.int64)


def _offsets_twin(fine_counts, table, num_tables):
    """:func:`_offsets` in NumPy (while the kernel cache is cold: the torch paths call it too)."""
    per_table = sum_rows_by(fine_counts.T, table, num_tables).T
    sizes = per_table.sum(0)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    before = np.cumsum(per_table, axis=0) - per_table
    return np.ascontiguousarray(before + starts[None, :]), sizes


@with_twin(_offsets_twin)
@njit(cache=True)
def _offsets(fine_counts, table, num_tables):
    """:func:`chunk_offsets` in one kernel."""
    chunks = fine_counts.shape[0]
    per_table = np.zeros((chunks, num_tables), np.int64)
    for c in range(chunks):
        for f in range(fine_counts.shape[1]):
            per_table[c, table[f]] += fine_counts[c, f]
    sizes = np.zeros(num_tables, np.int64)
    for c in range(chunks):
        sizes += per_table[c]
    offsets = np.empty((chunks, num_tables), np.int64)
    start = 0
    for t in range(num_tables):
        pos = start
        for c in range(chunks):
            offsets[c, t] = pos
            pos += per_table[c, t]
        start += sizes[t]
    return offsets, sizes


def chunk_offsets(fine_counts: np.ndarray, table: np.ndarray, num_tables: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each chunk's symbols of each table start in the table-ordered stream.

    Parameters
    ----------
    fine_counts : np.ndarray
        int64 ``(chunks, fine contexts)``: symbols of each fine context per chunk.
    table : np.ndarray
        Table of each fine context (:meth:`ContextSpace.tables`).
    num_tables : int
        Number of tables.

    Returns
    -------
    offsets : np.ndarray
        int64 ``(chunks, tables)``: position of a chunk's first symbol of each table.
    sizes : np.ndarray
        int64 ``(tables,)``: symbols per table (the tables follow each other in order).
    """
    return _offsets(np.ascontiguousarray(fine_counts, np.int64), np.ascontiguousarray(table, np.int64), int(num_tables))


# ================================================================ numba kernels (CPU)
# The kernels that write symbols in table order first gather a chunk's symbols by table in a
# chunk-sized buffer (L1/L2), then copy each table's run out: scattering straight into the
# tensor-sized output touches one page per table per symbol, and the TLB misses cost more than
# the copy (E8: 3.1 ns per symbol against ~1.3, one core).
@njit(cache=True)
def local_starts(offsets, sizes, c):
    """Where chunk ``c``'s run of each table starts in its chunk buffer (tables in order)."""
    tables = offsets.shape[1]
    pos = np.empty(tables, np.int64)
    start = 0
    for t in range(tables):
        end = offsets[c + 1, t] if c + 1 < offsets.shape[0] else offsets[0, t] + sizes[t]
        pos[t] = start
        start += end - offsets[c, t]
    return pos


@njit(cache=True)
def copy_in(symbols, offsets, sizes, c, buf):
    """Chunk ``c``'s run of each table from the table-ordered ``symbols`` into ``buf``, tables in order
    (the decoders' mirror of :func:`copy_out`); returns where each run starts in ``buf``."""
    pos = local_starts(offsets, sizes, c)
    for t in range(offsets.shape[1]):
        end = offsets[c + 1, t] if c + 1 < offsets.shape[0] else offsets[0, t] + sizes[t]
        src = symbols[offsets[c, t] : end]
        dst = buf[pos[t] : pos[t] + src.size]
        for k in range(src.size):
            dst[k] = src[k]
    return pos


@njit(cache=True)
def copy_out(buf, offsets, ends, c, out):
    """Copy chunk ``c``'s runs (table ``t``'s ends at ``ends[t]`` in ``buf``) to their places in ``out``."""
    start = 0
    for t in range(offsets.shape[1]):
        dst = out[offsets[c, t] : offsets[c, t] + ends[t] - start]
        src = buf[start : ends[t]]
        for k in range(src.size):
            dst[k] = src[k]
        start = ends[t]


@parallel_kernel
def norm_and_max(y):
    """``(sum of y**2 in float64, max |y|)`` of float32 ``y``; per-chunk sums added in chunk order.

    The max is taken on the magnitudes' bits (uint32, the order of non-negative floats), which
    runs on vector lanes, where a float max waits on each comparison in turn (NaN ordering)."""
    n = y.size
    chunks = (n + CHUNK - 1) // CHUNK
    sq = np.zeros(chunks, np.float64)
    top = np.zeros(max(chunks, 1), np.uint32)
    bits = y.view(np.uint32)
    for c in prange(chunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        sq[c] = _sum_f64(y, lo, hi, True)
        top[c] = _max_magnitude(bits[lo:hi])
    total = 0.0
    for c in range(chunks):
        total += sq[c]
    top[0] = top.max()
    return total, top[:1].view(np.float32)[0]


@njit(cache=True)
def _max_magnitude(bits):
    """The largest ``bits & 0x7FFFFFFF`` (``|y|`` of float32 bits, as bits)."""
    m = np.uint32(0)
    for i in range(bits.size):
        m = max(m, bits[i] & _MAGNITUDE)
    return m


@njit(cache=True, inline="always")
def _dithered(key, i, yi, inv):
    """``(index, fine bin, dither)`` of element ``i``."""
    v = uniform24(key, i)
    u = np.float64(v) - _HALF64
    return np.int64(np.rint(np.float64(yi) * inv + u)), np.int64(v * _FINE32), u


@njit(cache=True)
def _chunk_indices(y, inv, key, c0, count, hs, qq):
    """Dithered indices ``qq[r]`` (int32) of elements ``c0 + r`` and their hashes ``hs[r]``; returns the
    largest ``|q|``. Loops without table lookups or data-dependent stores: they run on vector lanes."""
    hash24_run(key, c0, count, hs)
    ys, hv, qv = y[c0 : c0 + count], hs[:count], qq[:count]
    top = 0
    for r in range(count):
        u = np.float64(np.float32(hv[r]) * _U_SCALE) - _HALF64
        q = np.int64(np.rint(np.float64(ys[r]) * inv + u))
        qv[r] = q
        top = max(top, abs(q))
    return top


@parallel_kernel
def scan(y, inv, key, hist_half, groups):
    """Largest ``|q|``, fine-bin counts per chunk and, if ``hist_half >= 0``, the histogram of
    ``(fine bin, q + hist_half)`` (int64 ``(FINE, 2 hist_half + 1)``; ``hist_half`` bounds ``|q|``).

    Returns ``(h, fine_counts (chunks, FINE), hist)``. Groups of chunks run in parallel, each with
    its own histogram, added at the end.
    """
    n = y.size
    chunks = (n + CHUNK - 1) // CHUNK
    width = 2 * hist_half + 1 if hist_half >= 0 else 0
    per_group = np.zeros((groups, FINE, max(width, 1)), np.int64)
    fine_counts = np.zeros((chunks, FINE), np.int64)
    tops = np.zeros(groups, np.int64)
    span = (chunks + groups - 1) // groups
    for g in prange(groups):
        hist = per_group[g]
        hs = np.empty(CHUNK, np.uint32)
        qq = np.empty(CHUNK, np.int32)
        top = 0
        for c in range(g * span, min((g + 1) * span, chunks)):
            c0 = c * CHUNK
            count = min(c0 + CHUNK, n) - c0
            top = max(top, _chunk_indices(y, inv, key, c0, count, hs, qq))
            counts = fine_counts[c]
            for r in range(count):
                b = hs[r] >> _BIN_SHIFT
                counts[b] += 1
                if width:
                    hist[b, min(max(np.int64(qq[r]) + hist_half, 0), width - 1)] += 1
        tops[g] = top
    total = np.zeros((FINE, max(width, 1)), np.int64)
    for g in range(groups):
        total += per_group[g]
    return (tops.max() if groups else 0), fine_counts, total


@parallel_kernel
def order_symbols(y, inv, key, h, table, sign, offsets, sizes, out):
    """Symbols of float32 ``y`` in table order: ``h + sign[b] q`` of fine bin ``b`` (``sign`` -1 where the
    context is folded) goes to the next slot of its table (``table`` per fine bin,
    :meth:`ContextSpace.tables`; ``offsets`` / ``sizes`` from :func:`chunk_offsets`)."""
    n = y.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        hs = np.empty(count, np.uint32)
        qq = np.empty(count, np.int32)
        _chunk_indices(y, inv, key, c0, count, hs, qq)
        buf = np.empty(count, out.dtype)
        pos = local_starts(offsets, sizes, c)
        for r in range(count):
            b = hs[r] >> _BIN_SHIFT
            t = table[b]
            buf[pos[t]] = h + sign[b] * np.int64(qq[r])
            pos[t] += 1
        copy_out(buf, offsets, pos, c, out)


@parallel_kernel
def pack(y, inv, key, h, width, out):
    """Symbols ``q + h`` of float32 ``y`` packed at ``width`` bits into ``out``."""
    n = y.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        codes = np.empty(hi - lo, np.uint16)
        for i in range(lo, hi):
            q, _, _ = _dithered(key, i, y[i], inv)
            codes[i - lo] = h + q
        pack_into(codes, hi - lo, width, out, (lo * width) // 8)


@parallel_kernel(count_arg=0)
def count_bins(n, key):
    """Fine-bin counts per chunk of the first ``n`` uniforms of ``key`` (what the decoder needs)."""
    chunks = (n + CHUNK - 1) // CHUNK
    fine_counts = np.zeros((chunks, FINE), np.int64)
    for c in prange(chunks):
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        hs = np.empty(count, np.uint32)
        hash24_run(key, c0, count, hs)
        counts = fine_counts[c]
        for r in range(count):
            counts[hs[r] >> _BIN_SHIFT] += 1
    return fine_counts


@parallel_kernel(count_arg=8)
def values_from_tables(symbols, key, step, h, table, sign, offsets, sizes, out):
    """Estimates ``step * (q - u)`` (float32) from table-ordered ``symbols`` (each ``<= 2h``, checked
    by the entropy decoder), ``q = sign[b] (s - h)``: the inverse of :func:`order_symbols`."""
    n = out.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        buf = np.empty(count, symbols.dtype)
        pos = copy_in(symbols, offsets, sizes, c, buf)
        hs = np.empty(count, np.uint32)
        hash24_run(key, c0, count, hs)
        qq = np.empty(count, np.int32)
        for r in range(count):
            b = hs[r] >> _BIN_SHIFT
            t = table[b]
            qq[r] = sign[b] * (np.int64(buf[pos[t]]) - h)
            pos[t] += 1
        dst = out[c0 : c0 + count]
        for r in range(count):
            u = np.float64(np.float32(hs[r]) * _U_SCALE) - _HALF64
            dst[r] = np.float32(step * (np.float64(qq[r]) - u))


@parallel_kernel(count_arg=2)
def values_from_packed(data, width, out, key, step, h):
    """Estimates from symbols packed at ``width`` bits; returns how many symbols exceed ``2h``."""
    n = out.size
    chunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(chunks, np.int64)
    top = 2 * h
    for c in prange(chunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        codes = np.empty(hi - lo, np.uint16)
        unpack_from(data, (lo * width) // 8, hi - lo, width, codes)
        over = 0
        for i in range(lo, hi):
            s = np.int64(codes[i - lo])
            over += s > top
            u = np.float64(uniform24(key, i)) - _HALF64
            out[i] = np.float32(step * (np.float64(s - h) - u))
        bad[c] = over
    return bad.sum()


# ================================================================ torch twins (any device)
def torch_dither(seed: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, fine bin)`` of ``n`` elements: the float64 dither ``v - 1/2`` and ``floor(64 v)`` (int64)."""
    v = uniform(seed, n, device=device)
    return v.double() - _HALF64, (v * _FINE32).long()


def torch_indices(y: torch.Tensor, inv: float, u: torch.Tensor) -> torch.Tensor:
    """Dithered indices ``round(y * inv + u)`` (int64) of float32 ``y``, in float64 as the kernels."""
    return torch.round(y.double() * inv + u).long()


def torch_norm_and_max(y: torch.Tensor) -> tuple[float, float]:
    """``(sum of y**2 in float64, max |y|)`` (the float64 sum in torch's order)."""
    if not y.numel():
        return 0.0, 0.0
    return float(y.double().square().sum()), float(y.abs().max())


def torch_fine_counts(contexts: torch.Tensor, size: int, n: int, positions: torch.Tensor | None = None) -> np.ndarray:
    """Counts per chunk (of a tensor of ``n`` elements) of each of ``size`` fine contexts, int64
    ``(chunks, size)`` as the kernels count them; ``positions`` are the element indices of
    ``contexts`` (default ``0 .. n - 1``)."""
    where = torch.arange(n, device=contexts.device) if positions is None else positions
    counts = torch.bincount((where // CHUNK) * size + contexts, minlength=num_chunks(n) * size)
    return counts.view(-1, size).cpu().numpy()


def torch_histogram(bins: torch.Tensor, q: torch.Tensor, half: int) -> np.ndarray:
    """Histogram of ``(fine bin, q + half)``, int64 ``(FINE, 2 half + 1)``, as :func:`scan`."""
    width = 2 * half + 1
    flat = bins * width + (q + half).clamp(0, width - 1)
    return torch.bincount(flat, minlength=FINE * width).view(FINE, width).cpu().numpy()


def torch_table_order(
    contexts: torch.Tensor, log2k: int, space: ContextSpace = SCALAR
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, flipped)``: the element order of the table-ordered stream (stable by table) and which
    elements are folded, for symbols of fine contexts ``contexts``.

    The table numbers are sorted as bytes (at most 256 tables): torch sorts uint8 keys some 50
    times faster than int64 ones, to the same (stable) order.
    """
    table, flipped = space.tables(log2k)
    key = torch.uint8 if space.num_tables(log2k) <= 256 else torch.int64
    table = torch.from_numpy(table).to(device=contexts.device, dtype=key)
    order = torch.sort(table[contexts], stable=True).indices
    return order, torch.from_numpy(flipped).to(contexts.device)[contexts]


def torch_order_symbols(q: torch.Tensor, bins: torch.Tensor, h: int, log2k: int) -> np.ndarray:
    """Symbols in table order (uint16 NumPy), as :func:`order_symbols`."""
    order, flipped = torch_table_order(bins, log2k)
    sym = torch.where(flipped, h - q, h + q)
    return sym[order].to(torch.int32).cpu().numpy().astype(np.uint16)


def torch_values_from_tables(
    symbols: np.ndarray, u: torch.Tensor, bins: torch.Tensor, step: float, h: int, log2k: int
) -> torch.Tensor:
    """Estimates from table-ordered symbols, as :func:`values_from_tables` (float32)."""
    order, flipped = torch_table_order(bins, log2k)
    s = torch.empty(bins.numel(), dtype=torch.int64, device=bins.device)
    s[order] = torch.from_numpy(symbols.astype(np.int64)).to(bins.device)
    q = torch.where(flipped, h - s, s - h)
    return (step * (q.double() - u)).float()


def torch_values(q: torch.Tensor, u: torch.Tensor, step: float) -> torch.Tensor:
    """Estimates ``float32(step * (q - u))`` of signed indices ``q``."""
    return (step * (q.double() - u)).float()
