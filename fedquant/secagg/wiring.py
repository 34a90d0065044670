"""What a secure round's collect message carries besides the protocol, shared by the strategy and the mod.

The collect request holds the protocol's ConfigRecord (:data:`~fedquant.secagg.messages.RECORD`),
the round's model (the inner strategy's ArrayRecord), the inner strategy's ConfigRecord, and one
more ConfigRecord :data:`GRID_RECORD`: the round's :class:`~fedquant.codecs.summable.SumGrid`
(keys under :data:`GRID_PREFIX`), the client's dither seed and the weighting rule. The update
that is summed is ``trained - received`` over every float tensor of the model, flattened in
sorted name order (:func:`float_layout`): nothing travels unmasked.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedquant.wire.payload import FORMAT_VERSION

GRID_RECORD = "fedquant.secagg.grid"
GRID_PREFIX = "fedquant.secagg.grid."
KEY_DITHER_SEED = "fedquant.secagg.dither-seed"
KEY_MAX_EXAMPLES = "fedquant.secagg.max-examples"  # 0: every client weighs 1
#: The summed segment of the update. Its name carries the payload format version, whose rotation
#: signs (``rht``) the grid's encoding uses: a client and a server of different formats would sum
#: differently rotated updates into a wrong model without a word, and with the version in the name
#: each refuses the other's segment list instead.
UPDATE_SEGMENT = f"update-v{FORMAT_VERSION}"
#: ConfigRecord in ``Context.state`` holding the client's protocol state between stages.
STATE_KEY = "fedquant.secagg.client"


def is_float(array: Array) -> bool:
    """Whether an Array holds a float tensor (summed securely) rather than ints or bools (kept)."""
    return np.dtype(array.dtype).kind == "f"


def float_layout(record: ArrayRecord) -> list[tuple[str, int]]:
    """``(name, numel)`` of every float tensor of ``record``, sorted by name: the update's layout."""
    return sorted((name, int(np.prod(a.shape))) for name, a in record.items() if is_float(a))


def grid_record(grid_config: Mapping[str, object], dither_seed: int, max_examples: int | None) -> ConfigRecord:
    """The collect request's grid record."""
    return ConfigRecord({**grid_config, KEY_DITHER_SEED: dither_seed, KEY_MAX_EXAMPLES: int(max_examples or 0)})


def flat_update(trained: Mapping[str, np.ndarray], received: Mapping[str, np.ndarray], layout) -> np.ndarray:
    """``trained - received`` over ``layout``'s tensors, flattened (float32)."""
    parts = [
        (np.asarray(trained[name], dtype=np.float64) - np.asarray(received[name], dtype=np.float64)).reshape(-1)
        for name, _ in layout
    ]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def add_flat(received: Mapping[str, np.ndarray], flat: np.ndarray, layout) -> dict[str, np.ndarray]:
    """``received + flat`` over ``layout``'s tensors (in their dtype); other tensors unchanged."""
    out = {name: np.asarray(a) for name, a in received.items()}
    offset = 0
    for name, numel in layout:
        base = out[name]
        part = flat[offset : offset + numel].astype(np.float64).reshape(base.shape)
        out[name] = (base.astype(np.float64) + part).astype(base.dtype)
        offset += numel
    return out


def wire_bytes(content: RecordDict) -> int:
    """Bytes of a message's content as Flower serializes it (every record: keys and shares count)."""
    return len(recorddict_to_proto(content).SerializeToString())
