"""Per-tensor policy: which codec a tensor of the model travels with, and the bounds its served value keeps.

Tensors are known by their ArrayRecord keys, the model's ``state_dict`` names, which the server
holds before any client answers: the policy is decided on the server, sent to each client as
``fedquant.tensor-codecs`` (:mod:`fedquant.protocol`) and enforced when the replies are decoded
(each tensor with the codec the server named; a payload of another codec is rejected), so a
client cannot choose its way around it. Bounds are applied to the model the round serves, after
the inner strategy aggregated (whatever it is: FedAvg's mean, Krum's one client, FedAdam's step).

Defaults (reasons and byte costs in ``docs/models.md``): BatchNorm running statistics are not
trained by gradients but read as they are at evaluation, so quantization noise lands straight
in the served model and a variance pushed below zero makes every evaluation NaN; they travel at
``fp16`` (their update to 2 bytes per element, relative error about 5e-4) and every
``running_var`` is clamped to be non-negative. Counters (``num_batches_tracked``) are integers
and travel as they are. Trained parameters (weights, biases, LayerNorm and BatchNorm affine
parameters, embeddings) follow the strategy's codec and ``min_numel``.

Patterns are :func:`fnmatch.fnmatchcase` patterns over the full tensor name; the user's rules are
tried before the defaults, the first match wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

import numpy as np
from flwr.app import ArrayRecord

from fedquant.codecs import Codec, get_codec
from fedquant.records import numpy_array
from fedquant.strategies.decode_plan import ClientAssignment

#: Codec per tensor-name pattern, applied unless a user rule matches first.
DEFAULT_CODECS: dict[str, str] = {"*running_mean": "fp16", "*running_var": "fp16"}
#: ``(low, high)`` bounds per tensor-name pattern for the served model (None: unbounded on that side).
DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {"*running_var": (0.0, None)}
#: The codec spec of a user rule that leaves a tensor to the strategy's codec.
STRATEGY_CODEC = "default"


def _first_match(name: str, patterns: Mapping[str, object]) -> object | None:
    for pattern, value in patterns.items():
        if fnmatchcase(name, pattern):
            return value
    return None


@dataclass(frozen=True)
class TensorPolicy:
    """Per-tensor codecs and value bounds by tensor-name pattern (see the module docstring).

    Parameters
    ----------
    codecs : mapping of str to str
        ``{pattern: codec spec}`` tried before :data:`DEFAULT_CODECS`; the spec ``"default"``
        leaves matching tensors to the strategy's codec (e.g. ``{"*running_mean": "default"}``).
    bounds : mapping of str to (float or None, float or None)
        ``{pattern: (low, high)}`` tried before :data:`DEFAULT_BOUNDS`; ``(None, None)`` lifts a
        default bound.
    defaults : bool
        Whether the defaults apply after the user's rules (default True).

    Examples
    --------
    >>> policy = TensorPolicy({"*.embed_tokens.weight": "fp16", "*running_var": "fp32"})  # doctest: +SKIP
    >>> QuantizedStrategy(FedAvg(), "eden:bits=2", tensor_policy=policy)  # doctest: +SKIP
    """

    codecs: Mapping[str, str] = field(default_factory=dict)
    bounds: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    defaults: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.codecs, Mapping) or not isinstance(self.bounds, Mapping):
            raise ValueError("TensorPolicy: codecs and bounds must be mappings of name patterns")
        built: dict[str, Codec | None] = {}
        for pattern, spec in self._codec_rules().items():
            if not isinstance(pattern, str) or not isinstance(spec, str):
                raise ValueError(f"TensorPolicy: codec rule {pattern!r}: {spec!r} must map a pattern to a spec")
            try:
                built[pattern] = None if spec == STRATEGY_CODEC else get_codec(spec)
            except ValueError as err:
                raise ValueError(f"TensorPolicy: codec rule {pattern!r}: {err}") from err
            if built[pattern] is not None and built[pattern].needs_side_info:
                raise ValueError(f"TensorPolicy: codec rule {pattern!r}: {spec!r} needs decoder side information")
        for pattern, bound in self._bound_rules().items():
            ok = isinstance(pattern, str) and isinstance(bound, tuple) and len(bound) == 2
            low, high = bound if ok else (None, None)
            ok = ok and all(b is None or (isinstance(b, int | float) and not math.isnan(b)) for b in (low, high))
            if not ok or (low is not None and high is not None and low > high):
                raise ValueError(f"TensorPolicy: bound {pattern!r}: {bound!r} must be (low or None, high or None)")
        object.__setattr__(self, "_built", built)

    def _codec_rules(self) -> dict[str, str]:
        return {**self.codecs, **{p: s for p, s in DEFAULT_CODECS.items() if self.defaults and p not in self.codecs}}

    def _bound_rules(self) -> dict[str, tuple[float | None, float | None]]:
        return {**self.bounds, **{p: b for p, b in DEFAULT_BOUNDS.items() if self.defaults and p not in self.bounds}}

    # ------------------------------------------------------------------ codecs
    def codec_of(self, name: str) -> Codec | None:
        """The codec the policy gives tensor ``name`` (None: the strategy's codec)."""
        for pattern, codec in self._built.items():  # type: ignore[attr-defined]
            if fnmatchcase(name, pattern):
                return codec
        return None

    def tensor_codecs(self, names: list[str]) -> dict[str, Codec]:
        """``{name: codec}`` of the tensors among ``names`` that the policy gives their own codec."""
        found = {name: self.codec_of(name) for name in names}
        return {name: codec for name, codec in found.items() if codec is not None}

    def assign(self, assignment: ClientAssignment, names: list[str]) -> ClientAssignment:
        """``assignment`` with the policy's codecs added to its per-tensor codecs (the policy's win)."""
        own = self.tensor_codecs(names)
        if not own:
            return assignment
        return replace(assignment, tensor_codecs={**assignment.tensor_codecs, **own})

    # ------------------------------------------------------------------ bounds
    def bound_of(self, name: str) -> tuple[float | None, float | None] | None:
        """The ``(low, high)`` bound of tensor ``name`` (None: unbounded)."""
        bound = _first_match(name, self._bound_rules())
        return None if bound is None or bound == (None, None) else bound  # type: ignore[return-value]

    def constrain(self, arrays: ArrayRecord) -> tuple[ArrayRecord, int]:
        """The served model with every bounded float tensor clipped to its bounds, and how many
        values were moved (the record is returned as it is when none were)."""
        out, moved = {}, 0
        for name, array in arrays.items():
            bound = self.bound_of(name)
            if bound is None or np.dtype(array.dtype).kind != "f":
                out[name] = array
                continue
            value = array.numpy()
            low = -np.inf if bound[0] is None else bound[0]
            high = np.inf if bound[1] is None else bound[1]
            outside = int(np.count_nonzero((value < low) | (value > high)))
            if outside:
                moved += outside
                out[name] = numpy_array(np.clip(value, low, high).astype(value.dtype, copy=False))
            else:
                out[name] = array
        return (ArrayRecord(out) if moved else arrays), moved

    def __repr__(self) -> str:
        return f"TensorPolicy(codecs={self._codec_rules()}, bounds={self._bound_rules()})"
