"""The sums a round needs of its first vote's updates, added while each decoded update is in cache.

The direction rules need the consensus (the sum of the vote's updates) and a FedAvg-like inner
strategy needs the weighted sum of the admitted updates. Both would otherwise take a pass of their
own over every decoded update, long after it left the cache. :class:`VoteSums` adds each update of
the vote to both in the pass that checks it (:func:`~fedquant.codecs.kernels.norms.accumulate_bounded`,
the decode's own ``base + update`` check), before the vote is judged: *speculatively*. The sums
stand only when the vote ends as they assumed:

* the consensus, when the replies the norm rule let through are exactly those added, unclipped;
* the weighted sum, when the replies FedAvg aggregates are exactly those added, unclipped, with
  the weights they were added with.

Otherwise (a rejected or clipped reply, a reply that failed halfway through its decode) the caller
sums again from the updates it kept, as before; an attacker can make a round take that slower path,
never change its result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels.norms import accumulate_bounded
from fedquant.records import RecordError, checked_squares
from fedquant.strategies.reply_decoder import DecodedReply

_NONE = np.zeros(0, np.float64)
_NONE32 = np.zeros(0, np.float32)


class VoteSums:
    """Running sums of the encoded entries of a vote's updates: their plain sum (float32; the
    consensus) and their weighted sum (float64, each update times its reply's weight).

    While every reply has come with the same weight ``w``, the weighted sum is ``w`` times the
    plain sum and is not kept apart (federations of equal clients pay for one sum, not two); the
    first reply of another weight starts it, from the plain sum so far.

    Parameters
    ----------
    consensus : bool
        The plain sum is needed as such (the direction rules are on).
    weighted : bool
        The weighted sum is needed (the inner strategy aggregates as FedAvg does).
    """

    def __init__(self, consensus: bool, weighted: bool) -> None:
        self.keeps_consensus = consensus
        self.keeps_weighted = weighted
        self.consensus: dict[str, np.ndarray] = {}  # the plain sum (also kept for the weighted one)
        self.weighted: dict[str, np.ndarray] | None = None  # started by the first reply of another weight
        self.members: list[DecodedReply] = []  # the replies added, in order
        self.weights: list[float] = []
        self.intact = True  # False once a reply was added in part (its decode failed halfway)
        self._weight = 0.0
        self._pending = False
        self._bounds: dict[int, tuple[float, np.ndarray]] = {}  # id -> (max |array|, the array: keeps the id valid)

    @property
    def active(self) -> bool:
        """Whether any sum is kept."""
        return self.keeps_consensus or self.keeps_weighted

    def squares(self, weight: float):
        """The ``squares`` hook of :meth:`fedquant.records.RecordCodec.decode` for the next reply
        (its FedAvg weight ``weight``): checks each decoded update and adds it to the sums.

        Call :meth:`joined` once the reply is decoded, or :meth:`failed` if its decode raised.
        """
        self._weight = float(weight)
        self._pending = True
        if self.keeps_weighted and self.weighted is None and self.weights and self._weight != self.weights[0]:
            w = self.weights[0]
            self.weighted = {name: w * flat.astype(np.float64) for name, flat in self.consensus.items()}
        return self._add

    def _add(self, name: str, reference: np.ndarray, update: np.ndarray | DeferredValues) -> float:
        deferred = isinstance(update, DeferredValues)
        if reference.dtype != np.float32:  # rare (float16/64 models): the plain check, then plain sums
            update = update.materialize().numpy() if deferred else update
            squares = checked_squares(name, reference, update)
            self._add_slow(name, update.reshape(-1))
            return squares
        size = update.numel if deferred else update.size
        if size != reference.size:
            raise RecordError(f"'{name}': the update holds {size} elements, the received tensor {reference.size}")
        consensus = self._buffer(self.consensus, name, size, np.float32) if self.active else _NONE32
        weighted = self._buffer(self.weighted, name, size, np.float64) if self.weighted is not None else _NONE
        base = np.ascontiguousarray(reference).reshape(-1)
        if deferred:  # the values computed in this pass from the payload's symbols, never stored
            squares, nonfinite = update.accumulate(base, consensus, weighted, self._weight, self._bound(reference))
        else:
            squares, nonfinite = accumulate_bounded(
                base, update.reshape(-1), consensus, weighted, self._weight, self._bound(reference)
            )
        if nonfinite:
            raise RecordError(f"'{name}': received + update overflows {reference.dtype} to Inf")
        return float(squares)

    def _bound(self, reference: np.ndarray) -> float:
        """``max |reference|`` (NaN when it holds a NaN), once per array sent this round: from its max
        and min, with no ``|reference|`` temporary (100 MB for a 25M-element tensor)."""
        key = id(reference)
        if key not in self._bounds:
            bound = 0.0
            if reference.size:
                high, low = float(reference.max()), float(reference.min())  # NaN if one is NaN
                bound = max(high, -low) if not math.isnan(high) else math.nan
            self._bounds[key] = (bound, reference)
        return self._bounds[key][0]

    def _add_slow(self, name: str, flat: np.ndarray) -> None:
        if self.active:
            self._buffer(self.consensus, name, flat.size, np.float32)[...] += flat
        if self.weighted is not None:
            self._buffer(self.weighted, name, flat.size, np.float64)[...] += self._weight * flat.astype(np.float64)

    def _buffer(self, sums: dict[str, np.ndarray], name: str, size: int, dtype: type) -> np.ndarray:
        buffer = sums.get(name)
        if buffer is None:
            buffer = sums[name] = np.zeros(size, dtype)
        elif buffer.size != size:  # replies disagree on a tensor's size: only the slow sums can tell
            self.intact = False
            buffer = np.zeros(size, dtype)
        return buffer

    def joined(self, decoded: DecodedReply) -> None:
        """The reply whose decode the last :meth:`squares` hook served succeeded: it is in the sums."""
        if self._pending:
            self.members.append(decoded)
            self.weights.append(self._weight)
            self._pending = False

    def failed(self) -> None:
        """The reply whose decode the last hook served was refused: part of it may be in the sums."""
        if self._pending:
            self.intact = False
            self._pending = False

    def holds_exactly(self, replies: Sequence[DecodedReply]) -> bool:
        """Whether the sums hold exactly ``replies`` (the same objects, in the same order), nothing else."""
        return (
            self.intact
            and len(replies) == len(self.members)
            and all(a is b for a, b in zip(replies, self.members, strict=True))
        )

    def weighted_sum_of(
        self, replies: Sequence[DecodedReply], weights: Sequence[float]
    ) -> tuple[Mapping[str, np.ndarray], float] | None:
        """``(sums, total)`` with ``sums / total`` the weighted mean of the encoded entries (flat)
        over exactly ``replies`` (as admitted: the same objects, in any order) with ``weights``, when
        the sums hold exactly that; else None.

        The sums are the weighted sum and the total weight, or, when every reply came with one
        weight, the plain sum and the number of replies. The caller may scale them in place.
        """
        if not (self.keeps_weighted and self.intact and len(replies) == len(self.members)):
            return None
        added = {id(d): w for d, w in zip(self.members, self.weights, strict=True)}
        for reply, weight in zip(replies, weights, strict=True):
            if added.get(id(reply)) != weight:
                return None
        if self.weighted is None:
            return self.consensus, float(len(replies))
        return self.weighted, float(sum(weights))
