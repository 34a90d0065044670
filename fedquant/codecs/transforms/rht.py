"""Randomized Hadamard rotation in front of any quantizer: ``rht+``.

``get_codec("rht+qsgd:levels=7")`` rotates each tensor with ``y = H D x`` before quantizing it
and the decoder rotates back (``x = D H y``): ``D`` is a diagonal of random signs, ``H`` the
orthonormal Walsh–Hadamard matrix. Whatever the update looks like (outliers, a few large
layers' worth of scale in one corner), the rotated coordinates are close to iid Gaussian with
the same energy, which is what the quantizers handle best (Suresh et al., ICML 2017; DRIVE and
EDEN, Vargaftik et al. 2021/2022). The rotation is orthonormal, so the quantization error keeps
its norm through the inverse and an unbiased quantizer stays unbiased.

Nothing of the rotation is sent: the signs come from the tensor's seed, through a sub-stream
``derive_seed(seed, "rht")`` of the counter-based generator of :mod:`fedquant.rng` (so they are
independent of the quantizer's rounding or dither stream, which uses ``seed`` itself, and the
same on CPU and CUDA). Decoder side information (NDQSG) is rotated by the codec with the same
:meth:`RandomizedHadamard.forward`.

Any length, by blocks: a tensor of ``n`` elements is laid out as consecutive blocks of
``2**max_log2`` elements (default 9: the 512-element bucket of every quantizer), the rest
(fewer) by its binary digits down to ``2**min_log2`` (default: none), and what is left as one
block padded with zeros to the next power of two; each block is rotated on its own. The payload
holds :meth:`RandomizedHadamard.output_numel` ``>= n`` elements (the padding is sent, quantized;
the decoder drops it): 16 for 10 elements, 1024 for 1000, none added to multiples of 512. Why
blocks of one bucket: ``docs/rht_layout.md`` (measured by ``python -m benchmarks.rht_layout``);
a quantizer with one scale per tensor (``bucket_size=0``) wants larger blocks,
``rht:max_log2=16+qsgd:bucket_size=0``. The layout is part of the wire spec (``rht`` with the
defaults, ``rht:max_log2=16`` otherwise).

Blocks of at most a cache tile need only the low pass of :mod:`fedquant.codecs.kernels.hadamard`
(one read and one write of the tensor).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from fedquant.codecs.codec import all_finite
from fedquant.codecs.kernels.hadamard import fusable, fwht_numba, fwht_torch, layout_table, runs_numel
from fedquant.codecs.params import Param
from fedquant.codecs.transforms.base import NonFiniteOutput, Transform
from fedquant.rng import derive_seed, stream_key

#: Default full block (log2): the 512-element bucket of the quantizers (docs/rht_layout.md).
MAX_BLOCK_LOG2 = 9


@lru_cache(maxsize=1024)
def block_runs(numel: int, max_log2: int = MAX_BLOCK_LOG2, min_log2: int | None = None) -> tuple[tuple[int, int], ...]:
    """The block layout of ``numel`` elements as runs ``(log2 block size, number of blocks)``.

    Full blocks of ``2**max_log2``, then the remainder's binary digits down to ``2**min_log2``
    (default ``max_log2``: none), then what is left padded to the next power of two; equal
    neighbours form one run. A few runs for any ``numel``, computed without a loop over blocks.

    >>> block_runs(1000, 8)
    ((8, 4),)
    >>> block_runs(1000, 8, 0)
    ((8, 3), (7, 1), (6, 1), (5, 1), (3, 1))
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    min_log2 = max_log2 if min_log2 is None else min_log2
    full = numel >> max_log2
    runs = [[max_log2, full]] if full else []
    rest = numel - (full << max_log2)
    tail = []
    for k in range(max_log2 - 1, min_log2 - 1, -1):
        if rest >> k:
            tail.append(k)
            rest -= 1 << k
    if rest:
        tail.append((rest - 1).bit_length())
    for k in tail:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return tuple((k, c) for k, c in runs)


@lru_cache(maxsize=64)
def block_layout(numel: int, max_log2: int = MAX_BLOCK_LOG2, min_log2: int | None = None) -> tuple[int, ...]:
    """log2 of the block sizes that hold ``numel`` elements, in order (:func:`block_runs`, one entry per block).

    >>> block_layout(1000, 8)
    (8, 8, 8, 8)
    >>> block_layout(1000, 8, 0)
    (8, 8, 8, 7, 6, 5, 3)
    """
    return tuple(k for k, count in block_runs(numel, max_log2, min_log2) for _ in range(count))


@lru_cache(maxsize=1024)
def _runs_numel(runs: tuple[tuple[int, int], ...]) -> int:
    return runs_numel(runs)


class FusedRotation:
    """``rht``'s rotation left to a quantizer's kernels (:meth:`RandomizedHadamard.fused`).

    The kernels rotate each chunk of their own pass in cache
    (:func:`~fedquant.codecs.kernels.hadamard.forward_span` before quantizing it,
    :func:`~fedquant.codecs.kernels.hadamard.inverse_span` after dequantizing it) instead of
    reading a rotated copy of the tensor from memory; the bytes are the same. Only layouts whose
    blocks fit a tile (:func:`~fedquant.codecs.kernels.hadamard.fusable`: the default ``rht``).

    Attributes
    ----------
    numel : int
        Elements before the rotation: the encoder's input, the decoder's output.
    runs : tuple of (int, int)
        The block layout (:func:`block_runs`).
    padded : int
        Elements of the rotated layout: what the quantizer quantizes.
    key : np.uint64
        Stream key of the signs.
    layout, scales : np.ndarray
        The layout as kernels take it (:func:`~fedquant.codecs.kernels.hadamard.layout_table`).
    finite : bool or None
        Decoding: whether the kernels found every decoded value finite (set by the quantizer).
    """

    def __init__(self, transform: RandomizedHadamard, numel: int, runs: tuple[tuple[int, int], ...], key: int):
        self.transform = transform
        self.numel = numel
        self.runs = runs
        self.padded = _runs_numel(runs)
        self.key = np.uint64(key)
        self.layout, self.scales = layout_table(runs)
        self.finite: bool | None = None

    def check(self, nonfinite: int) -> None:
        """Refuse as :meth:`RandomizedHadamard.forward` does when the rotated values were not all finite."""
        if nonfinite:
            self.transform.refuse()


class RandomizedHadamard(Transform):
    """Randomized Hadamard rotation by blocks (``rht``): signs from the seed, never sent.

    Parameters
    ----------
    max_log2 : int
        log2 of the full blocks (default 9: 512 elements; 62: the whole tensor padded).
    min_log2 : int, optional
        log2 of the smallest binary-digit block of the remainder (default: none, the remainder
        is one padded block). See :func:`block_layout`.
    """

    name = "rht"
    checks_finite = True
    params = {
        "max_log2": Param(int, MAX_BLOCK_LOG2, "log2 of the full blocks", minimum=1, maximum=62),
        "min_log2": Param(int, None, "log2 of the smallest block of the remainder (none: one padded block)", minimum=0),
    }

    def _validate(self) -> None:
        if self.min_log2 is not None and self.min_log2 > self.max_log2:
            raise ValueError(f"rht: parameter 'min_log2' must be <= max_log2 ({self.max_log2}), got {self.min_log2}")

    def blocks(self, numel: int) -> tuple[int, ...]:
        """log2 of the block sizes of a tensor of ``numel`` elements (one entry per block)."""
        return block_layout(numel, self.max_log2, self.min_log2)

    def runs(self, numel: int) -> tuple[tuple[int, int], ...]:
        """The block layout of a tensor of ``numel`` elements as runs ``(log2 size, count)``."""
        return block_runs(numel, self.max_log2, self.min_log2)

    def output_numel(self, numel: int) -> int:
        return _runs_numel(self.runs(numel))

    @staticmethod
    def sign_seed(seed: int) -> int:
        """The seed of the sign stream: a sub-stream of ``seed``, independent of the quantizer's."""
        return derive_seed(seed, "rht")

    def _rotate(
        self, flat: torch.Tensor, runs: tuple[tuple[int, int], ...], seed: int, inverse: bool
    ) -> tuple[torch.Tensor, bool | None]:
        """The rotated tensor and whether every value of it is finite (None: not checked, torch inverse)."""
        sign_seed = self.sign_seed(seed)
        flat = flat.to(torch.float32).contiguous()
        if not self.uses_kernels(flat):
            out = fwht_torch(flat, runs, sign_seed, inverse)
            return out, None if inverse else all_finite(out)
        out, nonfinite = fwht_numba(flat.numpy(), runs, stream_key(sign_seed), inverse)
        return torch.from_numpy(out), nonfinite == 0

    def fused(self, numel: int, seed: int, flat: torch.Tensor | None = None) -> FusedRotation | None:
        """The rotation for a quantizer's kernels (CPU kernels, blocks of at most a tile), else None."""
        if not self.uses_kernels(flat) or (flat is not None and flat.dtype != torch.float32):
            return None
        runs = self.runs(numel)
        if not fusable(runs):
            return None
        return FusedRotation(self, numel, runs, stream_key(self.sign_seed(seed)))

    def forward(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """Rotate ``flat`` (1-D float32): ``output_numel(numel)`` elements on its device.

        Raises
        ------
        NonFiniteOutput
            (a ValueError) If the rotation overflows float32 (values within ``sqrt(2**max_log2)``
            of the largest float32), or ``flat`` holds NaN or Inf.
        """
        out, finite = self._rotate(flat, self.runs(flat.numel()), seed, inverse=False)
        if not finite:
            self.refuse()
        return out

    def refuse(self) -> None:
        """Raise the error of a rotated tensor that is not finite."""
        raise NonFiniteOutput(f"{self.name}: the rotated tensor overflows float32; scale the update down")

    def inverse(self, flat: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
        """Rotate back: ``flat`` holds ``output_numel(numel)`` elements; returns the first ``numel``."""
        return self.inverse_checked(flat, numel, seed)[0]

    def inverse_checked(self, flat: torch.Tensor, numel: int, seed: int) -> tuple[torch.Tensor, bool]:
        """:meth:`inverse`, and whether the kernels found every value finite (the padding included)."""
        runs = self.runs(numel)
        if flat.numel() != _runs_numel(runs):
            raise ValueError(f"{self.name}: {flat.numel()} elements are not the rotation of {numel}")
        out, finite = self._rotate(flat, runs, seed, inverse=True)
        return out[:numel], bool(finite)
