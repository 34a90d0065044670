"""The one place that decides between a stage's numba kernels and its torch twin."""

from __future__ import annotations

import torch


class KernelDispatch:
    """Mixin of the pipeline stages with numba kernels (quantizers, transforms).

    CPU tensors run the numba kernels, tensors on other devices (CUDA) the torch twin; both give
    the same bytes. ``force_torch = True`` on an instance runs the torch twin on CPU tensors too,
    which is what the tests of path equality do.
    """

    force_torch: bool = False

    def uses_kernels(self, flat: torch.Tensor | None = None) -> bool:
        """Whether to run the numba kernels: CPU data (or decoding, ``flat`` None) and no ``force_torch``."""
        return not self.force_torch and (flat is None or flat.device.type == "cpu")
