"""An abstract model of the whole scheduler: many groups, permits, batches, timers, teachers,
checkpoints, crashes and shutdown, small enough to explore exhaustively.

The lifecycle table says what may happen to one group; the hard bugs live in how many groups
interleave. A `SchedState` is the scheduler at one instant; `enabled` lists what may happen next
and `apply` makes it happen. Every group change goes through `groupflow.model.fire`, and every
scheduling decision (admission, dispatch, the batch, demand, what a checkpoint re-issues) is a
function of `groupflow.model.decisions` that the pipeline calls too.

Time is abstract: a flush timer firing is an action that may happen whenever a batch waits. A
state is final when the run has exited (`Phase.DONE`).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

from groupflow.model import decisions
from groupflow.model.actions import EXTERNAL_KINDS, NOT_PROGRESS_KINDS, Action, ActionKind
from groupflow.model.bounds import Bounds
from groupflow.model.lifecycle import Actor, Event, Guard, fire
from groupflow.model.policy import (
    CheckpointPolicy,
    Design,
    Dispatch,
    DispatchReason,
    FailurePolicy,
    Sampler,
)
from groupflow.model.states import GroupState

__all__ = [
    "EXTERNAL_KINDS",
    "NOT_PROGRESS_KINDS",
    "Action",
    "ActionKind",
    "Bounds",
    "CheckpointPolicy",
    "Cut",
    "Design",
    "Dispatch",
    "DispatchReason",
    "FailurePolicy",
    "Group",
    "NotEnabled",
    "Phase",
    "Sampler",
    "SchedState",
    "Saved",
    "apply",
    "describe",
    "dispatch_reasons",
    "enabled",
    "group_of",
    "initial_state",
    "is_enabled",
    "next_prompt",
    "producer_ended",
    "summarize",
    "transition",
]

_S = GroupState
_K = ActionKind
_UNREADY = (_S.RESERVED, _S.WRITTEN, _S.SCORING)
_PENDING = (_S.WRITTEN, _S.SCORING)


class Phase(enum.IntEnum):
    RUNNING = 0
    SHUTDOWN = 1
    """No new prompts; rollouts are cancelled or finish; stages drain (or, after a failure,
    everything unready is dropped)."""
    DONE = 2
    """Exited: final."""


class Group(NamedTuple):
    ordinal: int
    state: GroupState
    permit: bool
    """The rollout task still holds its generation permit."""
    retries: int = 0
    stage: int = 0
    """Stages this group has been scored by."""
    again: bool = False
    """Queued again after a failed call: it goes alone, at once."""
    version: int = 0
    """The weight version its rollout started from (tracked for the windowed sampler only)."""


class Saved(NamedTuple):
    """What a checkpoint holds: the train position and the ledger of prompt ordinals."""

    step: int
    cursor: int
    trained: int
    """Bit set of ordinals trained by the saved weights."""
    shortfall: int
    """Bit set of ordinals given up on (failed for good), accounted rather than trained."""
    ready: tuple[int, ...]
    """Ordinals saved as READY groups, with their rows."""
    reissue: tuple[int, ...]
    """Ordinals issued before the save that must be issued again on resume."""
    versions: tuple[int, ...] = ()
    """The weight versions of the `ready` groups (windowed sampler only)."""


class Cut(NamedTuple):
    """A checkpoint in progress: its policy and, for `flush`, the groups it waits for."""

    policy: CheckpointPolicy
    ordinals: tuple[int, ...]


class SchedState(NamedTuple):
    """The scheduler at one instant. Tuples and ints only: hashable and cheap to compare."""

    phase: Phase
    step: int
    cursor: int
    """The next fresh ordinal the data source hands out."""
    reissue: tuple[int, ...]
    """Ordinals to issue again (after a restore) before fresh ones."""
    groups: tuple[Group, ...]
    """Groups the buffer holds, by ordinal."""
    pending: tuple[tuple[int, ...], ...]
    """Per lane: ordinals queued for a call, in arrival order."""
    inflight: tuple[tuple[tuple[int, ...], ...], ...]
    """Per lane: the batches whose call is in flight."""
    free_permits: int
    rows: int
    """Bit set of ordinals whose rows are in the store."""
    trained: int
    """Bit set of ordinals trained in the weights the run now has."""
    trained_twice: int
    """Ghost: ordinals a train step consumed although already trained. Must stay 0."""
    shortfall: int
    saved: Saved | None
    cut: Cut | None
    """While a checkpoint is in progress."""
    failed: bool
    """The run failed and is shutting down: nothing is scored or trained any more."""
    training: bool
    """A train step is running: its groups are CONSUMED, not yet trained."""
    stopped: bool
    """The run shut down because training was done (not interrupted, not failed)."""
    crashes_left: int
    checkpoints_left: int
    rollout_failures_left: int
    batch_failures_left: int
    train_failures_left: int
    aborts_left: int


def _fast_replace(cls: type[tuple[Any, ...]]) -> None:
    """Give a NamedTuple a `_replace` without the generic one's dict and map: the explorer
    replaces fields of states and groups millions of times."""
    fields: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
    index = {name: i for i, name in enumerate(fields)}
    new = tuple.__new__

    def _replace(self: tuple[Any, ...], **changes: Any) -> tuple[Any, ...]:
        values = list(self)
        for name, value in changes.items():
            i = index.get(name)
            if i is None:
                raise ValueError(f"{cls.__name__} has no field {name!r}")
            values[i] = value
        return new(cls, values)

    cls._replace = _replace  # type: ignore[attr-defined]


_fast_replace(Group)
_fast_replace(SchedState)


BUDGET_FIELDS = (
    "crashes_left",
    "checkpoints_left",
    "rollout_failures_left",
    "batch_failures_left",
    "train_failures_left",
    "aborts_left",
)
"""The explorer's fault budgets: bounds of the search, not state of the system."""


class NotEnabled(ValueError):
    """`apply` was asked for an action that is not enabled in the state."""


def initial_state(b: Bounds) -> SchedState:
    return SchedState(
        phase=Phase.RUNNING,
        step=0,
        cursor=0,
        reissue=(),
        groups=(),
        pending=((),) * b.lanes,
        inflight=((),) * b.lanes,
        free_permits=b.inflight,
        rows=0,
        trained=0,
        trained_twice=0,
        shortfall=0,
        saved=None,
        cut=None,
        failed=False,
        training=False,
        stopped=False,
        crashes_left=b.crashes,
        checkpoints_left=b.checkpoints,
        rollout_failures_left=b.rollout_failures,
        batch_failures_left=b.batch_failures,
        train_failures_left=b.train_failures,
        aborts_left=b.aborts,
    )


# -- helpers over a state -------------------------------------------------------------------


def _bit(ordinal: int) -> int:
    return 1 << ordinal


def _ordinals(bits: int) -> Iterator[int]:
    o = 0
    while bits:
        if bits & 1:
            yield o
        bits >>= 1
        o += 1


class _Bits:
    """A bit set seen as a container of ordinals (for the shared decision functions)."""

    __slots__ = ("bits",)

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def __contains__(self, ordinal: object) -> bool:
        return isinstance(ordinal, int) and bool(self.bits >> ordinal & 1)


_NAMES = tuple(f"prompt {o}" for o in range(256))


def _name(ordinal: int) -> str:
    return _NAMES[ordinal] if ordinal < len(_NAMES) else f"prompt {ordinal}"


def group_of(s: SchedState, ordinal: int) -> Group | None:
    for g in s.groups:
        if g.ordinal == ordinal:
            return g
    return None


def _move(g: Group, event: Event, actor: Actor, guard: Guard = Guard.ALWAYS) -> Group:
    state = fire(_name(g.ordinal), g.state, event, actor=actor, guard=guard)
    return _new_group((g[0], state, *g[2:]))  # `_replace(state=...)`, the explorer's hot path


_new_group = functools.partial(tuple.__new__, Group)


def _replace_group(s: SchedState, new: Group) -> tuple[Group, ...]:
    return tuple(new if g.ordinal == new.ordinal else g for g in s.groups)


def _without(s: SchedState, ordinals: set[int] | frozenset[int]) -> tuple[Group, ...]:
    return tuple(g for g in s.groups if g.ordinal not in ordinals)


def _set_at(items: tuple[Any, ...], index: int, value: object) -> tuple[Any, ...]:
    return items[:index] + (value,) + items[index + 1 :]


def next_prompt(s: SchedState, b: Bounds) -> int | None:
    """The ordinal the data source hands out next, if any."""
    if s.reissue:
        return s.reissue[0]
    if s.cursor < b.prompts:
        return s.cursor
    return None


def producer_ended(s: SchedState, b: Bounds) -> bool:
    """No prompt left to issue and no rollout in flight: downstream may drain."""
    return next_prompt(s, b) is None and not any(g.state is _S.RESERVED for g in s.groups)


def _step_resolved(s: SchedState, b: Bounds) -> bool:
    """Every prompt of the current step has been issued and ended READY or given up on."""
    ready = {g.ordinal for g in s.groups if g.state is _S.READY}
    missing = decisions.step_missing(
        b.step_ordinals(s.step), ready=ready, given_up=_Bits(s.shortfall)
    )
    return not missing


def _windowed(b: Bounds) -> bool:
    return b.sampler is Sampler.WINDOWED


def _stale(g: Group, s: SchedState, b: Bounds) -> bool:
    return decisions.too_stale(
        weight_version=s.step, start_version=g.version, max_staleness=b.max_staleness
    )


def _selectable(s: SchedState, b: Bounds) -> list[Group]:
    """READY groups the windowed sampler may train now, oldest weight version first."""
    ready = [g for g in s.groups if g.state is _S.READY and not _stale(g, s, b)]
    return sorted(ready, key=lambda g: (g.version, g.ordinal))


def _may_train(s: SchedState, b: Bounds) -> bool:
    if s.step >= b.steps:
        return False
    if not _windowed(b):
        return _step_resolved(s, b)
    selectable = len(_selectable(s, b))
    if selectable >= b.per_step:
        return True
    nothing_coming = producer_ended(s, b) and not any(g.state in _UNREADY for g in s.groups)
    return selectable > 0 and nothing_coming


def _steps_ahead(s: SchedState, b: Bounds, ordinal: int) -> int:
    """How far ahead of training admitting `ordinal` runs, in train steps. In order: its
    target step's distance. Windowed: the groups in flight (held, not yet trained), in steps;
    a gate on target steps would deadlock the windowed sampler once a step's prompts are given
    up (`groupflow check` found it)."""
    if not _windowed(b):
        return b.target(ordinal) - s.step
    return sum(1 for g in s.groups if g.state is not _S.CONSUMED) // b.per_step


def _may_stop(s: SchedState, b: Bounds) -> bool:
    """Training has run its steps, or (windowed) the data ran out and nothing is left to train.
    The windowed sampler evicts stale groups first: stopping with one READY would end the run
    with its prompt neither trained nor given up (`groupflow check` found this)."""
    if _windowed(b) and any(g.state is _S.READY and _stale(g, s, b) for g in s.groups):
        return False
    if s.step >= b.steps:
        return True
    return (
        _windowed(b)
        and producer_ended(s, b)
        and not any(g.state in _UNREADY for g in s.groups)
        and not _selectable(s, b)
    )


def _training_waits(s: SchedState, b: Bounds) -> bool:
    """Training waits on the groups of its step (in order only: the windowed sampler takes
    whatever is READY, so no step's groups are awaited in particular)."""
    return (
        not _windowed(b)
        and s.phase is Phase.RUNNING
        and s.cut is None
        and s.step < b.steps
        and not _step_resolved(s, b)
    )


def _draining(s: SchedState, b: Bounds, stage: int) -> bool:
    """Nothing more will reach this stage: producers ended and no group is at an earlier
    stage, or the run shuts down and stages drain."""
    if s.phase is Phase.SHUTDOWN and b.drain_on_shutdown and not s.failed:
        return True
    if not producer_ended(s, b):
        return False
    return not any(g.state in _PENDING and g.stage < stage for g in s.groups)


def _demanded(s: SchedState, b: Bounds, lane: int) -> bool:
    """Demand dispatch for `lane` (see `decisions.demand_dispatch`)."""
    if not _training_waits(s, b):
        return False
    stage = b.stage_of_lane(lane)
    ordinals = b.step_ordinals(s.step)
    upstream = any(
        g.ordinal in ordinals
        and (g.state is _S.RESERVED or (g.state in _PENDING and g.stage < stage))
        for g in s.groups
    )
    return decisions.demand_dispatch(
        training_waits=True,
        step_issued=decisions.step_issued(ordinals, cursor=s.cursor, reissue=s.reissue),
        step_upstream=upstream,
        step_queued_here=any(o in ordinals for o in s.pending[lane]),
    )


def _head_is_retry(s: SchedState, lane: int) -> bool:
    queue = s.pending[lane]
    head = group_of(s, queue[0]) if queue else None
    return head is not None and head.again


def dispatch_reasons(s: SchedState, b: Bounds, lane: int) -> tuple[DispatchReason, ...]:
    """Every reason a batch may be sent from `lane` now (the first is the one sent)."""
    if s.phase is Phase.DONE:
        return ()
    queue = s.pending[lane]
    if not queue or s.inflight[lane]:
        return ()
    return decisions.dispatch_reasons(
        design=b.design,
        run_failed=s.failed,
        queued=len(queue),
        head_is_retry=_head_is_retry(s, lane),
        call_in_flight=False,
        max_batch=b.max_batch,
        draining=_draining(s, b, b.stage_of_lane(lane)),
        flush_requested=s.cut is not None and any(o in s.cut.ordinals for o in queue),
        demanded=b.demand and _demanded(s, b, lane),
        timer_expired=b.flush_timer,
    )


def _batch(s: SchedState, b: Bounds, lane: int) -> tuple[int, ...]:
    queue = s.pending[lane]
    size = decisions.batch_size(
        design=b.design,
        queued=len(queue),
        head_is_retry=_head_is_retry(s, lane),
        max_batch=b.max_batch,
    )
    batch = [queue[0]]
    for o in queue[1:size]:
        g = group_of(s, o)
        if g is None or g.again:
            break
        batch.append(o)
    return tuple(batch)


def _ledger(s: SchedState, b: Bounds) -> Saved:
    """The checkpoint of the state as it is now (READY groups saved, the rest re-issued)."""
    ready = tuple(g.ordinal for g in s.groups if g.state is _S.READY)
    accounted = s.trained | s.shortfall
    for o in ready:
        accounted |= _bit(o)
    reissue = decisions.reissue_on_resume(s.cursor, _Bits(accounted))
    versions = tuple(g.version for g in s.groups if g.state is _S.READY) if _windowed(b) else ()
    return Saved(s.step, s.cursor, s.trained, s.shortfall, ready, reissue, versions)


def _save(s: SchedState, b: Bounds) -> SchedState:
    assert s.cut is not None
    saved = _ledger(s, b)
    if s.cut.policy is CheckpointPolicy.NAIVE:
        saved = saved._replace(reissue=())  # the upstream bug: in-flight prompts count as used
    return s._replace(saved=saved, cut=None)


def _restore(s: SchedState, b: Bounds) -> SchedState:
    """A crash: everything in memory is gone; the run resumes from the last checkpoint."""
    return _restored(
        s.saved,
        s.crashes_left - 1,
        s.checkpoints_left,
        s.rollout_failures_left,
        s.batch_failures_left,
        s.train_failures_left,
        s.aborts_left,
        b,
    )


@functools.lru_cache(maxsize=1 << 14)
def _restored(
    saved: Saved | None,
    crashes_left: int,
    checkpoints_left: int,
    rollout_failures_left: int,
    batch_failures_left: int,
    train_failures_left: int,
    aborts_left: int,
    b: Bounds,
) -> SchedState:
    """What a restart holds depends on the checkpoint and the budgets only, and a crash may
    happen in every state: computed once per checkpoint."""
    fresh = initial_state(b)._replace(
        crashes_left=crashes_left,
        checkpoints_left=checkpoints_left,
        rollout_failures_left=rollout_failures_left,
        batch_failures_left=batch_failures_left,
        train_failures_left=train_failures_left,
        aborts_left=aborts_left,
    )
    if saved is None:
        return fresh
    versions = saved.versions or (0,) * len(saved.ready)
    groups = tuple(
        Group(
            o,
            fire(_name(o), None, Event.RESTORE, actor=Actor.CHECKPOINT),
            False,
            stage=b.stages,
            version=v,
        )
        for o, v in zip(saved.ready, versions, strict=True)
    )
    rows = 0
    for o in saved.ready:
        rows |= _bit(o)
    return fresh._replace(
        step=saved.step,
        cursor=saved.cursor,
        reissue=saved.reissue,
        groups=groups,
        rows=rows,
        trained=saved.trained,
        shortfall=saved.shortfall,
        saved=saved,
    )


def _release_permits(
    groups: tuple[Group, ...], ordinals: set[int]
) -> tuple[tuple[Group, ...], int]:
    freed = 0
    out = []
    for g in groups:
        if g.ordinal in ordinals and g.permit:
            g = g._replace(permit=False)
            freed += 1
        out.append(g)
    return tuple(out), freed


# -- what may happen ------------------------------------------------------------------------


def enabled(s: SchedState, b: Bounds) -> list[Action]:
    """Every action that may happen next, in a fixed order (so traces are reproducible)."""
    if s.phase is Phase.DONE:
        return []
    out: list[Action] = []
    running = s.phase is Phase.RUNNING
    nxt = next_prompt(s, b)
    if (
        nxt is not None
        and decisions.admission(
            running=running,
            free_permits=s.free_permits,
            held_groups=len(s.groups),
            capacity=b.capacity,
            steps_ahead=_steps_ahead(s, b, nxt),
            gate_window=b.gate_window,
        )
        is None
    ):
        out.append(Action(_K.ADMIT, nxt))
    for g in s.groups:
        if g.state is _S.RESERVED:
            out.append(Action(_K.COMMIT, g.ordinal))
            if s.rollout_failures_left:
                out.append(Action(_K.ROLLOUT_FAIL, g.ordinal))
            if not running:
                out.append(Action(_K.CANCEL, g.ordinal))
        elif not running and g.state in _PENDING and (s.failed or not b.drain_on_shutdown):
            out.append(Action(_K.DROP, g.ordinal))
    for lane in range(b.lanes):
        reasons = dispatch_reasons(s, b, lane)
        if reasons:
            out.append(Action(_K.DISPATCH, lane=lane, detail=reasons[0]))
        if s.inflight[lane]:
            out.append(Action(_K.SCORED, lane=lane))
            if s.batch_failures_left:
                out.append(Action(_K.SCORE_FAIL, lane=lane))
    if s.training:
        if s.failed:
            out.append(Action(_K.TRAIN_CANCELLED, detail=f"step {s.step}"))
        else:
            out.append(Action(_K.TRAINED, detail=f"step {s.step}"))
            if s.train_failures_left:
                out.append(Action(_K.TRAIN_FAIL, detail=f"step {s.step}"))
    elif running and s.cut is None:
        if _may_train(s, b):
            out.append(Action(_K.TRAIN, detail=f"step {s.step}"))
        if _windowed(b) and any(g.state is _S.READY and _stale(g, s, b) for g in s.groups):
            out.append(Action(_K.EVICT))
        if _may_stop(s, b):
            out.append(Action(_K.STOP))
        if s.checkpoints_left:
            for policy in sorted(b.checkpoint_policies):
                out.append(Action(_K.CHECKPOINT, detail=policy))
    if s.cut is not None:
        if not any(g.state in _PENDING and g.ordinal in s.cut.ordinals for g in s.groups):
            out.append(Action(_K.CHECKPOINT_SAVED))
        if s.cut.ordinals:
            out.append(Action(_K.FLUSH_TIMEOUT))
    if not running and not s.training and not any(g.state in _UNREADY for g in s.groups):
        out.append(Action(_K.EXIT))
    if running and b.interrupts and s.step < b.steps:
        out.append(Action(_K.INTERRUPT))  # a run that has trained its steps stops by itself
    if s.aborts_left and not s.failed:
        out.append(Action(_K.ABORT))
    if s.crashes_left:
        out.append(Action(_K.CRASH))
    return out


def is_enabled(s: SchedState, b: Bounds, a: Action) -> bool:
    """Whether `a` may happen in `s`. A dispatch may name any reason that holds (the
    pipeline learns some facts, such as upstream having ended, a moment late)."""
    if a.kind == _K.DISPATCH:
        return 0 <= a.lane < b.lanes and a.detail in dispatch_reasons(s, b, a.lane)
    return a in enabled(s, b)


def transition(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The state after `a`, for an enabled action (not checked again: see `apply`).
    Raises `IllegalTransition` if the action would move a group against the lifecycle table."""
    return _HANDLERS[a.kind](s, b, a)


def apply(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The state after `a`. Raises `NotEnabled` if `a` may not happen in `s` (a replayed trace
    that no longer fits the model)."""
    if not is_enabled(s, b, a):
        raise NotEnabled(f"{describe(a, b)} is not enabled in: {summarize(s, b)}")
    return transition(s, b, a)


def _admit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    o = a.ordinal
    g = Group(
        o,
        fire(_name(o), None, Event.RESERVE, actor=Actor.ROLLOUT),
        permit=True,
        version=s.step if _windowed(b) else 0,
    )
    groups = tuple(sorted((*s.groups, g), key=lambda x: x.ordinal))
    if s.reissue and s.reissue[0] == o:
        return s._replace(groups=groups, reissue=s.reissue[1:], free_permits=s.free_permits - 1)
    return s._replace(groups=groups, cursor=s.cursor + 1, free_permits=s.free_permits - 1)


def _queue(s: SchedState, lane: int, ordinal: int) -> tuple[tuple[int, ...], ...]:
    return _set_at(s.pending, lane, s.pending[lane] + (ordinal,))


def _commit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    g = group_of(s, a.ordinal)
    assert g is not None
    scored = b.stages == 0
    g = _move(g, Event.COMMIT, Actor.ROLLOUT, Guard.COMPLETE if scored else Guard.PENDING)
    free = s.free_permits
    if scored or b.design is Design.PUMP:
        g = g._replace(permit=False)
        free += 1
    pending = s.pending if scored else _queue(s, b.lane(g.ordinal, 0), g.ordinal)
    return s._replace(
        groups=_replace_group(s, g),
        pending=pending,
        free_permits=free,
        rows=s.rows | _bit(g.ordinal),
    )


def _rollout_fail(s: SchedState, b: Bounds, a: Action) -> SchedState:
    g = group_of(s, a.ordinal)
    assert g is not None
    _move(g, Event.ROLLOUT_FAILED, Actor.ROLLOUT)
    return s._replace(
        groups=_without(s, {g.ordinal}),
        free_permits=s.free_permits + g.permit,
        shortfall=s.shortfall | _bit(g.ordinal),
        rollout_failures_left=s.rollout_failures_left - 1,
    )


def _cancel(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """A rollout cancelled at shutdown: its prompt is issued again on resume, not given up."""
    g = group_of(s, a.ordinal)
    assert g is not None
    _move(g, Event.ROLLOUT_FAILED, Actor.ROLLOUT)
    return s._replace(
        groups=_without(s, {g.ordinal}),
        free_permits=s.free_permits + g.permit,
        reissue=s.reissue + (g.ordinal,),
    )


def _dispatch(s: SchedState, b: Bounds, a: Action) -> SchedState:
    lane = a.lane
    batch = _batch(s, b, lane)
    members = set(batch)
    groups = tuple(
        _move(g, Event.TAKE_BATCH, Actor.STAGE)._replace(again=False) if g.ordinal in members else g
        for g in s.groups
    )
    return s._replace(
        groups=groups,
        pending=_set_at(s.pending, lane, s.pending[lane][len(batch) :]),
        inflight=_set_at(s.inflight, lane, s.inflight[lane] + (batch,)),
    )


def _finish_batch(s: SchedState, lane: int) -> tuple[SchedState, tuple[int, ...]]:
    batch = s.inflight[lane][0]
    return s._replace(inflight=_set_at(s.inflight, lane, s.inflight[lane][1:])), batch


def _scored(s: SchedState, b: Bounds, a: Action) -> SchedState:
    s, batch = _finish_batch(s, a.lane)
    members = set(batch)
    groups: list[Group] = []
    pending = s.pending
    ready: set[int] = set()
    for g in s.groups:
        if g.ordinal in members:
            stage = g.stage + 1
            complete = stage >= b.stages
            g = _move(g, Event.SCORED, Actor.STAGE, Guard.COMPLETE if complete else Guard.PENDING)
            g = g._replace(stage=stage)
            if complete:
                ready.add(g.ordinal)
            else:
                lane = b.lane(g.ordinal, stage)
                pending = _set_at(pending, lane, pending[lane] + (g.ordinal,))
        groups.append(g)
    out, freed = _release_permits(tuple(groups), ready)  # inline and coalesce: rollouts return
    return s._replace(groups=out, pending=pending, free_permits=s.free_permits + freed)


def _drop(s: SchedState, ordinals: set[int], actor: Actor, *, give_up: bool) -> SchedState:
    """Discard groups that are WRITTEN or SCORING: rows cleared, permits returned, removed from
    every queue and in-flight batch."""
    shortfall = s.shortfall
    rows = s.rows
    freed = 0
    for g in s.groups:
        if g.ordinal in ordinals:
            _move(g, Event.DROP, actor)
            freed += g.permit
            rows &= ~_bit(g.ordinal)
            if give_up:
                shortfall |= _bit(g.ordinal)
    pending = tuple(tuple(o for o in q if o not in ordinals) for q in s.pending)
    inflight = tuple(
        tuple(kept for batch in batches if (kept := tuple(o for o in batch if o not in ordinals)))
        for batches in s.inflight
    )
    return s._replace(
        groups=_without(s, ordinals),
        pending=pending,
        inflight=inflight,
        free_permits=s.free_permits + freed,
        rows=rows,
        shortfall=shortfall,
    )


def _fail_run(s: SchedState) -> SchedState:
    return s._replace(phase=Phase.SHUTDOWN, failed=True, cut=None)


def _score_fail(s: SchedState, b: Bounds, a: Action) -> SchedState:
    lane = a.lane
    s, batch = _finish_batch(s, lane)
    s = s._replace(batch_failures_left=s.batch_failures_left - 1)
    if b.failure_policy is FailurePolicy.FAIL:
        s = _drop(s, set(batch), Actor.STAGE, give_up=False)
        return _fail_run(s._replace(reissue=s.reissue + batch))
    again = [
        o
        for o in batch
        if (g := group_of(s, o)) is not None
        and decisions.retry_after_failure(b.failure_policy, g.retries)
    ]
    retried = set(again)
    groups = tuple(
        _move(g, Event.RETRY, Actor.STAGE)._replace(retries=g.retries + 1, again=True)
        if g.ordinal in retried
        else g
        for g in s.groups
    )
    s = s._replace(groups=groups, pending=_set_at(s.pending, lane, tuple(again) + s.pending[lane]))
    return _drop(s, set(batch) - retried, Actor.STAGE, give_up=True)


def _drop_one(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """Shutdown drops one group; its prompt joins the queue to issue again (on resume)."""
    s = _drop(s, {a.ordinal}, Actor.SUPERVISOR, give_up=False)
    return s._replace(reissue=s.reissue + (a.ordinal,))


def _train(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The train pump selects the step's groups (CONSUMED) and starts the step."""
    if _windowed(b):
        ordinals = {g.ordinal for g in _selectable(s, b)[: b.per_step]}
    else:
        ordinals = set(b.step_ordinals(s.step))
    groups = tuple(
        _move(g, Event.SELECT, Actor.TRAIN) if g.ordinal in ordinals else g for g in s.groups
    )
    return s._replace(groups=groups, training=True)


def _evict(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """READY groups too stale for any later step are dropped; their prompts are given up."""
    stale = {g.ordinal for g in s.groups if g.state is _S.READY and _stale(g, s, b)}
    bits = 0
    for g in s.groups:
        if g.ordinal in stale:
            _move(g, Event.EVICT, Actor.TRAIN)
            bits |= _bit(g.ordinal)
    return s._replace(groups=_without(s, stale), rows=s.rows & ~bits, shortfall=s.shortfall | bits)


def _end_step(s: SchedState) -> tuple[SchedState, int]:
    """The step's CONSUMED groups let go, their rows cleared."""
    bits = 0
    for g in s.groups:
        if g.state is _S.CONSUMED:
            bits |= _bit(g.ordinal)
    groups = tuple(g for g in s.groups if g.state is not _S.CONSUMED)
    return s._replace(groups=groups, rows=s.rows & ~bits, training=False), bits


def _trained(s: SchedState, b: Bounds, a: Action) -> SchedState:
    s, bits = _end_step(s)
    return s._replace(
        trained=s.trained | bits,
        trained_twice=s.trained_twice | (s.trained & bits),
        step=s.step + 1,
    )


def _train_fail(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The learner raised: nothing is trained, the rows go, and the run fails. No checkpoint
    records those prompts trained, so a resume issues them again."""
    s, _ = _end_step(s)
    return _fail_run(s._replace(train_failures_left=s.train_failures_left - 1))


def _train_cancelled(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The run failed elsewhere and cancelled the step: as a failed step, without the fault."""
    s, _ = _end_step(s)
    return s


def _checkpoint(s: SchedState, b: Bounds, a: Action) -> SchedState:
    policy = CheckpointPolicy(a.detail)
    cut = decisions.flush_cut(policy, (g.ordinal for g in s.groups if g.state in _PENDING))
    return s._replace(cut=Cut(policy, cut), checkpoints_left=s.checkpoints_left - 1)


def _checkpoint_saved(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _save(s, b)


def _stop(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return s._replace(phase=Phase.SHUTDOWN, stopped=True)


def _exit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """Nothing is unready any more; READY groups left over stay with their rows."""
    return s._replace(phase=Phase.DONE)


def _interrupt(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return s._replace(phase=Phase.SHUTDOWN, cut=None)


def _abort(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _fail_run(s._replace(aborts_left=s.aborts_left - 1))


def _crash(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _restore(s, b)


_HANDLERS = {
    _K.ADMIT: _admit,
    _K.COMMIT: _commit,
    _K.ROLLOUT_FAIL: _rollout_fail,
    _K.CANCEL: _cancel,
    _K.DISPATCH: _dispatch,
    _K.SCORED: _scored,
    _K.SCORE_FAIL: _score_fail,
    _K.DROP: _drop_one,
    _K.TRAIN: _train,
    _K.TRAINED: _trained,
    _K.EVICT: _evict,
    _K.TRAIN_FAIL: _train_fail,
    _K.TRAIN_CANCELLED: _train_cancelled,
    _K.CHECKPOINT: _checkpoint,
    _K.CHECKPOINT_SAVED: _checkpoint_saved,
    _K.FLUSH_TIMEOUT: _checkpoint_saved,
    _K.STOP: _stop,
    _K.EXIT: _exit,
    _K.INTERRUPT: _interrupt,
    _K.ABORT: _abort,
    _K.CRASH: _crash,
}


# -- words ----------------------------------------------------------------------------------


def _lane_name(lane: int, b: Bounds) -> str:
    return f"teacher {lane}" if lane < b.teachers else f"stage {b.stage_of_lane(lane) + 1}"


def describe(a: Action, b: Bounds) -> str:
    """One action in words a user can follow."""
    o = a.ordinal
    lane = _lane_name(a.lane, b)
    kind = ActionKind(a.kind)
    if kind is _K.ADMIT:
        return f"admit prompt {o} for step {b.target(o)} (teacher {b.teacher(o)})"
    if kind is _K.COMMIT:
        if b.stages == 0:
            return f"rollout of prompt {o} finishes: commit, READY"
        return f"rollout of prompt {o} finishes: commit, queue at teacher {b.teacher(o)}"
    if kind is _K.ROLLOUT_FAIL:
        return f"rollout of prompt {o} fails: group discarded, prompt given up"
    if kind is _K.CANCEL:
        return f"rollout of prompt {o} cancelled by shutdown"
    if kind is _K.DISPATCH:
        return f"{lane}: send a batch ({a.detail})"
    if kind is _K.SCORED:
        return f"{lane}: call returns, its groups scored"
    if kind is _K.SCORE_FAIL:
        return f"{lane}: call fails ({b.failure_policy} policy)"
    if kind is _K.DROP:
        return f"shutdown drops prompt {o}'s group (issued again on resume)"
    if kind is _K.TRAIN:
        return f"train {a.detail}: select its groups"
    if kind is _K.TRAINED:
        return f"train {a.detail} done"
    if kind is _K.EVICT:
        return f"evict READY groups more than {b.max_staleness} versions old (prompts given up)"
    if kind is _K.TRAIN_CANCELLED:
        return f"train {a.detail} cancelled by the failing run"
    if kind is _K.TRAIN_FAIL:
        return f"train {a.detail} raises: the run fails"
    if kind is _K.CHECKPOINT:
        return f"checkpoint starts ({a.detail})"
    if kind is _K.CHECKPOINT_SAVED:
        return "checkpoint saved"
    if kind is _K.FLUSH_TIMEOUT:
        return "flush timed out: checkpoint saved without the pending groups"
    if kind is _K.STOP:
        return "training done: shutdown"
    if kind is _K.EXIT:
        return "run exits"
    if kind is _K.INTERRUPT:
        return "user stops the run: shutdown"
    if kind is _K.ABORT:
        return "a pump fails: the run aborts"
    return "crash: restart from the last checkpoint"


def summarize(s: SchedState, b: Bounds) -> str:
    """The state in one line: phase, step, permits, each group, each lane's queue."""
    groups = (
        " ".join(
            f"p{g.ordinal}:{g.state.value}{'*' if g.permit else ''}{'r' if g.retries else ''}"
            + (f"@{g.stage}" if b.stages > 1 and g.state in _PENDING else "")
            for g in s.groups
        )
        or "-"
    )
    lanes = " ".join(
        f"{'t' if lane < b.teachers else 's'}{lane}[queued {list(s.pending[lane])} in flight "
        f"{[list(x) for x in s.inflight[lane]]}]"
        for lane in range(b.lanes)
    )
    extra = []
    if s.reissue:
        extra.append(f"reissue {list(s.reissue)}")
    if s.cut is not None:
        extra.append(f"checkpoint ({s.cut.policy}) waits for {list(s.cut.ordinals)}")
    if s.training:
        extra.append("training")
    if s.failed:
        extra.append("failed")
    phase = s.phase.name.lower()
    return (
        f"{phase} step {s.step}/{b.steps}, next prompt {next_prompt(s, b)}, permits free "
        f"{s.free_permits}/{b.inflight}, held {len(s.groups)}/{b.capacity} | {groups} | {lanes}"
        + ("" if not extra else " | " + ", ".join(extra))
    )
