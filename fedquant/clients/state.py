"""Error-feedback residuals kept in a ClientApp's ``context.state`` between rounds.

``context.state[STATE_RESIDUAL_KEY]`` is one ArrayRecord whose entries are the float32 residuals,
keyed by tensor name. A ClientApp object does not survive between rounds; its Context does.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedquant.strategies.protocol import STATE_RESIDUAL_KEY


def load_residual(state: RecordDict, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The stored float32 residual of tensor ``name``; None when none (or one of another shape) is stored."""
    record = state.array_records.get(STATE_RESIDUAL_KEY)
    if record is not None and name in record:
        value = record[name].numpy()
        if value.shape == tuple(shape) and value.dtype == np.float32:
            return torch.from_numpy(value.copy())
    return None


def store_residuals(state: RecordDict, residuals: dict[str, torch.Tensor]) -> None:
    """Store (replace) the residuals of the given tensors; others stay as they are."""
    if not residuals:
        return
    record = state.array_records.get(STATE_RESIDUAL_KEY)
    if record is None:
        record = ArrayRecord()
        state[STATE_RESIDUAL_KEY] = record
    for name, residual in residuals.items():
        record[name] = Array(np.ascontiguousarray(residual.detach().cpu().to(torch.float32).numpy()))
