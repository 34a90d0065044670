"""Gradient codecs: pure tensor <-> bytes, no Flower import.

A codec is a pipeline of stages (see ``docs/ARCHITECTURE.md``): transforms, a quantizer, a
symbol coder and the payload envelope. Spec strings name the transforms, outermost first, then
the quantizer with its parameters (``coding`` picks the symbol coder)::

>>> from fedquant.codecs import get_codec
>>> codec = get_codec("qsgd:levels=16,bucket_size=512")
>>> payload = codec.encode(x, seed=1234)
>>> x_hat = codec.decode(payload, seed=1234)
>>> get_codec("ef+qsgd:levels=7,coding=entropy")     # error feedback in front (client state)
"""

from __future__ import annotations

import importlib
from typing import Any

from fedquant.codecs.codec import Codec
from fedquant.codecs.params import Param, parse_pipeline
from fedquant.codecs.quantizers.base import Quantizer
from fedquant.codecs.transforms.base import StatefulTransform, Transform

# name -> "module:class"; modules are imported on first use.
_QUANTIZERS: dict[str, str] = {
    "fp32": "fedquant.codecs.quantizers.floats:Float32Quantizer",
    "fp16": "fedquant.codecs.quantizers.floats:Float16Quantizer",
    "qsgd": "fedquant.codecs.quantizers.grid:QSGDQuantizer",
    "terngrad": "fedquant.codecs.quantizers.grid:TernGradQuantizer",
    "signsgd": "fedquant.codecs.quantizers.sign:SignSGDQuantizer",
    "bingrad-b": "fedquant.codecs.quantizers.levels:BinGradBQuantizer",
    "bingrad-pb": "fedquant.codecs.quantizers.levels:BinGradPBQuantizer",
    "orq": "fedquant.codecs.quantizers.levels:ORQQuantizer",
    "linear": "fedquant.codecs.quantizers.levels:LinearQuantizer",
    "dqsg": "fedquant.codecs.quantizers.dither:DQSGQuantizer",
    "ndqsg": "fedquant.codecs.quantizers.dither:NDQSGQuantizer",
    "eden": "fedquant.codecs.quantizers.eden:EdenQuantizer",
    "ecdq": "fedquant.codecs.quantizers.ecdq:ECDQQuantizer",
}
_TRANSFORMS: dict[str, str] = {
    "ef": "fedquant.codecs.transforms.error_feedback:ErrorFeedback",
    "rht": "fedquant.codecs.transforms.rht:RandomizedHadamard",
}


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def available_codecs() -> list[str]:
    """Names of all quantizers, in the order of the registry."""
    return list(_QUANTIZERS)


def available_transforms() -> list[str]:
    """Names of all transforms (``"ef"``, ...), usable as ``name+`` prefixes of a spec."""
    return list(_TRANSFORMS)


def codec_class(name: str) -> type[Quantizer]:
    """The quantizer class registered under ``name``.

    Raises
    ------
    ValueError
        If no quantizer has that name.
    """
    if name not in _QUANTIZERS:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(_QUANTIZERS)}")
    return _load(_QUANTIZERS[name])


def transform_class(name: str) -> type[Transform | StatefulTransform]:
    """The transform class registered under ``name``.

    Raises
    ------
    ValueError
        If no transform has that name.
    """
    if name not in _TRANSFORMS:
        raise ValueError(f"unknown transform {name + '+'!r}; available: {', '.join(t + '+' for t in _TRANSFORMS)}")
    return _load(_TRANSFORMS[name])


def get_codec(name_or_spec: str | Codec, **params: Any) -> Codec:
    """Build a codec from a spec string, with keyword parameters (of the quantizer) taking precedence.

    Parameters
    ----------
    name_or_spec : str or Codec
        ``"qsgd"``, ``"qsgd:levels=16,bucket_size=512"``, ``"ef+signsgd"``,
        ``"ef+rht+qsgd:levels=7,coding=entropy"``, ``"rht:max_log2=12+qsgd"`` (transforms take
        parameters too), or a codec (returned as is when no parameters are given, else
        ``codec.with_params(**params)``).
    **params
        Quantizer parameters; they override those in the spec string.

    Raises
    ------
    ValueError
        For an unknown codec, transform or parameter, or a value out of range, naming the bad part.
    """
    if isinstance(name_or_spec, Codec):
        return name_or_spec.with_params(**params)
    *transforms, (name, spec_params) = parse_pipeline(name_or_spec)
    cls = codec_class(name)
    quantizer = cls(**{**spec_params, **params})
    # A quantizer that only works on rotated coordinates (EDEN) brings its transforms: "eden" is "rht+eden".
    named = {t for t, _ in transforms}
    transforms += [(t, {}) for t in cls.implied_transforms if t not in named]
    return Codec(quantizer, [transform_class(t)(**p) for t, p in transforms])


__all__ = [
    "Codec",
    "Param",
    "Quantizer",
    "StatefulTransform",
    "Transform",
    "available_codecs",
    "available_transforms",
    "codec_class",
    "get_codec",
    "transform_class",
]
