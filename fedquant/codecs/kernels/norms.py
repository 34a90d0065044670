"""Sums of squares of float32 tensors in one pass, without a float64 copy (the server's update norms).

The server needs each decoded update's L2 norm (the admission rules compare them) and, for a
float32 model, ``received + update``. Upcasting a 25M-element update to float64 to take its
norm cost more than decoding it; a float32 sum of squares is not an option either (it overflows
above ``1.8e19`` per element, underflows below ``1e-23`` and loses ~1e-3 relative over 2**25
terms). These kernels read float32 and square and add in float64 registers, by blocks of
``BLOCK`` elements (each block's sum is exact to ~``BLOCK`` float64 roundings, the blocks are
then added pairwise), so the result matches the float64 reference to ~1e-12 relative at any
size, never overflows (``2**31`` squares of the largest float32 fit a float64) and keeps tiny
values. :func:`add_sum_squares` also writes ``received + update`` in the same pass and counts
the non-finite sums, :func:`checked_sum_squares` counts them without writing the sum (a server
that aggregates the updates themselves never builds it); :func:`dot_terms` gives the inner
products of an update's cosine with the round's consensus (the direction rules) and
:func:`add_scaled` adds ``factor x update`` to a float64 sum (the consensus, the weighted mean of
a round's updates), both without the float64 copies NumPy would make.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numba import njit, prange
from numba.typed import List

from fedquant.jit import parallel_kernel

#: Elements per block (one float64 partial sum each).
BLOCK = 4096
#: The fast-math flags of the sums within a block: reassociation (so that the loops vectorize
#: into several partial sums, in an order fixed by the compiled code) and nothing that assumes
#: finite values, so an Inf or NaN still shows in the result.
REASSOCIATE = {"reassoc", "nsz", "contract"}
_F32_MAX = np.float32(np.finfo(np.float32).max)


def _sum_squares_twin(x: np.ndarray) -> float:
    return float(np.dot(x.astype(np.float64), x.astype(np.float64))) if x.size else 0.0


def _add_sum_squares_twin(base: np.ndarray, update: np.ndarray, out: np.ndarray) -> tuple[float, int]:
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(base, update, out=out)
    return _sum_squares_twin(update), int(out.size - np.count_nonzero(np.isfinite(out)))


def _nonfinite_sums(base: np.ndarray, update: np.ndarray) -> int:
    with np.errstate(over="ignore", invalid="ignore"):
        total = base + update
    return int(total.size - np.count_nonzero(np.isfinite(total)))


def _checked_sum_squares_twin(base: np.ndarray, update: np.ndarray) -> tuple[float, int]:
    return _sum_squares_twin(update), _nonfinite_sums(base, update)


def _add_scaled_twin(acc: np.ndarray, update: np.ndarray, factor: float) -> None:
    acc += factor * update.astype(np.float64)


def _accumulate_twin(update: np.ndarray, consensus: np.ndarray, weighted: np.ndarray, weight: float) -> float:
    if consensus.size:
        consensus += update
    if weighted.size:
        weighted += weight * update.astype(np.float64)
    return _sum_squares_twin(update)


def _checked_accumulate_twin(
    base: np.ndarray, update: np.ndarray, consensus: np.ndarray, weighted: np.ndarray, weight: float
) -> tuple[float, int]:
    nonfinite = _nonfinite_sums(base, update)
    return _accumulate_twin(update, consensus, weighted, weight), nonfinite


def _dot_terms_twin(update: np.ndarray, consensus: np.ndarray) -> tuple[float, float]:
    u = update.astype(np.float64)
    return float(np.dot(u, consensus.astype(np.float64))), float(np.dot(u, u))


@njit(cache=True, fastmath=REASSOCIATE)
def _block_squares(x, lo, hi):
    """``sum(x[lo:hi]**2)`` in float64."""
    acc = 0.0
    seg = x[lo:hi]  # indices from 0 up: no negative-index wraparound to test, the loop vectorizes
    for j in range(seg.size):
        v = np.float64(seg[j])
        acc += v * v
    return acc


@njit(cache=True, fastmath=REASSOCIATE)
def _block_checked(base, update, out, lo, hi, write):
    """``(sum(update[lo:hi]**2), how many float32 base + update are not finite)``, ``out`` written when ``write``.

    Not finite is ``not |s| <= FLOAT32_MAX``, true for Inf and NaN (a comparison, which the
    reassociation the sums are allowed does not touch).
    """
    acc = 0.0
    nonfinite = 0
    us, bs, outs = update[lo:hi], base[lo:hi], out[lo:hi]
    for j in range(us.size):
        u = us[j]
        t = bs[j] + u
        if write:
            outs[j] = t
        nonfinite += not abs(t) <= _F32_MAX
        v = np.float64(u)
        acc += v * v
    return acc, nonfinite


@parallel_kernel(twin=_sum_squares_twin)
def sum_squares(x):
    """``sum(x**2)`` of a 1-D float32 array, accumulated in float64 by blocks."""
    n = x.size
    blocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(blocks, np.float64)
    for b in prange(blocks):
        partial[b] = _block_squares(x, b * BLOCK, min(n, (b + 1) * BLOCK))
    return partial.sum()


@parallel_kernel(count_arg=1, twin=_add_sum_squares_twin)
def add_sum_squares(base, update, out):
    """``out = base + update`` (float32, 1-D, same length); returns ``(sum(update**2), non-finite outs)``."""
    n = update.size
    blocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(blocks, np.float64)
    bad = np.zeros(blocks, np.int64)
    for b in prange(blocks):
        partial[b], bad[b] = _block_checked(base, update, out, b * BLOCK, min(n, (b + 1) * BLOCK), True)
    return partial.sum(), bad.sum()


@parallel_kernel(count_arg=1, twin=_checked_sum_squares_twin)
def checked_sum_squares(base, update):
    """``(sum(update**2), how many float32 base + update are not finite)`` (float32, 1-D, same
    length), as :func:`add_sum_squares` returns them, without writing the sum."""
    n = update.size
    blocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(blocks, np.float64)
    bad = np.zeros(blocks, np.int64)
    for b in prange(blocks):
        partial[b], bad[b] = _block_checked(base, update, update, b * BLOCK, min(n, (b + 1) * BLOCK), False)
    return partial.sum(), bad.sum()


@njit(cache=True, fastmath=REASSOCIATE)
def block_accumulate(base, update, consensus, weighted, weight, lo, hi, check):
    """:func:`_block_checked` of ``lo .. hi`` that also adds the update to the running sums; without
    ``check`` only the squares (``base`` unread, the count 0)."""
    acc = 0.0
    nonfinite = 0
    us = update[lo:hi]
    if consensus.size:
        cs = consensus[lo:hi]
        for j in range(us.size):
            cs[j] += us[j]
    if weighted.size:
        ws = weighted[lo:hi]
        for j in range(us.size):
            ws[j] += weight * np.float64(us[j])
    if not check:
        return _block_squares(update, lo, hi), 0
    bs = base[lo:hi]
    for j in range(us.size):
        u = us[j]
        nonfinite += not abs(bs[j] + u) <= _F32_MAX
        v = np.float64(u)
        acc += v * v
    return acc, nonfinite


@parallel_kernel(count_arg=1, twin=_checked_accumulate_twin)
def checked_accumulate(base, update, consensus, weighted, weight):
    """:func:`checked_sum_squares` of ``update`` against ``base``, and the update added to two running
    sums in the same pass (while it is in cache): ``consensus += update`` (float32) and
    ``weighted += weight x update`` (float64). Either
    sum may be an empty array (not kept). Returns ``(sum(update**2), non-finite base + update)``;
    the sums are written whatever the count (a caller that rejects the update discards them).
    """
    n = update.size
    blocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(blocks, np.float64)
    bad = np.zeros(blocks, np.int64)
    for b in prange(blocks):
        partial[b], bad[b] = block_accumulate(
            base, update, consensus, weighted, weight, b * BLOCK, min(n, (b + 1) * BLOCK), True
        )
    return partial.sum(), bad.sum()


@parallel_kernel(twin=_accumulate_twin)
def _accumulate(update, consensus, weighted, weight):
    """:func:`checked_accumulate` without the check (``base`` unread): ``sum(update**2)``, the sums added."""
    n = update.size
    blocks = (n + BLOCK - 1) // BLOCK
    partial = np.zeros(blocks, np.float64)
    for b in prange(blocks):
        partial[b] = block_accumulate(
            update, update, consensus, weighted, weight, b * BLOCK, min(n, (b + 1) * BLOCK), False
        )[0]
    return partial.sum()


#: ``|u_i| <= ||u||``; this margin covers the float64 rounding of ``sqrt(sum(u**2))`` and of the sum.
_BOUND_MARGIN = 1.0 - 2.0**-20


def accumulate_bounded(
    base: np.ndarray,
    update: np.ndarray,
    consensus: np.ndarray,
    weighted: np.ndarray,
    weight: float,
    base_bound: float,
) -> tuple[float, int]:
    """:func:`checked_accumulate`, given ``base_bound >= max |base|`` (NaN: none known): the pass reads
    ``update`` and the sums but not ``base`` (4 bytes an element less), and counts the non-finite
    ``base + update`` only when ``||update|| + base_bound`` may reach ``FLOAT32_MAX`` (every
    ``|update_i| <= ||update||``; a NaN or Inf makes the norm NaN or Inf and takes the count too).
    The count is then exact as :func:`checked_accumulate`'s; the squares agree to float64 rounding.
    """
    squares = float(_accumulate(update, consensus, weighted, weight))
    return squares, nonfinite_beyond(squares, base, update, base_bound)


def nonfinite_beyond(squares: float, base: np.ndarray, update: np.ndarray, base_bound: float) -> int:
    """How many float32 ``base + update`` are not finite, given ``squares = sum(update**2)`` and
    ``base_bound >= max |base|`` (NaN: none known): 0, reading neither, where ``||update|| +
    base_bound`` stays below ``FLOAT32_MAX`` (see :func:`accumulate_bounded`), else counted."""
    if math.sqrt(squares) + base_bound <= float(_F32_MAX) * _BOUND_MARGIN:
        return 0
    return int(checked_sum_squares(base, update)[1])


@parallel_kernel(count_arg=1, twin=_add_scaled_twin)
def add_scaled(acc, update, factor):
    """``acc += factor x update`` in place: ``acc`` float64, ``update`` float32, 1-D, one length.

    Each element takes one float64 product and one addition, as NumPy's
    ``acc += factor * update.astype(np.float64)`` does (bit for bit), without the copy.
    """
    for i in prange(update.size):
        acc[i] += factor * np.float64(update[i])


def _add_scaled_float32_twin(acc: np.ndarray, base: np.ndarray, factor: float, out: np.ndarray) -> None:
    out[...] = (acc + factor * base.astype(np.float64)).astype(np.float32)


@parallel_kernel(count_arg=1, twin=_add_scaled_float32_twin)
def add_scaled_float32(acc, base, factor, out):
    """``out = float32(acc + factor x base)``: ``acc`` float64, ``base`` and ``out`` float32, 1-D, one
    length (the last step of a weighted mean: the received model's share added, rounded once)."""
    for i in prange(base.size):
        out[i] = np.float32(acc[i] + factor * np.float64(base[i]))


@njit(cache=True, fastmath=REASSOCIATE)
def _block_dot(update, consensus, lo, hi):
    dot = 0.0
    own = 0.0
    us, cs = update[lo:hi], consensus[lo:hi]
    for j in range(us.size):
        u = np.float64(us[j])
        dot += u * np.float64(cs[j])
        own += u * u
    return dot, own


@parallel_kernel(twin=_dot_terms_twin)
def dot_terms(update, consensus):
    """``(<u, c>, <u, u>)`` of ``update`` (float32) and ``consensus`` (float32 or float64), both 1-D of
    one length: float64 by blocks, no temporary arrays (the direction rules' inner products; see
    :func:`cosine_with`)."""
    n = update.size
    blocks = (n + BLOCK - 1) // BLOCK
    dots = np.zeros(blocks, np.float64)
    owns = np.zeros(blocks, np.float64)
    for b in prange(blocks):
        dots[b], owns[b] = _block_dot(update, consensus, b * BLOCK, min(n, (b + 1) * BLOCK))
    return dots.sum(), owns.sum()


#: Blocks of a consensus :func:`dot_terms_many` reads once for all updates (512 KiB of float32:
#: it stays in L2 while every update's part is read against it).
MANY_GROUP = 32


def _dot_terms_many_twin(updates, consensus: np.ndarray, terms: np.ndarray) -> None:
    for k, update in enumerate(updates):
        terms[k] = _dot_terms_twin(update, consensus)


@njit(cache=True)
def _row_sums(parts, terms, column):
    """``terms[k, column] = sum(parts[k])`` in order (a plain loop: the same sums serial or parallel)."""
    for k in range(parts.shape[0]):
        acc = 0.0
        for b in range(parts.shape[1]):
            acc += parts[k, b]
        terms[k, column] = acc


@parallel_kernel(count_arg=1, twin=_dot_terms_many_twin)
def _dot_terms_many(updates, consensus, terms):
    n = consensus.size
    count = len(updates)
    blocks = (n + BLOCK - 1) // BLOCK
    dots = np.zeros((count, blocks), np.float64)
    owns = np.zeros((count, blocks), np.float64)
    for g in prange((blocks + MANY_GROUP - 1) // MANY_GROUP):
        for k in range(count):
            update = updates[k]
            for b in range(g * MANY_GROUP, min(blocks, (g + 1) * MANY_GROUP)):
                dots[k, b], owns[k, b] = _block_dot(update, consensus, b * BLOCK, min(n, (b + 1) * BLOCK))
    _row_sums(dots, terms, 0)
    _row_sums(owns, terms, 1)


def dot_terms_many(updates: Sequence[np.ndarray], consensus: np.ndarray) -> list[tuple[float, float]]:
    """:func:`dot_terms` of each of ``updates`` with one ``consensus``, which is read once for all.

    Per update, :func:`dot_terms` reads the consensus again (4 bytes an element, as much as the
    update itself): for a vote of many updates, the same consensus from memory each time. Here each
    group of ``MANY_GROUP`` blocks of it stays in cache while every update's part is read against
    it (100 updates of 1M, one core: 0.50 -> 0.37 ms each). The block sums are
    :func:`dot_terms`'s; they are added in block order, so the result does not depend on the
    thread count (it may differ from :func:`dot_terms`'s by a float64 rounding).

    Parameters
    ----------
    updates : sequence of numpy.ndarray
        1-D float32 arrays, each as long as ``consensus``.
    consensus : numpy.ndarray
        1-D, float32 or float64.

    Returns
    -------
    list of tuple of float
        ``(<u, c>, <u, u>)`` per update, in order.
    """
    for update in updates:
        if update.dtype != np.float32 or update.ndim != 1 or update.size != consensus.size:
            raise ValueError("dot_terms_many takes 1-D float32 updates as long as the consensus")
    if not updates:
        return []
    terms = np.zeros((len(updates), 2), np.float64)
    _dot_terms_many(List(updates), consensus, terms)
    return [(float(dot), float(own)) for dot, own in terms]


def cosine_with(dot: float, own: float, consensus_squares: float, weight: float) -> tuple[float, float, float]:
    """``(<u, c'>, <c', c'>, <u, u>)`` for ``c' = c + weight x u`` from ``dot = <u, c>``, ``own = <u, u>``
    and ``consensus_squares = <c, c>`` (one pass over each update instead of three sums; the
    consensus's own squares are taken once per round). ``<c', c'>`` is expanded in float64, which
    loses to cancellation only where ``c'`` is ~1e-8 of ``c`` and ``u``: never for a consensus of two
    or more other updates, which is when the direction rules look at it."""
    return dot + weight * own, consensus_squares + 2.0 * weight * dot + weight * weight * own, own
