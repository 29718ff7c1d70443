"""The group lifecycle as data: the transition table and the one function that applies it.

Every state change in groupflow, in production as in tests, goes through `fire`, so an illegal
move raises at the spot where it was attempted instead of surfacing later as a lost or
double-trained prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from groupflow.model.enums import ValueEnum
from groupflow.model.errors import IllegalTransition as IllegalTransition
from groupflow.model.states import GroupState


class Event(ValueEnum):
    """Something that happens to a group."""

    RESERVE = "reserve"
    COMMIT = "commit"
    ROLLOUT_FAILED = "rollout_failed"
    TAKE_BATCH = "take_batch"
    SCORED = "scored"
    RETRY = "retry"
    DROP = "drop"
    SELECT = "select"
    EVICT = "evict"
    RESTORE = "restore"


class Actor(ValueEnum):
    """The part of the system that fires an event; the table says who may fire what."""

    ROLLOUT = "rollout"
    STAGE = "stage"
    TRAIN = "train"
    SUPERVISOR = "supervisor"
    CHECKPOINT = "checkpoint"


class Guard(ValueEnum):
    """Which of an event's rows applies, decided by the group's field set."""

    ALWAYS = "always"
    COMPLETE = "complete"
    """Every field training needs is present and no stage still has to mark the group."""
    PENDING = "pending"
    """Some stage still has to add fields or mark the group."""


@attrs.frozen
class Transition:
    """One row of the lifecycle table."""

    source: GroupState | None
    """None for the events that create a group."""
    event: Event
    target: GroupState
    actors: frozenset[Actor]
    guard: Guard = Guard.ALWAYS
    effect: str = ""
    """The side effect the implementation owes when it fires this row, in words."""


def _row(
    source: GroupState | None,
    event: Event,
    target: GroupState,
    actors: Iterable[Actor],
    effect: str,
    guard: Guard = Guard.ALWAYS,
) -> Transition:
    return Transition(source, event, target, frozenset(actors), guard, effect)


_S = GroupState
_A = Actor
TRANSITIONS: tuple[Transition, ...] = (
    _row(None, Event.RESERVE, _S.RESERVED, [_A.ROLLOUT], "capacity counted"),
    _row(_S.RESERVED, Event.COMMIT, _S.READY, [_A.ROLLOUT], "rows written first", Guard.COMPLETE),
    _row(
        _S.RESERVED,
        Event.COMMIT,
        _S.WRITTEN,
        [_A.ROLLOUT],
        "rows written first; generation permit released",
        Guard.PENDING,
    ),
    _row(_S.RESERVED, Event.ROLLOUT_FAILED, _S.DISCARDED, [_A.ROLLOUT], "partial rows cleared"),
    _row(_S.WRITTEN, Event.TAKE_BATCH, _S.SCORING, [_A.STAGE], ""),
    _row(_S.SCORING, Event.SCORED, _S.READY, [_A.STAGE], "new fields recorded", Guard.COMPLETE),
    _row(_S.SCORING, Event.SCORED, _S.WRITTEN, [_A.STAGE], "new fields recorded", Guard.PENDING),
    _row(_S.SCORING, Event.RETRY, _S.WRITTEN, [_A.STAGE], "retry count kept"),
    _row(
        _S.WRITTEN,
        Event.DROP,
        _S.DISCARDED,
        [_A.STAGE, _A.SUPERVISOR, _A.CHECKPOINT],
        "rows cleared",
    ),
    _row(
        _S.SCORING,
        Event.DROP,
        _S.DISCARDED,
        [_A.STAGE, _A.SUPERVISOR, _A.CHECKPOINT],
        "rows cleared after in-flight readers finished",
    ),
    _row(_S.READY, Event.SELECT, _S.CONSUMED, [_A.TRAIN], "rows cleared after the step"),
    _row(_S.READY, Event.EVICT, _S.DISCARDED, [_A.TRAIN], "rows cleared"),
    _row(_S.READY, Event.DROP, _S.DISCARDED, [_A.SUPERVISOR], "rows cleared at the run's exit"),
    _row(None, Event.RESTORE, _S.READY, [_A.CHECKPOINT], "rows written from the checkpoint"),
)
"""The whole lifecycle. CONSUMED and DISCARDED have no outgoing rows: they are terminal."""


def _index(
    rows: Iterable[Transition],
) -> Mapping[tuple[GroupState | None, Event], tuple[Transition, ...]]:
    index: dict[tuple[GroupState | None, Event], list[Transition]] = {}
    for row in rows:
        index.setdefault((row.source, row.event), []).append(row)
    return {key: tuple(value) for key, value in index.items()}


_BY_SOURCE_EVENT = _index(TRANSITIONS)


def transitions_from(state: GroupState | None) -> tuple[Transition, ...]:
    """The table's rows that start in `state` (None: the rows that create a group)."""
    return tuple(row for row in TRANSITIONS if row.source == state)


def _state_name(state: GroupState | None) -> str:
    return "(new)" if state is None else str(state)


def fire(
    group_id: str,
    state: GroupState | None,
    event: Event,
    *,
    actor: Actor,
    guard: Guard = Guard.ALWAYS,
) -> GroupState:
    """Apply `event` to a group in `state` and return its new state.

    `guard` (from `readiness`) chooses between an event's COMPLETE and PENDING rows; it must be
    given for those events and is ignored by the others. Raises `IllegalTransition` when no row
    allows the move or when `actor` may not fire it.
    """
    target = _FAST.get((state, event, actor, guard))
    if target is not None:
        return target
    rows = _BY_SOURCE_EVENT.get((state, event), ())
    if not rows:
        allowed = sorted({str(row.event) for row in transitions_from(state)})
        hint = ", ".join(allowed) if allowed else "none: the state is terminal"
        raise IllegalTransition(
            f"group {group_id!r} is {_state_name(state)}: event '{event}' is not allowed there "
            f"(allowed: {hint})",
            group_id=group_id,
            state=state,
            event=event,
            actor=actor,
        )
    row = next((r for r in rows if r.guard in (Guard.ALWAYS, guard)), None)
    if row is None:
        raise TypeError(
            f"event '{event}' from {_state_name(state)} depends on readiness: pass "
            f"guard=Guard.COMPLETE or guard=Guard.PENDING (got {guard})"
        )
    if actor not in row.actors:
        who = ", ".join(sorted(str(a) for a in row.actors))
        raise IllegalTransition(
            f"group {group_id!r} is {_state_name(state)}: {actor} may not fire event "
            f"'{event}' (only {who} may)",
            group_id=group_id,
            state=state,
            event=event,
            actor=actor,
        )
    _FAST[(state, event, actor, guard)] = row.target
    return row.target


_FAST: dict[tuple[GroupState | None, Event, Actor, Guard], GroupState] = {}
"""Moves `fire` has allowed before: the table is fixed, so a legal move stays legal (the
explorer fires millions)."""
