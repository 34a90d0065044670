"""Decoded values that are not written out: what a server needs of an update, read from the payload.

A server that aggregates many updates uses each decoded update a few times (its norm and a check,
running sums, inner products with the round's consensus) and never needs it as a tensor of its
own. For a codec whose decoder is a cheap function of a few bits per element, recomputing the
values inside each of those passes costs less than writing 4 bytes per element and reading them
back from memory. :meth:`fedquant.codecs.Codec.decode_deferred` returns such a handle, checked as
:meth:`~fedquant.codecs.Codec.decode` checks the payload (header, checksum, side data, lengths),
for the codecs that offer one (scaled grids with fixed-width symbols: QSGD, TernGrad); the
symbols' alphabet is checked by every pass (a payload with out-of-range symbols raises
:class:`~fedquant.errors.PayloadError` from the first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch


class DeferredValues(ABC):
    """A decoded 1-D float32 tensor of ``numel`` elements, computed in each pass instead of stored.

    Every method gives, bit for bit, what the same computation over :meth:`materialize` gives.
    """

    numel: int

    @abstractmethod
    def accumulate(
        self,
        base: np.ndarray,
        consensus: np.ndarray,
        weighted: np.ndarray,
        weight: float,
        base_bound: float | None = None,
    ) -> tuple[float, int]:
        """``(sum(u**2), how many float32 base + u are not finite)``, adding ``u`` to ``consensus``
        (float32) and ``weight x u`` to ``weighted`` (float64) in the same pass; either sum may be an
        empty array. As :func:`fedquant.codecs.kernels.norms.checked_accumulate` of the values (the
        squared norm to float64 rounding). ``base_bound``, an upper bound of ``|base|`` the caller
        knows (NaN or Inf: none), lets an implementation skip the elementwise check where it can
        prove ``|base| + |u|`` finite."""

    @abstractmethod
    def dot_terms(self, consensus: np.ndarray) -> tuple[float, float]:
        """``(<u, consensus>, <u, u>)``, as :func:`fedquant.codecs.kernels.norms.dot_terms` of the values."""

    def written(self) -> np.ndarray | None:
        """The values as a flat float32 array when a pass has written them out already, else None (a
        caller with many updates may then read them in a pass of its own, such as
        :func:`fedquant.codecs.kernels.norms.dot_terms_many`)."""
        return None

    @abstractmethod
    def materialize(self) -> torch.Tensor:
        """The values as a new 1-D float32 CPU tensor (what ``Codec.decode`` returns, flat)."""
