"""attrs validators and converters shared by the config classes: each refusal is a
`ConfigError` naming the class, the field and the value."""

from __future__ import annotations

import enum
import math
from typing import Any, TypeVar

import attrs

from groupflow.model.errors import ConfigError
from groupflow.model.validators import refuse

_E = TypeVar("_E", bound=enum.Enum)


def _finite_positive(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value > 0
    )


def positive_seconds(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not _finite_positive(value):
        raise refuse(instance, attribute, f"must be a finite number of seconds > 0, got {value!r}")


def positive_number(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not _finite_positive(value):
        raise refuse(instance, attribute, f"must be a finite number > 0, got {value!r}")


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


MAX_RUN_PROMPTS = 1_000_000
"""The most prompts one run of the shipped tools (`groupflow train`, `groupflow sim`) takes.
Both build every prompt before the first step; a million is hours of training on the embedded
task and about 300 MB of prompts, and a mistyped `steps` far past it would otherwise fill the
memory or hang before the first step instead of being refused."""


def check_run_size(steps: int, prompts_per_step: int, *, config: str, name: str = "") -> None:
    """Refuse a run of more than `MAX_RUN_PROMPTS` prompts, naming `steps` (as `name`, by
    default `CONFIG.steps`)."""
    prompts = steps * prompts_per_step
    if prompts > MAX_RUN_PROMPTS:
        most = MAX_RUN_PROMPTS // prompts_per_step
        raise ConfigError(
            f"{name or config + '.steps'}={steps:,} at prompts_per_step={prompts_per_step} is {prompts:,} "
            f"prompts; a run takes at most {MAX_RUN_PROMPTS:,} (steps <= {most:,})",
            field="steps",
            config=config,
        )
