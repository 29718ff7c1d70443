"""When each action of the abstract scheduler may happen: the conditions over a state
(training may start, a stage drains, a batch is demanded), the reasons a batch may be sent,
and `enabled`, every action that may happen next, in a fixed order.

What each action then does is in `groupflow.model.scheduler.transitions`.
"""

from __future__ import annotations

import functools

from groupflow.model import decisions
from groupflow.model.policy import DispatchReason, Sampler
from groupflow.model.scheduler.actions import (
    PERMANENT_FAILURE,
    WRITE_FAILED,
    Action,
    ActionKind,
)
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.state import (
    PENDING,
    UNREADY,
    Group,
    Phase,
    SchedState,
    _Bits,
    group_of,
    next_prompt,
    producer_ended,
)
from groupflow.model.states import GroupState

__all__ = ["BUDGET_OF", "dispatch_reasons", "enabled", "is_enabled"]

_S = GroupState
_K = ActionKind

BUDGET_OF: dict[ActionKind, str] = {
    _K.ROLLOUT_FAIL: "rollout_failures_left",
    _K.SCORE_FAIL: "batch_failures_left",
    _K.TRAIN_FAIL: "train_failures_left",
    _K.CHECKPOINT: "checkpoints_left",
    _K.ABORT: "aborts_left",
    _K.CRASH: "crashes_left",
}
"""The fault budget (`BUDGET_FIELDS`) each of these kinds spends. `enabled` offers such an
action only while its budget is left, and reads the budgets for nothing else: the explorer
lists the actions of a state once with every budget left, and drops those whose budget is
spent in each state that differs only there."""


# Enum members read in every state the explorer visits, bound once: on Python 3.11 reading
# `Enum.MEMBER` goes through `EnumType.__getattr__`, several times slower than a global.
_RESERVED, _READY, _CONSUMED = _S.RESERVED, _S.READY, _S.CONSUMED
_RUNNING, _SHUTDOWN, _DONE = Phase.RUNNING, Phase.SHUTDOWN, Phase.DONE
_WINDOWED = Sampler.WINDOWED
_ADMIT, _COMMIT, _ROLLOUT_FAIL, _CANCEL, _DROP = (
    _K.ADMIT,
    _K.COMMIT,
    _K.ROLLOUT_FAIL,
    _K.CANCEL,
    _K.DROP,
)
_DISPATCH, _SCORED, _SCORE_FAIL = _K.DISPATCH, _K.SCORED, _K.SCORE_FAIL
_TRAIN, _TRAINED, _TRAIN_FAIL, _TRAIN_CANCELLED = (
    _K.TRAIN,
    _K.TRAINED,
    _K.TRAIN_FAIL,
    _K.TRAIN_CANCELLED,
)


# -- conditions over a state ----------------------------------------------------------------


def _step_resolved(s: SchedState, b: Bounds) -> bool:
    """Every prompt of the current step has been issued and ended READY or given up on."""
    ready = {g.ordinal for g in s.groups if g.state is _READY}
    missing = decisions.step_missing(
        b.step_ordinals(s.step), ready=ready, given_up=_Bits(s.shortfall) if s.shortfall else ()
    )
    return not missing


def _windowed(b: Bounds) -> bool:
    return b.sampler is _WINDOWED


def _stale(g: Group, s: SchedState, b: Bounds) -> bool:
    return decisions.too_stale(
        weight_version=s.step, start_version=g.version, max_staleness=b.max_staleness
    )


def _selectable(s: SchedState, b: Bounds) -> list[Group]:
    """READY groups the windowed sampler may train now, oldest weight version first."""
    ready = [g for g in s.groups if g.state is _READY and not _stale(g, s, b)]
    return sorted(ready, key=lambda g: (g.version, g.ordinal))


def _may_train(s: SchedState, b: Bounds) -> bool:
    if s.step >= b.steps:
        return False
    if b.sampler is not _WINDOWED:
        return _step_resolved(s, b)
    selectable = len(_selectable(s, b))
    if selectable >= b.shape.prompts_per_step:
        return True
    nothing_coming = producer_ended(s, b) and not any(g.state in UNREADY for g in s.groups)
    return selectable > 0 and nothing_coming


def _steps_ahead(s: SchedState, b: Bounds, ordinal: int) -> int:
    """How far ahead of training admitting `ordinal` runs, in train steps. In order: its
    target step's distance. Windowed: the groups in flight (held, not yet trained), in steps;
    a gate on target steps would deadlock the windowed sampler once a step's prompts are given
    up (`groupflow check` found it)."""
    if b.sampler is not _WINDOWED:
        return b.target(ordinal) - s.step
    return sum(1 for g in s.groups if g.state is not _CONSUMED) // b.shape.prompts_per_step


def _may_stop(s: SchedState, b: Bounds) -> bool:
    """Training has run its steps, or (windowed) the data ran out and nothing is left to train.
    The windowed sampler evicts stale groups first: stopping with one READY would end the run
    with its prompt neither trained nor given up (`groupflow check` found this)."""
    if b.sampler is _WINDOWED and any(g.state is _READY and _stale(g, s, b) for g in s.groups):
        return False
    if s.step >= b.steps:
        return True
    return (
        b.sampler is _WINDOWED
        and producer_ended(s, b)
        and not any(g.state in UNREADY for g in s.groups)
        and not _selectable(s, b)
    )


def _training_waits(s: SchedState, b: Bounds) -> bool:
    """Training waits on the groups of its step (in order only: the windowed sampler takes
    whatever is READY, so no step's groups are awaited in particular)."""
    return (
        b.sampler is not _WINDOWED
        and s.phase is _RUNNING
        and s.cut is None
        and s.writing is None
        and s.step < b.steps
        and not _step_resolved(s, b)
    )


def _draining(s: SchedState, b: Bounds, stage: int) -> bool:
    """Nothing more will reach this stage: producers ended and no group is at an earlier
    stage, or the run shuts down and stages drain."""
    if s.phase is _SHUTDOWN and b.drain_on_shutdown and not s.failed:
        return True
    if not producer_ended(s, b):
        return False
    return not any(g.state in PENDING and g.stage < stage for g in s.groups)


def _demanded(s: SchedState, b: Bounds, lane: int) -> bool:
    """Demand dispatch for `lane` (see `decisions.demand_dispatch`)."""
    if not _training_waits(s, b):
        return False
    stage = b.stage_of_lane(lane)
    ordinals = b.step_ordinals(s.step)
    upstream = any(
        g.ordinal in ordinals and (g.state is _RESERVED or (g.state in PENDING and g.stage < stage))
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
    if s.phase is _DONE:
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
        max_batch_groups=b.shape.max_batch_groups,
        draining=_draining(s, b, b.stage_of_lane(lane)),
        flush_requested=s.cut is not None and any(o in s.cut.ordinals for o in queue),
        demanded=b.demand and _demanded(s, b, lane),
        timer_expired=b.flush_timer,
    )


# -- what may happen ------------------------------------------------------------------------

_EVICT = Action(_K.EVICT)
_STOP = Action(_K.STOP)
_SAVED = Action(_K.CHECKPOINT_SAVED)
_FLUSH_TIMEOUT = Action(_K.FLUSH_TIMEOUT)
_WRITTEN = Action(_K.CHECKPOINT_WRITTEN)
_EXIT = Action(_K.EXIT)
_INTERRUPT = Action(_K.INTERRUPT)
_ABORT = Action(_K.ABORT)
_CRASH = Action(_K.CRASH)


@functools.lru_cache(maxsize=1024)
def _step_action(kind: ActionKind, step: int) -> Action:
    """An action of the train step `step`: built once, as `enabled` offers them in most states."""
    return Action(kind, detail=f"step {step}")


_action = functools.lru_cache(maxsize=8192)(Action)
"""`Action(kind, ordinal, lane, detail)`, each built once: `enabled` offers the same actions
in most states (positional arguments only, so that one action has one key)."""


@functools.lru_cache(maxsize=256)
def _checkpoint_actions(b: Bounds) -> tuple[Action, ...]:
    return tuple(Action(_K.CHECKPOINT, detail=policy) for policy in sorted(b.checkpoint_policies))


def enabled(s: SchedState, b: Bounds) -> list[Action]:
    """Every action that may happen next, in a fixed order (so traces are reproducible).

    Of the checkpoints it reads only whether one is being written, and of the budgets only
    which are left, each to offer the kinds it gates (`BUDGET_OF`)."""
    if s.phase is _DONE:
        return []
    out: list[Action] = []
    running = s.phase is _RUNNING
    nxt = next_prompt(s, b)
    if (
        nxt is not None
        and decisions.admission(
            running=running,
            free_permits=s.free_permits,
            held_groups=len(s.groups),
            max_buffered_groups=b.shape.max_buffered_groups,
            steps_ahead=_steps_ahead(s, b, nxt),
            gate_window=b.shape.gate_window,
        )
        is None
    ):
        out.append(_action(_ADMIT, nxt))
    for g in s.groups:
        if g.state is _RESERVED:
            out.append(_action(_COMMIT, g.ordinal))
            if s.rollout_failures_left and decisions.failure_is_judged(run_failed=s.failed):
                out.append(_action(_ROLLOUT_FAIL, g.ordinal))
            if not running:
                out.append(_action(_CANCEL, g.ordinal))
        elif not running and g.state in PENDING and (s.failed or not b.drain_on_shutdown):
            out.append(_action(_DROP, g.ordinal))
    pending, inflight = s.pending, s.inflight
    for lane in range(len(pending)):
        queue, flying = pending[lane], inflight[lane]
        if queue and not flying:
            reasons = dispatch_reasons(s, b, lane)
            if reasons:
                out.append(_action(_DISPATCH, -1, lane, reasons[0]))
        if flying:
            out.append(_action(_SCORED, -1, lane))
            # a call is judged when it fails; its cleanup awaits the store, so its report may
            # come after the run failed meanwhile (unlike a rollout's, made in one block)
            if s.batch_failures_left:
                out.append(_action(_SCORE_FAIL, -1, lane))
                if b.permanent_failures and decisions.permanence_matters(b.failure_policy):
                    out.append(_action(_SCORE_FAIL, -1, lane, PERMANENT_FAILURE))
    if s.training:
        if s.failed:
            out.append(_step_action(_TRAIN_CANCELLED, s.step))
        else:
            out.append(_step_action(_TRAINED, s.step))
            if s.train_failures_left:
                out.append(_step_action(_TRAIN_FAIL, s.step))
    elif running and s.cut is None and s.writing is None:
        if _may_train(s, b):
            out.append(_step_action(_TRAIN, s.step))
        if b.sampler is _WINDOWED and any(g.state is _READY and _stale(g, s, b) for g in s.groups):
            out.append(_EVICT)
        if _may_stop(s, b):
            out.append(_STOP)
        if s.checkpoints_left:
            out += _checkpoint_actions(b)
    if s.cut is not None:
        cut = s.cut.ordinals
        if not cut:
            out.append(_SAVED)
        else:
            if not any(g.ordinal in cut and g.state in PENDING for g in s.groups):
                out.append(_SAVED)
            out.append(_FLUSH_TIMEOUT)
    if s.writing is not None:
        out.append(_WRITTEN)
    elif not running and not s.training and not any(g.state in UNREADY for g in s.groups):
        out.append(_EXIT)
    if running and b.interrupts and s.step < b.steps:
        out.append(_INTERRUPT)  # a run that has trained its steps stops by itself
    if s.aborts_left and not s.failed:
        out.append(_ABORT)
    if s.crashes_left:
        out.append(_CRASH)
    return out


def is_enabled(s: SchedState, b: Bounds, a: Action) -> bool:
    """Whether `a` may happen in `s`. A dispatch may name any reason that holds (the
    pipeline learns some facts, such as upstream having ended, a moment late)."""
    if a.kind == _K.DISPATCH:
        return 0 <= a.lane < b.lanes and a.detail in dispatch_reasons(s, b, a.lane)
    if a.kind == _K.CHECKPOINT_WRITTEN and a.detail == WRITE_FAILED:
        return s.writing is not None  # not explored (see WRITE_FAILED), but a run may say it
    return a in enabled(s, b)
