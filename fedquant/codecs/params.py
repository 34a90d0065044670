"""Declared codec parameters and spec strings (``"qsgd:levels=16,bucket_size=512"``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

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
        Value when the user gives none. ``None`` only for optional float parameters.
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
