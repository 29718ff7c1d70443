"""`Shape`: the sizes that decide how groups flow from generation to training. One value, held
whole by the checker's `Bounds`, the pipeline's `PipelineConfig` and the trainer's
`TrainConfig`, so the shape `groupflow check` explores is the shape a run is built with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from groupflow.model.validators import non_negative_int, positive_int


@attrs.frozen
class Shape:
    """Prompts per step, rows per group, generation permits, buffer size, gate and batch size.

    The defaults are the smallest shape that takes every path (a step of two prompts, a batch
    of two groups, one permit fewer than the buffer's slots): the checker's. A run states its
    own."""

    prompts_per_step: int = attrs.field(default=2, validator=positive_int)
    """Prompts per train step."""
    num_generations_per_prompt: int = attrs.field(default=2, validator=positive_int)
    """Rows per group: responses sampled per prompt."""
    max_inflight_prompts: int = attrs.field(default=3, validator=positive_int)
    """Generation permits: rollouts running at once."""
    max_buffered_groups: int = attrs.field(default=4, validator=positive_int)
    """Groups the buffer holds at once; unready ones count."""
    gate_window: int = attrs.field(default=1, validator=non_negative_int)
    """A prompt is admitted at most this many train steps ahead of training."""
    max_batch_groups: int = attrs.field(default=2, validator=positive_int)
    """Groups per teacher call, at most (unused when nothing scores)."""

    def evolve(self, **changes: Any) -> Shape:
        """This shape with some sizes changed (checked again)."""
        return attrs.evolve(self, **changes)


SHAPE_FIELDS: tuple[str, ...] = tuple(a.name for a in attrs.fields(Shape))
"""The shape's field names: the names a flat table (TOML, the command line) uses for them."""


def split_shape(values: Mapping[str, Any], base: Shape) -> tuple[Shape, dict[str, Any]]:
    """`values` as `(shape, rest)`: the shape's names taken out onto `base`, the others left.
    For configs written flat (a TOML table) whose value holds the shape whole."""
    sizes = {k: v for k, v in values.items() if k in SHAPE_FIELDS}
    rest = {k: v for k, v in values.items() if k not in SHAPE_FIELDS}
    return (base.evolve(**sizes) if sizes else base), rest


def shape_dict(shape: Shape) -> dict[str, int]:
    """The shape as a flat table, by the names `split_shape` reads."""
    return {name: getattr(shape, name) for name in SHAPE_FIELDS}
