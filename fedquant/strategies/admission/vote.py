"""A round's vote: decoded updates in; running sums, the consensus and the round's references out.

:class:`Vote` is held in the round's state (``TrainRound.vote``) and forgotten with it.

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
sums again from the updates it kept; an attacker can make a round take that slower path (a float64
sum where the running one is float32: the two agree to float32 rounding), never change what it sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedquant.codecs.deferred import DeferredValues
from fedquant.codecs.kernels.norms import accumulate_bounded, add_scaled
from fedquant.records import RecordError, checked_squares
from fedquant.strategies.admission.cosines import consensus_cosine, consensus_terms, consensus_terms_many, squares_of
from fedquant.strategies.reply_decoder import DecodedReply, float_update

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


@dataclass(frozen=True)
class MetricSchema:
    """What every admitted MetricRecord of a round holds.

    Attributes
    ----------
    keys : frozenset of str
        Exactly these keys (after :func:`conform`).
    lists : dict of str to int
        The keys sent as lists, with their length; every other key is a number.
    strict : bool
        True when a strict majority carried ``keys``: a reply with other keys is rejected. False
        when no key set had one: extra keys are stripped, missing ones still reject.
    """

    keys: frozenset[str]
    lists: dict[str, int] = field(default_factory=dict)
    strict: bool = True


@dataclass
class Vote:
    """One round's vote, for the rules to judge by: the first vote's sums and consensus, the round's references.

    ``consensus`` is the sum of the first vote's updates after the norm rule (clipped, so a
    minority moves it by at most its clipped share), ``voters`` how many it holds, ``squares``
    ``<c, c>`` of each of its entries; ``schema`` the round's metric keys and ``weight_reference``
    its reference weight, both from screening.
    """

    kind: str = "train"
    sums: VoteSums | None = None
    schema: MetricSchema | None = None
    weight_reference: float | None = None
    consensus: dict[str, np.ndarray] = field(default_factory=dict)
    voters: int = 0
    squares: dict[str, float] = field(default_factory=dict)

    def set_consensus(self, decoded: Sequence[DecodedReply], received: Sequence[Mapping[str, np.ndarray]]) -> None:
        """The consensus of the first vote's updates ``decoded`` (as the norm rule left them).

        The running sums give the encoded entries' part when they hold exactly ``decoded`` (nobody
        rejected or clipped by the norm rule); else every update is summed again.
        """
        if not decoded:
            return
        sums = self.sums
        total: dict[str, np.ndarray] = {}
        if sums is not None and sums.keeps_consensus and sums.holds_exactly(decoded):
            for reply, sent in zip(decoded, received, strict=True):
                plain = {k: v for k, v in float_update(reply, sent, deferred=True).items() if k not in reply.updates}
                _add_update(total, plain)
            for name, flat in sums.consensus.items():
                total[name] = flat.reshape(received[0][name].shape)
        else:
            for reply, sent in zip(decoded, received, strict=True):
                _add_update(total, float_update(reply, sent))
        self.consensus, self.voters = total, len(decoded)
        self.squares = squares_of(total)

    def terms_of(
        self, decoded: Sequence[DecodedReply], received: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, tuple[float, float]]]:
        """Each update's inner products with the consensus, in one pass over the consensus for all."""
        updates = [float_update(d, r, deferred=True) for d, r in zip(decoded, received, strict=True)]
        return consensus_terms_many(updates, self.consensus)

    def take_consensus(self) -> dict[str, np.ndarray]:
        """The consensus buffers (float64), forgotten here: the rules are done with them once the
        round's replies are admitted, and the weighted mean can reuse their memory."""
        consensus, self.consensus = self.consensus, {}
        return consensus


class Ballot:
    """One update as the direction rules judge it against the vote's consensus.

    ``in_vote``: the update is in the consensus (a first-vote reply); its inner products with the
    consensus are taken once, on first use, for every rule that asks a cosine.
    """

    def __init__(
        self,
        vote: Vote,
        node: int,
        decoded: DecodedReply,
        received: Mapping[str, np.ndarray],
        in_vote: bool,
        terms: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self.vote, self.node, self.in_vote, self.voters = vote, node, in_vote, vote.voters
        self._decoded, self._received, self._terms = decoded, received, terms

    @property
    def terms(self) -> Mapping[str, tuple[float, float]]:
        """``(<u, c>, <u, u>)`` per entry of the update and the consensus."""
        if self._terms is None:
            self._terms = consensus_terms(
                float_update(self._decoded, self._received, deferred=True), self.vote.consensus
            )
        return self._terms

    def cosine(self, self_weight: float) -> float | None:
        """The update's cosine with ``consensus + self_weight x update`` (None when either is zero)."""
        return consensus_cosine({}, self.vote.consensus, self_weight, self.vote.squares, self.terms)


def _add_update(total: dict[str, np.ndarray], update: Mapping[str, np.ndarray]) -> None:
    """``total += update`` entry by entry, in float64 (the first update is copied in)."""
    for name, value in update.items():
        if name in total:
            add_scaled(total[name].reshape(-1), np.ascontiguousarray(value).reshape(-1), 1.0)
        else:
            total[name] = value.astype(np.float64)
