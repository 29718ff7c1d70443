"""attrs validators for the configuration classes, model and pipeline alike: each refusal is a
`ConfigError` naming the class, the field and the value."""

from __future__ import annotations

from typing import Any

import attrs

from groupflow.model.errors import ConfigError


def refuse(instance: object, attribute: attrs.Attribute[Any], what: str) -> ConfigError:
    """The error for `instance`'s field `attribute`: `CLASS.FIELD WHAT`."""
    config = type(instance).__name__
    return ConfigError(f"{config}.{attribute.name} {what}", field=attribute.name, config=config)


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse(instance, attribute, f"must be a positive int, got {value!r}")


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise refuse(instance, attribute, f"must be an int >= 0, got {value!r}")
