"""The folds the direction rules take of an update against the round's consensus (float64 sums).

``<u, c>`` and ``<u, u>`` per entry, in one pass over each, for one update or for a vote's updates
in one pass over the consensus; the cosine of an update with the consensus, with or without itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels.norms import cosine_with, dot_terms, dot_terms_many, sum_squares


def consensus_terms(
    update: Mapping[str, np.ndarray | DeferredValues], consensus: Mapping[str, np.ndarray]
) -> dict[str, tuple[float, float]]:
    """``(<u, c>, <u, u>)`` per entry both hold (float64, one pass over each): what
    :func:`consensus_cosine` needs of the update, for any ``self_weight`` (a caller that asks for
    two cosines of one update passes these to both instead of reading it twice). An entry may be
    deferred (:func:`float_update` with ``deferred``): its values are computed in the pass."""
    terms = {}
    for k in update:
        if k not in consensus or not _same_layout(update[k], consensus[k]):
            continue
        c = np.ascontiguousarray(consensus[k]).ravel()  # float32 (the vote's running sum) or float64
        if isinstance(update[k], DeferredValues):
            terms[k] = update[k].dot_terms(c)
        else:
            terms[k] = dot_terms(np.ascontiguousarray(update[k], dtype=np.float32).ravel(), c)
    return terms


def consensus_terms_many(
    updates: Sequence[Mapping[str, np.ndarray | DeferredValues]], consensus: Mapping[str, np.ndarray]
) -> list[dict[str, tuple[float, float]]]:
    """:func:`consensus_terms` of each of ``updates``, reading each entry of the consensus once for all
    of them where their values are in memory (:func:`~fedquant.codecs.kernels.norms.dot_terms_many`);
    a deferred entry not written out yet computes its values in a pass of its own, as there."""
    found: list[dict[str, tuple[float, float]]] = [{} for _ in updates]
    for name, entry in consensus.items():
        c = np.ascontiguousarray(entry).ravel()
        batch, arrays = [], []
        for i, update in enumerate(updates):
            value = update.get(name)
            if value is None or not _same_layout(value, entry):
                continue
            if isinstance(value, DeferredValues):
                stored = value.written()
                if stored is None:
                    found[i][name] = value.dot_terms(c)
                    continue
                value = stored
            batch.append(i)
            arrays.append(np.ascontiguousarray(value, dtype=np.float32).ravel())
        for i, terms in zip(batch, dot_terms_many(arrays, c), strict=True):
            found[i][name] = terms
    return [{k: terms[k] for k in update if k in terms} for update, terms in zip(updates, found, strict=True)]


def consensus_cosine(
    update: Mapping[str, np.ndarray | DeferredValues],
    consensus: Mapping[str, np.ndarray],
    self_weight: float,
    consensus_squares: Mapping[str, float] | None = None,
    terms: Mapping[str, tuple[float, float]] | None = None,
) -> float | None:
    """Cosine between an update and ``consensus + self_weight x update``, over the entries both hold;
    None when either is zero. ``self_weight`` 1 adds the update to a consensus without it, -1 leaves
    it out of one that holds it (leave-one-out), 0 takes the consensus as it is.
    ``consensus_squares`` (:func:`squares_of`) saves a pass over the consensus per call, ``terms``
    (:func:`consensus_terms` of this update and consensus) the pass over the update."""
    if terms is None:
        terms = consensus_terms(update, consensus)
    dot = square = own = 0.0
    for k, (uc, uu) in terms.items():
        c = consensus[k]
        cc = consensus_squares[k] if consensus_squares is not None else _squares(np.ascontiguousarray(c).ravel())
        parts = cosine_with(uc, uu, cc, float(self_weight))
        dot, square, own = dot + parts[0], square + parts[1], own + parts[2]
    if not (square > 0 and own > 0):
        return None
    return dot / math.sqrt(square * own)


def squares_of(consensus: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``<c, c>`` of each entry of a consensus (float64 sums), for :func:`consensus_cosine`."""
    return {k: _squares(np.ascontiguousarray(v).ravel()) for k, v in consensus.items()}


def _squares(c: np.ndarray) -> float:
    return float(sum_squares(c)) if c.dtype == np.float32 else float(np.dot(c, c))


def _same_layout(update: np.ndarray | DeferredValues, consensus: np.ndarray) -> bool:
    if isinstance(update, DeferredValues):
        return update.numel == consensus.size
    return update.shape == consensus.shape
