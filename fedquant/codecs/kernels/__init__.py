"""CPU (numba) kernels by family, each beside its torch twin (the CUDA path); both give the same bytes.

* :mod:`~fedquant.codecs.kernels.common`: shared primitives (inline uniforms, bucket statistics,
  bit packing of chunks);
* :mod:`~fedquant.codecs.kernels.grid`: scaled grids (QSGD, TernGrad) and scaled sign, torch twins
  in the same module;
* :mod:`~fedquant.codecs.kernels.levels`: per-bucket levels (ORQ, Linear, BinGrad), torch twin in
  :mod:`~fedquant.codecs.kernels.levels_torch`;
* :mod:`~fedquant.codecs.kernels.dither`: subtractive and nested dither (DQSG, NDQSG), torch twins
  in the same module;
* :mod:`~fedquant.codecs.kernels.hadamard`: the blocked fast Walsh–Hadamard transform of ``rht+``,
  torch twin in the same module.

The JIT runtime they share (cache, twins, target CPU) is :mod:`fedquant.jit`, imported first so
that its cache locator is in place before any kernel is decorated.
"""

import fedquant.jit  # noqa: F401
