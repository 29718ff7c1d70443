"""`Bounds`: the parameters of one exploration of the abstract scheduler, or of the model a
running pipeline is checked against: sizes, budgets for faults, and the policy choices."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from groupflow.model.decisions import config_problems
from groupflow.model.errors import ConfigError
from groupflow.model.policy import CheckpointPolicy, Design, FailurePolicy, Sampler
from groupflow.model.shape import Shape
from groupflow.model.validators import non_negative_int, positive_int


def _policies(values: Iterable[CheckpointPolicy | str]) -> frozenset[CheckpointPolicy]:
    return frozenset(CheckpointPolicy(v) for v in values)


def _as_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


MAX_STAGES = 2


@attrs.frozen(cache_hash=True)
class Bounds:
    """Sizes, fault budgets and design choices. Budgets bound how often the world may do
    something (crash, fail a call); the explorer tries every place it could happen."""

    prompts: int = attrs.field(default=4, validator=positive_int)
    """Prompts in the data source."""
    shape: Shape = attrs.field(factory=Shape)
    """Prompts per step, rows per group, permits, buffer size, gate and batch size: the value
    a `PipelineConfig` holds, so a checked shape is the shape a run is built with."""
    teachers: int = attrs.field(default=1, validator=positive_int)
    """Physical teachers; prompt `o` is routed to `routing[o]`, by default `o % teachers`."""
    crashes: int = attrs.field(default=0, validator=non_negative_int)
    checkpoints: int = attrs.field(default=1, validator=non_negative_int)
    rollout_failures: int = attrs.field(default=0, validator=non_negative_int)
    batch_failures: int = attrs.field(default=0, validator=non_negative_int)
    train_failures: int = attrs.field(default=0, validator=non_negative_int)
    """Train steps that raise (the run then fails)."""
    aborts: int = attrs.field(default=0, validator=non_negative_int)
    """Failures from outside the scheduler (a pump raised) that fail the run at any moment."""
    stages: int = attrs.field(default=1)
    """Scoring stages each group goes through: 0 (READY at commit), 1 (the teacher) or 2 (the
    teacher, then a verifier: SCORED -> WRITTEN in between)."""
    routing: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    """The teacher of each prompt; empty: prompt `o` goes to teacher `o % teachers`."""
    design: Design = attrs.field(default=Design.PUMP, converter=Design)
    flush_timer: bool = True
    """A waiting batch is sent after `flush_after_s` even if not full."""
    demand: bool = False
    """Demand dispatch: send at once when training waits on a step none of whose groups can
    still join the queue."""
    failure_policy: FailurePolicy = attrs.field(
        default=FailurePolicy.RETRY, converter=FailurePolicy
    )
    permanent_failures: bool = False
    """A failed teacher call may also be permanent (`SCORE_FAIL` with detail
    `PERMANENT_FAILURE`): under `retry` its groups are given up at once, not retried. Off by
    default, which keeps the checker's state counts; the model a live run is checked against
    has it on (the world may fail a call either way)."""
    checkpoint_policies: frozenset[CheckpointPolicy] = attrs.field(
        default=frozenset({CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED}),
        converter=_policies,
    )
    """Each checkpoint may use any of these; the explorer tries every one."""
    drain_on_shutdown: bool = True
    """At shutdown stages score what is queued; if false they drop it (prompts issued again)."""
    interrupts: bool = True
    """The user may stop the run at any moment (an external event)."""
    sampler: Sampler = attrs.field(default=Sampler.IN_ORDER, converter=Sampler)
    """In order (a step trains the prompts admitted for it) or windowed (a step trains up to
    `prompts_per_step` READY groups generated at most `max_staleness` weight versions ago; older ones
    are evicted, their prompts given up)."""
    max_staleness: int = attrs.field(default=1, validator=non_negative_int)
    _route: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    _targets: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)
    _lanes: int = attrs.field(init=False, repr=False, eq=False)
    _steps: int = attrs.field(init=False, repr=False, eq=False)
    _step_ordinals: tuple[range, ...] = attrs.field(init=False, repr=False, eq=False)

    @shape.validator
    def _check_shape(self, attribute: attrs.Attribute[Shape], value: object) -> None:
        if not isinstance(value, Shape):
            raise ConfigError(
                f"Bounds.shape must be a Shape, got {value!r}", field="shape", config="Bounds"
            )

    @stages.validator
    def _check_stages(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STAGES:
            raise ConfigError(
                f"Bounds.stages must be 0, 1 or {MAX_STAGES}, got {value!r}",
                field="stages",
                config="Bounds",
            )

    @routing.validator
    def _check_routing(
        self, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
    ) -> None:
        if not value:
            return
        if len(value) != self.prompts:
            raise ConfigError(
                f"Bounds.routing names a teacher for {len(value)} prompts, there are {self.prompts}",
                field="routing",
                config="Bounds",
            )
        bad = sorted({t for t in value if not (isinstance(t, int) and 0 <= t < self.teachers)})
        if bad:
            raise ConfigError(
                f"Bounds.routing names teachers {bad} outside 0..{self.teachers - 1}",
                field="routing",
                config="Bounds",
            )

    def __attrs_post_init__(self) -> None:
        # the lookup tables the explorer reads millions of times
        route = self.routing or tuple(o % self.teachers for o in range(self.prompts))
        object.__setattr__(self, "_route", route)
        object.__setattr__(
            self, "_targets", tuple(o // self.shape.prompts_per_step for o in range(self.prompts))
        )
        object.__setattr__(self, "_lanes", self.teachers + max(0, self.stages - 1))
        object.__setattr__(self, "_steps", -(-self.prompts // self.shape.prompts_per_step))
        object.__setattr__(
            self, "_step_ordinals", tuple(self._ordinals_of(step) for step in range(self._steps))
        )

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def lanes(self) -> int:
        """Stage queues: one per teacher for the teacher stage, one for each later stage."""
        return self._lanes

    def target(self, ordinal: int) -> int:
        targets = self._targets
        return (
            targets[ordinal] if ordinal < len(targets) else ordinal // self.shape.prompts_per_step
        )

    def teacher(self, ordinal: int) -> int:
        return self._route[ordinal]

    def lane(self, ordinal: int, stage: int) -> int:
        """The queue of prompt `ordinal`'s group at stage `stage` (0: the teacher stage)."""
        return self.teacher(ordinal) if stage == 0 else self.teachers + stage - 1

    def stage_of_lane(self, lane: int) -> int:
        return 0 if lane < self.teachers else lane - self.teachers + 1

    def step_ordinals(self, step: int) -> range:
        ordinals = self._step_ordinals
        return ordinals[step] if 0 <= step < len(ordinals) else self._ordinals_of(step)

    def _ordinals_of(self, step: int) -> range:
        return range(
            step * self.shape.prompts_per_step,
            min((step + 1) * self.shape.prompts_per_step, self.prompts),
        )

    def problems(self) -> list[str]:
        """What the pipeline's config would refuse in these bounds (the same function)."""
        return config_problems(
            shape=self.shape,
            design=self.design,
            flush_timer=self.flush_timer,
            demand=self.demand,
        )
