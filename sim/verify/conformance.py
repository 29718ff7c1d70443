"""Conformance: the running pipeline refines the model `groupflow check` explores.

The pipeline reports every abstract action it takes (`groupflow.impl._pipeline.ActionObserver`). `Conformance`
keeps the model's state beside it: for each action it checks that the model allows it from
there (`is_enabled`), moves the model with the model's own transition function, checks the
model's invariants on the new state, and compares the new state with the abstraction of the live
pipeline (`abstract`: buffer, ledger, stage queues, permits, train position, checkpoint, phase
mapped onto a `SchedState`). It stops at the first action the model does not allow, or the
first state that differs, and keeps both states and the trace that led there.

The model's fault budgets are bounds of the search, not state of the system, so they are left
out of the comparison (`BUDGET_FIELDS`); everything else must match, field by field.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from groupflow.impl._pipeline import Pipeline, PipelineConfig, QueueView
from groupflow.model import GroupState
from groupflow.model.errors import ConformanceError as ConformanceError
from groupflow.model.policy import CheckpointPolicy, Design, Dispatch
from groupflow.model.scheduler import (
    BUDGET_FIELDS,
    Cut,
    Group,
    NotEnabled,
    Saved,
    SchedState,
    describe,
    initial_state,
    is_enabled,
    restart,
    summarize,
    transition,
)
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.checks import check_state

_UNLIMITED = 1 << 30
"""Fault budget for a live run: the world may fail anything, any number of times."""
_HELD = frozenset({GroupState.RESERVED, GroupState.WRITTEN, GroupState.SCORING, GroupState.READY})


def bounds_for(
    config: PipelineConfig,
    *,
    prompts: int,
    routing: Sequence[int] = (),
    teachers: int = 1,
    stages: int | None = None,
) -> Bounds:
    """The model a run of `config` over `prompts` prompts is checked against. `routing` gives
    the teacher lane of each prompt (as `RunStatus.lanes` numbers them); `stages` counts the
    scoring stages (default: the teacher's alone when the config scores, else none)."""
    scoring = config.scoring
    if stages is None:
        stages = 0 if scoring is None else 1
    design = Design.PUMP if scoring is None else scoring.design
    return Bounds(
        prompts=prompts,
        shape=config.shape,
        teachers=teachers,
        crashes=_UNLIMITED,
        checkpoints=_UNLIMITED,
        rollout_failures=_UNLIMITED,
        batch_failures=_UNLIMITED,
        train_failures=_UNLIMITED,
        aborts=_UNLIMITED,
        stages=stages,
        routing=tuple(routing),
        design=design,
        # always on, but for a test that turns it off to show the deadlock it prevents
        flush_timer=scoring is None or math.isfinite(scoring.flush_after_s),
        demand=scoring is not None and scoring.dispatch is Dispatch.DEMAND,
        failure_policy=scoring.failure_policy if scoring is not None else "retry",
        # the live world fails a call with any error, transient or not
        permanent_failures=True,
        # a run without checkpoints never saves: any one policy keeps the model the same
        checkpoint_policies=[
            CheckpointPolicy.FLUSH if config.checkpoints is None else config.checkpoints.policy
        ],
        # the inline baseline scores inside the rollout, which shutdown cancels
        drain_on_shutdown=design is not Design.INLINE,
        interrupts=True,  # `Pipeline.request_stop`
    )


def _bits(ordinals: Iterable[int]) -> int:
    bits = 0
    for o in ordinals:
        bits |= 1 << o
    return bits


def saved_from(step: int, ledger: Mapping[str, Any]) -> Saved:
    """A checkpoint's ledger (as `PromptLedger.state_dict` writes it) as the model's `Saved`:
    the live check reads it from the checkpointer, the replay from a trace's resume line."""
    return Saved(
        step=step,
        cursor=ledger["cursor"],
        trained=_bits(ledger["trained"]),
        shortfall=_bits(ledger["shortfall"]),
        ready=tuple(ledger["saved"]),
        reissue=tuple(ledger["reissue"]),
    )


@attrs.frozen
class ModelStep:
    """The model's answer to one action: the state after it, or why it refuses."""

    state: SchedState
    """The state after the action (the state before, if the model does not allow it)."""
    allowed: bool
    violations: tuple[str, ...] = ()
    """The model's invariants that fail in the new state."""

    @property
    def ok(self) -> bool:
        return self.allowed and not self.violations


def model_step(state: SchedState, bounds: Bounds, action: Action) -> ModelStep:
    """One action in the model: allowed from `state` (`is_enabled`), applied with the model's
    own transition, the invariants checked after. The one mapping of actions onto the model,
    shared by the live check (`Conformance`) and the trace replay (`groupflow.sim.verify.replay`)."""
    if not is_enabled(state, bounds, action):
        return ModelStep(state, allowed=False)
    new = transition(state, bounds, action)
    return ModelStep(new, allowed=True, violations=tuple(map(str, check_state(new, bounds))))


def abstract(pipeline: Pipeline, bounds: Bounds, budgets: SchedState) -> SchedState:
    """The live pipeline as a model state (the abstraction function). `budgets` supplies the
    fields that are not the system's state (the model's fault budgets)."""
    buffer = pipeline.buffer
    ordinal_of: dict[str, int] = {}
    groups = []
    queues: dict[str, QueueView] = {}
    for stage in pipeline.stages:
        queues.update(stage.queues())
    if pipeline.inline is not None:
        queues.update(pipeline.inline.queues())
    # a pending group's stage is how many stages' fields it has (each marks its own)
    stage_fields = [stage.field for stage in pipeline.stages]
    again = {gid for view in queues.values() for gid in view.again}
    training = pipeline.train.in_step
    for view in buffer.groups():
        if view.ordinal is None:
            raise ConformanceError(f"group {view.group_id!r} has no prompt ordinal")
        ordinal_of[view.group_id] = view.ordinal
        if view.state not in _HELD and not (training and view.state is GroupState.CONSUMED):
            continue  # finished, its rows being let go
        done = view.state in (GroupState.READY, GroupState.CONSUMED)
        at = sum(field in view.fields for field in stage_fields)
        groups.append(
            Group(
                ordinal=view.ordinal,
                state=view.state,
                permit=view.ordinal in pipeline.rollout.holding,
                retries=buffer.retries_of(view.group_id),
                stage=bounds.stages if done else at,
                again=view.group_id in again,
            )
        )
    groups.sort(key=lambda g: g.ordinal)
    pending: list[tuple[int, ...]] = [()] * bounds.lanes
    inflight: list[tuple[tuple[int, ...], ...]] = [()] * bounds.lanes
    lanes = pipeline.status.lanes
    for teacher, queue in queues.items():
        lane = lanes[teacher]
        pending[lane] = tuple(ordinal_of[g] for g in queue.queued)
        if queue.in_flight:
            inflight[lane] = (tuple(ordinal_of[g] for g in queue.in_flight),)
    rows = 0
    for g in groups:
        if g.state is not GroupState.RESERVED:
            rows |= 1 << g.ordinal
    ledger = pipeline.ledger
    saved = writing = None
    cut = None
    checkpointer = pipeline.checkpointer
    if checkpointer is not None:
        if checkpointer.last is not None:
            saved = saved_from(checkpointer.last["step"], checkpointer.last["ledger"])
        if checkpointer.writing is not None:
            writing = saved_from(checkpointer.writing["step"], checkpointer.writing["ledger"])
        if checkpointer.cut is not None and not pipeline.status.failed:
            cut = Cut(*checkpointer.cut)
    return SchedState(
        phase=pipeline.status.phase,
        step=pipeline.position.step,
        cursor=ledger.cursor,
        reissue=tuple(ledger.reissue),
        groups=tuple(groups),
        pending=tuple(pending),
        inflight=tuple(inflight),
        free_permits=pipeline.rollout.free_permits,
        rows=rows,
        trained=_bits(ledger.trained),
        trained_twice=0,
        shortfall=_bits(ledger.shortfall),
        saved=saved,
        cut=cut,
        writing=writing,
        failed=pipeline.status.failed,
        training=training,
        stopped=pipeline.status.stopped,
        **{name: getattr(budgets, name) for name in BUDGET_FIELDS},
    )


def differences(live: SchedState, model: SchedState) -> list[str]:
    """The fields where two states differ (budgets left out), each as `field: live | model`."""
    return [
        f"{name}: live {getattr(live, name)!r} | model {getattr(model, name)!r}"
        for name in SchedState._fields
        if name not in BUDGET_FIELDS and getattr(live, name) != getattr(model, name)
    ]


@attrs.define
class Conformance:
    """Checks a live run against the model, action by action (see the module docstring)."""

    bounds: Bounds
    state: SchedState = attrs.field(init=False)
    pipeline: Pipeline | None = None
    actions: int = 0
    """Actions checked so far."""
    failure: str | None = None
    """The first disagreement, in words: the action, both states, the recent trace."""
    seconds: float = 0.0
    """Wall time spent checking (to report the overhead)."""
    trace: list[Action] = attrs.field(factory=list)
    """Every action checked, in order (across a crash: both runs, and the crash)."""

    def __attrs_post_init__(self) -> None:
        self.state = initial_state(self.bounds)

    @property
    def ok(self) -> bool:
        return self.failure is None

    def attach(self, pipeline: Pipeline) -> None:
        """Check `pipeline` from now on (a fresh run, or the run resumed after a crash)."""
        if self.pipeline is not None:
            self.pipeline.status.observer = None
        self.pipeline = pipeline
        pipeline.status.observer = self

    def crash(self) -> None:
        """The process dies now: the pipeline checked so far is gone (its last words are not
        the model's), and the model restarts from its last checkpoint."""
        if self.pipeline is not None:
            self.pipeline.status.observer = None
            self.pipeline = None
        self._step(Action(ActionKind.CRASH), compare=False)

    def restart(self) -> None:
        """The run ended (stopped early, or failed) and a new process resumes it from its last
        checkpoint: the model restarts from there (`groupflow.model.scheduler.restart`)."""
        if self.pipeline is not None:
            self.pipeline.status.observer = None
            self.pipeline = None
        if self.failure is None:
            try:
                self.state = restart(self.state, self.bounds)
            except NotEnabled as exc:
                self._fail(f"after action {self.actions}: {exc}")

    def compare(self) -> None:
        """Compare the live pipeline with the model now (after a resume, say)."""
        if self.failure is None and self.pipeline is not None:
            started = time.perf_counter()
            self._compare("after resume" if self.actions else "at the start")
            self.seconds += time.perf_counter() - started

    def on_action(self, action: Action) -> None:
        self._step(action, compare=True)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ConformanceError(self.failure)

    # -- internals -----------------------------------------------------------------------

    def _step(self, action: Action, *, compare: bool) -> None:
        if self.failure is not None:
            return
        started = time.perf_counter()
        try:
            self.trace.append(action)
            self.actions += 1
            step = model_step(self.state, self.bounds, action)
            if not step.allowed:
                self._fail(
                    f"the model does not allow action {self.actions}: "
                    f"{describe(action, self.bounds)} ({action.to_json()})"
                )
                return
            self.state = step.state
            if step.violations:
                self._fail(
                    f"after action {self.actions}, {describe(action, self.bounds)}, the model's "
                    f"invariants fail: " + "; ".join(step.violations)
                )
                return
            if compare:
                self._compare(f"after action {self.actions}, {describe(action, self.bounds)}")
        finally:
            self.seconds += time.perf_counter() - started

    def _compare(self, when: str) -> None:
        assert self.pipeline is not None
        live = abstract(self.pipeline, self.bounds, self.state)
        diff = differences(live, self.state)
        if diff:
            self._fail(f"{when}, the live state differs from the model's: " + "; ".join(diff))

    def _fail(self, what: str) -> None:
        b = self.bounds
        lines = [what, f"  model: {summarize(self.state, b)}"]
        if self.pipeline is not None:
            live = abstract(self.pipeline, b, self.state)
            lines.append(f"  live:  {summarize(live, b)}")
        recent = self.trace[-12:]
        lines.append("  recent actions: " + ", ".join(describe(a, b) for a in recent))
        self.failure = "\n".join(lines)
