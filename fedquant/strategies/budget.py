"""Upload deadline and byte budget: choose each sampled client's codec setting before a round.

A user with slow, heterogeneous links states what an upload may cost instead of picking levels:

* ``deadline_seconds=T`` with ``bandwidth(node) -> bytes/s``: each client gets the finest setting
  of its codec's rate ladder whose predicted reply fits ``bandwidth x T`` (the coarsest when none
  does);
* ``bytes_budget=B``: the round's predicted replies must sum to at most ``B``; the largest predicted
  reply is coarsened one step at a time until they fit (or every client is at the coarsest).

Both may be given. The settings are the codec's own :meth:`~fedquant.codecs.Codec.rate_ladder`
(each quantizer declares its ladder: ``levels`` steps, ``bits`` steps, ``fp32 -> fp16``, or the
codec alone), so the controller knows no parameter names.

Size model: the record codec's :meth:`~fedquant.records.RecordCodec.predict_bytes` of the reply
for the current model (from each quantizer's declared sizes: exact for fixed-width coding, an
upper bound for entropy and Elias coding), times a correction learned from the last ``window``
rounds: per round, the median observed/predicted ratio of the *admitted* replies of that setting
(so a rejected reply, or a minority of admitted ones, cannot move it), and over the rounds the
largest, which brings the bound down to what entropy coding really achieves without
under-estimating it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Container, Mapping

import numpy as np
from flwr.app import ArrayRecord

from fedquant.codecs import Codec, get_codec
from fedquant.metrics.links import transfer_seconds
from fedquant.records import RecordCodec
from fedquant.strategies.decode_plan import ClientAssignment

DEADLINE_MET_FRACTION = "deadline-met-fraction"
UPLINK_BUDGET_MET = "uplink-budget-met"
PREDICTED_UPLINK_BYTES = "predicted-uplink-bytes"
CHOSEN_SETTING_MIN = "chosen-setting-min"
CHOSEN_SETTING_MEAN = "chosen-setting-mean"
CHOSEN_SETTING_MAX = "chosen-setting-max"
COARSEST_FRACTION = "chosen-coarsest-fraction"


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """What :meth:`UploadBudget.choose` decided for one round, kept with the round until ``observe``."""

    assignments: dict[int, ClientAssignment]
    predicted: dict[int, float]  # node id -> predicted bytes, before the learned correction
    coarsest: dict[int, bool]  # node id -> at its ladder's end

    @property
    def chosen(self) -> dict[int, str]:
        """Node id -> the spec of the setting it got."""
        return {n: a.codec.spec for n, a in self.assignments.items()}


class UploadBudget:
    """Chooses per-client codec settings so uploads meet a deadline and/or a per-round byte budget.

    Parameters
    ----------
    deadline_seconds : float, optional
        Every sampled client's upload should finish within this time.
    bandwidth : callable, optional
        ``node_id -> bytes per second``; required with ``deadline_seconds``.
    bytes_budget : int, optional
        Largest total of the round's replies, in bytes.
    min_numel : int
        The strategy's encoding threshold (to predict which tensors travel encoded).
    window : int
        Rounds of observed reply sizes that refine the size model.
    """

    def __init__(
        self,
        *,
        deadline_seconds: float | None = None,
        bandwidth: Callable[[int], float] | None = None,
        bytes_budget: int | None = None,
        min_numel: int = 1,
        window: int = 3,
    ) -> None:
        if deadline_seconds is not None:
            if isinstance(deadline_seconds, bool) or not 0 < float(deadline_seconds) < math.inf:
                raise ValueError(f"upload_deadline_seconds must be a positive number, got {deadline_seconds!r}")
            if bandwidth is None:
                raise ValueError("upload_deadline_seconds needs uplink_bandwidth (node_id -> bytes per second)")
        if bytes_budget is not None and (isinstance(bytes_budget, bool) or not bytes_budget > 0):
            raise ValueError(f"uplink_bytes_budget must be a positive number of bytes, got {bytes_budget!r}")
        if deadline_seconds is None and bytes_budget is None:
            raise ValueError("UploadBudget needs upload_deadline_seconds or uplink_bytes_budget")
        self.deadline_seconds = None if deadline_seconds is None else float(deadline_seconds)
        self.bandwidth = bandwidth
        self.bytes_budget = bytes_budget
        self.min_numel = min_numel
        self._ladders: dict[str, list[Codec]] = {}
        self._prior: dict[tuple[str, tuple], int] = {}
        self._ratios: dict[str, deque[float]] = {}
        self.window = window

    def __repr__(self) -> str:
        return f"UploadBudget(deadline_seconds={self.deadline_seconds}, bytes_budget={self.bytes_budget})"

    def predict(self, codec: Codec, model: ArrayRecord) -> float:
        """Predicted reply bytes of ``codec`` for ``model``: the size model's times the learned correction."""
        layout = tuple((k, a.dtype, tuple(a.shape)) for k, a in model.items())
        key = (codec.spec, layout)
        if key not in self._prior:
            self._prior[key] = RecordCodec(codec, self.min_numel).predict_bytes(model)
        ratios = self._ratios.get(codec.spec)
        return self._prior[key] * (max(ratios) if ratios else 1.0)

    def choose(self, assignments: Mapping[int, ClientAssignment], model: ArrayRecord) -> BudgetChoice:
        """Each node's assignment with the setting of its codec's family that fits the constraints."""
        ladders, sizes, index = {}, {}, {}
        for node_id, assignment in assignments.items():
            spec = assignment.codec.spec
            if spec not in self._ladders:
                self._ladders[spec] = assignment.codec.rate_ladder()
            ladders[node_id] = self._ladders[spec]
            sizes[node_id] = [self.predict(c, model) for c in ladders[node_id]]
            index[node_id] = 0
            if self.deadline_seconds is not None:
                allowed = float(self.bandwidth(node_id)) * self.deadline_seconds
                fitting = [i for i, size in enumerate(sizes[node_id]) if size <= allowed]
                index[node_id] = fitting[0] if fitting else len(sizes[node_id]) - 1
        if self.bytes_budget is not None:
            while sum(sizes[n][index[n]] for n in index) > self.bytes_budget:
                coarsenable = [n for n in index if index[n] + 1 < len(sizes[n])]
                if not coarsenable:
                    break
                largest = max(coarsenable, key=lambda n: (sizes[n][index[n]], -n))
                index[largest] += 1
        out = {n: dataclasses.replace(a, codec=ladders[n][index[n]]) for n, a in assignments.items()}
        return BudgetChoice(
            out,
            {n: sizes[n][index[n]] / self._correction(out[n].codec) for n in out},
            {n: index[n] == len(ladders[n]) - 1 for n in out},
        )

    def _correction(self, codec: Codec) -> float:
        ratios = self._ratios.get(codec.spec)
        return max(ratios) if ratios else 1.0

    def observe(
        self, choice: BudgetChoice, reply_bytes: Mapping[int, int], admitted: Container[int] | None = None
    ) -> dict[str, float]:
        """Learn from the bytes of the admitted replies; the round's controller metrics (over all replies).

        Parameters
        ----------
        choice : BudgetChoice
            What :meth:`choose` decided for the round.
        reply_bytes : mapping of int to int
            Per replying node, the bytes its reply's ArrayRecords hold.
        admitted : container of int, optional
            The nodes whose replies the admission rules let in (default: all): only they teach
            the size model, so a rejected reply of any size cannot coarsen everyone's setting.
        """
        chosen, predicted, coarsest = choice.chosen, choice.predicted, choice.coarsest
        observed: dict[str, list[float]] = {}
        for node_id, spec in chosen.items():
            if node_id in reply_bytes and predicted.get(node_id) and (admitted is None or node_id in admitted):
                observed.setdefault(spec, []).append(reply_bytes[node_id] / predicted[node_id])
        for spec, ratios in observed.items():  # one value per round and setting
            self._ratios.setdefault(spec, deque(maxlen=self.window)).append(float(np.median(ratios)))
        values = [self._ladder_codec(spec).rate for spec in chosen.values()]
        metrics: dict[str, float] = {}
        if values:
            metrics[CHOSEN_SETTING_MIN] = min(values)
            metrics[CHOSEN_SETTING_MEAN] = float(np.mean(values))
            metrics[CHOSEN_SETTING_MAX] = max(values)
        metrics[PREDICTED_UPLINK_BYTES] = float(sum(predicted.values()))
        metrics[COARSEST_FRACTION] = float(np.mean(list(coarsest.values()))) if coarsest else 0.0
        answered = {n: b for n, b in reply_bytes.items() if n in chosen}
        if self.deadline_seconds is not None and answered:
            met = [transfer_seconds(b, self.bandwidth(n)) <= self.deadline_seconds for n, b in answered.items()]
            metrics[DEADLINE_MET_FRACTION] = float(np.mean(met))
        if self.bytes_budget is not None:
            metrics[UPLINK_BUDGET_MET] = float(sum(answered.values()) <= self.bytes_budget)
        return metrics

    def _ladder_codec(self, spec: str) -> Codec:
        for ladder in self._ladders.values():
            for codec in ladder:
                if codec.spec == spec:
                    return codec
        return get_codec(spec)
