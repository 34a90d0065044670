"""The relative admission rules of a run: their references across rounds and the steps a round takes.

:class:`~fedquant.strategies.QuantizedStrategy` holds one :class:`InfluenceBounds` and calls, per
train round: :meth:`~InfluenceBounds.screen_non_float` before decoding (integer and bool entries,
cheap), :meth:`~InfluenceBounds.judge_update` for every decoded reply (reject or clip its norm),
:meth:`~InfluenceBounds.bound_weights` on the admitted replies, :meth:`~InfluenceBounds.end_round`;
per evaluate round :meth:`~InfluenceBounds.bound_weights`. Each step is a function of the round's
replies and this object's references, so a staged round can call them in its own order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
from flwr.app import Message, MetricRecord

from fedquant.codecs.kernels.norms import add_scaled
from fedquant.strategies.admission import (
    REASON_NON_FLOAT,
    REASON_NORM,
    REASON_PAYLOAD,
    AdmissionRules,
    MedianReference,
    Reference,
)
from fedquant.strategies.direction import DirectionHistory
from fedquant.strategies.metric_screen import weights_of, write_weights
from fedquant.strategies.reply_decoder import DecodedReply, RejectedReply
from fedquant.strategies.update_bounds import (
    bool_digest,
    bool_majority,
    clip_update,
    consensus_cosine,
    consensus_terms,
    consensus_terms_many,
    float_update,
    integer_change,
    non_float_names,
    scale_integers,
    sent_bool_digest,
    squares_of,
)
from fedquant.strategies.vote_sums import VoteSums

Reject = Callable[[int, tuple[str, str]], None]


class InfluenceBounds:
    """Minority-proof references (update norm, integer change, train and evaluate weights) and the rules using them.

    Parameters
    ----------
    rules : AdmissionRules
        The factors and switches.
    weight_key : str
        The metric the inner strategy weights replies by.
    """

    def __init__(self, rules: AdmissionRules, weight_key: str) -> None:
        self.rules = rules
        self.weight_key = weight_key
        self.norms = MedianReference()
        self.integer_changes = MedianReference()
        self.weights = {"train": MedianReference(), "evaluate": MedianReference()}
        self.consensus: dict[str, np.ndarray] = {}  # the sum of the round's first-vote updates
        self.voters = 0  # how many updates that sum holds
        self.consensus_squares: dict[str, float] = {}  # <c, c> of each of its entries
        persistence = rules.persistent_opposition
        self.directions = DirectionHistory(persistence) if persistence is not None else None
        self.round_weight: dict[str, float | None] = {}  # per kind, the round's reference weight

    def __repr__(self) -> str:
        return f"InfluenceBounds(norms={self.norms!r})"

    # ------------------------------------------------------------------ non-float entries
    def screen_non_float(
        self,
        replies: Mapping[int, Message],
        received: Callable[[int], Mapping[str, np.ndarray]],
        reject: Reject,
    ) -> tuple[dict[int, Message], int]:
        """The replies whose integer and bool entries pass, and how many had their integer change clipped.

        ``reject(node, problem)`` is called for the others.
        """
        if not self.rules.check_non_float or not replies:
            return dict(replies), 0
        sent = received(next(iter(replies)))
        ints, bools = non_float_names(sent)
        if not ints and not bools:
            return dict(replies), 0
        changes: dict[int, float] = {}
        digests: dict[int, bytes] = {}
        kept: dict[int, Message] = {}
        for node, reply in replies.items():
            try:
                changes[node] = integer_change(reply.content, received(node), ints)
                digests[node] = bool_digest(reply.content, received(node), bools)
            except RejectedReply as err:
                reject(node, (REASON_PAYLOAD, str(err)))
                continue
            kept[node] = reply
        majority = bool_majority(digests, sent_bool_digest(sent, bools))
        reference = self.integer_changes.value(list(changes.values())) if ints else None
        admitted: dict[int, Message] = {}
        clipped = 0
        admitted_changes: list[float] = []
        for node, reply in kept.items():
            if bools and digests[node] != majority:
                reject(node, (REASON_NON_FLOAT, "its bool entries differ from those of the round's majority"))
                continue
            problem, scale = self._verdict(changes[node], reference)
            if problem is not None:
                reject(node, (REASON_NON_FLOAT, f"integer entries: {problem}"))
                continue
            if scale < 1:
                scale_integers(reply.content, received(node), ints, scale)
                clipped += 1
            admitted[node] = reply
            admitted_changes.append(changes[node] * scale)
        if ints:
            self.integer_changes.end_round(admitted_changes)
        return admitted, clipped

    def _verdict(self, norm: float, reference: float | None) -> tuple[str | None, float]:
        if reference is not None and reference == 0 and norm > 0 and self.rules.relative_norms:
            return "changed where the round's reference change is 0", 1.0
        return self.rules.norm_verdict(norm, reference)

    # ------------------------------------------------------------------ float updates
    def norm_reference(self, current: Sequence[float]) -> Reference | None:
        """The reference norm (and the spread of the norms) given this round's ``current`` norms (None
        when no relative rule is on)."""
        return self.norms.reference(current) if self.rules.relative_norms else None

    def norm_split(self, norms: Sequence[float]) -> float | None:
        """How far apart the upper and lower halves of a vote's norms lie (median of each), when that is
        more than ``norm_factor``: then the reference may be an attacker's, and the round should say so."""
        factor = self.rules.norm_factor
        if factor is None or len(norms) < 4:
            return None
        ordered = sorted(norms)
        half = len(ordered) // 2
        low, high = float(np.median(ordered[:half])), float(np.median(ordered[-half:]))
        if high > factor * low:
            return high / low if low > 0 else float("inf")
        return None

    def judge_update(
        self,
        decoded: DecodedReply,
        received: Mapping[str, np.ndarray],
        reference: Reference | None,
        record: MetricRecord | None = None,
    ) -> tuple[str | None, DecodedReply, list[str]]:
        """``(sentence, reply, clipped)``: a sentence when the update is rejected, else the reply,
        clipped to ``clip_factor x reference`` if needed (``clipped == ["update-norm"]``). ``record``,
        the reply's metrics, gives its weight (``norm_per_weight``)."""
        problem, scale = self.rules.norm_verdict(decoded.update_norm, reference, self.weight_ratio(record))
        if problem is not None or scale >= 1:
            return problem, decoded, []
        return None, clip_update(decoded, received, scale), [REASON_NORM]

    def start_round(self) -> None:
        """Forget the previous round's consensus."""
        self.consensus, self.voters, self.consensus_squares = {}, 0, {}

    def directions_on(self) -> bool:
        """Whether a direction rule needs the round's consensus."""
        return self.rules.reject_opposing or self.directions is not None

    def set_consensus(
        self,
        decoded: Sequence[DecodedReply],
        received: Sequence[Mapping[str, np.ndarray]],
        sums: VoteSums | None = None,
    ) -> None:
        """The round's consensus: the sum of the first vote's updates after the norm rule (clipped,
        so a minority moves it by at most its clipped share).

        ``sums``, the vote's running sums, give the encoded entries' part when they hold exactly
        ``decoded`` (nobody rejected or clipped by the norm rule); else every update is summed again.
        """
        if not self.directions_on() or not decoded:
            return
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
        self.consensus_squares = squares_of(total)

    def take_consensus(self) -> dict[str, np.ndarray]:
        """The round's consensus buffers (float64), forgotten here: the direction rules are done with
        them once the round's replies are admitted, and the weighted mean can reuse their memory."""
        consensus, self.consensus = self.consensus, {}
        return consensus

    def vote_terms(
        self, decoded: Sequence[DecodedReply], received: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, tuple[float, float]]] | None:
        """The inner products :meth:`opposition` takes of each of the first vote's updates with the
        consensus, for all of them in one pass over the consensus (:func:`consensus_terms_many`);
        None when no direction rule will look at them."""
        observes = self.directions is not None and self.voters - 1 >= 2  # as opposition decides, in the vote
        if not self.consensus or not decoded or not (observes or self.rules.reject_opposing):
            return None
        updates = [float_update(d, r, deferred=True) for d, r in zip(decoded, received, strict=True)]
        return consensus_terms_many(updates, self.consensus)

    def opposition(
        self,
        node: int,
        decoded: DecodedReply,
        received: Mapping[str, np.ndarray],
        in_vote: bool,
        terms: Mapping[str, tuple[float, float]] | None = None,
    ) -> str | None:
        """A sentence when the update points against the round's consensus (cosine below
        ``-opposing_margin``) or the node's updates have opposed the others persistently
        (``persistent_opposition``: its cosine with the sum of the round's *other* first-vote updates
        feeds the node's CUSUM, when there are at least two others), else None.

        The consensus counts the update itself (``in_vote``: it is in the first vote's sum; else it is
        added), so an update is rejected only when the others pull the other way more than it pulls its
        own: an honest update of noise alone (nearly orthogonal to the others) passes, a sign-flipped
        honest one is rejected once the honest updates agree (cosine above ``1 / (n - 1)`` between them,
        plus the margin). ``terms``, the update's inner products with the consensus when the caller
        has them (:meth:`vote_terms`), saves the pass that takes them.
        """
        if not self.consensus:
            return None
        update = float_update(decoded, received, deferred=True) if terms is None else {}
        # with one other update, who opposes whom is undecidable: both would be flagged
        if self.directions is not None and self.voters - in_vote >= 2:
            if terms is None:  # the update's inner products, one pass for both cosines
                terms = consensus_terms(update, self.consensus)
            others = consensus_cosine(update, self.consensus, -1 if in_vote else 0, self.consensus_squares, terms)
            if others is not None:
                self.directions.observe(node, others)
        if self.directions is not None and self.directions.persistent(node):
            return f"its updates point against the others' persistently (CUSUM {self.directions.sum_of(node):.3g})"
        if not self.rules.reject_opposing:
            return None
        if terms is None:
            terms = consensus_terms(update, self.consensus)
        cosine = consensus_cosine(update, self.consensus, 0 if in_vote else 1, self.consensus_squares, terms)
        if cosine is None or cosine >= -self.rules.opposing_margin:
            return None
        return f"its update points against the round's consensus (cosine {cosine:.3g})"

    # ------------------------------------------------------------------ weights
    def weight_ratio(self, record: MetricRecord | None) -> float:
        """A train reply's weight over the round's reference weight (1.0 when either is unknown)."""
        reference = self.round_weight.get("train")
        weights = weights_of([record], self.weight_key) if record is not None else None
        return float(weights[0]) / reference if weights and reference else 1.0

    def screen_weights(self, records: Mapping[int, MetricRecord], kind: str) -> dict[int, str]:
        """Per node, a sentence for the weights above ``weight_reject_factor`` x the round's reference
        (which is kept for :meth:`weight_ratio`)."""
        self.round_weight[kind] = None
        if weights_of(list(records.values()), self.weight_key) is None:
            return {}
        weights = {n: r[self.weight_key] for n, r in records.items()}
        reference = self.weights[kind].reference(list(weights.values()))
        self.round_weight[kind] = reference.value if reference is not None and reference.value > 0 else None
        if self.rules.weight_reject_factor is None:
            return {}
        problems = {n: self.rules.weight_outlier(w, reference, self.weight_key) for n, w in weights.items()}
        return {n: p for n, p in problems.items() if p is not None}

    def bound_weights(self, records: Sequence[MetricRecord], kind: str) -> int:
        """Clip the weights of admitted records relative to the round (written into them); how many were clipped."""
        weights = weights_of(records, self.weight_key)
        if weights is None:
            return 0
        reference = self.weights[kind].value(weights)
        bounded = self.rules.bound_weights(weights, reference)
        self.weights[kind].end_round(bounded)
        return write_weights(records, self.weight_key, bounded)

    # ------------------------------------------------------------------ rounds
    def end_round(self, admitted_norms: Sequence[float]) -> None:
        """Remember the round's admitted update norms (after clipping) for the next reference."""
        if self.rules.relative_norms:
            self.norms.end_round(admitted_norms)


def _add_update(total: dict[str, np.ndarray], update: Mapping[str, np.ndarray]) -> None:
    """``total += update`` entry by entry, in float64 (the first update is copied in)."""
    for name, value in update.items():
        if name in total:
            add_scaled(total[name].reshape(-1), np.ascontiguousarray(value).reshape(-1), 1.0)
        else:
            total[name] = value.astype(np.float64)
