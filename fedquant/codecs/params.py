"""Declared codec parameters and spec strings (``"rht:max_log2=12+qsgd:levels=16,bucket_size=512"``).

A spec names the stages of a pipeline, outermost first, joined by ``+``; each stage is a name
with optional ``key=value`` parameters after a ``:``. The last stage is the quantizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from fedquant.wire.payload import split_stages

_NAME = re.compile(r"[a-z0-9][a-z0-9_+\-]*")
_KEY = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Param:
    """One declared codec parameter.

    Parameters
    ----------
    kind : type
        ``int``, ``float``, ``str`` or ``bool``.
    default : Any
        Value when the user gives none. ``None`` for an optional parameter (left out of specs).
    doc : str
        One line for error messages and docs.
    minimum, maximum : float, optional
        Inclusive bounds for numbers.
    choices : tuple, optional
        Allowed values for strings.
    """

    kind: type
    default: Any
    doc: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None

    def convert(self, codec: str, key: str, value: Any) -> Any:
        """Check and convert a user value (Python value or spec-string text)."""
        where = f"{codec}: parameter '{key}'"
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            if self.default is None:
                return None
            raise ValueError(f"{where} needs a value ({self.doc})")
        try:
            if self.kind is bool:
                if isinstance(value, str):
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError
                    value = value.lower() in ("true", "1")
                elif not isinstance(value, (bool, int)):
                    raise ValueError
                value = bool(value)
            elif self.kind is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                value = int(value)
            elif self.kind is float:
                if isinstance(value, bool):
                    raise ValueError
                value = float(value)
                if value != value or value in (float("inf"), float("-inf")):
                    raise ValueError
            else:
                value = str(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where} must be {self.kind.__name__} ({self.doc}), got {value!r}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{where} must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{where} must be >= {self.minimum} ({self.doc}), got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{where} must be <= {self.maximum} ({self.doc}), got {value!r}")
        return value


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:key=value,key=value"`` into the name and a dict of raw strings.

    Raises
    ------
    ValueError
        If the string is not of that form, naming the bad part.
    """
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a string, got {type(spec).__name__}")
    text = spec.strip()
    name, _, rest = text.partition(":")
    name = name.strip().lower()
    if not _NAME.fullmatch(name):
        raise ValueError(f"codec spec {spec!r}: {name!r} is not a codec name")
    params: dict[str, str] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not _KEY.fullmatch(key) or not value:
                raise ValueError(f"codec spec {spec!r}: {item.strip()!r} is not of the form key=value")
            if key in params:
                raise ValueError(f"codec spec {spec!r}: parameter {key!r} is given twice")
            params[key] = value
    return name, params


def format_value(value: Any) -> str:
    """A parameter value as it appears in a canonical spec."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


class Configurable:
    """A pipeline stage with a registry name and declared parameters (quantizers, transforms).

    Subclasses set ``name`` and ``params``; keyword arguments are checked against ``params``,
    stored in ``config`` and as attributes, then :meth:`_validate` runs the cross-parameter checks.
    A stage is a value: its parameters cannot be reassigned; :meth:`with_params` derives another.

    Attributes
    ----------
    spec_lists_defaults : bool
        Whether :attr:`spec` names parameters at their default value too (quantizers: yes, their
        canonical spec lists every parameter; transforms: no, so that a transform that gained a
        parameter keeps its wire name, ``rht``).
    """

    name: ClassVar[str]
    params: ClassVar[dict[str, Param]] = {}
    spec_lists_defaults: ClassVar[bool] = True

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(unknown)}; known: {known}")
        config: dict[str, Any] = {}
        for key, param in self.params.items():
            value = param.convert(self.name, key, params.get(key, param.default))
            config[key] = value
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_config", config)
        self._validate()

    @property
    def config(self) -> MappingProxyType[str, Any]:
        """The parameters, read-only (every declared one, defaults included)."""
        return MappingProxyType(self._config)

    def __setattr__(self, key: str, value: Any) -> None:
        if key in type(self).params or key in ("config", "_config"):
            raise AttributeError(
                f"{type(self).__name__}.{key} is part of the spec; derive a variant with with_params()"
            )
        object.__setattr__(self, key, value)

    def _validate(self) -> None:
        """Cross-parameter checks; raise ValueError with a sentence naming the problem."""
        return None

    def with_params(self, **params: Any) -> Configurable:
        """The same stage with some parameters changed (checked like the constructor's)."""
        return type(self)(**{**self.config, **params}) if params else self

    @property
    def spec(self) -> str:
        """Canonical spec: the name and its parameters, sorted by key (see ``spec_lists_defaults``)."""
        items = ",".join(
            f"{k}={format_value(v)}"
            for k, v in sorted(self.config.items())
            if v is not None and (self.spec_lists_defaults or v != self.params[k].default)
        )
        return f"{self.name}:{items}" if items else self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)


def parse_pipeline(spec: str) -> list[tuple[str, dict[str, str]]]:
    """Split ``"ef+rht:max_log2=12+qsgd:levels=7"`` into its stages: ``(name, raw parameters)``, outermost first.

    The last stage is the quantizer; the others are transforms, whose names must be plain keys.

    Raises
    ------
    ValueError
        If a stage is malformed, naming it.
    """
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a string, got {type(spec).__name__}")
    stages = [parse_spec(stage) for stage in split_stages(spec.strip())]
    for name, _ in stages[:-1]:
        if not _KEY.fullmatch(name):
            raise ValueError(f"codec spec {spec!r}: {name!r} is not a transform name")
    return stages
