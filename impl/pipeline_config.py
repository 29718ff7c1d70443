"""The pipeline's configuration, checked when it is built with the conditions the checker proved
necessary, so a deadlocking setting fails at start-up and not an hour into a run.

`groupflow check` shows why each condition is here: a batch of `max_inflight_prompts` or more
groups can wait forever for a group that is never generated; a buffer smaller than one step
can never complete the step; without a positive flush timer a partial batch can wait forever.
"""

from __future__ import annotations

import enum

import attrs

from groupflow.impl.validators import non_negative_int, positive_int, positive_seconds
from groupflow.model.scheduler import CheckpointPolicy, Design, FailurePolicy


class Dispatch(enum.Enum):
    """When the teacher stage sends a batch that is not full."""

    TIMER = "timer"
    """After `flush_after_s` since its oldest group arrived (or at once on drain)."""
    DEMAND = "demand"
    """Also at once when training waits on a step whose missing groups are all queued here."""

    def __str__(self) -> str:
        return self.value


class StallAction(enum.Enum):
    WARN = "warn"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


def _design(value: Design | str) -> Design:
    design = Design(value)
    if design is Design.COALESCE:
        raise ValueError(
            "design='coalesce' exists only in `groupflow check`, to show why it deadlocks; "
            "use 'pump' (the default) or the 'inline' baseline"
        )
    return design


def _checkpoint_policy(value: CheckpointPolicy | str) -> CheckpointPolicy:
    policy = CheckpointPolicy(value)
    if policy is CheckpointPolicy.NAIVE:
        raise ValueError(
            "checkpoint_policy='naive' exists only in `groupflow check`, where it loses prompts; "
            "use 'flush' or 'uncommitted'"
        )
    return policy


@attrs.frozen
class ScoringConfig:
    """The teacher scoring stage."""

    max_batch_groups: int = attrs.field(validator=positive_int)
    flush_after_s: float = attrs.field(validator=positive_seconds)
    dispatch: Dispatch = attrs.field(default=Dispatch.DEMAND, converter=Dispatch)
    design: Design = attrs.field(default=Design.PUMP, converter=_design)
    """`pump` (groupflow's) or `inline`, the upstream baseline kept for comparison."""
    failure_policy: FailurePolicy = attrs.field(
        default=FailurePolicy.RETRY, converter=FailurePolicy
    )
    max_consecutive_failed_batches: int = attrs.field(default=3, validator=positive_int)
    """More failed calls in a row than this fails the run instead of discarding on and on."""


@attrs.frozen
class PipelineConfig:
    """Sizes, timeouts and policies of one run; invalid combinations raise `ValueError` here."""

    prompts_per_step: int = attrs.field(validator=positive_int)
    num_generations_per_prompt: int = attrs.field(validator=positive_int)
    max_inflight_prompts: int = attrs.field(validator=positive_int)
    max_buffered_groups: int = attrs.field(validator=positive_int)
    gate_window: int = attrs.field(default=1, validator=non_negative_int)
    """A prompt is admitted at most this many train steps ahead of training."""
    scoring: ScoringConfig | None = None
    """None: no scoring stage; groups are READY at commit."""
    stall_timeout_s: float = attrs.field(default=600.0, validator=positive_seconds)
    stall_action: StallAction = attrs.field(default=StallAction.WARN, converter=StallAction)
    shutdown_timeout_s: float = attrs.field(default=60.0, validator=positive_seconds)
    checkpoint_policy: CheckpointPolicy = attrs.field(
        default=CheckpointPolicy.FLUSH, converter=_checkpoint_policy
    )
    flush_timeout_s: float = attrs.field(default=120.0, validator=positive_seconds)
    """How long a `flush` checkpoint waits for pending groups before saving without them."""
    checkpoint_every_steps: int | None = attrs.field(default=None)
    """Save after every this many train steps (None: never)."""

    @checkpoint_every_steps.validator
    def _check_every(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None:
            positive_int(self, attribute, value)

    def __attrs_post_init__(self) -> None:
        if self.max_buffered_groups < self.prompts_per_step:
            raise ValueError(
                f"max_buffered_groups={self.max_buffered_groups} is smaller than "
                f"prompts_per_step={self.prompts_per_step}: a step's READY groups would fill the "
                f"buffer and its last prompt could never be admitted (the run would hang); use "
                f"max_buffered_groups >= {self.prompts_per_step}"
            )
        scoring = self.scoring
        if scoring is not None and scoring.max_batch_groups >= self.max_inflight_prompts:
            raise ValueError(
                f"max_batch_groups={scoring.max_batch_groups} must be < "
                f"max_inflight_prompts={self.max_inflight_prompts}: a batch that large can wait "
                f"for groups that are never generated (`groupflow check --allow-unsafe-batch` "
                f"shows how)"
            )
