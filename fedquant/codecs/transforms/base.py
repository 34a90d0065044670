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
from collections.abc import Callable
from typing import Any

import torch

from fedquant.codecs.dispatch import KernelDispatch
from fedquant.codecs.params import Configurable


class Transform(Configurable, KernelDispatch):
    """An invertible transform that the decoder undoes (on the wire).

    Its spec names only parameters away from their defaults (``rht``, ``rht:max_log2=16``).
    """

    spec_lists_defaults = False
    #: Whether :meth:`forward` refuses (:class:`NonFiniteOutput`) an output that is not finite, which
    #: any NaN or Inf in its input makes: the codec then skips its own check of the input.
    checks_finite: bool = False

    def output_numel(self, numel: int) -> int:
        """Elements after :meth:`forward` of ``numel`` elements (padding transforms grow it)."""
        return numel

    @abstractmethod
    def forward(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """Encoder side: 1-D float32 of ``numel`` elements to ``output_numel(numel)`` elements."""

    @abstractmethod
    def inverse(self, flat: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
        """Decoder side: undo :meth:`forward`, back to ``numel`` elements."""

    def fused(self, numel: int, seed: int, flat: torch.Tensor | None = None) -> Any:
        """This transform as a quantizer's kernels can apply it themselves, or None (the default).

        ``numel``: elements before the transform; ``flat``: the encoder's input (None when
        decoding). A quantizer that accepts the result (``Quantizer.fuses``) is given it
        instead of the transformed tensor (:mod:`fedquant.codecs.codec`).
        """
        return None

    def inverse_checked(self, flat: torch.Tensor, numel: int, seed: int) -> tuple[torch.Tensor, bool]:
        """:meth:`inverse`, and True when every value it returns is known to be finite.

        Default: not known (False), the codec checks. A transform whose kernels see every value
        anyway says so, and the codec skips its own pass over the decoded tensor.
        """
        return self.inverse(flat, numel, seed), False


class NonFiniteOutput(ValueError):
    """A transform's output holds NaN or Inf (its input did, or the transform overflowed float32)."""


class StatefulTransform(Configurable):
    """A client-side transform with state per tensor (not on the wire).

    ``biased`` says whether the pipeline's output stops being an unbiased estimate of its input
    (error feedback sends ``x + e``, not ``x``).
    """

    biased: bool = True
    spec_lists_defaults = False

    def bind_codec(self, quantizer: Any) -> None:
        """Called once when a codec puts this transform in front of ``quantizer``; ValueError if it cannot run there."""
        return None

    @abstractmethod
    def apply(
        self, flat: torch.Tensor, state: torch.Tensor | None, expected_error: Callable[[torch.Tensor], float | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(what the rest of the pipeline encodes instead of flat, what next_state needs)``.

        ``expected_error(v)`` is the rest of the pipeline's ``E||C(v) - v||^2 / ||v||^2`` for ``v``.
        """

    @abstractmethod
    def next_state(self, kept: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """The state to keep, from :meth:`apply`'s second value and what the decoder will get back."""
