"""The one place that decides between a stage's numba kernels and its torch twin."""

from __future__ import annotations

import torch

from fedquant.jit.cache import kernels_ready


class KernelDispatch:
    """Mixin of the pipeline stages with numba kernels (quantizers, transforms).

    CPU tensors run the numba kernels, tensors on other devices (CUDA) the torch twin; both give
    the same bytes. ``force_torch = True`` on an instance runs the torch twin on CPU tensors too,
    which is what the tests of path equality do. CPU tensors also take the twin while numba's
    on-disk cache of the kernels is cold (:mod:`fedquant.jit.cache`): compiling them
    takes seconds per kernel, the twin gives the same bytes at once.
    """

    force_torch: bool = False

    def uses_kernels(self, flat: torch.Tensor | None = None) -> bool:
        """Whether to run the numba kernels: CPU data (or decoding, ``flat`` None), no ``force_torch``, a warm cache."""
        return not self.force_torch and (flat is None or flat.device.type == "cpu") and kernels_ready()
