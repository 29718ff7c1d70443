"""BufferConfig: refused values name the field, names and lists are converted."""

from __future__ import annotations

from typing import Any

import pytest

from groupflow.impl import BufferConfig, Sampler
from tests.helpers import INPUT, TEACHER


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"group_size": 0}, "group_size must be a positive int, got 0"),
        ({"group_size": -3}, "group_size must be a positive int, got -3"),
        ({"group_size": True}, "group_size must be a positive int, got True"),
        ({"capacity": 0}, "capacity must be a positive int, got 0"),
        ({"capacity": 2.5}, "capacity must be a positive int, got 2.5"),
        (
            {"max_staleness_versions": -1},
            "max_staleness_versions must be an int >= 0 or None, got -1",
        ),
        ({"sampler": Sampler.WINDOWED}, "needs max_staleness_versions"),
        ({"sampler": "windowed"}, "needs max_staleness_versions"),
    ],
)
def test_bad_config_raises_value_error_naming_the_value(
    overrides: dict[str, Any], fragment: str
) -> None:
    settings: dict[str, Any] = {"group_size": 2, "capacity": 4}
    settings.update(overrides)
    with pytest.raises(ValueError, match=fragment):
        BufferConfig(**settings)


def test_required_fields_as_a_bare_string_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"'input_ids'"):
        BufferConfig(group_size=2, capacity=4, required_fields="input_ids")


def test_config_converts_sampler_names_and_field_lists() -> None:
    config = BufferConfig(
        group_size=2,
        capacity=4,
        required_fields=[INPUT, TEACHER],
        sampler="windowed",
        max_staleness_versions=0,
    )
    assert config.sampler is Sampler.WINDOWED
    assert config.required_fields == frozenset({INPUT, TEACHER})
