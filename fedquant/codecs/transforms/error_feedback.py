"""Error feedback (EF-SGD, Karimireddy et al. 2019, Algorithm 1) in front of any codec: ``ef+``.

Each client keeps, per tensor, the residual ``e`` of what its codec failed to send, and adds it
to the next update: ``p = x + e``, send ``C(p)``, keep ``e' = p - C(p)``. With a biased codec
(scaled sign, BinGrad) the sum of what was sent then tracks the sum of the updates, the residual
staying bounded. Where the residual lives is the caller's business: a Flower client keeps it in
its ``Context.state`` (:mod:`fedquant.clients.state`), because a ClientApp object does not
survive between rounds.

The payload is the rest of the pipeline's: the server decodes it without the residual.

>>> codec = get_codec("ef+signsgd")
>>> residuals = {}                                         # per tensor name, kept across rounds
>>> payload, state = codec.encode_stateful(update, seed, {"ef": residuals.get("w")})
>>> residuals["w"] = state["ef"]
>>> server_side = codec.decode(payload, seed)
"""

from __future__ import annotations

import torch

from fedquant.codecs.transforms.base import StatefulTransform


class ErrorFeedback(StatefulTransform):
    """Adds the residual kept from the previous round; the new residual is what was lost."""

    name = "ef"
    biased = True

    def apply(self, flat: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        if state is None:
            return flat
        if state.numel() != flat.numel():
            raise ValueError(f"residual has {state.numel()} elements, the tensor {flat.numel()}")
        return flat + state.detach().to(device=flat.device, dtype=torch.float32).reshape(-1)

    def next_state(self, encoded: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        return encoded - decoded.to(encoded.device).reshape(-1)
