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

Any length: block layout
------------------------
The Hadamard transform needs power-of-two lengths. A tensor of ``n`` elements is laid out as
consecutive blocks of ``2**MAX_BLOCK_LOG2 = 512`` elements, and the rest (fewer) as one block
padded with zeros to the next power of two; each block is rotated on its own. The payload holds
:meth:`RandomizedHadamard.output_numel` ``>= n`` elements (the padding is sent, quantized; the
decoder drops it after the inverse rotation): 16 for 10 elements, 1024 for 1000, none added to
multiples of 512.

Measured with ``python -m benchmarks.rht_layout`` (rotation + codec + inverse; vNMSE @ bits per
coordinate from payload bytes; ``dqsg 2,entropy`` is ``dqsg:levels=2,coding=entropy``; ``t2``:
iid Student-t(2), heavy-tailed; ``real``: 30 updates of the digits MLP's 8192-element hidden
weights; on Gaussian data every layout is within 0.5% of no rotation at 2**20, 1.5 * 2**20 and
25M, except padding)::

    n, data        codec           none          pad           blocks 2^9    2^10          2^12          2^16
    2^20, t2       qsgd:levels=7   0.296 @4.06   0.0353 @4.06  0.0189 @4.06  0.0207 @4.06  0.0240 @4.06  0.0309 @4.06
    2^20, t2       dqsg 2,entropy  6.78  @0.67   0.217  @1.70  0.116  @1.80  0.127  @1.79  0.147  @1.78  0.190  @1.75
    1.5*2^20, t2   qsgd:levels=7   0.362 @4.06   0.0273 @5.42  0.0234 @4.06  0.0255 @4.06  -             0.0348 @4.06
    1.5*2^20, gau  dqsg 2,entropy  0.222 @1.69   0.168  @2.25  0.224  @1.68  0.223  @1.69  -             0.224  @1.69
    25M, t2        qsgd:levels=7   0.323 @4.06   0.0270 @5.45  0.0205 @4.06  0.0223 @4.06  -             0.0318 @4.06
    25M, t2        dqsg 2,entropy  6.34  @0.67   0.165  @2.27  0.125  @1.80  0.137  @1.79  -             0.195  @1.72
    8192, real     qsgd:levels=7   0.0663 @4.14  0.0360 @4.14  0.0350 @4.14  0.0356 @4.14  0.0362 @4.14  = pad
    8192, real     dqsg 2,entropy  0.587 @1.16   0.221  @1.78  0.215  @1.80  0.218  @1.78  0.222  @1.77  = pad
    1000, t2       qsgd:levels=7   0.352 @4.69   0.0307 @4.78  0.0285 @4.78  = pad (one padded block of 1024)
    10, gauss      qsgd:levels=7   0.0119 @69.6  0.0088 @72.0  = pad for every layout (16; the envelope dominates)

* **Padding** the whole tensor to one power of two costs up to twice the bits (``1.5 * 2**20``:
  33% more) for a proportionally smaller error: a bad trade (one more bit per coordinate buys
  about 4x less error). Splitting the length into its binary digits (no padding at all) leaves
  blocks too small to mix and measured no better than padding the tail.
* **Block size:** every fedquant quantizer scales buckets of 512 elements. A rotation larger
  than a bucket spreads an outlier's energy into buckets that did not have it and takes away
  the bucket scales' adaptation; one smaller than a bucket leaves buckets with mixed energy.
  Blocks of exactly one bucket measured best on heavy-tailed and on real updates (2^8: 0.0214
  and 0.0414 for qsgd on t2 and real).
* With **one scale per tensor** (``bucket_size=0``) the opposite holds: ``qsgd:levels=7,
  bucket_size=0`` on t2 gives 0.079 padded, 0.086 with blocks of 2^16, 0.20 with 2^12 and 0.75
  with 2^9 (15.4 without rotation); on real updates 0.055, -, 0.057, 0.076 (0.141). The layout
  is fixed for the wire name ``rht`` (class attributes ``max_log2``, ``min_log2``); a quantizer
  with per-tensor scales wants a variant with larger blocks.

Blocks of at most a cache tile need only the low pass of :mod:`fedquant.codecs.kernels.hadamard`
(one read and one write of the tensor).
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar

import torch

from fedquant.codecs.codec import all_finite
from fedquant.codecs.kernels.hadamard import fwht_numba, fwht_torch, runs_numel
from fedquant.codecs.transforms.base import Transform
from fedquant.rng import derive_seed, stream_key

#: Largest block (log2): the 512-element bucket of the quantizers (measured above).
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


class RandomizedHadamard(Transform):
    """Randomized Hadamard rotation by blocks (``rht``): signs from the seed, never sent.

    Attributes
    ----------
    max_log2, min_log2 : int
        The block layout (:func:`block_layout`); class attributes, fixed for the wire name.
    """

    name = "rht"
    max_log2: ClassVar[int] = MAX_BLOCK_LOG2
    min_log2: ClassVar[int | None] = None

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
    ) -> tuple[torch.Tensor, bool]:
        """The rotated tensor and whether every value of it is finite."""
        sign_seed = self.sign_seed(seed)
        flat = flat.to(torch.float32).contiguous()
        if not self.uses_kernels(flat):
            out = fwht_torch(flat, runs, sign_seed, inverse)
            return out, all_finite(out)
        out, nonfinite = fwht_numba(flat.numpy(), runs, stream_key(sign_seed), inverse)
        return torch.from_numpy(out), nonfinite == 0

    def forward(self, flat: torch.Tensor, seed: int) -> torch.Tensor:
        """Rotate ``flat`` (1-D float32): ``output_numel(numel)`` elements on its device.

        Raises
        ------
        ValueError
            If the rotation overflows float32 (values within ``sqrt(2**max_log2)`` of the largest
            float32).
        """
        out, finite = self._rotate(flat, self.runs(flat.numel()), seed, inverse=False)
        if not finite:
            raise ValueError(f"{self.name}: the rotated tensor overflows float32; scale the update down")
        return out

    def inverse(self, flat: torch.Tensor, numel: int, seed: int) -> torch.Tensor:
        """Rotate back: ``flat`` holds ``output_numel(numel)`` elements; returns the first ``numel``."""
        runs = self.runs(numel)
        if flat.numel() != _runs_numel(runs):
            raise ValueError(f"{self.name}: {flat.numel()} elements are not the rotation of {numel}")
        return self._rotate(flat, runs, seed, inverse=True)[0][:numel]
