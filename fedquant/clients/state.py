"""The state of a codec's client-side transforms (error feedback), kept in ``context.state`` between rounds.

A ClientApp object does not survive between rounds; its Context does. ``context.state``
holds one ArrayRecord under :data:`~fedquant.protocol.STATE_TRANSFORMS_KEY` whose entries are
float32 tensors keyed ``"<transform>/<tensor>"`` (``"ef/fc.weight"``: the error-feedback
residual of ``fc.weight``). Transform names hold no ``/``, so the key splits at its first one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedquant.protocol import STATE_TRANSFORMS_KEY


def state_entry(transform: str, tensor_name: str) -> str:
    """The ArrayRecord key of ``transform``'s state for tensor ``tensor_name``."""
    return f"{transform}/{tensor_name}"


def load_state(
    state: RecordDict, tensor_name: str, shape: tuple[int, ...], transforms: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The stored state of one tensor per transform name (what ``Codec.encode_stateful`` takes).

    A transform without a stored float32 tensor of ``shape`` is left out (it starts afresh).
    """
    record = state.array_records.get(STATE_TRANSFORMS_KEY)
    out: dict[str, torch.Tensor] = {}
    if record is None:
        return out
    for transform in transforms:
        key = state_entry(transform, tensor_name)
        if key in record:
            value = record[key].numpy()
            if value.shape == tuple(shape) and value.dtype == np.float32:
                out[transform] = torch.from_numpy(value.copy())
    return out


def store_state(state: RecordDict, tensor_states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Store (replace) the state of the given tensors, ``{tensor: {transform: value}}``; others stay."""
    if not any(tensor_states.values()):
        return
    record = state.array_records.get(STATE_TRANSFORMS_KEY)
    if record is None:
        record = ArrayRecord()
        state[STATE_TRANSFORMS_KEY] = record
    for tensor_name, per_transform in tensor_states.items():
        for transform, value in per_transform.items():
            value = value.detach().cpu().to(torch.float32).numpy()
            record[state_entry(transform, tensor_name)] = Array(np.require(value, requirements="C"))  # keeps 0-d


class FiniteState:
    """:func:`load_state` over ``state`` that drops a tensor's stored state holding NaN or Inf.

    A non-finite error-feedback residual never recovers (every later update would carry it), so
    that tensor starts afresh; :attr:`resets` counts the tensors dropped (``fedquant.state-resets``).
    """

    def __init__(self, state: RecordDict) -> None:
        self.state = state
        self.resets = 0

    def __call__(self, tensor_name: str, shape: tuple[int, ...], transforms: Iterable[str]) -> dict[str, torch.Tensor]:
        stored = load_state(self.state, tensor_name, shape, transforms)
        if all(bool(torch.isfinite(v).all()) for v in stored.values()):
            return stored
        self.resets += 1
        return {}
