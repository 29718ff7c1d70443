"""attrs validators shared by the config classes: each names the class, the field and the value."""

from __future__ import annotations

import math
from typing import Any

import attrs


def _where(instance: object, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_where(instance, attribute)} must be a positive int, got {value!r}")


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_where(instance, attribute)} must be an int >= 0, got {value!r}")


def positive_seconds(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(
            f"{_where(instance, attribute)} must be a finite number of seconds > 0, got {value!r}"
        )
