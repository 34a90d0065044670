"""Error feedback (EF-SGD, Karimireddy et al. 2019, Algorithm 1) around any codec.

Each client keeps, per tensor, the residual ``e`` of what its codec failed to send, and adds it
to the next update: ``p = x + e``, send ``C(p)``, keep ``e' = p - C(p)``. With a biased codec
(scaled sign, BinGrad) the sum of what was sent then tracks the sum of the updates, the residual
staying bounded. Where the residual lives is the caller's business: in a Flower client it is the
client's ``Context.state`` (one ArrayRecord entry per tensor, see :func:`residual_state_key`),
because a ClientApp object does not survive between rounds.

The payload is the inner codec's: the server decodes it with the inner codec (or with this
wrapper, whose ``decode`` delegates) and never sees the residual.

>>> ef = get_codec("ef+signsgd")                       # or ErrorFeedback(get_codec("signsgd"))
>>> residuals = {}                                     # per tensor name, kept across rounds
>>> payload, residuals["w"] = ef.encode_with_feedback(update, seed, residuals.get("w"))
>>> server_side = ef.decode(payload, seed)             # = ef.inner.decode(payload, seed)
"""

from __future__ import annotations

from typing import Any

import torch

from fedquant.codecs.base import Codec

EF_PREFIX = "ef+"
RESIDUAL_PREFIX = "fedquant.ef."


def residual_state_key(tensor_name: str) -> str:
    """Key under which a client keeps the residual of ``tensor_name`` (e.g. in an ArrayRecord)."""
    return RESIDUAL_PREFIX + tensor_name


class ErrorFeedback:
    """Error-feedback wrapper: ``encode_with_feedback`` adds and updates a residual per tensor.

    Parameters
    ----------
    inner : Codec
        The codec that does the compressing (any registered codec; biased ones benefit most).

    Notes
    -----
    ``encode`` alone is stateless and identical to ``inner.encode``: error feedback needs the
    caller to keep the residual and call :meth:`encode_with_feedback`.
    """

    def __init__(self, inner: Codec) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("error feedback is already applied; use one 'ef+' prefix")
        if not isinstance(inner, Codec):
            raise TypeError(f"ErrorFeedback wraps a Codec, got {type(inner).__name__}")
        self.inner = inner

    @property
    def spec(self) -> str:
        """``"ef+"`` followed by the inner codec's spec."""
        return EF_PREFIX + self.inner.spec

    @property
    def name(self) -> str:
        return EF_PREFIX + self.inner.name

    unbiased = False

    @property
    def needs_side_info(self) -> bool:
        return self.inner.needs_side_info

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ErrorFeedback) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def encode_with_feedback(
        self, x: torch.Tensor, seed: int, residual: torch.Tensor | None
    ) -> tuple[bytes, torch.Tensor]:
        """Encode ``x + residual`` and return the payload with the new residual.

        Parameters
        ----------
        x : torch.Tensor
            The update (any shape, floating, CPU or CUDA).
        seed : int
            Seed for the inner codec.
        residual : torch.Tensor or None
            The residual kept from the previous call for this tensor (same number of elements);
            ``None`` on the first call.

        Returns
        -------
        payload : bytes
            The inner codec's payload of ``p = x + residual``.
        new_residual : torch.Tensor
            ``p - inner.decode(payload)``: float32, shape of ``x``, on ``x``'s device.
        """
        p = x.detach().to(torch.float32)
        if residual is not None:
            if residual.numel() != x.numel():
                raise ValueError(f"residual has {residual.numel()} elements, the tensor {x.numel()}")
            p = p + residual.detach().to(device=x.device, dtype=torch.float32).reshape(x.shape)
        payload = self.inner.encode(p, seed)
        decoded = self.inner.decode(payload, seed, **self._decode_side(p)).to(device=x.device)
        return payload, p - decoded.reshape(x.shape)

    def _decode_side(self, p: torch.Tensor) -> dict[str, Any]:
        # A decoder that needs side information gets the exact value here: the client knows it.
        return {"side_info": p} if self.inner.needs_side_info else {}

    def encode(self, x: torch.Tensor, seed: int = 0) -> bytes:
        """Stateless encode, the same as ``inner.encode`` (no residual; see the class notes)."""
        return self.inner.encode(x, seed)

    def decode(self, payload: bytes | bytearray | memoryview, seed: int = 0, side_info=None, **kwargs) -> torch.Tensor:
        """Decode an inner-codec payload (delegates to ``inner.decode``)."""
        return self.inner.decode(payload, seed, side_info, **kwargs)
