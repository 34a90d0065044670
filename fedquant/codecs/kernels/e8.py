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

from fedquant.codecs.kernels.common import CHUNK, pack_into, uniform24, unpack_from
from fedquant.codecs.kernels.ecdq import FINE, ContextSpace
from fedquant.jit import parallel_kernel
from fedquant.rng import uniform

#: Normalized second moment of E8 (Conway & Sloane): mean squared error per coordinate of a
#: uniform point of its Voronoi cell at unit volume. Z's is 1/12.
SECOND_MOMENT = 929 / 12960
E8 = ContextSpace(groups=2, cosets=2, parities=2)
_FINE32 = np.float32(FINE)
_TWO = 2.0


# ================================================================ numba kernels (CPU)
@njit(cache=True, inline="always")
def _nearest_coset(t, shift, out):
    """Nearest point of ``D8 + shift`` to ``t`` (8 float64): its integer part ``t - shift`` rounded
    into ``out``; returns the squared distance."""
    total = 0
    worst = -1.0
    wi = 0
    for k in range(8):
        a = t[k] - shift
        r = np.rint(a)
        out[k] = r
        total += np.int64(r)
        e = abs(a - r)
        if e > worst:
            worst = e
            wi = k
    if total & 1:
        a = t[wi] - shift
        out[wi] = out[wi] + 1.0 if a >= out[wi] else out[wi] - 1.0
    d = 0.0
    for k in range(8):
        e = (t[k] - shift) - out[k]
        d += e * e
    return d


@njit(cache=True, inline="always")
def _fine_context(k, b, v, s):
    """Fine context (:data:`E8`) of coordinate ``k`` of a block of coset ``b``, uniform ``v``, symbol ``s``."""
    last = k == 7
    group = 1 if last else 0
    parity = (s & 1) if last else 0
    return ((group * 2 + b) * FINE + np.int64(v * _FINE32)) * 2 + parity


@parallel_kernel
def lattice(y, inv, key, m, coset):
    """Nearest E8 points of the dithered blocks of float32 ``y`` (``y.size`` a multiple of 8): ``m``
    (int16, ``lambda - coset / 2``) and ``coset`` (uint8 per block); returns ``max |2 lambda - 2|``."""
    n = y.size
    chunks = (n + CHUNK - 1) // CHUNK
    tops = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        t = np.empty(8, np.float64)
        lo = np.empty(8, np.float64)
        hi = np.empty(8, np.float64)
        top = 0
        for j in range(c * CHUNK // 8, min(c * CHUNK + CHUNK, n) // 8):
            i0 = 8 * j
            for k in range(8):
                t[k] = np.float64(y[i0 + k]) * inv + _TWO * np.float64(uniform24(key, i0 + k))
            d0 = _nearest_coset(t, 0.0, lo)
            d1 = _nearest_coset(t, 0.5, hi)
            b = 1 if d1 < d0 else 0
            coset[j] = b
            for k in range(8):
                r = np.int64(hi[k] if b else lo[k])
                m[i0 + k] = r
                top = max(top, abs(2 * r + b - 2))
        tops[c] = top
    return tops.max() if chunks else 0


@parallel_kernel
def contexts_and_histogram(m, coset, key, h, with_hist, groups):
    """Fine-context counts per chunk ``(chunks, E8.size)`` and, if ``with_hist``, the histogram of
    ``(fine context, s)`` ``(E8.size, 2h + 1)`` of the symbols ``s = m + h - 1``."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    width = 2 * h + 1 if with_hist else 1
    per_group = np.zeros((groups, 512, width), np.int64)
    fine_counts = np.zeros((chunks, 512), np.int64)
    span = (chunks + groups - 1) // groups
    for g in prange(groups):
        hist = per_group[g]
        for c in range(g * span, min((g + 1) * span, chunks)):
            counts = fine_counts[c]
            for i in range(c * CHUNK, min(c * CHUNK + CHUNK, n)):
                s = np.int64(m[i]) + h - 1
                f = _fine_context(i & 7, np.int64(coset[i >> 3]), uniform24(key, i), s)
                counts[f] += 1
                if with_hist:
                    hist[f, s] += 1
    total = np.zeros((512, width), np.int64)
    for g in range(groups):
        total += per_group[g]
    return fine_counts, total


@parallel_kernel
def order_symbols(m, coset, key, h, table, flipped, offsets, out):
    """Coded symbols (``s``, or ``2h - b - s`` in folded contexts) in table order."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        pos = offsets[c].copy()
        for i in range(c * CHUNK, min(c * CHUNK + CHUNK, n)):
            b = np.int64(coset[i >> 3])
            s = np.int64(m[i]) + h - 1
            f = _fine_context(i & 7, b, uniform24(key, i), s)
            t = table[f]
            out[pos[t]] = 2 * h - b - s if flipped[f] else s
            pos[t] += 1


@parallel_kernel(count_arg=2)
def count_first(coset, key, n):
    """Fine-context counts per chunk of the first seven coordinates of each block (decoder, stage 2)."""
    chunks = (n + CHUNK - 1) // CHUNK
    fine_counts = np.zeros((chunks, 512), np.int64)
    for c in prange(chunks):
        counts = fine_counts[c]
        for i in range(c * CHUNK, min(c * CHUNK + CHUNK, n)):
            if i & 7 != 7:
                counts[_fine_context(i & 7, np.int64(coset[i >> 3]), uniform24(key, i), 0)] += 1
    return fine_counts


@parallel_kernel(count_arg=7)
def place_first(symbols, coset, key, h, table, flipped, offsets, m):
    """``m`` of the first seven coordinates from their table-ordered coded symbols; returns the
    fine-context counts per chunk of the eighth coordinates (their parity follows from the seven)
    and the number of symbols beyond ``2h - b``."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    fine_counts = np.zeros((chunks, 512), np.int64)
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        pos = offsets[c].copy()
        counts = fine_counts[c]
        over = 0
        for j in range(c * CHUNK // 8, min(c * CHUNK + CHUNK, n) // 8):
            b = np.int64(coset[j])
            parity = 0
            for k in range(7):
                i = 8 * j + k
                f = _fine_context(k, b, uniform24(key, i), 0)
                t = table[f]
                code = np.int64(symbols[pos[t]])
                pos[t] += 1
                over += 1 if code > 2 * h - b else 0
                s = 2 * h - b - code if flipped[f] else code
                r = s - h + 1
                m[i] = r
                parity += r
            s_last = (parity & 1) + h - 1  # the parity of the eighth symbol, m_8 = sum of the others mod 2
            counts[_fine_context(7, b, uniform24(key, 8 * j + 7), s_last)] += 1
        bad[c] = over
    return fine_counts, bad.sum()


@parallel_kernel(count_arg=8)
def finish(symbols, coset, key, h, step, table, flipped, offsets, m, out):
    """The eighth coordinates from their coded symbols, then ``step (lambda - z)`` of every coordinate
    (float32 into ``out``); returns the number of symbols beyond ``2h - b`` or of the wrong parity."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(chunks, np.int64)
    for c in prange(chunks):
        pos = offsets[c].copy()
        over = 0
        for j in range(c * CHUNK // 8, min(c * CHUNK + CHUNK, n) // 8):
            b = np.int64(coset[j])
            i0 = 8 * j
            parity = 0
            for k in range(7):
                parity += np.int64(m[i0 + k])
            v = uniform24(key, i0 + 7)
            f = _fine_context(7, b, v, (parity & 1) + h - 1)
            t = table[f]
            code = np.int64(symbols[pos[t]])
            pos[t] += 1
            s = 2 * h - b - code if flipped[f] else code
            r = s - h + 1
            over += 1 if code > 2 * h - b or (r - parity) & 1 else 0
            m[i0 + 7] = r
            half = 0.5 * b
            for k in range(8):
                z = _TWO * np.float64(uniform24(key, i0 + k))
                out[i0 + k] = np.float32(step * ((np.float64(m[i0 + k]) + half) - z))
        bad[c] = over
    return bad.sum()


@parallel_kernel
def pack(m, coset, h, width, out):
    """Symbols ``m + h - 1`` packed at ``width`` bits (the cosets go separately, one bit per block)."""
    n = m.size
    chunks = (n + CHUNK - 1) // CHUNK
    for c in prange(chunks):
        lo = c * CHUNK
        hi = min(lo + CHUNK, n)
        codes = np.empty(hi - lo, np.uint16)
        for i in range(lo, hi):
            codes[i - lo] = np.int64(m[i]) + h - 1
        pack_into(codes, hi - lo, width, out, (lo * width) // 8)


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
