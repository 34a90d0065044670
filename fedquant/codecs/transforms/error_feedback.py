"""Error feedback (EF-SGD, Karimireddy et al. 2019, Algorithm 1) in front of any codec: ``ef+``.

Each client keeps, per tensor, the residual ``e`` of what its codec failed to send, and adds it
to the next update: ``p = x + e``, send ``C(gamma p)``, keep ``e' = p - C(gamma p)``. The sum of
what was sent then tracks the sum of the updates, as long as the residual stays bounded, which
needs a *contractive* compressor: ``E||C(p) - p||^2 <= (1 - delta) ||p||^2`` with ``delta > 0``.

Not every codec is one. An unbiased codec of variance ``omega`` (``E||C(p) - p||^2 = omega ||p||^2``)
leaves a residual of ``omega ||p||^2``, which grows every round when ``omega >= 1`` (EDEN at 0.5
bits has ``omega`` about 2: measured, ``ef+eden:bits=0.5`` fell to chance). So ``ef+`` reads the
error each quantizer declares (:meth:`fedquant.codecs.Quantizer.error_bound`,
:meth:`~fedquant.codecs.Quantizer.expected_error`) and

* **scales** unbiased codecs: it encodes ``gamma p`` with ``gamma = 1 / (1 + omega(p))``, the
  factor that minimises the expected residual ``E||p - gamma C(p)||^2 = omega / (1 + omega) ||p||^2``:
  contractive with ``delta = 1 / (1 + omega)`` for every ``omega``. ``omega(p)`` is the exact
  variance for this ``p`` where the quantizer has it in closed form (QSGD, TernGrad, DQSG, ORQ,
  Linear: ``gamma`` is then about 1 for accurate settings and nothing changes), else the declared
  value (EDEN's vNMSE);
* **accepts** biased codecs whose declared bound is at most 1 as they are (scaled sign, BinGrad:
  ``1 - 1/d``; fp16), as EF-SignSGD does;
* **refuses**, when the codec is built, biased codecs with a larger bound (TernGrad or ORQ with
  ``clip``) and codecs that declare none (NDQSG, whose decoded value depends on the server's
  side information), with a ValueError that names the codec and its bound.

Scaling rather than refusing keeps ``ef+`` usable with the codecs where its bias correction is
wanted most (below one bit per coordinate); scaling is exact because every codec here is
scale-equivariant (``C(gamma p)`` is distributed as ``gamma C(p)``).

Where the residual lives is the caller's business: a Flower client keeps it in its
``Context.state`` (:mod:`fedquant.clients.state`), because a ClientApp object does not survive
between rounds. The payload is the rest of the pipeline's: the server decodes it without the
residual.

>>> codec = get_codec("ef+signsgd")
>>> residuals = {}                                         # per tensor name, kept across rounds
>>> payload, state = codec.encode_stateful(update, seed, {"ef": residuals.get("w")})
>>> residuals["w"] = state["ef"]
>>> server_side = codec.decode(payload, seed)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fedquant.codecs.transforms.base import StatefulTransform

#: Size at which a codec's declaration is read when it is built (the bucketed codecs' bounds
#: grow with the bucket, not beyond it).
PROBE_NUMEL = 1 << 16


def ef_scale(omega: float | None) -> float:
    """``1 / (1 + omega)``: the scale that makes an unbiased codec of variance ``omega`` contractive."""
    return 1.0 / (1.0 + max(float(omega or 0.0), 0.0))


class ErrorFeedback(StatefulTransform):
    """Adds the residual kept from the previous round; the new residual is what was lost.

    Unbiased codecs are scaled by ``1 / (1 + omega)`` first (see the module docstring).
    """

    name = "ef"
    biased = True
    scales = False  # whether apply() scales by 1 / (1 + omega): set by bind_codec

    def bind_codec(self, quantizer: Any) -> None:
        """Refuse ``quantizer`` when error feedback could diverge with it; scale when it is unbiased."""
        bound = quantizer.error_bound(PROBE_NUMEL)
        spec = getattr(quantizer, "spec", quantizer.name)
        if bound is None:
            raise ValueError(
                f"ef+{spec}: {quantizer.name} declares no error bound (Quantizer.error_bound), so error "
                "feedback's residual cannot be shown to stay bounded; use a codec that declares one"
                + (" (ef+dqsg for ndqsg)" if quantizer.name == "ndqsg" else "")
            )
        if not quantizer.unbiased and bound > 1.0:
            raise ValueError(
                f"ef+{spec}: {quantizer.name} is biased and its error can reach omega = {bound:.3g} times "
                f"||x||^2 (> 1) on {PROBE_NUMEL} elements, so error feedback's residual could grow every round. "
                "ef+ takes biased codecs with omega <= 1 and scales unbiased ones by 1/(1+omega); drop clip "
                "or the ef+ prefix"
            )
        self.scales = bool(quantizer.unbiased)

    def apply(
        self, flat: torch.Tensor, state: torch.Tensor | None, expected_error: Callable[[torch.Tensor], float | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p = flat
        if state is not None:
            if state.numel() != flat.numel():
                raise ValueError(f"residual has {state.numel()} elements, the tensor {flat.numel()}")
            p = flat + state.detach().to(device=flat.device, dtype=torch.float32).reshape(-1)
        gamma = ef_scale(expected_error(p)) if self.scales else 1.0
        return (p if gamma == 1.0 else p * gamma), p

    def next_state(self, kept: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        return kept - decoded.to(kept.device).reshape(-1)
