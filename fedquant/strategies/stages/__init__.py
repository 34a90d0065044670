"""Round stages: the steps ``QuantizedStrategy`` runs a train round through, in order.

========== ===================================================== =========================
stage      what it does                                          module
========== ===================================================== =========================
assign     codec setting (decode plan, upload budget) and seed   :mod:`.assignment`
downlink   the model each client is sent                          :mod:`.sending`
arrival    bytes of every reply, the mod's own metrics            :mod:`.arrival`
screen     sender; opens the vote; metrics, weights, integers     :mod:`.screening`
decode     vote groups in the plan's order; the rules judge each  :mod:`.decoding`
budget     the upload budget learns the reply sizes               :mod:`.budgeting`
aggregate  weights bounded; the inner strategy, guarded           :mod:`.aggregation`
record     traffic metrics                                        :mod:`.recording`
========== ===================================================== =========================

Every stage implements :class:`RoundStage`; all per-round state lives in one
:class:`TrainRound` kept by a :class:`RoundLedger`.
"""

from fedquant.strategies.round import RoundLedger, TrainRound
from fedquant.strategies.stages.assignment import write_messages
from fedquant.strategies.stages.base import RoundStage
from fedquant.strategies.stages.pipeline import Settings, build_stages

__all__ = ["RoundLedger", "RoundStage", "Settings", "TrainRound", "build_stages", "write_messages"]
