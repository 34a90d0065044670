"""Gradient codecs: pure tensor <-> bytes, no Flower import.

>>> from fedquant.codecs import get_codec
>>> codec = get_codec("qsgd:levels=16,bucket_size=512")
>>> payload = codec.encode(x, seed=1234)
>>> x_hat = codec.decode(payload, seed=1234)

A spec prefixed with ``ef+`` (``"ef+signsgd"``) wraps the codec in error feedback.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedquant.codecs.base import Codec
from fedquant.codecs.params import Param, parse_spec

# name -> "module:class"; modules are imported on first use.
_REGISTRY: dict[str, str] = {
    "fp32": "fedquant.codecs.floats:Float32Codec",
    "fp16": "fedquant.codecs.floats:Float16Codec",
    "qsgd": "fedquant.codecs.qsgd:QSGDCodec",
    "terngrad": "fedquant.codecs.terngrad:TernGradCodec",
    "signsgd": "fedquant.codecs.signsgd:SignSGDCodec",
    "bingrad-b": "fedquant.codecs.bingrad:BinGradBCodec",
    "bingrad-pb": "fedquant.codecs.bingrad:BinGradPBCodec",
    "orq": "fedquant.codecs.orq:ORQCodec",
    "linear": "fedquant.codecs.orq:LinearCodec",
    "dqsg": "fedquant.codecs.dithered:DQSGCodec",
    "ndqsg": "fedquant.codecs.dithered:NDQSGCodec",
}
EF_PREFIX = "ef+"


def available_codecs() -> list[str]:
    """Names of all codecs, in the order of the registry."""
    return list(_REGISTRY)


def codec_class(name: str) -> type[Codec]:
    """The class registered under ``name``.

    Raises
    ------
    ValueError
        If no codec has that name.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_codec(name_or_spec: str | Codec, **params: Any) -> Codec:
    """Build a codec from a name or spec string, with keyword parameters taking precedence.

    Parameters
    ----------
    name_or_spec : str or Codec
        ``"qsgd"``, ``"qsgd:levels=16,bucket_size=512"``, ``"ef+signsgd"``, or a codec (returned
        as is when no parameters are given).
    **params
        Parameters; they override those in the spec string.

    Raises
    ------
    ValueError
        For an unknown codec or parameter, or a value out of range, naming the bad part.
    """
    from fedquant.codecs.error_feedback import ErrorFeedback

    if isinstance(name_or_spec, (Codec, ErrorFeedback)):
        if not params:
            return name_or_spec
        name_or_spec = name_or_spec.spec
    if isinstance(name_or_spec, str) and name_or_spec.strip().lower().startswith(EF_PREFIX):
        return ErrorFeedback(get_codec(name_or_spec.strip()[len(EF_PREFIX) :], **params))
    name, spec_params = parse_spec(name_or_spec)
    return codec_class(name)(**{**spec_params, **params})


__all__ = ["Codec", "Param", "available_codecs", "codec_class", "get_codec"]
