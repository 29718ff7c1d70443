"""attrs validators and converters shared by the config classes: each refusal is a
`ConfigError` naming the class, the field and the value."""

from __future__ import annotations

import enum
import math
from typing import Any, TypeVar

import attrs

from groupflow.model.errors import ConfigError

_E = TypeVar("_E", bound=enum.Enum)


def _refuse(instance: object, attribute: attrs.Attribute[Any], what: str) -> ConfigError:
    config = type(instance).__name__
    return ConfigError(f"{config}.{attribute.name} {what}", field=attribute.name, config=config)


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(instance, attribute, f"must be a positive int, got {value!r}")


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _refuse(instance, attribute, f"must be an int >= 0, got {value!r}")


def positive_seconds(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise _refuse(instance, attribute, f"must be a finite number of seconds > 0, got {value!r}")


def choice(kind: type[_E], value: _E | str, *, config: str, field: str) -> _E:
    """`value`, a member of `kind` or its value, as a member; anything else is a `ConfigError`
    that names the field and the values it takes. For the converters of enum fields."""
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(
            f"{config}.{field} must be one of {known}, got {value!r}", field=field, config=config
        ) from None
