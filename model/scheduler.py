"""An abstract model of the whole scheduler: many groups, permits, batches, timers, teachers,
checkpoints, crashes and shutdown, small enough to explore exhaustively.

The lifecycle table says what may happen to one group; the hard bugs live in how many groups
interleave. A `SchedState` is the scheduler at one instant; `enabled` lists what may happen next
and `apply` makes it happen. Every group change goes through `groupflow.model.fire`, so the
explorer also checks that the scheduler only moves groups along the table.

Time is abstract: a flush timer firing is an action that may happen whenever a batch waits. A
state is final when the run has exited (`Phase.DONE`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import attrs

from groupflow.model.lifecycle import Actor, Event, Guard, fire
from groupflow.model.states import GroupState

_S = GroupState


class Design(enum.Enum):
    """Where scoring sits relative to the generation permit."""

    PUMP = "pump"
    """The permit is released at commit; a stage batches groups across rollouts (groupflow's)."""
    INLINE = "inline"
    """Commit awaits scoring of its own group under one lock per teacher, holding its permit."""
    COALESCE = "coalesce"
    """Each rollout commits, joins a per-teacher batch and awaits its result, holding its permit."""

    def __str__(self) -> str:
        return self.value


class FailurePolicy(enum.Enum):
    """What a stage does with the groups of a failed teacher call."""

    RETRY = "retry"
    """Retry each group alone once, then discard it."""
    DISCARD = "discard"
    FAIL = "fail"
    """Fail the run (which then shuts down)."""

    def __str__(self) -> str:
        return self.value


class CheckpointPolicy(enum.Enum):
    """What a checkpoint does with groups still WRITTEN or SCORING."""

    FLUSH = "flush"
    """Wait (bounded) for the stages to finish them, then save them READY."""
    UNCOMMITTED = "uncommitted"
    """Save only READY groups; the prompts of the others are issued again on resume."""
    NAIVE = "naive"
    """The upstream baseline: save READY groups and the data cursor only, with no ledger of
    prompts in flight. Not offered by the implementation; here so the checker can show why."""

    def __str__(self) -> str:
        return self.value


class Phase(enum.IntEnum):
    RUNNING = 0
    SHUTDOWN = 1
    """No new prompts; rollouts and in-flight calls finish; stages drain."""
    DONE = 2
    """Exited: final."""


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _policies(values: Iterable[CheckpointPolicy | str]) -> frozenset[CheckpointPolicy]:
    return frozenset(CheckpointPolicy(v) for v in values)


@attrs.frozen
class Bounds:
    """The parameters of one exploration: sizes, budgets for faults, and the design choices."""

    prompts: int = attrs.field(default=4, validator=_positive)
    """Prompts in the data source."""
    per_step: int = attrs.field(default=2, validator=_positive)
    """Prompts per train step (the in-order sampler trains one step's prompts together)."""
    inflight: int = attrs.field(default=3, validator=_positive)
    """Generation permits (`max_inflight_prompts`)."""
    max_batch: int = attrs.field(default=2, validator=_positive)
    """Groups per teacher call (`max_batch_groups`)."""
    teachers: int = attrs.field(default=1, validator=_positive)
    """Physical teachers; prompt `o` is routed to teacher `o % teachers`."""
    generations: int = attrs.field(default=2, validator=_positive)
    """Rows per group (`num_generations_per_prompt`)."""
    capacity: int = attrs.field(default=4, validator=_positive)
    """Groups the buffer holds at once (`max_buffered_groups`); unready ones count."""
    gate_window: int = attrs.field(default=1, validator=_non_negative)
    """A prompt is admitted at most this many steps ahead of training."""
    crashes: int = attrs.field(default=0, validator=_non_negative)
    checkpoints: int = attrs.field(default=1, validator=_non_negative)
    rollout_failures: int = attrs.field(default=0, validator=_non_negative)
    batch_failures: int = attrs.field(default=0, validator=_non_negative)
    design: Design = attrs.field(default=Design.PUMP, converter=Design)
    flush_timer: bool = True
    """A waiting batch is sent after `flush_after_s` even if not full."""
    demand: bool = False
    """Demand dispatch: send at once when training waits on groups that are all queued here."""
    failure_policy: FailurePolicy = attrs.field(
        default=FailurePolicy.RETRY, converter=FailurePolicy
    )
    checkpoint_policies: frozenset[CheckpointPolicy] = attrs.field(
        default=frozenset({CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED}),
        converter=_policies,
    )
    """Each checkpoint may use any of these; the explorer tries every one."""
    drain_on_shutdown: bool = True
    """At shutdown stages score what is queued; if false they drop it (prompts issued again)."""
    interrupts: bool = True
    """The user may stop the run at any moment (an external event)."""
    allow_unsafe_batch: bool = False
    """Let `max_batch >= inflight` through, as the real config does not."""

    def __attrs_post_init__(self) -> None:
        if self.max_batch >= self.inflight and not self.allow_unsafe_batch:
            raise ValueError(
                f"max_batch={self.max_batch} must be < inflight={self.inflight} "
                f"(max_batch_groups < max_inflight_prompts); pass allow_unsafe_batch=True to "
                f"explore such bounds anyway"
            )

    @property
    def steps(self) -> int:
        return -(-self.prompts // self.per_step)

    def target(self, ordinal: int) -> int:
        return ordinal // self.per_step

    def teacher(self, ordinal: int) -> int:
        return ordinal % self.teachers

    def step_ordinals(self, step: int) -> range:
        return range(step * self.per_step, min((step + 1) * self.per_step, self.prompts))


class Group(NamedTuple):
    ordinal: int
    state: GroupState
    permit: bool
    """The rollout task still holds its generation permit."""
    retries: int = 0


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
    """Per teacher: ordinals queued for a call, in arrival order."""
    inflight: tuple[tuple[tuple[int, ...], ...], ...]
    """Per teacher: the batches whose call is in flight."""
    free_permits: int
    rows: int
    """Bit set of ordinals whose rows are in the store."""
    trained: int
    """Bit set of ordinals trained in the weights the run now has."""
    trained_twice: int
    """Ghost: ordinals a train step consumed although already trained. Must stay 0."""
    shortfall: int
    saved: Saved | None
    cut: tuple[int, ...] | None
    """While a flush checkpoint waits: the groups pending at the cut."""
    crashes_left: int
    checkpoints_left: int
    rollout_failures_left: int
    batch_failures_left: int
    failed: bool
    """The run failed (failure policy `fail`) and is shutting down."""


class Action(NamedTuple):
    """One thing that happens. `kind` names it; the other fields say to what."""

    kind: str
    ordinal: int = -1
    teacher: int = -1
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind}
        if self.ordinal >= 0:
            out["ordinal"] = self.ordinal
        if self.teacher >= 0:
            out["teacher"] = self.teacher
        if self.detail:
            out["detail"] = self.detail
        return out


EXTERNAL_KINDS = frozenset({"crash", "interrupt"})
"""Actions the world does to the run. Liveness must hold without them: the run finishes on its own."""

NOT_PROGRESS_KINDS = EXTERNAL_KINDS | {"checkpoint"}
"""A state where nothing but these can happen is a deadlock: starting a checkpoint moves no group."""


class NotEnabled(ValueError):
    """`apply` was asked for an action that is not enabled in the state."""


def initial_state(b: Bounds) -> SchedState:
    return SchedState(
        phase=Phase.RUNNING,
        step=0,
        cursor=0,
        reissue=(),
        groups=(),
        pending=((),) * b.teachers,
        inflight=((),) * b.teachers,
        free_permits=b.inflight,
        rows=0,
        trained=0,
        trained_twice=0,
        shortfall=0,
        saved=None,
        cut=None,
        crashes_left=b.crashes,
        checkpoints_left=b.checkpoints,
        rollout_failures_left=b.rollout_failures,
        batch_failures_left=b.batch_failures,
        failed=False,
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


def group_of(s: SchedState, ordinal: int) -> Group | None:
    for g in s.groups:
        if g.ordinal == ordinal:
            return g
    return None


def _move(g: Group, event: Event, actor: Actor, guard: Guard = Guard.ALWAYS) -> Group:
    return g._replace(state=fire(f"prompt {g.ordinal}", g.state, event, actor=actor, guard=guard))


def _replace_group(s: SchedState, new: Group) -> tuple[Group, ...]:
    return tuple(new if g.ordinal == new.ordinal else g for g in s.groups)


def _without(s: SchedState, ordinals: set[int] | frozenset[int]) -> tuple[Group, ...]:
    return tuple(g for g in s.groups if g.ordinal not in ordinals)


def _set_at(items: tuple, index: int, value: object) -> tuple:  # type: ignore[type-arg]
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
    ordinals = b.step_ordinals(s.step)
    if s.cursor < ordinals.stop and ordinals:
        return False
    if any(o in ordinals for o in s.reissue):
        return False
    held = {g.ordinal: g.state for g in s.groups}
    for o in ordinals:
        state = held.get(o)
        if state is None:
            if not s.shortfall & _bit(o):
                return False  # neither held nor accounted: it will be issued again
        elif state is not _S.READY:
            return False
    return True


def _demanded(s: SchedState, b: Bounds, teacher: int) -> bool:
    """Training waits on the current step, every group it still lacks is queued at the stage
    (at any teacher: judging per teacher deadlocks when a step spans teachers), and `teacher`
    holds one of them."""
    ordinals = b.step_ordinals(s.step)
    if s.cursor < ordinals.stop or any(o in ordinals for o in s.reissue):
        return False
    lacking = {g.ordinal for g in s.groups if g.ordinal in ordinals and g.state is not _S.READY}
    queued = {o for q in s.pending for o in q}
    return bool(lacking) and lacking <= queued and bool(lacking & set(s.pending[teacher]))


def dispatch_reason(s: SchedState, b: Bounds, teacher: int) -> str | None:
    """Why a batch may be sent to `teacher` now, or None if it must wait."""
    queue = s.pending[teacher]
    if not queue or s.inflight[teacher]:
        return None
    if b.design is Design.INLINE:
        return "lock free"
    if len(queue) >= b.max_batch:
        return "full"
    if s.phase is Phase.SHUTDOWN and b.drain_on_shutdown:
        return "shutdown drain"
    if producer_ended(s, b):
        return "drain"
    if s.cut is not None and any(o in s.cut for o in queue):
        return "checkpoint flush"
    if b.demand and _demanded(s, b, teacher):
        return "demand"
    if b.flush_timer:
        return "timer"
    return None


def _batch(s: SchedState, b: Bounds, teacher: int) -> tuple[int, ...]:
    queue = s.pending[teacher]
    head = group_of(s, queue[0])
    if b.design is Design.INLINE or (head is not None and head.retries):
        return queue[:1]  # inline: one group per call; a retried group goes alone
    size = b.max_batch
    return tuple(o for o in queue[:size] if (g := group_of(s, o)) is not None and not g.retries)


def _ledger(s: SchedState, b: Bounds) -> Saved:
    """The checkpoint of the state as it is now (READY groups saved, the rest re-issued)."""
    ready = tuple(g.ordinal for g in s.groups if g.state is _S.READY)
    accounted = s.trained | s.shortfall
    for o in ready:
        accounted |= _bit(o)
    reissue = tuple(o for o in range(s.cursor) if not accounted & _bit(o))
    return Saved(s.step, s.cursor, s.trained, s.shortfall, ready, reissue)


def _save(s: SchedState, b: Bounds, policy: CheckpointPolicy) -> SchedState:
    saved = _ledger(s, b)
    if policy is CheckpointPolicy.NAIVE:
        saved = saved._replace(reissue=())  # the upstream bug: in-flight prompts count as used
    return s._replace(saved=saved, cut=None, checkpoints_left=s.checkpoints_left - 1)


def _restore(s: SchedState, b: Bounds) -> SchedState:
    """A crash: everything in memory is gone; the run resumes from the last checkpoint."""
    fresh = initial_state(b)
    if s.saved is None:
        return fresh._replace(
            crashes_left=s.crashes_left - 1,
            checkpoints_left=s.checkpoints_left,
            rollout_failures_left=s.rollout_failures_left,
            batch_failures_left=s.batch_failures_left,
        )
    saved = s.saved
    groups = tuple(
        Group(o, fire(f"prompt {o}", None, Event.RESTORE, actor=Actor.CHECKPOINT), permit=False)
        for o in saved.ready
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
        crashes_left=s.crashes_left - 1,
        checkpoints_left=s.checkpoints_left,
        rollout_failures_left=s.rollout_failures_left,
        batch_failures_left=s.batch_failures_left,
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
        running
        and s.cut is None
        and nxt is not None
        and s.free_permits > 0
        and len(s.groups) < b.capacity
        and b.target(nxt) <= s.step + b.gate_window
    ):
        out.append(Action("admit", nxt))
    for g in s.groups:
        if g.state is _S.RESERVED:
            out.append(Action("commit", g.ordinal))
            if s.rollout_failures_left:
                out.append(Action("rollout_fail", g.ordinal))
            if not running:
                out.append(Action("cancel", g.ordinal))
    for t in range(b.teachers):
        reason = dispatch_reason(s, b, t)
        if reason is not None:
            out.append(Action("dispatch", teacher=t, detail=reason))
        if s.inflight[t]:
            out.append(Action("scored", teacher=t))
            if s.batch_failures_left:
                out.append(Action("score_fail", teacher=t))
    if not running and not b.drain_on_shutdown and any(s.pending):
        out.append(Action("drop_pending"))
    if running and s.cut is None and s.step < b.steps and _step_resolved(s, b):
        out.append(Action("train", detail=f"step {s.step}"))
    if running and s.cut is None and s.checkpoints_left:
        for policy in sorted(b.checkpoint_policies, key=lambda p: p.value):
            out.append(Action("checkpoint", detail=policy.value))
    if s.cut is not None:
        pending = {g.ordinal for g in s.groups if g.state in (_S.WRITTEN, _S.SCORING)}
        if pending.isdisjoint(s.cut):
            out.append(Action("checkpoint_saved"))
        out.append(Action("flush_timeout"))
    if not running and not any(g.state in (_S.RESERVED, _S.WRITTEN, _S.SCORING) for g in s.groups):
        out.append(Action("exit"))
    if running and b.interrupts:
        out.append(Action("interrupt"))
    if s.crashes_left:
        out.append(Action("crash"))
    return out


def transition(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The state after `a`, for an action `enabled` returned (not checked again: see `apply`).
    Raises `IllegalTransition` if the action would move a group against the lifecycle table."""
    return _HANDLERS[a.kind](s, b, a)


def apply(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The state after `a`. Raises `NotEnabled` if `a` may not happen in `s` (a replayed trace
    that no longer fits the model)."""
    if a not in enabled(s, b):
        raise NotEnabled(f"{describe(a, b)} is not enabled in: {summarize(s, b)}")
    return transition(s, b, a)


def _admit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    o = a.ordinal
    g = Group(o, fire(f"prompt {o}", None, Event.RESERVE, actor=Actor.ROLLOUT), permit=True)
    groups = tuple(sorted((*s.groups, g), key=lambda x: x.ordinal))
    if s.reissue and s.reissue[0] == o:
        return s._replace(groups=groups, reissue=s.reissue[1:], free_permits=s.free_permits - 1)
    return s._replace(groups=groups, cursor=s.cursor + 1, free_permits=s.free_permits - 1)


def _commit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    g = group_of(s, a.ordinal)
    assert g is not None
    g = _move(g, Event.COMMIT, Actor.ROLLOUT, Guard.PENDING)
    free = s.free_permits
    if b.design is Design.PUMP:
        g = g._replace(permit=False)
        free += 1
    t = b.teacher(g.ordinal)
    return s._replace(
        groups=_replace_group(s, g),
        pending=_set_at(s.pending, t, s.pending[t] + (g.ordinal,)),
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
    return s._replace(groups=_without(s, {g.ordinal}), free_permits=s.free_permits + g.permit)


def _dispatch(s: SchedState, b: Bounds, a: Action) -> SchedState:
    t = a.teacher
    batch = _batch(s, b, t)
    groups = s.groups
    for o in batch:
        g = group_of(s._replace(groups=groups), o)
        assert g is not None
        groups = tuple(
            _move(x, Event.TAKE_BATCH, Actor.STAGE) if x.ordinal == o else x for x in groups
        )
    queue = tuple(o for o in s.pending[t] if o not in batch)
    return s._replace(
        groups=groups,
        pending=_set_at(s.pending, t, queue),
        inflight=_set_at(s.inflight, t, s.inflight[t] + (batch,)),
    )


def _finish_batch(s: SchedState, b: Bounds, t: int) -> tuple[SchedState, tuple[int, ...]]:
    batch = s.inflight[t][0]
    return s._replace(inflight=_set_at(s.inflight, t, s.inflight[t][1:])), batch


def _scored(s: SchedState, b: Bounds, a: Action) -> SchedState:
    s, batch = _finish_batch(s, b, a.teacher)
    members = set(batch)
    groups = tuple(
        _move(g, Event.SCORED, Actor.STAGE, Guard.COMPLETE) if g.ordinal in members else g
        for g in s.groups
    )
    groups, freed = _release_permits(groups, members)  # inline and coalesce: the rollouts return
    return s._replace(groups=groups, free_permits=s.free_permits + freed)


def _drop(s: SchedState, ordinals: set[int], actor: Actor, *, give_up: bool) -> SchedState:
    """Discard groups that are WRITTEN or SCORING: rows cleared, permits returned."""
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
    return s._replace(
        groups=_without(s, ordinals),
        free_permits=s.free_permits + freed,
        rows=rows,
        shortfall=shortfall,
    )


def _score_fail(s: SchedState, b: Bounds, a: Action) -> SchedState:
    t = a.teacher
    s, batch = _finish_batch(s, b, t)
    s = s._replace(batch_failures_left=s.batch_failures_left - 1)
    if b.failure_policy is FailurePolicy.FAIL:
        s = _drop(s, set(batch), Actor.STAGE, give_up=False)
        return s._replace(phase=Phase.SHUTDOWN, failed=True, cut=None)
    again: list[int] = []
    if b.failure_policy is FailurePolicy.RETRY:
        again = [o for o in batch if (g := group_of(s, o)) is not None and not g.retries]
    groups = s.groups
    for o in again:
        groups = tuple(
            _move(g, Event.RETRY, Actor.STAGE)._replace(retries=g.retries + 1)
            if g.ordinal == o
            else g
            for g in groups
        )
    s = s._replace(groups=groups, pending=_set_at(s.pending, t, tuple(again) + s.pending[t]))
    return _drop(s, set(batch) - set(again), Actor.STAGE, give_up=True)


def _drop_pending(s: SchedState, b: Bounds, a: Action) -> SchedState:
    queued = {o for queue in s.pending for o in queue}
    s = _drop(s, queued, Actor.SUPERVISOR, give_up=False)
    return s._replace(pending=((),) * b.teachers)


def _train(s: SchedState, b: Bounds, a: Action) -> SchedState:
    ordinals = set(b.step_ordinals(s.step))
    consumed = {g.ordinal for g in s.groups if g.ordinal in ordinals}
    for g in s.groups:
        if g.ordinal in consumed:
            _move(g, Event.SELECT, Actor.TRAIN)
    bits = 0
    for o in consumed:
        bits |= _bit(o)
    step = s.step + 1
    return s._replace(
        groups=_without(s, consumed),
        rows=s.rows & ~bits,
        trained=s.trained | bits,
        trained_twice=s.trained_twice | (s.trained & bits),
        step=step,
        phase=Phase.SHUTDOWN if step == b.steps else s.phase,
    )


def _checkpoint(s: SchedState, b: Bounds, a: Action) -> SchedState:
    policy = CheckpointPolicy(a.detail)
    if policy is CheckpointPolicy.FLUSH:
        cut = tuple(g.ordinal for g in s.groups if g.state in (_S.WRITTEN, _S.SCORING))
        if cut:
            return s._replace(cut=cut)
    return _save(s, b, policy)


def _checkpoint_saved(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _save(s, b, CheckpointPolicy.FLUSH)


def _flush_timeout(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _save(s, b, CheckpointPolicy.UNCOMMITTED)


def _exit(s: SchedState, b: Bounds, a: Action) -> SchedState:
    """The last checkpoint saves the READY groups with their rows; then the store is cleared."""
    saved = _ledger(s, b)
    return s._replace(phase=Phase.DONE, saved=saved, rows=0, groups=(), cut=None)


def _interrupt(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return s._replace(phase=Phase.SHUTDOWN, cut=None)


def _crash(s: SchedState, b: Bounds, a: Action) -> SchedState:
    return _restore(s, b)


_HANDLERS = {
    "admit": _admit,
    "commit": _commit,
    "rollout_fail": _rollout_fail,
    "cancel": _cancel,
    "dispatch": _dispatch,
    "scored": _scored,
    "score_fail": _score_fail,
    "drop_pending": _drop_pending,
    "train": _train,
    "checkpoint": _checkpoint,
    "checkpoint_saved": _checkpoint_saved,
    "flush_timeout": _flush_timeout,
    "exit": _exit,
    "interrupt": _interrupt,
    "crash": _crash,
}


# -- words ----------------------------------------------------------------------------------


def describe(a: Action, b: Bounds) -> str:
    """One action in words a user can follow."""
    o, t = a.ordinal, a.teacher
    if a.kind == "admit":
        return f"admit prompt {o} for step {b.target(o)} (teacher {b.teacher(o)})"
    if a.kind == "commit":
        return f"rollout of prompt {o} finishes: commit, queue at teacher {b.teacher(o)}"
    if a.kind == "rollout_fail":
        return f"rollout of prompt {o} fails: group discarded, prompt given up"
    if a.kind == "cancel":
        return f"rollout of prompt {o} cancelled by shutdown"
    if a.kind == "dispatch":
        return f"teacher {t}: send a batch ({a.detail})"
    if a.kind == "scored":
        return f"teacher {t}: call returns, its groups scored"
    if a.kind == "score_fail":
        return f"teacher {t}: call fails ({b.failure_policy} policy)"
    if a.kind == "drop_pending":
        return "shutdown drops the queued groups (prompts issued again on resume)"
    if a.kind == "train":
        return f"train {a.detail}"
    if a.kind == "checkpoint":
        return f"checkpoint ({a.detail})"
    if a.kind == "checkpoint_saved":
        return "flush done: checkpoint saved"
    if a.kind == "flush_timeout":
        return "flush timed out: checkpoint saved without the pending groups"
    if a.kind == "exit":
        return "run exits: last checkpoint saved, store cleared"
    if a.kind == "interrupt":
        return "user stops the run: shutdown"
    if a.kind == "crash":
        return "crash: restart from the last checkpoint"
    return a.kind  # pragma: no cover


def summarize(s: SchedState, b: Bounds) -> str:
    """The state in one line: phase, step, permits, each group, each teacher's queue."""
    groups = (
        " ".join(
            f"p{g.ordinal}:{g.state.value}{'*' if g.permit else ''}{'r' if g.retries else ''}"
            for g in s.groups
        )
        or "-"
    )
    teachers = " ".join(
        f"t{t}[queued {list(s.pending[t])} in flight {[list(x) for x in s.inflight[t]]}]"
        for t in range(b.teachers)
    )
    extra = []
    if s.reissue:
        extra.append(f"reissue {list(s.reissue)}")
    if s.cut is not None:
        extra.append(f"flushing {list(s.cut)}")
    return (
        f"{s.phase.name.lower()} step {s.step}/{b.steps}, next prompt "
        f"{next_prompt(s, b)}, permits free {s.free_permits}/{b.inflight}, held "
        f"{len(s.groups)}/{b.capacity} | {groups} | {teachers}"
        + ("" if not extra else " | " + ", ".join(extra))
    )
