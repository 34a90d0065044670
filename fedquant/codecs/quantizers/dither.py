"""Dithered (DQSG) and nested dithered (NDQSG) quantization of Abdi & Fekri (2019).

Both quantizers add a subtractive dither ``u ~ U[-step/2, step/2]`` that the decoder regenerates
from the seed, so the dither is never sent. It comes from :func:`fedquant.rng.uniform`
(counter-based, the counter is the element's index in the flattened tensor), which is
bit-identical on CPU and CUDA and in every process: a client may encode on its GPU while the
server decodes on its CPU.

``dqsg``
    Per bucket ``kappa = max|g|`` and ``step = kappa / M`` (the paper's ``Delta = 1/M`` on
    ``g / kappa``); index ``q = round(g / step + u)`` in ``{-M..M}``; decode
    ``g~ = step * (q - u)``. The error is uniform on ``[-step/2, step/2]`` and independent of
    ``g`` (Schuchman), variance ``step**2 / 12`` per coordinate.
``ndqsg``
    Nested pair: fine step ``Delta1 = kappa / M1`` (per bucket, the authors' rule), coarse step
    ``Delta2 = rho * Delta1`` with odd ``rho``, shrinkage ``alpha``. The client sends only the
    fine bin's position inside its coarse bin, ``s = Q1(t) - Q2(t)`` with ``t = alpha*g + u``,
    ``s`` in ``{-(rho-1)/2 .. (rho-1)/2}``: ``log2(rho)`` bits instead of ``log2(2M+1)``. The
    server resolves the ambiguity with side information ``y`` (its estimate of ``g``, e.g. the mean
    of the updates already decoded): ``g^ = y + alpha * [((s - u) Delta1 - alpha y) mod Delta2]``
    (centred modulo). With ``x = y + z`` and no wrap-around the error is
    ``(alpha**2 - 1) z + alpha Delta1 eps``, MSE ``(1-alpha**2)**2 sigma_z**2 + alpha**2 Delta1**2/12``.

The fine step comes from the client's own bucket maximum, as in the authors' code
(``scale = ||w||_inf / M1``): the client needs nothing from the server but ``rho`` and ``alpha``,
its error variance equals DQSG's at the same ``levels``, and the server learns each step from the
payload (32 bits per bucket). The price is that ``Delta1`` (hence the wrap-around margin
``(Delta2 - Delta1) / 2``) scales with each client's own maximum, so a server choosing ``rho``
from a spread ``sigma_z`` must compare it with the clients' typical ``kappa / M1`` per bucket
(see :mod:`fedquant.strategies.nested_rules`).

Both paths live in :mod:`fedquant.codecs.kernels.dither`: numba kernels on CPU tensors (dither
drawn inline, quantization fused with bit packing, unpacking fused with reconstruction; no
full-size temporaries) and the torch functions for other devices (CUDA) and, with
``force_torch = True`` on a quantizer, the reference the kernels are tested against.

Wire, per tensor (the layout of :mod:`fedquant.codecs.coders.layout`): one float32 step per
bucket, then the symbols ``q + M`` (``dqsg``, ``2M + 1`` of them) or ``s + (rho - 1) / 2``
(``ndqsg``, ``rho`` of them) in the stream of ``coding``: packed at ``ceil(log2(K))`` bits
(``fixed``), QSGD's Elias codes of the signed indices (``elias``) or rANS (``entropy``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from fedquant.codecs.buckets import bucket_stat, check_bucket_scales, effective_bucket_size, num_buckets, to_buckets
from fedquant.codecs.kernels import dither as kernels
from fedquant.codecs.kernels.common import kernel_key
from fedquant.codecs.kernels.hadamard import fwht_numba
from fedquant.codecs.params import Param
from fedquant.codecs.quantizers.base import (
    BucketScaledQuantizer,
    LevelsLadder,
    Quantized,
    check_alphabet,
    relative_error,
    require_finite,
)
from fedquant.codecs.side_info import SideInfoQuantizer
from fedquant.errors import PayloadError

MAX_LEVELS = (1 << 15) - 1  # 2M+1 indices must fit the 16-bit packer
MAX_RHO = (1 << 16) - 1

_BUCKET = Param(int, 512, "elements per bucket, each with its own step; 0 = one step per tensor", minimum=0)


class DitherQuantizer(LevelsLadder, BucketScaledQuantizer):
    """Shared base of DQSG and NDQSG: a float32 step per bucket, a symmetric alphabet of indices.

    The per-bucket side field is :class:`~fedquant.codecs.quantizers.grid.BucketScaledQuantizer`'s
    (here the step ``max|g| / levels`` itself rather than a scale).

    Subclasses define :meth:`half` (the alphabet is ``2 half + 1`` symbols ``index + half``),
    :meth:`_kernel_args` (the keyword arguments of the kernels) and the torch path
    (:meth:`_torch_symbols`, :meth:`_torch_values`).
    """

    codings = ("fixed", "elias", "entropy")
    symmetric = True

    def half(self) -> int:
        """Largest index magnitude: symbols are ``index + half``."""
        raise NotImplementedError

    def checks_finite(self) -> bool:
        """Steps are bucket maxima over ``levels``: finite exactly when the bucket is."""
        return True

    def num_symbols(self) -> int:
        return 2 * self.half() + 1

    def check_side(self, side: list[np.ndarray]) -> None:
        check_bucket_scales(side[0], self.name, "bucket step")

    # ------------------------------------------------------------------ encode
    def fuses(self, rotation) -> bool:
        """Fixed-width or entropy coding on the CPU kernels with buckets that tile the chunks rotates as
        it goes (NDQSG's side information too: a bound copy takes it before the rotation)."""
        d = effective_bucket_size(self.bucket_size, rotation.padded)
        return self.coding in ("fixed", "entropy") and self.uses_kernels() and kernels.CHUNK % d == 0

    def quantize(self, flat: torch.Tensor, seed: int, packed_width: int | None) -> Quantized:
        if self.rotation is not None:  # the kernels rotate each chunk and take its steps in one pass
            d = effective_bucket_size(self.bucket_size, self.rotation.padded)
            if packed_width is None:  # entropy coding: the symbols (and their histogram)
                count = self.wants_counts()
                out = kernels.step_encode_symbols(
                    flat.numpy(), d, kernel_key(seed), self.rotation, count=count, **self._kernel_args()
                )
                return Quantized([out[0]], symbols=out[1], counts=out[2] if count else None)
            steps, packed = kernels.step_encode_packed(
                flat.numpy(), d, kernel_key(seed), packed_width, rotation=self.rotation, **self._kernel_args()
            )
            return Quantized([steps], packed=packed)
        numel = flat.numel()
        d = effective_bucket_size(self.bucket_size, numel)
        if self.uses_kernels(flat):
            x = flat.numpy()
            key = kernel_key(seed)
            if packed_width is not None and kernels.CHUNK % d == 0:  # steps and symbols in one pass
                steps, packed = kernels.step_encode_packed(x, d, key, packed_width, **self._kernel_args())
                require_finite(steps)
                return Quantized([steps], packed=packed)
            # the true float32 division of kernels.bucket_steps, on the kernel's bucket maxima
            steps = bucket_stat(flat, d, "max", use_kernels=True) / np.float32(self.levels)
            require_finite(steps)
            if packed_width is not None:
                return Quantized(
                    [steps], packed=kernels.encode_packed(x, d, steps, key, packed_width, **self._kernel_args())
                )
            if self.wants_counts():
                symbols, counts = kernels.encode_symbols(x, d, steps, key, count=True, **self._kernel_args())
                return Quantized([steps], symbols=symbols, counts=counts)
            return Quantized([steps], symbols=kernels.encode_symbols(x, d, steps, key, **self._kernel_args()))
        v = to_buckets(flat, d)
        step = kernels.bucket_steps(flat, d, self.levels)
        require_finite(step.reshape(-1).cpu().numpy())
        u = kernels.dither(seed, v.numel(), flat.device).view_as(v)
        symbols = self._torch_symbols(v, step, u) + self.half()
        return Quantized(
            [step.reshape(-1).cpu().numpy()],
            symbols=symbols.reshape(-1)[:numel].to(torch.int32).cpu().numpy().astype(np.uint16),
        )

    # ------------------------------------------------------------------ decode
    def dequantize(self, side: list[np.ndarray], symbols: np.ndarray, numel: int, seed: int) -> torch.Tensor:
        if self.rotation is not None or self.uses_kernels():  # (bound to a rotation: the kernels rotate back)
            y = self._side_info_array()
            try:
                d, steps = self.bucket_scales(side, numel)
                values, top, finite, values_finite = kernels.decode_symbols(
                    symbols, d, steps, kernel_key(seed), side_info=y, rotation=self.rotation, **self._kernel_args()
                )
            except PayloadError:
                self._check_side_finite(y)  # bad side information is reported first, as always
                raise
            return self._kernel_values(values, top, finite, values_finite, y)
        self._checked_side_info()
        d, steps = self.bucket_scales(side, numel)
        nb = num_buckets(numel, d)
        padded = torch.zeros(nb * d, dtype=torch.float32)
        padded[:numel] = torch.from_numpy(symbols.astype(np.float32))
        sym = padded.view(nb, d) - self.half()
        u = kernels.dither(seed, sym.numel()).view_as(sym)
        step = torch.from_numpy(steps.copy()).reshape(nb, 1)  # steps may be a read-only view of the payload
        return self._torch_values(sym, step, u, d).reshape(-1)[:numel].to(torch.float32)

    def dequantize_packed(
        self, side: list[np.ndarray], packed: np.ndarray, width: int, numel: int, seed: int
    ) -> torch.Tensor:
        if self.rotation is None and not self.uses_kernels():
            return super().dequantize_packed(side, packed, width, numel, seed)
        y = self._side_info_array()
        try:
            d, steps = self.bucket_scales(side, numel)
            values, top, finite, values_finite = kernels.decode_packed(
                packed, numel, d, steps, kernel_key(seed), width, side_info=y, rotation=self.rotation,
                **self._kernel_args(),
            )  # fmt: skip
        except PayloadError:
            self._check_side_finite(y)  # bad side information is reported first, as always
            raise
        return self._kernel_values(values, top, finite, values_finite, y)

    def _kernel_values(
        self, values: np.ndarray, top: int, finite: bool, values_finite: bool, y: np.ndarray | None
    ) -> torch.Tensor:
        """A decoding kernel's values, after its checks: the side information (NaN/Inf, read in the
        kernel's pass), then the largest symbol; the kernel checked the values too (``values_finite``)."""
        if y is not None:
            self._check_side_finite(y, finite)
        self._check_top(top)
        self.values_finite = values_finite
        return torch.from_numpy(values)

    def _check_top(self, top: int) -> None:
        """PayloadError if the largest symbol a kernel decoded is beyond the alphabet."""
        if top >= self.num_symbols():
            check_alphabet(np.array([top]), self.num_symbols(), self.name)

    def _checked_side_info(self) -> None:
        """ValueError if side information is required and missing or not finite (the torch path)."""
        return None

    def _side_info_array(self) -> np.ndarray | None:
        """Side information as the kernels take it (CPU float32, not checked), or None; ValueError if missing."""
        return None

    def _check_side_finite(self, y: np.ndarray | None, finite: bool | None = None) -> None:
        """ValueError if ``y`` holds a NaN or Inf (``finite``: a kernel's answer, else checked here)."""
        return None

    # ------------------------------------------------------------------ per family
    def _kernel_args(self) -> dict:
        raise NotImplementedError

    def _torch_symbols(self, v: torch.Tensor, step: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Signed indices of the ``(buckets, d)`` tensor ``v`` (float, in ``[-half, half]``)."""
        raise NotImplementedError

    def _torch_values(self, sym: torch.Tensor, step: torch.Tensor, u: torch.Tensor, d: int) -> torch.Tensor:
        """Values of the signed indices ``sym`` (``(buckets, d)``, float32) on the CPU."""
        raise NotImplementedError


class DQSGQuantizer(DitherQuantizer):
    """Dithered quantized SG (Abdi & Fekri 2019, Alg. 1): subtractive dither from the shared seed.

    Parameters
    ----------
    levels : int
        ``M``: ``2M+1`` indices ``{-M..M}``, step ``max|g| / M`` per bucket. Default 3 (7 levels),
        the authors' setting for the DQSG group of their NDQSG experiments.
    bucket_size : int
        Elements per bucket (each sends one float32 step). Default 512; 0 = one step per tensor.
    coding : {"fixed", "elias", "entropy"}
        Indices packed at ``ceil(log2(2M+1))`` bits (default), Elias coded (QSGD's codes) or
        entropy coded with their own empirical distribution (:mod:`fedquant.wire.entropy`), the
        rate the authors report.

    Notes
    -----
    Unbiased, error ``U[-step/2, step/2]`` independent of the input, variance ``step**2/12`` per
    coordinate; always less than stochastic rounding's average at the same ``M``. The decoder
    must be given the encoder's seed.
    """

    name = "dqsg"
    params: ClassVar[dict[str, Param]] = {
        "levels": Param(int, 3, "M: 2M+1 quantization indices, step = max|g|/M", minimum=1, maximum=MAX_LEVELS),
        "bucket_size": _BUCKET,
    }
    unbiased = True
    paper = "Abdi & Fekri 2019 (DQSG)"
    wire = "float32 step per bucket + indices (2M+1 symbols) fixed-width, Elias or entropy coded; no dither bits"

    def half(self) -> int:
        return self.levels

    def error_bound(self, numel: int) -> float:
        """``omega = d / (12 M^2)``: variance ``step^2 / 12`` per element, ``step = max|g| / M <= ||g_b|| / M``."""
        return effective_bucket_size(self.bucket_size, numel) / (12 * self.levels**2)

    def expected_error(self, flat: torch.Tensor) -> float:
        """Exact: ``sum_b n_b step_b^2 / 12`` over the buckets (``n_b`` their element counts)."""
        numel = flat.numel()
        d = effective_bucket_size(self.bucket_size, numel)
        steps = bucket_stat(flat, d, "max", self.uses_kernels(flat)).astype(np.float64) / self.levels
        counts = np.full(steps.shape, d, dtype=np.float64)
        if counts.size:
            counts[-1] = numel - (counts.size - 1) * d
        return relative_error(float((counts * steps * steps).sum()) / 12, flat)

    def _kernel_args(self) -> dict:
        return {"levels": self.levels}

    def _torch_symbols(self, v, step, u):
        return kernels.dithered_quantize(v, step, u, self.levels)

    def _torch_values(self, sym, step, u, d):
        return kernels.dithered_reconstruct(sym, step, u)


class NDQSGQuantizer(SideInfoQuantizer, DitherQuantizer):
    """Nested dithered quantized SG (Abdi & Fekri 2019, Alg. 2 group P2); decoding needs side info.

    Parameters
    ----------
    levels : int
        ``M1``: fine step ``Delta1 = max|g| / M1`` per bucket (as DQSG at ``levels=M1``). Default 3.
    rho : int
        Odd ratio ``Delta2 / Delta1`` >= 3; ``s`` takes ``rho`` values. Default 3 (authors).
    alpha : float
        Shrinkage in (0, 1]. 1 (default) keeps the decoder conditionally unbiased.
    bucket_size : int
        Elements per bucket. Default 512; 0 = one step per tensor.
    coding : {"fixed", "elias", "entropy"}
        Coset indices packed at ``ceil(log2(rho))`` bits (default), Elias coded, or entropy coded
        (about ``log2(rho)`` bits: the dither makes them nearly uniform).

    Notes
    -----
    ``decode(..., side_info=y)`` needs the decoder's estimate ``y`` of the tensor. Correct while
    ``|alpha (g - y) + Delta1 eps| < Delta2 / 2`` per coordinate (``eps`` the fine rounding error
    in ``[-1/2, 1/2]``); beyond that the estimate jumps by ``alpha Delta2``. Choose ``rho`` with
    :func:`fedquant.strategies.nested_rules.choose_rho`. ``unbiased`` is False because the estimate
    is biased for ``alpha < 1`` and after wrap-arounds; with ``alpha = 1`` and no wrap it is
    unbiased with DQSG's variance ``Delta1**2 / 12``. On the server,
    :class:`~fedquant.strategies.nested.NestedDecodePlan` provides the side information.
    """

    name = "ndqsg"
    params: ClassVar[dict[str, Param]] = {
        "levels": Param(int, 3, "M1: fine step Delta1 = max|g|/M1 per bucket", minimum=1, maximum=MAX_LEVELS),
        "rho": Param(int, 3, "odd coarse/fine step ratio Delta2/Delta1, >= 3", minimum=3, maximum=MAX_RHO),
        "alpha": Param(float, 1.0, "shrinkage factor in (0, 1]", maximum=1.0),
        "bucket_size": _BUCKET,
    }
    unbiased = False
    paper = "Abdi & Fekri 2019 (NDQSG)"
    wire = "float32 fine step per bucket + coset indices (rho symbols) fixed-width, Elias or entropy coded; side info"

    def _validate(self) -> None:
        if self.rho % 2 == 0:
            raise ValueError(f"ndqsg: parameter 'rho' must be odd (coarse cells on fine ones), got {self.rho}")
        if not self.alpha > 0:
            raise ValueError(f"ndqsg: parameter 'alpha' must be in (0, 1], got {self.alpha}")

    def half(self) -> int:
        return self.rho // 2

    def error_bound(self, numel: int) -> None:
        """None: the decoded value depends on the server's side information, which the client lacks.

        A client can decode its own payload only with the exact value as side information, so
        an error-feedback residual would not be what the server failed to receive (whenever
        ``alpha < 1`` or a coordinate wraps around): ``ef+ndqsg`` is refused; use ``ef+dqsg``.
        """
        return None

    def rate_ladder(self) -> tuple[NDQSGQuantizer, ...]:
        return (self,)  # its decode plan sets rho and the groups' codecs each round

    def _kernel_args(self) -> dict:
        return {"levels": self.levels, "nested": True, "rho": self.rho, "alpha": self.alpha}

    def _required_side_info(self) -> torch.Tensor:
        if self.side_info is None:
            raise ValueError(
                "ndqsg: decoding needs side_info, the server's estimate of this tensor (e.g. the mean of the "
                "updates already decoded this round); nested indices alone do not determine the values"
            )
        return self.side_info

    def _side_info_array(self) -> np.ndarray:
        return self._required_side_info().detach().to("cpu", torch.float32).contiguous().numpy()

    def _checked_side_info(self) -> None:
        if not bool(torch.isfinite(self._required_side_info()).all()):
            raise ValueError("ndqsg: side_info contains NaN or Inf")

    def _check_side_finite(self, y: np.ndarray | None, finite: bool | None = None) -> None:
        rotation = self.rotation
        if rotation is not None and finite is None:
            # Bound to a rotation the side information is given before it, and what is refused is its
            # rotation (the kernel refuses that itself): the unfused pipeline rotates it first.
            rotation.check(fwht_numba(y, rotation.runs, rotation.key, False)[1])
            return
        if not (kernels.all_finite(y) if finite is None else finite):
            raise ValueError("ndqsg: side_info contains NaN or Inf")

    def _torch_symbols(self, v, step, u):
        return kernels.nested_quantize(v, step, u, self.rho, self.alpha)

    def _torch_values(self, sym, step, u, d):
        y = to_buckets(self.side_info.detach().to("cpu", torch.float64), d)
        return kernels.nested_reconstruct(sym, step, u, self.rho, self.alpha, y)
