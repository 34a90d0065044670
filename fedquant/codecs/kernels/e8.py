"""ECDQ on the E8 lattice (``ecdq:lattice=e8``): numba kernels and their torch twins.

Each block of 8 rotated coordinates ``y`` (scaled by ``inv = 1 / step``) gets the dither
``z = 2 v`` (``v`` the block's 8 uniforms of :func:`fedquant.rng.uniform`'s stream: ``z`` is
uniform on ``[0, 2)^8``, a fundamental cell of ``2 Z^8``, a sublattice of E8, so ``z`` is uniform
modulo E8 and the error below is uniform on E8's Voronoi cell and independent of ``y``) and the
E8 point ``lambda`` nearest to ``t = y inv + z``; the decoder returns ``step (lambda - z)``.

``E8 = D8 u (D8 + 1/2)``, ``D8`` the integer vectors of even sum (Conway & Sloane, *Sphere
Packings*, ch. 20): the nearest point of ``D8 + shift`` rounds ``t - shift`` and, when the sum is
odd, rounds the coordinate with the largest rounding error the other way; E8's nearest point is
the nearer of the two cosets (``D8`` on a tie). The kernels and the torch twin do these float64
operations in the same order (the distances summed coordinate by coordinate, the first largest
error taken), so they pick the same points.

Symbols. A block sends its coset ``b`` (``lambda = m + b/2``, ``m`` in ``D8``) and the eight
``s_k = m_k + h - 1`` (``h = ceil(max |lambda - 1|)``, so ``s`` lies in ``0 .. 2h - b``). The
entropy model (:data:`E8`, a :class:`~fedquant.codecs.kernels.ecdq.ContextSpace`) codes ``s`` in
two groups: coordinates 1-7 by (coset, dither bin of ``v_k``), and coordinate 8 by (coset, bin,
parity of ``s_8``), which the decoder knows from the first seven because ``sum m`` is even: the
parity constraint of ``D8`` saves most of a bit per block. Decoding therefore runs in three
stages: the cosets, the first seven coordinates, then the eighth.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from fedquant.codecs.kernels.common import (
    _GAMMA,
    _SHIFT_U,
    _U_SCALE,
    CHUNK,
    counter,
    hash24_run,
    mix64,
    pack_into,
    uniform24,
    unpack_from,
)
from fedquant.codecs.kernels.ecdq import FINE, ContextSpace, copy_in, copy_out, local_starts
from fedquant.jit import parallel_kernel
from fedquant.rng import uniform

#: Normalized second moment of E8 (Conway & Sloane): mean squared error per coordinate of a
#: uniform point of its Voronoi cell at unit volume. Z's is 1/12.
SECOND_MOMENT = 929 / 12960
E8 = ContextSpace(groups=2, cosets=2, parities=2)
_FINE32 = np.float32(FINE)
_TWO = 2.0
_BLOCKS = CHUNK // 8
_EIGHT_GAMMA = np.uint64((8 * int(_GAMMA)) % (1 << 64))
_SIZE = E8.size
_PAD = 40
_BIN_SHIFT = np.uint32(24 - 6)  # a 24-bit hash's top FINE_BITS bits: floor(64 v)


# ================================================================ numba kernels (CPU)
# ---------------------------------------------------------------- the fused encoder pass
# A chunk's blocks are held coordinate-major ("k-major": coordinate k of block j at k * blocks + j)
# in the scratch and in ``m``, so that the nearest-point search runs one block per vector lane.
@njit(cache=True)
def _dither_kmajor(y, inv, key, c0, blocks, t):
    """``t[k, j] = y[c0 + 8j + k] inv + 2 v`` (float64, the kernel's order of operations)."""
    for k in range(8):
        z0 = counter(key, c0 + k)
        ys = y[c0 + k : c0 + 8 * blocks : 8]
        row = t[k]
        for j in range(blocks):
            v = np.float32(mix64(z0 + np.uint64(j) * _EIGHT_GAMMA) >> _SHIFT_U) * _U_SCALE
            row[j] = np.float64(ys[j]) * inv + _TWO * np.float64(v)


@njit(cache=True)
def _nearest_kmajor(t, blocks, mk, coset):
    """Nearest E8 points of the k-major dithered blocks ``t``: ``mk[k, j]`` (``lambda - coset / 2``) and
    ``coset[j]``; returns ``max |2 lambda - 2|``.

    Per coset ``D8 + shift``: round ``t - shift``; on an odd sum, move the first coordinate of largest
    rounding error the other way; the squared distance summed coordinate by coordinate (the torch
    twin's order). Branch-free, so that the loop over blocks runs on vector lanes."""
    top = 0
    for j in range(blocks):
        d0 = d1 = 0.0
        w0 = w1 = 0
        m0 = m1 = 0.0
        for s in range(2):
            shift = 0.5 * s
            total = 0
            worst = -1.0
            wi = 0
            aw = rw = 0.0
            for k in range(8):
                a = t[k, j] - shift
                r = np.rint(a)
                total += np.int64(r)
                e = abs(a - r)
                better = e > worst
                worst = e if better else worst
                wi = k if better else wi
                aw = a if better else aw
                rw = r if better else rw
            moved = (rw + 1.0 if aw >= rw else rw - 1.0) if total & 1 else rw
            d = 0.0
            for k in range(8):
                a = t[k, j] - shift
                e = a - (moved if k == wi else np.rint(a))
                d += e * e
            if s == 0:
                d0, w0, m0 = d, wi, moved
            else:
                d1, w1, m1 = d, wi, moved
        b = 1 if d1 < d0 else 0
        shift = 0.5 * b
        wi = w1 if b else w0
        mv = m1 if b else m0
        coset[j] = b
        for k in range(8):
            r = np.int64(mv if k == wi else np.rint(t[k, j] - shift))
            mk[k, j] = r
            top = max(top, abs(2 * r + b - 2))
    return top


@njit(cache=True)
def _count_chunk(mk, coset, key, c0, off, width, ff, sv, counts, hist):
    """Fine-context counts of a chunk into ``counts`` and, if ``width``, the histogram of (fine context,
    ``m + off``) into ``hist``; the eighth coordinate's parity bit is that of ``m`` (:func:`lattice_counts`)."""
    blocks = mk.shape[1]
    _contexts_kmajor(mk, coset, key, c0, 0, off, ff, sv)
    for k in range(8):
        frow, srow = ff[k], sv[k]
        for j in range(blocks):
            f = frow[j]
            counts[f] += 1
            if width:
                hist[f, min(np.int64(srow[j]), width - 1)] += 1


@parallel_kernel
def lattice_counts(y, inv, key, off, width, groups, m, coset):
    """The fused first pass of E8's encoder: nearest points, fine-context counts and histogram.

    ``m`` (int16, ``lambda - coset / 2``) is written k-major per chunk (:func:`kmajor_index`),
    ``coset`` per block. Returns ``(max |2 lambda - 2|, fine_counts (chunks, E8.size), hist)``:
    the eighth coordinate's context carries the parity of ``m``, not yet of its symbol
    ``m + h - 1`` (``h`` is known at the end: :func:`symbol_parity`), and, if ``width``, ``hist``
    counts (fine context, ``m + off``), ``width = 2 off + 1`` columns (``off`` bounds ``|m| + 1``).
    """
    n = y.size
    chunks = (n + CHUNK - 1) // CHUNK
    per_group = np.zeros((groups, _SIZE, max(width, 1)), np.int64)
    fine_counts = np.zeros((chunks, _SIZE), np.int64)
    tops = np.zeros(groups, np.int64)
    span = (chunks + groups - 1) // groups
    for g in prange(groups):
        t = np.empty((8, _BLOCKS), np.float64)
        ff = np.empty((8, _BLOCKS + _PAD), np.uint16)
        sv = np.empty((8, _BLOCKS + _PAD), np.uint16)
        top = 0
        for c in range(g * span, min((g + 1) * span, chunks)):
            c0 = c * CHUNK
            blocks = (min(c0 + CHUNK, n) - c0) // 8
            mk = m[c0 : c0 + 8 * blocks].reshape(8, blocks)
            cs = coset[c0 // 8 : c0 // 8 + blocks]
            _dither_kmajor(y, inv, key, c0, blocks, t)
            top = max(top, _nearest_kmajor(t, blocks, mk, cs))
            _count_chunk(mk, cs, key, c0, off, width, ff, sv, fine_counts[c], per_group[g])
        tops[g] = top
    total = np.zeros((_SIZE, max(width, 1)), np.int64)
    for g in range(groups):
        total += per_group[g]
    return (tops.max() if groups else 0), fine_counts, total


def natural_order(m: np.ndarray) -> np.ndarray:
    """:func:`lattice_counts`'s k-major ``m`` in element order (for tests and tools)."""
    out = np.empty_like(m)
    for c0 in range(0, m.size, CHUNK):
        blocks = (min(c0 + CHUNK, m.size) - c0) // 8
        out[c0 : c0 + 8 * blocks] = m[c0 : c0 + 8 * blocks].reshape(8, blocks).T.reshape(-1)
    return out


def symbol_parity(fine_counts: np.ndarray, hist: np.ndarray | None, h: int, off: int):
    """:func:`lattice_counts`'s counts with the eighth coordinate's parity bit that of its symbol
    ``s = m + h - 1``, and its histogram as (fine context, ``s``) ``(E8.size, 2h + 1)``."""
    if (h - 1) & 1:
        swap = np.arange(E8.size)
        last = swap >= E8.size // 2  # group 1: the eighth coordinates
        swap[last] ^= 1
        fine_counts = fine_counts[:, swap]
        hist = None if hist is None else hist[swap]
    if hist is not None:
        hist = np.ascontiguousarray(hist[:, off - h + 1 : off + h + 2])
    return fine_counts, hist


@njit(cache=True)
def _contexts_kmajor(mk, coset, key, c0, shift, vshift, ff, sv):
    """Fine context ``ff[k, j]`` (:data:`E8`, the eighth coordinate's parity that of ``m + shift``) and
    ``sv[k, j] = m + vshift`` of every coordinate of a chunk's k-major ``mk`` (contiguous rows, no table
    lookups: LLVM keeps gathers out of vector loops on this CPU, so the lookups come later)."""
    blocks = mk.shape[1]
    for k in range(8):
        z0 = counter(key, c0 + k)
        last = np.int64(k == 7)
        row, frow, srow = mk[k], ff[k], sv[k]
        for j in range(blocks):
            fine = np.int64((mix64(z0 + np.uint64(j) * _EIGHT_GAMMA) >> _SHIFT_U) >> _BIN_SHIFT)
            r = np.int64(row[j])
            frow[j] = ((last * 2 + np.int64(coset[j])) * FINE + fine) * 2 + ((r + shift) & last)
            srow[j] = r + vshift


@parallel_kernel
def order_kmajor(m, coset, key, h, table, base, sign, offsets, sizes, out):
    """Coded symbols in table order, from k-major ``m``: ``base[f] + sign[f] s`` for symbol ``s = m + h - 1``
    of fine context ``f`` (``s``, or ``2h - b - s`` where the context is folded). ``sizes``: symbols per
    table (:func:`~fedquant.codecs.kernels.ecdq.chunk_offsets`)."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        blocks = count // 8
        # Rows padded past 4 KiB apart: reading eight rows a coordinate at a time would
        # otherwise alias in the store buffer (4K aliasing; 4.2 against 1.5 ns per symbol).
        ff = np.empty((8, blocks + _PAD), np.uint16)
        sv = np.empty((8, blocks + _PAD), np.uint16)
        mk = m[c0 : c0 + count].reshape(8, blocks)
        _contexts_kmajor(mk, coset[c0 // 8 : c0 // 8 + blocks], key, c0, h - 1, h - 1, ff, sv)
        buf = np.empty(count, out.dtype)
        pos = local_starts(offsets, sizes, c)
        for j in range(blocks):
            for k in range(8):
                f = ff[k, j]
                t = table[f]
                buf[pos[t]] = base[f] + sign[f] * np.int64(sv[k, j])
                pos[t] += 1
        copy_out(buf, offsets, pos, c, out)


def folding(h: int, log2k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(base, sign)`` per fine context: a symbol ``s`` is coded as ``base + sign s`` (:func:`order_kmajor`)."""
    _, flipped = E8.tables(log2k)
    return np.where(flipped, 2 * h - E8.coset(), 0).astype(np.int64), np.where(flipped, -1, 1).astype(np.int64)


@parallel_kernel
def pack_kmajor(m, coset, h, width, out):
    """Symbols ``m + h - 1`` of k-major ``m`` packed at ``width`` bits in element order."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        blocks = (hi - lo) // 8
        codes = np.empty(hi - lo, np.uint16)
        for r in range(hi - lo):
            codes[r] = np.int64(m[lo + (r & 7) * blocks + (r >> 3)]) + h - 1
        pack_into(codes, hi - lo, width, out, (lo * width) // 8)


@parallel_kernel(count_arg=2)
def count_first(coset, key, n):
    """Fine-context counts per chunk of the first seven coordinates of each block (decoder, stage 2)."""
    chunks = (n + CHUNK - 1) // CHUNK
    fine_counts = np.zeros((chunks, _SIZE), np.int64)
    for c in prange(chunks):
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        hs = np.empty(count, np.uint32)
        hash24_run(key, c0, count, hs)
        counts = fine_counts[c]
        for j in range(count // 8):
            b = np.int64(coset[c0 // 8 + j]) * FINE
            for k in range(7):
                counts[(b + np.int64(hs[8 * j + k] >> _BIN_SHIFT)) * 2] += 1
    return fine_counts


@parallel_kernel(count_arg=8)
def place_first(symbols, coset, key, h, table, base, sign, offsets, sizes, m):
    """``m`` of the first seven coordinates from their table-ordered coded symbols (``s = base[f] +
    sign[f] code``, :func:`folding`); returns the fine-context counts per chunk of the eighth
    coordinates (their parity follows from the seven) and the number of symbols beyond ``2h - b``."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    fine_counts = np.zeros((chunks, _SIZE), np.int64)
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        counts = fine_counts[c]
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        buf = np.empty(count, symbols.dtype)
        pos = copy_in(symbols, offsets, sizes, c, buf)
        hs = np.empty(count, np.uint32)
        hash24_run(key, c0, count, hs)
        over = 0
        for j in range(count // 8):
            b = np.int64(coset[c0 // 8 + j])
            top = 2 * h - b
            parity = 0
            for k in range(7):
                f = (b * FINE + np.int64(hs[8 * j + k] >> _BIN_SHIFT)) * 2
                t = table[f]
                code = np.int64(buf[pos[t]])
                pos[t] += 1
                over += code > top
                r = base[f] + sign[f] * code - h + 1
                m[c0 + 8 * j + k] = r
                parity += r
            # the eighth symbol's parity: m_8 = sum of the others mod 2
            counts[((2 + b) * FINE + np.int64(hs[8 * j + 7] >> _BIN_SHIFT)) * 2 + ((parity + h - 1) & 1)] += 1
        bad[c] = over
    return fine_counts, bad.sum()


@parallel_kernel(count_arg=9)
def finish(symbols, coset, key, h, step, table, base, sign, offsets, sizes, m, out):
    """The eighth coordinates from their coded symbols, then ``step (lambda - z)`` of every coordinate
    (float32 into ``out``); returns the number of symbols beyond ``2h - b`` or of the wrong parity."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        c0 = c * CHUNK
        count = min(c0 + CHUNK, n) - c0
        buf = np.empty(count // 8, symbols.dtype)
        pos = copy_in(symbols, offsets, sizes, c, buf)
        hs = np.empty(count, np.uint32)
        hash24_run(key, c0, count, hs)
        half = np.empty(count, np.float64)
        over = 0
        for j in range(count // 8):
            b = np.int64(coset[c0 // 8 + j])
            i0 = c0 + 8 * j
            parity = 0
            for k in range(7):
                parity += np.int64(m[i0 + k])
            f = ((2 + b) * FINE + np.int64(hs[8 * j + 7] >> _BIN_SHIFT)) * 2 + ((parity + h - 1) & 1)
            t = table[f]
            code = np.int64(buf[pos[t]])
            pos[t] += 1
            r = base[f] + sign[f] * code - h + 1
            over += (code > 2 * h - b) | ((r - parity) & 1)
            m[i0 + 7] = r
            for k in range(8):
                half[8 * j + k] = 0.5 * b
        _values(m[c0 : c0 + count], half, hs, step, out[c0 : c0 + count])
        bad[c] = over
    return bad.sum()


@njit(cache=True)
def _values(m, half, hs, step, out):
    """``float32(step ((m + coset / 2) - 2 v))`` of a chunk, on vector lanes (``half``: coset / 2 per element)."""
    for r in range(out.size):
        z = _TWO * np.float64(np.float32(hs[r]) * _U_SCALE)
        out[r] = np.float32(step * ((np.float64(m[r]) + half[r]) - z))


@parallel_kernel(count_arg=3)
def values_from_packed(data, width, coset, out, key, h, step):
    """Estimates from symbols packed at ``width`` bits and the cosets; returns how many symbols exceed
    ``2h - b`` or break a block's even sum."""
    n = out.size
    chunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        codes = np.empty(hi - lo, np.uint16)
        unpack_from(data, (lo * width) // 8, hi - lo, width, codes)
        over = 0
        for j in range(lo // 8, hi // 8):
            b = np.int64(coset[j])
            half = 0.5 * b
            parity = 0
            for k in range(8):
                i = 8 * j + k
                s = np.int64(codes[i - lo])
                over += 1 if s > 2 * h - b else 0
                r = s - h + 1
                parity += r
                z = _TWO * np.float64(uniform24(key, i))
                out[i] = np.float32(step * ((np.float64(r) + half) - z))
            over += parity & 1
        bad[c] = over
    return bad.sum()


# ================================================================ torch twins (any device)
def _torch_coset(t: torch.Tensor, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Nearest point of ``D8 + shift`` to each row of ``t`` ``(blocks, 8)``: integer parts and squared distances."""
    a = t - shift if shift else t  # t - 0.0 is t, bit for bit (-0.0 included)
    r = torch.round(a)
    e = a - r
    worst = e.abs().argmax(dim=1, keepdim=True)
    odd = (r.sum(dim=1).long() & 1).bool().unsqueeze(1)
    at = a.gather(1, worst)
    rt = r.gather(1, worst)
    moved = torch.where(odd, torch.where(at >= rt, rt + 1.0, rt - 1.0), rt)
    r.scatter_(1, worst, moved)
    e.scatter_(1, worst, at - moved)  # a - r, where r moved
    e.mul_(e)
    d = e[:, 0] + e[:, 1]
    for k in range(2, 8):  # in the kernel's order
        d += e[:, k]
    return r, d


def torch_uniforms(seed: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, fine bin)`` of ``n`` elements: the float64 dither ``2 v`` and ``floor(64 v)`` (int64)."""
    v = uniform(seed, n, device=device)
    return _TWO * v.double(), (v * _FINE32).long()


def torch_lattice(y: torch.Tensor, inv: float, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, coset)``: int64 ``(blocks, 8)`` and ``(blocks,)``, as :func:`lattice`."""
    t = y.double().mul_(inv).add_(z).view(-1, 8)
    lo, d0 = _torch_coset(t, 0.0)
    hi, d1 = _torch_coset(t, 0.5)
    coset = (d1 < d0).long()
    return torch.where(coset.bool().unsqueeze(1), hi, lo).long(), coset


def torch_fine_contexts(m: torch.Tensor, coset: torch.Tensor, bins: torch.Tensor, h: int) -> torch.Tensor:
    """Fine context (:data:`E8`) of every element, flat in element order."""
    contexts = (bins.view(-1, 8) + coset.unsqueeze(1) * FINE).mul_(2)  # group 0 (the first seven), parity 0
    contexts[:, 7] += 4 * FINE + ((m[:, 7] + h - 1) & 1)  # the last: group 1, with its symbol's parity
    return contexts.reshape(-1)


def torch_values(m: torch.Tensor, coset: torch.Tensor, z: torch.Tensor, step: float) -> torch.Tensor:
    """``float32(step (lambda - z))``, flat."""
    lam = m.double() + 0.5 * coset.double().unsqueeze(1)
    return (step * (lam.reshape(-1) - z)).float()
