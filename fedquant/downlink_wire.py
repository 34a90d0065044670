"""What a compressed train message carries downstream, and how a model is rebuilt from it.

Both halves import this module (it imports neither): the server
(:mod:`fedquant.strategies.downlink`) rebuilds the model a client will decode with the very
function the client runs (:mod:`fedquant.clients.downlink`), so the two views cannot drift apart.

Server -> client (ConfigRecord entries, only when the strategy has a ``downlink_codec``):

================================  =====  =====================================================
key                               type   meaning
================================  =====  =====================================================
``fedquant.downlink-codec``       str    codec spec of this message's payloads
``fedquant.downlink-seed``        int    seed of the payloads (per tensor: ``tensor_seed``)
``fedquant.downlink-base``        int    id of the reference model the payloads are a difference
                                         to; ``NO_REFERENCE`` (-1): they hold the model itself
``fedquant.downlink-reference``   int    id of the model the client rebuilds (it reports it back)
================================  =====  =====================================================

The message's ArrayRecord keeps the model's keys. An entry with ``stype == PAYLOAD_STYPE`` holds
a codec payload (float tensors that pass :func:`~fedquant.protocol.is_encoded`); every
other entry is the model's value as it is.

Client -> server: the reply's MetricRecord gains ``fedquant.downlink-reference``, the id of the
model the client now holds. The server believes it only when it equals the id it sent that node
this round, and sends the full model otherwise.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedquant.codecs import Codec
from fedquant.protocol import PAYLOAD_STYPE, tensor_seed

KEY_DOWNLINK_CODEC = "fedquant.downlink-codec"
KEY_DOWNLINK_SEED = "fedquant.downlink-seed"
KEY_DOWNLINK_BASE = "fedquant.downlink-base"
KEY_DOWNLINK_REFERENCE = "fedquant.downlink-reference"
METRIC_DOWNLINK_REFERENCE = "fedquant.downlink-reference"
NO_REFERENCE = -1
# Reference ids stay below 2**52 so that they survive any float conversion of a metric.
REFERENCE_ID_BITS = 52

# The model a client holds, kept in its ``context.state`` between rounds.
STATE_MODEL_KEY = "fedquant.downlink-model"
STATE_HELD_KEY = "fedquant.downlink-held"


class DownlinkError(ValueError):
    """A compressed train message that cannot be rebuilt (e.g. a difference to a model not held)."""


def rebuild_model(wire: ArrayRecord, base: ArrayRecord | None, codec: Codec, seed: int) -> ArrayRecord:
    """The dense model that a compressed ArrayRecord stands for.

    Parameters
    ----------
    wire : ArrayRecord
        What the train message carries: payload entries and plain entries.
    base : ArrayRecord or None
        The reference model the payloads are differences to; None when they hold the model itself.
    codec : Codec
        The codec of the payloads.
    seed : int
        The message's downlink seed.

    Returns
    -------
    ArrayRecord
        Same keys as ``wire``: ``base + decoded difference`` (in the base's dtype) or the decoded
        tensor for payload entries, the plain entries unchanged.

    Raises
    ------
    DownlinkError
        When the base lacks a tensor or a payload does not decode (naming the tensor).
    """
    out: dict[str, Array] = {}
    for name, array in wire.items():
        if array.stype != PAYLOAD_STYPE:
            out[name] = array
            continue
        seed_t = tensor_seed(seed, name)
        if base is not None and name not in base:
            raise DownlinkError(f"the reference model has no tensor '{name}'")
        try:
            if base is None:
                value = codec.decode(array.data, seed_t).numpy()
            else:
                ref = base[name].numpy()
                delta = codec.decode(array.data, seed_t, shape=ref.shape, dtype=torch.float32).numpy()
                value = (ref.astype(np.float32, copy=False) + delta).astype(ref.dtype, copy=False)
        except ValueError as err:  # PayloadError is a ValueError
            raise DownlinkError(f"downlink tensor '{name}': {err}") from err
        out[name] = Array(np.require(value, requirements="C"))  # keeps 0-d shapes
    return ArrayRecord(out)
