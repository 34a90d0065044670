"""The transform stage: what happens to a tensor before it is quantized.

Two kinds, declared by type:

* :class:`Transform` travels with the payload: the encoder applies :meth:`Transform.forward`,
  the decoder :meth:`Transform.inverse` (a random rotation). Its name is part of the payload's
  spec (``"rht+qsgd:..."``), so a decoder without it rejects the payload.
* :class:`StatefulTransform` lives on the client only and keeps state per tensor between
  rounds (error feedback). The state is passed in and returned explicitly; the payload is the
  one of the rest of the pipeline, so the server never knows.

Transforms are flat float32 tensor to flat float32 tensor, on the tensor's device.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from fedquant.codecs.dispatch import KernelDispatch
from fedquant.codecs.params import Configurable


class Transform(Configurable, KernelDispatch):
    """An invertible transform that the decoder undoes (on the wire).

    Its spec names only parameters away from their defaults (``rht``, ``rht:max_log2=16``).
    """

    spec_lists_defaults = False

    def output_numel(self, numel: int) -> int:
        """Elements after :meth:`forward` of ``numel`` elements (padding transforms grow it)."""
        return numel

    @abstractmethod
    def forward(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """Encoder side: 1-D float32 of ``numel`` elements to ``output_numel(numel)`` elements."""

    @abstractmethod
    def inverse(self, flat: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
        """Decoder side: undo :meth:`forward`, back to ``numel`` elements."""


class StatefulTransform(Configurable):
    """A client-side transform with state per tensor (not on the wire).

    ``biased`` says whether the pipeline's output stops being an unbiased estimate of its input
    (error feedback sends ``x + e``, not ``x``).
    """

    biased: bool = True
    spec_lists_defaults = False

    @abstractmethod
    def apply(self, flat: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """What the rest of the pipeline encodes instead of ``flat``, given this tensor's state."""

    @abstractmethod
    def next_state(self, encoded: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """The state to keep, from what was encoded and what the decoder will get back."""
