"""The pipeline's configuration, checked when it is built with the conditions the checker
proved exact (`groupflow.model.decisions.config_problems`, the function the checker's bounds
use too), so a deadlocking setting fails at start-up and not an hour into a run.

A buffer smaller than one step can never complete the step; `flush_after_s` must be positive,
so a partial batch never waits forever. Nothing else is needed: with the flush timer on, the
checker finds no deadlock for any batch size, `max_batch_groups >= max_inflight_prompts`
included (the generation permit is free while a batch waits), and a test sweeps bounds to keep
the config and the checker in agreement.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import attrs

from groupflow.impl._core import choice, positive_int, positive_seconds
from groupflow.impl._pipeline._failures import DEFAULT_TRANSIENT_ERRORS
from groupflow.model.decisions import config_problems
from groupflow.model.enums import ValueEnum
from groupflow.model.errors import ConfigError
from groupflow.model.policy import CheckpointPolicy, Design, Dispatch, FailurePolicy
from groupflow.model.shape import Shape

__all__ = [
    "CheckpointConfig",
    "Dispatch",
    "PipelineConfig",
    "ScoringConfig",
    "Shape",
    "StallAction",
]


class StallAction(ValueEnum):
    """What the stall watchdog does when nothing moved for `stall_timeout_s`."""

    WARN = "warn"
    ABORT = "abort"


_E = TypeVar("_E", Design, CheckpointPolicy)


def _offered(
    kind: type[_E], value: _E | str, *, config: str, field: str, checker_only: _E, why: str
) -> _E:
    """`choice`, refusing the member that only `groupflow check` explores (to show `why`)."""
    member = choice(kind, value, config=config, field=field)
    if member is checker_only:
        raise ConfigError(
            f"{field}={member.value!r} exists only in `groupflow check`, {why}",
            field=field,
            config=config,
        )
    return member


def _design(value: Design | str) -> Design:
    return _offered(
        Design,
        value,
        config="ScoringConfig",
        field="design",
        checker_only=Design.COALESCE,
        why="to show why it deadlocks; use 'pump' (the default) or the 'inline' baseline",
    )


def _dispatch(value: Dispatch | str) -> Dispatch:
    return choice(Dispatch, value, config="ScoringConfig", field="dispatch")


def _failure_policy(value: FailurePolicy | str) -> FailurePolicy:
    return choice(FailurePolicy, value, config="ScoringConfig", field="failure_policy")


def _transient_errors(value: object) -> tuple[type[BaseException], ...]:
    """Exception classes, as a tuple (any iterable of them is taken). A bare class, a name or
    an instance is refused: `isinstance` would take a class, but a string of class names or a
    caught exception instead of its class would silently never match."""
    field = "transient_errors"
    if isinstance(value, str | bytes | type) or not isinstance(value, Iterable):
        hint = f" (for one class, write ({value.__name__},))" if isinstance(value, type) else ""
        raise ConfigError(
            f"ScoringConfig.{field} must be a tuple of exception classes, got {value!r}{hint}",
            field=field,
            config="ScoringConfig",
        )
    classes = tuple(value)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, BaseException))]
    if bad:
        raise ConfigError(
            f"ScoringConfig.{field} must hold exception classes only, got {bad[0]!r} in "
            f"{classes!r}",
            field=field,
            config="ScoringConfig",
        )
    return classes


def _stall_action(value: StallAction | str) -> StallAction:
    return choice(StallAction, value, config="PipelineConfig", field="stall_action")


def _checkpoint_policy(value: CheckpointPolicy | str) -> CheckpointPolicy:
    return _offered(
        CheckpointPolicy,
        value,
        config="CheckpointConfig",
        field="policy",
        checker_only=CheckpointPolicy.NAIVE,
        why="where it loses prompts; use 'flush' or 'uncommitted'",
    )


@attrs.frozen
class ScoringConfig:
    """The teacher scoring stage."""

    flush_after_s: float = attrs.field(validator=positive_seconds)
    """A batch that is not full is sent this long after its first group arrived (the batch
    size, `max_batch_groups`, is the run's `Shape`'s)."""
    dispatch: Dispatch = attrs.field(default=Dispatch.DEMAND, converter=_dispatch)
    design: Design = attrs.field(default=Design.PUMP, converter=_design)
    """`pump` (groupflow's) or `inline`, the upstream baseline kept for comparison."""
    failure_policy: FailurePolicy = attrs.field(
        default=FailurePolicy.RETRY, converter=_failure_policy
    )
    call_timeout_s: float = attrs.field(default=600.0, validator=positive_seconds)
    """A teacher call past this is cancelled and fails under the failure policy
    (`ScoringTimeout`, transient); one that ignores cancellation is abandoned after the
    pipeline's `shutdown_timeout_s` and fails the run (`ScorerLost`)."""
    max_consecutive_failed_batches: int = attrs.field(default=3, validator=positive_int)
    """More failed calls in a row than this fails the run instead of discarding on and on."""
    transient_errors: tuple[type[BaseException], ...] = attrs.field(
        default=DEFAULT_TRANSIENT_ERRORS, converter=_transient_errors
    )
    """Failures that may go away by themselves (`is_transient`; by default `OSError`,
    `trio.TooSlowError` and `TransientError`; torch's CUDA out-of-memory error always counts).
    Under `retry` only these are retried; any other failure gives its groups up at once."""


def _folder(value: object) -> Path:
    if isinstance(value, bool) or not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigError(
            f"CheckpointConfig.folder must be a path (a str or a Path), got {value!r}",
            field="folder",
            config="CheckpointConfig",
        )
    return Path(value)


def _optional_positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        positive_int(instance, attribute, value)


@attrs.frozen
class CheckpointConfig:
    """Where and how often a run saves checkpoints, and what a save does with groups still
    being scored (`PipelineConfig.checkpoints`)."""

    folder: Path = attrs.field(converter=_folder)
    """The checkpoints' folder; a run holds it locked against other runs."""
    every_steps: int = attrs.field(validator=positive_int)
    """Save after every this many train steps, and after the last step however the run ends
    (stopped, or its steps trained)."""
    keep: int | None = attrs.field(default=None, validator=_optional_positive)
    """Keep only the newest this many, deleting older ones after each save (None: all)."""
    policy: CheckpointPolicy = attrs.field(
        default=CheckpointPolicy.FLUSH, converter=_checkpoint_policy
    )
    """`flush`: wait for the groups being scored, then save them; `uncommitted`: save without
    them, their prompts issued again on resume."""
    flush_timeout_s: float = attrs.field(default=120.0, validator=positive_seconds)
    """How long a `flush` save waits for pending groups before saving without them."""
    write_in_thread: bool = True
    """Write from a worker thread so the run goes on meanwhile. Under a virtual clock (tests,
    the simulator) write inline instead: a thread's real time would let the clock jump."""


@attrs.frozen
class PipelineConfig:
    """Sizes, timeouts and policies of one run; invalid values and combinations raise
    `ConfigError` (a `ValueError`) here, naming the field."""

    shape: Shape = attrs.field()
    """Prompts per step, rows per group, permits, buffer size, gate and batch size: the value
    `groupflow check`'s `Bounds` holds too."""
    scoring: ScoringConfig | None = None
    """None: no scoring stage; groups are READY at commit."""
    max_consecutive_failed_rollouts: int = attrs.field(default=8, validator=positive_int)
    """More rollouts failed in a row than this fails the run (`RolloutsFailed`) instead of
    giving up prompt after prompt."""
    stall_timeout_s: float = attrs.field(default=600.0, validator=positive_seconds)
    stall_action: StallAction = attrs.field(default=StallAction.WARN, converter=_stall_action)
    shutdown_timeout_s: float = attrs.field(default=60.0, validator=positive_seconds)
    checkpoints: CheckpointConfig | None = attrs.field(default=None)
    """None: no checkpoints."""

    @shape.validator
    def _check_shape(self, attribute: attrs.Attribute[Shape], value: object) -> None:
        if not isinstance(value, Shape):
            raise ConfigError(
                f"PipelineConfig.shape must be a Shape, got {value!r}",
                field="shape",
                config="PipelineConfig",
            )

    @checkpoints.validator
    def _check_checkpoints(
        self, attribute: attrs.Attribute[CheckpointConfig | None], value: object
    ) -> None:
        if value is not None and not isinstance(value, CheckpointConfig):
            raise ConfigError(
                f"PipelineConfig.checkpoints must be a CheckpointConfig or None, got {value!r}",
                field="checkpoints",
                config="PipelineConfig",
            )

    def __attrs_post_init__(self) -> None:
        scoring = self.scoring
        problems = config_problems(
            shape=self.shape,
            design=Design.PUMP if scoring is None else scoring.design,
            flush_timer=True,  # flush_after_s is always set: a positive number of seconds
            demand=scoring is not None and scoring.dispatch is Dispatch.DEMAND,
        )
        if problems:
            # with the flush timer always on, the buffer's size is the one condition left
            raise ConfigError(
                "PipelineConfig: " + "; ".join(problems),
                field="max_buffered_groups",
                config="PipelineConfig",
            )
