"""What the server and the clients agree on: config keys, the payload marker, per-tensor seeds.

Everything fedquant puts into a train message or a reply is named here, in one place; what is
encoded and how is :class:`fedquant.records.RecordCodec`'s. Both halves import this module and it
imports neither: ``import fedquant.clients`` loads no server code.

Server -> client (entries added to the train message's ConfigRecord by ``QuantizedStrategy``):

===========================  =====  ==========================================================
key                          type   meaning
===========================  =====  ==========================================================
``fedquant.codec``           str    codec spec for this client this round (``"qsgd:levels=16,..."``,
                                    ``"ef+signsgd"``); its presence switches ``quantize_mod`` on
``fedquant.seed``            int    the client's seed for this round,
                                    ``derive_seed(base_seed, server_round, node_id)``
``fedquant.min-numel``       int    float tensors with fewer elements are sent as they are
``fedquant.client-mse``      bool   whether the client measures the quantization MSE (one
                                    extra decode per tensor); absent means yes
``fedquant.role``            str    optional; a decode plan's role for this client (e.g. NDQSG's
                                    ``"p1"`` / ``"p2"`` groups); ``quantize_mod`` ignores it
``fedquant.tensor-codecs``   str    optional; per-tensor codec specs that override
                                    ``fedquant.codec``, a JSON object ``{"tensor name": "spec"}``
                                    (:func:`tensor_codecs_entry`); e.g. NDQSG's ``rho`` per tensor.
                                    The server decodes each tensor with the codec it named.
===========================  =====  ==========================================================

A decode plan may add further ``fedquant.*`` entries per client. With downlink compression
(``QuantizedStrategy(downlink_codec=...)``) the message also carries:

================================  =====  =====================================================
key                               type   meaning
================================  =====  =====================================================
``fedquant.downlink-codec``       str    codec spec of this message's payloads
``fedquant.downlink-seed``        int    seed of the payloads (per tensor: ``tensor_seed``)
``fedquant.downlink-base``        int    id of the reference model the payloads are a difference
                                         to; ``NO_REFERENCE`` (-1): they hold the model itself
``fedquant.downlink-reference``   int    id of the model the client rebuilds (it reports it back)
================================  =====  =====================================================

and its ArrayRecord keeps the model's keys: payload entries for the encoded tensors, the
model's values for the others.

Client -> server (the reply):

* The reply's single ArrayRecord keeps the keys of the ArrayRecord the client received. Every
  entry the record codec's policy selects (by the arrays the server sent, which the server
  knows, so a client cannot choose) holds an :class:`flwr.app.Array` with
  ``stype == PAYLOAD_STYPE``, ``dtype == "uint8"``, ``shape == (len(payload),)`` and the codec
  payload as ``data`` (no NumPy header, so ``ArrayRecord.count_bytes()`` counts exactly the
  payload plus the key). It is the payload of the *update* ``trained - received`` (float32).
* Every other entry (float tensors under ``min-numel`` elements, non-float tensors) is the
  client's trained value, unchanged, as a normal NumPy Array. The server uses it as the trained
  value, not as an update.
* The reply's MetricRecord gains ``fedquant.quantization-mse`` (mean squared error of the
  decoded update over all encoded elements, as the client measures it; absent for codecs that
  need decoder side information) and ``fedquant.encode-seconds``; ``fedquant.state-resets``
  (tensors whose error-feedback residual was not finite and was reset) when there were any. The
  server removes them before the inner strategy sees the reply and reports bounded means as
  ``quantization-mse`` and ``encode-seconds``, and ``client-state-resets``. With downlink
  compression it also gains ``fedquant.downlink-reference``, the id of the model the client now
  holds; the server believes it only when it equals the id it sent that node this round, and
  sends the full model otherwise.

Per tensor the codec's seed is ``derive_seed(client_seed, tensor_name)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from flwr.app import Array

from fedquant.rng import derive_seed

CONFIG_PREFIX = "fedquant."
KEY_CODEC = "fedquant.codec"
KEY_SEED = "fedquant.seed"
KEY_MIN_NUMEL = "fedquant.min-numel"
KEY_ROLE = "fedquant.role"
KEY_CLIENT_MSE = "fedquant.client-mse"
KEY_TENSOR_CODECS = "fedquant.tensor-codecs"

KEY_DOWNLINK_CODEC = "fedquant.downlink-codec"
KEY_DOWNLINK_SEED = "fedquant.downlink-seed"
KEY_DOWNLINK_BASE = "fedquant.downlink-base"
KEY_DOWNLINK_REFERENCE = "fedquant.downlink-reference"
METRIC_DOWNLINK_REFERENCE = "fedquant.downlink-reference"
NO_REFERENCE = -1
# Reference ids stay below 2**52 so that they survive any float conversion of a metric.
REFERENCE_ID_BITS = 52

METRIC_CLIENT_MSE = "fedquant.quantization-mse"
METRIC_CLIENT_ENCODE_SECONDS = "fedquant.encode-seconds"
METRIC_CLIENT_STATE_RESETS = "fedquant.state-resets"
CLIENT_METRIC_KEYS = (METRIC_CLIENT_MSE, METRIC_CLIENT_ENCODE_SECONDS, METRIC_CLIENT_STATE_RESETS)
# MetricRecord the mod creates when the ClientApp's reply has none; the server drops it again.
CLIENT_METRICRECORD_NAME = "fedquant"

PAYLOAD_STYPE = "fedquant.payload"
PAYLOAD_DTYPE = "uint8"

# The state of a codec's client-side transforms (error-feedback residuals) lives in
# ``context.state`` under this key: one ArrayRecord, see :mod:`fedquant.clients.state`.
STATE_TRANSFORMS_KEY = "fedquant.transform-state"
# The model a client holds (downlink compression), kept in its ``context.state`` between rounds.
STATE_MODEL_KEY = "fedquant.downlink-model"
STATE_HELD_KEY = "fedquant.downlink-held"

# QSGD's authors left tensors under 10K elements unquantized (ImageNet-size models). fedquant's
# default is lower so that the hidden layers of small models (a 64x32 MLP layer has 2048
# weights) are compressed too; biases and norm parameters still travel as they are.
DEFAULT_MIN_NUMEL = 1024

FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})


def tensor_seed(client_seed: int, tensor_name: str) -> int:
    """The codec seed of one tensor: ``derive_seed(client_seed, tensor_name)``."""
    return derive_seed(client_seed, tensor_name)


def payload_array(payload: bytes) -> Array:
    """A codec payload as an Array entry (no NumPy header, so ``count_bytes`` counts the payload)."""
    return Array(dtype=PAYLOAD_DTYPE, shape=(len(payload),), stype=PAYLOAD_STYPE, data=bytes(payload))


def is_payload(array: Array) -> bool:
    """Whether an entry is marked as a codec payload (its ``stype``)."""
    return array.stype == PAYLOAD_STYPE


def tensor_codecs_entry(specs: Mapping[str, str]) -> str:
    """The ``fedquant.tensor-codecs`` value for per-tensor codec specs (a JSON object, sorted keys)."""
    return json.dumps(dict(specs), sort_keys=True, separators=(",", ":"))


def parse_tensor_codecs(value: object) -> dict[str, str]:
    """Per-tensor codec specs from a ``fedquant.tensor-codecs`` value.

    Raises
    ------
    ValueError
        When the value is not a JSON object of strings.
    """
    if not isinstance(value, str):
        raise ValueError(f"{KEY_TENSOR_CODECS} must be a JSON string, got {type(value).__name__}")
    specs = json.loads(value)  # json.JSONDecodeError is a ValueError
    if not isinstance(specs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in specs.items()):
        raise ValueError(f"{KEY_TENSOR_CODECS} must map tensor names to codec spec strings")
    return specs
