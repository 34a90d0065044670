"""CPU (numba) kernels by quantizer family; their torch twins sit in the quantizer modules.

* :mod:`~fedquant.codecs.kernels.common`: shared primitives (inline uniforms, bucket statistics,
  bit packing of chunks, the parallel/serial switch);
* :mod:`~fedquant.codecs.kernels.grid`: scaled grids (QSGD, TernGrad) and scaled sign;
* :mod:`~fedquant.codecs.kernels.levels`: per-bucket levels (ORQ, Linear, BinGrad), torch twin in
  :mod:`~fedquant.codecs.kernels.levels_torch`;
* :mod:`~fedquant.codecs.kernels.dither`: subtractive and nested dither (DQSG, NDQSG).
"""
