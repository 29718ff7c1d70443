"""The replay buffer's configuration, validated when it is built rather than an hour into a run."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from groupflow.impl._core._validators import choice
from groupflow.model.errors import ConfigError
from groupflow.model.policy import Sampler
from groupflow.model.validators import positive_int

__all__ = ["BufferConfig", "Sampler"]


def _field_names(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise TypeError(
            f"required_fields must be a collection of names, got the string {value!r}; "
            f"write ({value!r},) for one field"
        )
    return frozenset(value)


def _sampler(value: Sampler | str) -> Sampler:
    return choice(Sampler, value, config="BufferConfig", field="sampler")


@attrs.frozen
class BufferConfig:
    """What the buffer must know up front: group size, capacity, the fields training needs."""

    group_size: int = attrs.field(validator=positive_int)
    """Rows per group (`num_generations_per_prompt`)."""
    capacity: int = attrs.field(validator=positive_int)
    """Groups held at once (`max_buffered_groups`); unready groups count too."""
    required_fields: frozenset[str] = attrs.field(factory=frozenset, converter=_field_names)
    """Fields a group must have to become READY."""
    sampler: Sampler = attrs.field(default=Sampler.IN_ORDER, converter=_sampler)
    max_staleness_versions: int | None = attrs.field(default=None)
    """How many weight versions old a group may be and still be trained; None: no limit (in-order only)."""

    @max_staleness_versions.validator
    def _check_staleness(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is None:
            if self.sampler is Sampler.WINDOWED:
                raise ConfigError(
                    "BufferConfig(sampler='windowed') needs max_staleness_versions (an int >= 0)",
                    field="max_staleness_versions",
                    config="BufferConfig",
                )
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"BufferConfig.max_staleness_versions must be an int >= 0 or None, got {value!r}",
                field="max_staleness_versions",
                config="BufferConfig",
            )
