"""Server side: the ``QuantizedStrategy`` wrapper and its decode hook.

>>> from fedquant.strategies import QuantizedStrategy
>>> strategy = QuantizedStrategy(FedAvg(), codec="qsgd:levels=16", seed=0)
"""

from fedquant.protocol import DEFAULT_MIN_NUMEL
from fedquant.strategies.admission import AdmissionRules
from fedquant.strategies.budget import UploadBudget
from fedquant.strategies.decode_plan import ClientAssignment, DecodedClient, DecodePlan, default_plan_for
from fedquant.strategies.downlink import DownlinkCompressor
from fedquant.strategies.nested import NestedDecodePlan
from fedquant.strategies.quantized import QuantizedStrategy
from fedquant.strategies.side_info import SideInfoPlan, SideInformation
from fedquant.strategies.tensor_policy import TensorPolicy

__all__ = [
    "AdmissionRules",
    "DEFAULT_MIN_NUMEL",
    "ClientAssignment",
    "DecodePlan",
    "DecodedClient",
    "DownlinkCompressor",
    "NestedDecodePlan",
    "QuantizedStrategy",
    "SideInfoPlan",
    "SideInformation",
    "TensorPolicy",
    "UploadBudget",
    "default_plan_for",
]
