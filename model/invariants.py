"""What must hold of a whole buffer at every moment, as plain functions over a snapshot.

The implementation can call these in debug runs; the property suites call them after every step.
Each check returns the violations it found rather than stopping at the first, so one failing
example shows everything that went wrong at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from groupflow.model.errors import InvariantViolation as InvariantViolation
from groupflow.model.readiness import missing_fields
from groupflow.model.states import GroupState

_ROW_OWNING_STATES = frozenset(
    {GroupState.WRITTEN, GroupState.SCORING, GroupState.READY, GroupState.CONSUMED}
)


@attrs.frozen
class GroupView:
    """One group as the buffer holds it at the moment of a snapshot."""

    group_id: str
    state: GroupState
    target_step: int
    sample_ids: tuple[str, ...] = ()
    fields: frozenset[str] = frozenset()
    awaiting_stage: bool = False
    """A stage still has to mark this group (the commit deferred readiness)."""
    start_weight_version: int | None = None
    end_weight_version: int | None = None
    ordinal: int | None = None
    agent: str | None = None


@attrs.frozen
class BufferSnapshot:
    """A buffer's groups, the store's row ids and the buffer's own counters, taken at one instant."""

    groups: tuple[GroupView, ...]
    store_ids: frozenset[str]
    counts: Mapping[GroupState, int]
    """The buffer's own per-state counters, which must agree with a recount of `groups`."""
    capacity: int
    group_size: int
    required_fields: frozenset[str]


@attrs.frozen
class Violation:
    """One broken invariant, with the evidence in words."""

    invariant: str
    message: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


_STATES = tuple(GroupState)
"""Every state, listed once: iterating the enum itself builds the list again each time."""


def one_state_per_group(snapshot: BufferSnapshot) -> list[Violation]:
    """Each group appears once, so it is in exactly one state."""
    seen: dict[str, int] = {}
    for g in snapshot.groups:
        seen[g.group_id] = seen.get(g.group_id, 0) + 1
    return [
        Violation("one_state_per_group", f"group {gid!r} appears {n} times")
        for gid, n in sorted(seen.items())
        if n > 1
    ]


def ready_has_required_fields(snapshot: BufferSnapshot) -> list[Violation]:
    """A READY group has every field training needs and no stage still owes it a mark."""
    out = []
    for g in snapshot.groups:
        if g.state is not GroupState.READY:
            continue
        missing = missing_fields(g.fields, snapshot.required_fields)
        if missing:
            out.append(
                Violation(
                    "ready_has_required_fields",
                    f"group {g.group_id!r} is READY but lacks {sorted(missing)}",
                )
            )
        if g.awaiting_stage:
            out.append(
                Violation(
                    "ready_has_required_fields",
                    f"group {g.group_id!r} is READY while a stage still has to mark it",
                )
            )
    return out


def rows_match_groups(snapshot: BufferSnapshot) -> list[Violation]:
    """Groups with rows own exactly `group_size` of them in the store, and no other row exists."""
    out = []
    owner: dict[str, str] = {}
    for g in snapshot.groups:
        if g.state not in _ROW_OWNING_STATES:
            if g.sample_ids and g.state is GroupState.RESERVED:
                out.append(
                    Violation(
                        "rows_match_groups",
                        f"group {g.group_id!r} is RESERVED but records rows {list(g.sample_ids)}",
                    )
                )
            continue
        if len(g.sample_ids) != snapshot.group_size:
            out.append(
                Violation(
                    "rows_match_groups",
                    f"group {g.group_id!r} ({g.state}) has {len(g.sample_ids)} rows, "
                    f"expected group_size={snapshot.group_size}",
                )
            )
        absent = [sid for sid in g.sample_ids if sid not in snapshot.store_ids]
        if absent:
            out.append(
                Violation(
                    "rows_match_groups",
                    f"group {g.group_id!r} ({g.state}) owns rows missing from the store: {absent}",
                )
            )
        for sid in g.sample_ids:
            if sid in owner:
                out.append(
                    Violation(
                        "rows_match_groups",
                        f"row {sid!r} is owned by both {owner[sid]!r} and {g.group_id!r}",
                    )
                )
            owner[sid] = g.group_id
    orphans = sorted(snapshot.store_ids - owner.keys())
    if orphans:
        out.append(
            Violation("rows_match_groups", f"rows in the store that no live group owns: {orphans}")
        )
    return out


def counts_consistent(snapshot: BufferSnapshot) -> list[Violation]:
    """The buffer's per-state counters agree with a recount of its groups."""
    recount: dict[GroupState, int] = {}
    for g in snapshot.groups:
        recount[g.state] = recount.get(g.state, 0) + 1
    out = []
    for state in _STATES:
        held = snapshot.counts.get(state, 0)
        if held != recount.get(state, 0):
            out.append(
                Violation(
                    "counts_consistent",
                    f"counter for {state} says {held}, recount finds {recount.get(state, 0)}",
                )
            )
    return out


def capacity_respected(snapshot: BufferSnapshot) -> list[Violation]:
    """Groups held by the buffer (unready ones included) never exceed its capacity."""
    held = sum(1 for g in snapshot.groups if g.state is not GroupState.DISCARDED)
    if held > snapshot.capacity:
        return [
            Violation(
                "capacity_respected",
                f"{held} groups held, capacity is {snapshot.capacity}",
            )
        ]
    return []


INVARIANTS: tuple[Callable[[BufferSnapshot], list[Violation]], ...] = (
    one_state_per_group,
    ready_has_required_fields,
    rows_match_groups,
    counts_consistent,
    capacity_respected,
)


def check_invariants(snapshot: BufferSnapshot) -> list[Violation]:
    """Every violation of every invariant in `snapshot`; empty when all hold."""
    return [v for check in INVARIANTS for v in check(snapshot)]


def assert_invariants(snapshot: BufferSnapshot) -> None:
    """Raise `InvariantViolation` listing every broken invariant, if any."""
    violations = check_invariants(snapshot)
    if violations:
        raise InvariantViolation(violations)
