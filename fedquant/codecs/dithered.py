"""Dithered (DQSG) and nested dithered (NDQSG) quantization of Abdi & Fekri (2019).

Both codecs add a subtractive dither ``u ~ U[-step/2, step/2]`` that the decoder regenerates from
the seed, so the dither is never sent. It comes from :func:`fedquant.rng.uniform` (counter-based,
the counter is the element's index in the flattened tensor), which is bit-identical on CPU and
CUDA and in every process: a client may encode on its GPU while the server decodes on its CPU.

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
(see :mod:`fedquant.codecs.nested_params`).

On CPU tensors both codecs run the numba kernels of :mod:`fedquant.codecs.dither_kernels`
(dither drawn inline, quantization fused with bit packing, unpacking fused with reconstruction;
no full-size temporaries); the torch functions below are the path for other devices (CUDA) and,
with ``force_torch = True`` on a codec instance, the reference the kernels are tested against
byte for byte and value for value.

Wire, per tensor: one float32 step per bucket, then the indices packed at ``ceil(log2(2M+1))``
(``dqsg``) or ``ceil(log2(rho))`` (``ndqsg``) bits each, or with ``coding="entropy"`` the bytes of
:func:`fedquant.wire.entropy.entropy_encode` to the end of the body.
"""

from __future__ import annotations

import numpy as np
import torch

from fedquant.codecs.base import Codec
from fedquant.codecs.buckets import num_buckets, to_buckets
from fedquant.codecs.index_coding import coder_available, decode_symbols, encode_symbols
from fedquant.codecs.kernels import dither as dither_kernels
from fedquant.codecs.params import Param
from fedquant.errors import PayloadError
from fedquant.rng import stream_key, uniform
from fedquant.wire.bitpack import bit_width, pack_bits, packed_size, unpack_bits
from fedquant.wire.body import BodyReader, BodyWriter

MAX_LEVELS = (1 << 15) - 1  # 2M+1 indices must fit the 16-bit packer
MAX_RHO = (1 << 16) - 1


# ---------------------------------------------------------------------- shared pieces
def dither(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The dither of a tensor in units of its step: ``n`` float32 values on ``[-1/2, 1/2)``.

    Element ``i`` is element ``i`` of :func:`fedquant.rng.uniform`'s stream for ``seed``, minus
    one half (exact in float32), so encoder and decoder agree bit for bit on any device.
    """
    return uniform(seed, n, device=device) - 0.5


def bucket_steps(buckets: torch.Tensor, levels: int) -> torch.Tensor:
    """Step ``max|v| / levels`` of each row of a ``(buckets, d)`` tensor, shape ``(buckets, 1)``."""
    if buckets.shape[0] == 0:
        return buckets.new_zeros((0, 1))
    # A true division on every device: CUDA turns division by a Python scalar into a
    # multiplication by its reciprocal, which can move the step by one ulp.
    divisor = torch.tensor(float(levels), dtype=buckets.dtype, device=buckets.device)
    return buckets.abs().amax(dim=1, keepdim=True) / divisor


def _safe(step: torch.Tensor) -> torch.Tensor:
    """Steps with zeros replaced by one (a zero step means an all-zero bucket: its input is 0)."""
    return torch.where(step > 0, step, torch.ones_like(step))


def dithered_quantize(v: torch.Tensor, step: torch.Tensor, u: torch.Tensor, levels: int) -> torch.Tensor:
    """DQSG indices ``round(v / step + u)`` clamped to ``{-levels..levels}``.

    ``u`` is the dither in units of ``step``. The clamp only acts when rounding of ``v / step``
    lands a hair above ``levels`` at the bucket maximum; all-zero buckets (``step = 0``) give 0.
    """
    return torch.round(v / _safe(step) + u).clamp_(-levels, levels)


def dithered_reconstruct(q: torch.Tensor, step: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """DQSG decoder ``step * (q - u)``: the dither is subtracted again."""
    return step * (q - u)


def nested_quantize(v: torch.Tensor, step1: torch.Tensor, u: torch.Tensor, rho: int, alpha: float) -> torch.Tensor:
    """Nested indices ``s = Q1(t) - Q2(t)``, ``t = alpha v + u step1``, in units of ``step1``.

    With ``q1 = round(t / step1)`` and odd ``rho``, ``Q2(t) / step1 = rho * round(q1 / rho)``
    (``q1 / rho`` is never a half-integer), so ``s`` lies in ``{-(rho-1)/2 .. (rho-1)/2}``.
    """
    q1 = torch.round(alpha * v / _safe(step1) + u)
    return q1 - rho * torch.round(q1 / rho)


def nested_reconstruct(
    s: torch.Tensor, step1: torch.Tensor, u: torch.Tensor, rho: int, alpha: float, y: torch.Tensor
) -> torch.Tensor:
    """Nested decoder with side information ``y`` (computed in the dtype of ``y``).

    ``r = (s - u) step1 - alpha y``, reduced to ``[-Delta2/2, Delta2/2]`` (``Delta2 = rho step1``),
    then ``y + alpha r``: of all values consistent with ``s``, the one in the coarse cell of ``y``.
    Buckets whose step is 0 were all zeros at the encoder and decode to 0.
    """
    step1 = step1.to(y.dtype)
    step2 = rho * step1
    r = (s.to(y.dtype) - u.to(y.dtype)) * step1 - alpha * y
    r = r - step2 * torch.round(r / _safe(step2))
    return torch.where(step1 > 0, y + alpha * r, torch.zeros_like(y))


def _bucket(numel: int, bucket_size: int) -> int:
    """Effective bucket size: ``bucket_size``, or the whole tensor when it is 0."""
    return bucket_size if bucket_size else max(numel, 1)


def _write(out: BodyWriter, steps: torch.Tensor, symbols: torch.Tensor, numel: int, half: int, coding: str) -> None:
    """Steps as float32, then the symbols ``0 .. 2 half`` packed or entropy coded."""
    out.add_array(steps.reshape(-1).cpu().numpy(), "<f4")
    sym = symbols.reshape(-1)[:numel].to(torch.int32).cpu().numpy()
    if coding == "fixed":
        out.add(pack_bits(sym, bit_width(2 * half + 1)))
    else:
        encode_symbols(out, sym.astype(np.uint16), half, coding)


def _read_steps(body: BodyReader, name: str, numel: int, bucket_size: int) -> np.ndarray:
    """The float32 bucket steps of a body, checked finite and non-negative."""
    steps = body.take_array("<f4", num_buckets(numel, bucket_size), "bucket steps")
    if not np.isfinite(steps).all() or (steps < 0).any():
        raise PayloadError(f"{name} payload holds a negative or non-finite bucket step")
    return steps.astype(np.float32)


def _check_top(name: str, top: int, num_symbols: int) -> None:
    if top >= num_symbols:
        raise PayloadError(f"{name} payload holds an index {top} outside 0..{num_symbols - 1}")


def _read(body: BodyReader, name: str, numel: int, bucket_size: int, half: int, coding: str):
    """Steps ``(buckets, 1)`` and symbols (float32, padded to whole buckets) of a body, all checked."""
    nb = num_buckets(numel, bucket_size)
    num_symbols = 2 * half + 1
    steps = _read_steps(body, name, numel, bucket_size)
    if coding == "fixed":
        width = bit_width(num_symbols)
        sym = unpack_bits(body.take(packed_size(numel, width), "packed indices"), width, numel)
    else:
        sym = decode_symbols(body, numel, half, coding, name)
    if sym.size:
        _check_top(name, int(sym.max()), num_symbols)
    padded = torch.zeros(nb * bucket_size, dtype=torch.float32)
    padded[:numel] = torch.from_numpy(sym.astype(np.float32))
    return torch.from_numpy(steps).reshape(nb, 1), padded.view(nb, bucket_size)


def _kernel_encode(
    flat: torch.Tensor, seed: int, bucket_size: int, levels: int, half: int, coding: str, **nested
) -> BodyWriter:
    """Body of a CPU tensor through :mod:`fedquant.codecs.dither_kernels` (same bytes as torch)."""
    x = flat.numpy()
    d = _bucket(x.size, bucket_size)
    steps = dither_kernels.bucket_steps(x, d, levels)
    key = np.uint64(stream_key(seed))
    out = BodyWriter()
    out.add_array(steps, "<f4")
    if coding == "fixed":
        out.add(dither_kernels.encode_packed(x, d, steps, key, bit_width(2 * half + 1), levels=levels, **nested))
    else:
        encode_symbols(out, dither_kernels.encode_symbols(x, d, steps, key, levels=levels, **nested), half, coding)
    return out


def _kernel_decode(
    body: BodyReader, name: str, numel: int, seed: int, bucket_size: int, levels: int, half: int, coding: str, **nested
) -> torch.Tensor:
    """Values of a body through :mod:`fedquant.codecs.dither_kernels` (same values as torch)."""
    d = _bucket(numel, bucket_size)
    steps = _read_steps(body, name, numel, d)
    key = np.uint64(stream_key(seed))
    num_symbols = 2 * half + 1
    if coding == "fixed":
        width = bit_width(num_symbols)
        data = np.frombuffer(body.take(packed_size(numel, width), "packed indices"), np.uint8)
        values, top = dither_kernels.decode_packed(data, numel, d, steps, key, width, levels=levels, **nested)
    else:
        codes = decode_symbols(body, numel, half, coding, name)
        values, top = dither_kernels.decode_symbols(codes, d, steps, key, levels=levels, **nested)
    _check_top(name, top, num_symbols)
    return torch.from_numpy(values)


_BUCKET = Param(int, 512, "elements per bucket, each with its own step; 0 = one step per tensor", minimum=0)
_CODING = Param(str, "fixed", "index stream: fixed-width packing or entropy coded", choices=("fixed", "entropy"))


def _uses_kernels(codec: Codec, flat: torch.Tensor | None = None) -> bool:
    """Whether to run the numba kernels: CPU data and no ``force_torch`` (tests of path equality)."""
    return not codec.force_torch and (flat is None or flat.device.type == "cpu")


def _check_coding(name: str, coding: str) -> None:
    if not coder_available(coding):
        raise ValueError(f"{name}: coding '{coding}' is not available in this installation")


# ---------------------------------------------------------------------- codecs
class DQSGCodec(Codec):
    """Dithered quantized SG (Abdi & Fekri 2019, Alg. 1): subtractive dither from the shared seed.

    Parameters
    ----------
    levels : int
        ``M``: ``2M+1`` indices ``{-M..M}``, step ``max|g| / M`` per bucket. Default 3 (7 levels),
        the authors' setting for the DQSG group of their NDQSG experiments.
    bucket_size : int
        Elements per bucket (each sends one float32 step). Default 512; 0 = one step per tensor.
    coding : {"fixed", "entropy"}
        Indices packed at ``ceil(log2(2M+1))`` bits (default) or entropy coded with their own
        empirical distribution (:mod:`fedquant.wire.entropy`), the rate the authors report.

    Notes
    -----
    Unbiased, error ``U[-step/2, step/2]`` independent of the input, variance ``step**2/12`` per
    coordinate; always less than stochastic rounding's average at the same ``M``. The decoder
    must be given the encoder's seed.
    """

    name = "dqsg"
    params = {
        "levels": Param(int, 3, "M: 2M+1 quantization indices, step = max|g|/M", minimum=1, maximum=MAX_LEVELS),
        "bucket_size": _BUCKET,
        "coding": _CODING,
    }
    unbiased = True
    paper = "Abdi & Fekri 2019 (DQSG)"
    wire = "float32 step per bucket + indices at ceil(log2(2M+1)) bits or entropy coded; no dither bits"

    #: Set to True to run the torch implementation (the CUDA path) on CPU tensors too.
    force_torch: bool = False

    def _validate(self) -> None:
        _check_coding(self.name, self.coding)

    @property
    def num_symbols(self) -> int:
        return 2 * self.levels + 1

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        if _uses_kernels(self, flat):
            return _kernel_encode(flat, seed, self.bucket_size, self.levels, self.levels, self.coding)
        v = to_buckets(flat, _bucket(flat.numel(), self.bucket_size))
        step = bucket_steps(v, self.levels)
        u = dither(seed, v.numel(), flat.device).view_as(v)
        q = dithered_quantize(v, step, u, self.levels)
        out = BodyWriter()
        _write(out, step, q + self.levels, flat.numel(), self.levels, self.coding)
        return out

    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        if _uses_kernels(self):
            return _kernel_decode(body, self.name, numel, seed, self.bucket_size, self.levels, self.levels, self.coding)
        step, sym = _read(body, self.name, numel, _bucket(numel, self.bucket_size), self.levels, self.coding)
        u = dither(seed, sym.numel()).view_as(sym)
        return dithered_reconstruct(sym - self.levels, step, u).reshape(-1)[:numel]


class NDQSGCodec(Codec):
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
    coding : {"fixed", "entropy"}
        Coset indices packed at ``ceil(log2(rho))`` bits (default) or entropy coded (about
        ``log2(rho)`` bits: the dither makes them nearly uniform).

    Notes
    -----
    ``decode(..., side_info=y)`` needs the decoder's estimate ``y`` of the tensor. Correct while
    ``|alpha (g - y) + Delta1 eps| < Delta2 / 2`` per coordinate (``eps`` the fine rounding error
    in ``[-1/2, 1/2]``); beyond that the estimate jumps by ``alpha Delta2``. Choose ``rho`` with
    :func:`fedquant.codecs.nested_params.choose_rho`. ``unbiased`` is False because the estimate
    is biased for ``alpha < 1`` and after wrap-arounds; with ``alpha = 1`` and no wrap it is
    unbiased with DQSG's variance ``Delta1**2 / 12``.
    """

    name = "ndqsg"
    params = {
        "levels": Param(int, 3, "M1: fine step Delta1 = max|g|/M1 per bucket", minimum=1, maximum=MAX_LEVELS),
        "rho": Param(int, 3, "odd coarse/fine step ratio Delta2/Delta1, >= 3", minimum=3, maximum=MAX_RHO),
        "alpha": Param(float, 1.0, "shrinkage factor in (0, 1]", maximum=1.0),
        "bucket_size": _BUCKET,
        "coding": _CODING,
    }
    unbiased = False
    needs_side_info = True
    decode_plan = "fedquant.strategies.nested:NestedDecodePlan"
    paper = "Abdi & Fekri 2019 (NDQSG)"
    wire = "float32 fine step per bucket + coset indices at ceil(log2(rho)) bits or entropy coded; side info"

    #: Set to True to run the torch implementation (the CUDA path) on CPU tensors too.
    force_torch: bool = False

    def _validate(self) -> None:
        _check_coding(self.name, self.coding)
        if self.rho % 2 == 0:
            raise ValueError(f"ndqsg: parameter 'rho' must be odd (coarse cells on fine ones), got {self.rho}")
        if not self.alpha > 0:
            raise ValueError(f"ndqsg: parameter 'alpha' must be in (0, 1], got {self.alpha}")

    def _nested(self) -> dict:
        return {"nested": True, "rho": self.rho, "alpha": self.alpha}

    def _encode(self, flat: torch.Tensor, seed: int) -> BodyWriter:
        if _uses_kernels(self, flat):
            half = self.rho // 2
            return _kernel_encode(flat, seed, self.bucket_size, self.levels, half, self.coding, **self._nested())
        v = to_buckets(flat, _bucket(flat.numel(), self.bucket_size))
        step1 = bucket_steps(v, self.levels)
        u = dither(seed, v.numel(), flat.device).view_as(v)
        s = nested_quantize(v, step1, u, self.rho, self.alpha)
        out = BodyWriter()
        _write(out, step1, s + self.rho // 2, flat.numel(), self.rho // 2, self.coding)
        return out

    def _decode(self, body: BodyReader, numel: int, seed: int, side_info: torch.Tensor | None) -> torch.Tensor:
        if side_info is None:
            raise ValueError(
                "ndqsg: decoding needs side_info, the server's estimate of this tensor (e.g. the mean of the "
                "updates already decoded this round); nested indices alone do not determine the values"
            )
        if _uses_kernels(self):
            y = side_info.detach().to("cpu", torch.float32).contiguous().numpy()
            if not dither_kernels.all_finite(y):
                raise ValueError("ndqsg: side_info contains NaN or Inf")
            half = self.rho // 2
            nested = self._nested()
            return _kernel_decode(
                body, self.name, numel, seed, self.bucket_size, self.levels, half, self.coding, side_info=y, **nested
            )
        if not bool(torch.isfinite(side_info).all()):
            raise ValueError("ndqsg: side_info contains NaN or Inf")
        d = _bucket(numel, self.bucket_size)
        step1, sym = _read(body, self.name, numel, d, self.rho // 2, self.coding)
        u = dither(seed, sym.numel()).view_as(sym)
        y = to_buckets(side_info.detach().to("cpu", torch.float64), d)
        x = nested_reconstruct(sym - self.rho // 2, step1, u, self.rho, self.alpha, y)
        return x.reshape(-1)[:numel].to(torch.float32)
