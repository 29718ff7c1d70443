"""What each action of the abstract scheduler does: `transition` (and `apply`, which first
checks the action is enabled), one handler per action kind, the checkpoint a state saves, and
the state a crash or a restart resumes in.

Every group change goes through `groupflow.model.fire`, and every scheduling decision (the
batch, what a checkpoint re-issues) is a function of `groupflow.model.decisions` that the
pipeline calls too. When each action may happen is in `groupflow.model.scheduler.guards`.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

from groupflow.model import decisions
from groupflow.model.lifecycle import Actor, Event, Guard, fire
from groupflow.model.policy import CheckpointPolicy, Design, FailurePolicy
from groupflow.model.scheduler.actions import PERMANENT_FAILURE, WRITE_FAILED, Action, ActionKind
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.guards import (
    BUDGET_OF,
    _head_is_retry,
    _selectable,
    _stale,
    _windowed,
    is_enabled,
)
from groupflow.model.scheduler.state import (
    PENDING,
    Cut,
    Group,
    NotEnabled,
    Phase,
    Saved,
    SchedState,
    _bit,
    _Bits,
    _name,
    group_of,
    initial_state,
)
from groupflow.model.scheduler.words import describe, summarize
from groupflow.model.states import GroupState

__all__ = [
    "SNAPSHOT_READS",
    "SPENDS",
    "TOUCHES",
    "Footprint",
    "apply",
    "footprint",
    "ready_groups",
    "restart",
    "transition",
]

_S = GroupState
_K = ActionKind


# -- helpers over a state -------------------------------------------------------------------


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


def _batch(s: SchedState, b: Bounds, lane: int) -> tuple[int, ...]:
    queue = s.pending[lane]
    size = decisions.batch_size(
        design=b.design,
        queued=len(queue),
        head_is_retry=_head_is_retry(s, lane),
        max_batch_groups=b.shape.max_batch_groups,
    )
    batch = [queue[0]]
    for o in queue[1:size]:
        g = group_of(s, o)
        if g is None or g.again:
            break
        batch.append(o)
    return tuple(batch)


def ready_groups(groups: tuple[Group, ...], b: Bounds) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """All a checkpoint's snapshot reads of the groups: the READY ones' ordinals, and their
    weight versions where the sampler tracks them (else empty)."""
    ready = tuple(g.ordinal for g in groups if g.state is _S.READY)
    versions = tuple(g.version for g in groups if g.state is _S.READY) if _windowed(b) else ()
    return ready, versions


def _ledger(s: SchedState, b: Bounds) -> Saved:
    """The checkpoint of the state as it is now (READY groups saved, the rest re-issued)."""
    ready, versions = ready_groups(s.groups, b)
    accounted = s.trained | s.shortfall
    for o in ready:
        accounted |= _bit(o)
    reissue = decisions.reissue_on_resume(s.cursor, _Bits(accounted))
    return Saved(s.step, s.cursor, s.trained, s.shortfall, ready, reissue, versions)


def _save(s: SchedState, b: Bounds) -> SchedState:
    """The snapshot is taken; its write starts (on disk at `checkpoint_written`)."""
    assert s.cut is not None
    saved = _ledger(s, b)
    if s.cut.policy is CheckpointPolicy.NAIVE:
        saved = saved._replace(reissue=())  # the upstream bug: in-flight prompts count as used
    return s._replace(writing=saved, cut=None)


def _written(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The write ends: the snapshot is the checkpoint a crash restarts from; or it failed,
    and the run fails with the checkpoint before it on disk."""
    assert s.writing is not None
    if a.detail == WRITE_FAILED:
        return _fail_run(s._replace(writing=None))
    return s._replace(saved=s.writing, writing=None)


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


def restart(s: SchedState, b: Bounds) -> SchedState:
    """A new process resuming a run that ended before its last step (the user stopped it, or
    it failed): it starts from the last checkpoint, as after a crash. Not an action of the run
    (a DONE run takes none, and the explorer stops there) but the start of the next one, which
    the conformance checker follows when a resumed pipeline attaches."""
    if s.phase is not Phase.DONE:
        raise NotEnabled(f"a restart follows a run that is done, not: {summarize(s, b)}")
    return _restored(
        s.saved,
        s.crashes_left,
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
    ready: set[int] = set()
    onward: dict[int, int] = {}
    """Ordinal -> the stage it moves on to."""
    for g in s.groups:
        if g.ordinal in members:
            stage = g.stage + 1
            complete = stage >= b.stages
            g = _move(g, Event.SCORED, Actor.STAGE, Guard.COMPLETE if complete else Guard.PENDING)
            g = g._replace(stage=stage)
            if complete:
                ready.add(g.ordinal)
            else:
                onward[g.ordinal] = stage
        groups.append(g)
    pending = s.pending
    for o in sorted(onward, key=batch.index):  # the next stage queues them in batch order
        lane = b.lane(o, onward[o])
        pending = _set_at(pending, lane, pending[lane] + (o,))
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
    """A call fails: under `fail` the run fails; otherwise each group is retried (by
    `decisions.retry_after_failure`: once, and never after a permanent failure) or dropped
    and given up."""
    lane = a.lane
    transient = a.detail != PERMANENT_FAILURE
    s, batch = _finish_batch(s, lane)
    s = s._replace(batch_failures_left=s.batch_failures_left - 1)
    if b.failure_policy is FailurePolicy.FAIL:
        s = _drop(s, set(batch), Actor.STAGE, give_up=False)
        return _fail_run(s._replace(reissue=s.reissue + batch))
    again = [
        o
        for o in batch
        if (g := group_of(s, o)) is not None
        and decisions.retry_after_failure(b.failure_policy, g.retries, transient=transient)
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
        ordinals = {g.ordinal for g in _selectable(s, b)[: b.shape.prompts_per_step]}
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
    cut = decisions.flush_cut(policy, (g.ordinal for g in s.groups if g.state in PENDING))
    return s._replace(cut=Cut(policy, cut), checkpoints_left=s.checkpoints_left - 1)


def _checkpoint_saved(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _save(s, b)


def _stop(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return s._replace(phase=Phase.SHUTDOWN, stopped=True)


def _exit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """Nothing is unready any more; READY groups left over (a step ahead, or of a failed run)
    are dropped, their rows cleared: the run leaves the store as it found it, and their
    prompts are issued again on resume unless a checkpoint saved them."""
    ready = {g.ordinal for g in s.groups if g.state is _S.READY}
    bits = 0
    for g in s.groups:
        if g.ordinal in ready:
            _move(g, Event.DROP, Actor.SUPERVISOR)
            bits |= _bit(g.ordinal)
    return s._replace(
        phase=Phase.DONE,
        groups=_without(s, ready),
        rows=s.rows & ~bits,
        reissue=s.reissue + tuple(sorted(ready)),
    )


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
    _K.CHECKPOINT_WRITTEN: _written,
    _K.STOP: _stop,
    _K.EXIT: _exit,
    _K.INTERRUPT: _interrupt,
    _K.ABORT: _abort,
    _K.CRASH: _crash,
}


class Footprint(enum.Enum):
    """What an action's handler reads and writes of a state's outer part (the checkpoints and
    the fault budgets, `OUTER_FIELDS`) and of the rest, its core. The explorer computes a
    handler once per value of what it reads, and reuses the result in every state that holds
    that value (`tests/model/test_explorer.py` checks each kind's footprint on every reachable
    state of a sweep)."""

    LOCAL = "local"
    """Reads the core only and writes nothing outer: the outer part is kept."""
    SPEND = "spend"
    """As `LOCAL`, and spends one unit of the budget `SPENDS[kind]`."""
    OUTER = "outer"
    """Reads and writes the outer part only: the core is kept."""
    RESTART = "restart"
    """Reads the outer part only, and replaces the core."""
    SNAPSHOT = "snapshot"
    """Reads the core only, writes some of it and the snapshot being written (`writing`) from
    it: the rest of the outer part is kept."""
    WHOLE = "whole"
    """Anything else: computed on the whole state each time."""


SPENDS: dict[ActionKind, str] = {k: v for k, v in BUDGET_OF.items() if k is not _K.CRASH}
"""The budget each `Footprint.SPEND` kind spends (a crash spends one too, and restarts)."""

_FOOTPRINTS = {
    **{kind: Footprint.LOCAL for kind in _HANDLERS},
    **{kind: Footprint.SPEND for kind in SPENDS},
    _K.CHECKPOINT_SAVED: Footprint.SNAPSHOT,
    _K.FLUSH_TIMEOUT: Footprint.SNAPSHOT,
    _K.CHECKPOINT_WRITTEN: Footprint.OUTER,
    _K.CRASH: Footprint.RESTART,
}


_FAILS_RUN = ("phase", "failed", "cut")  # `_fail_run`
_DROPS = ("groups", "pending", "inflight", "free_permits", "rows", "shortfall")  # `_drop`
_ENDS_STEP = ("groups", "rows", "training")  # `_end_step`

TOUCHES: dict[ActionKind, frozenset[str]] = {
    kind: frozenset(fields)
    for kind, fields in {
        _K.ADMIT: ("step", "cursor", "reissue", "groups", "free_permits"),
        _K.COMMIT: ("groups", "pending", "free_permits", "rows"),
        _K.ROLLOUT_FAIL: ("groups", "free_permits", "shortfall", "rollout_failures_left"),
        _K.CANCEL: ("groups", "free_permits", "reissue"),
        _K.DISPATCH: ("groups", "pending", "inflight"),
        _K.SCORED: ("groups", "pending", "inflight", "free_permits"),
        _K.SCORE_FAIL: (*_DROPS, *_FAILS_RUN, "reissue", "batch_failures_left"),
        _K.DROP: (*_DROPS, "reissue"),
        _K.TRAIN: ("step", "groups", "training"),
        _K.TRAINED: (*_ENDS_STEP, "step", "trained", "trained_twice"),
        _K.EVICT: ("step", "groups", "rows", "shortfall"),
        _K.TRAIN_FAIL: (*_ENDS_STEP, *_FAILS_RUN, "train_failures_left"),
        _K.TRAIN_CANCELLED: _ENDS_STEP,
        _K.CHECKPOINT: ("groups", "cut", "checkpoints_left"),
        _K.CHECKPOINT_SAVED: ("step", "cursor", "groups", "trained", "shortfall", "cut", "writing"),
        _K.FLUSH_TIMEOUT: ("step", "cursor", "groups", "trained", "shortfall", "cut", "writing"),
        _K.CHECKPOINT_WRITTEN: (*_FAILS_RUN, "saved", "writing"),
        _K.STOP: ("phase", "stopped"),
        _K.EXIT: ("phase", "reissue", "groups", "rows"),
        _K.INTERRUPT: ("phase", "cut"),
        _K.ABORT: (*_FAILS_RUN, "aborts_left"),
    }.items()
}
"""The fields of `SchedState` each kind's handler reads or writes (a crash: all of them): the
state after it is the state before with these fields changed, and these fields after depend
on these fields before only. The explorer computes a handler once per value of its fields."""

SNAPSHOT_READS = frozenset({"step", "cursor", "trained", "shortfall", "cut"})
"""What a `Footprint.SNAPSHOT` handler reads of the core besides the groups, of which it reads
`ready_groups` alone; of the core it writes `cut` alone. The explorer computes a snapshot once
per value of these and of `ready_groups`, which far more states share than their groups."""


def footprint(a: Action) -> Footprint:
    """What `transition` reads and writes of a state for `a` (see `Footprint`)."""
    if a.kind is _K.CHECKPOINT_WRITTEN and a.detail == WRITE_FAILED:
        return Footprint.WHOLE  # the run fails: its core changes too
    return _FOOTPRINTS[a.kind]
