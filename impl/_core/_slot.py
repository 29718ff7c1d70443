"""What the buffer holds per group (`Slot`, its metadata; rows stay in the store), the checks of
the rows a group is given, and what a train step is handed (`Selection`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import attrs

from groupflow.impl._core._store import PAD_PREFIX, Row
from groupflow.model import GroupState, GroupView
from groupflow.model.errors import ArgumentError


@attrs.frozen
class Selection:
    """The groups picked for one train step, now CONSUMED; `release` them after the step."""

    step: int
    weight_version: int
    groups: tuple[GroupView, ...]

    @property
    def group_ids(self) -> tuple[str, ...]:
        return tuple(g.group_id for g in self.groups)

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return tuple(sid for g in self.groups for sid in g.sample_ids)


@attrs.define
class Slot:
    """One group's metadata: its state moves only through `groupflow.model.fire`."""

    group_id: str
    target_step: int
    ordinal: int | None
    agent: str | None
    state: GroupState
    sample_ids: tuple[str, ...] = ()
    fields: frozenset[str] = frozenset()
    awaiting_stage: bool = False
    start_weight_version: int | None = None
    end_weight_version: int | None = None
    retries: int = 0

    def view(self) -> GroupView:
        return GroupView(
            group_id=self.group_id,
            state=self.state,
            target_step=self.target_step,
            sample_ids=self.sample_ids,
            fields=self.fields,
            awaiting_stage=self.awaiting_stage,
            start_weight_version=self.start_weight_version,
            end_weight_version=self.end_weight_version,
            ordinal=self.ordinal,
            agent=self.agent,
        )


def check_index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArgumentError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_rows(
    group_id: str, rows: Sequence[Row], *, group_size: int, owner: Mapping[str, str]
) -> frozenset[str]:
    """The field set a group's rows share, once they are `group_size` `Row`s with fresh ids
    (`owner`: the group of each id in use) and the same fields."""
    if len(rows) != group_size:
        raise ArgumentError(f"group {group_id!r}: got {len(rows)} rows, group_size is {group_size}")
    bad = [r for r in rows if not isinstance(r, Row)]
    if bad:
        raise TypeError(f"group {group_id!r}: rows must be groupflow Row objects, got {bad[0]!r}")
    ids = [r.sample_id for r in rows]
    padded = [sid for sid in ids if not isinstance(sid, str) or sid.startswith(PAD_PREFIX)]
    if padded:
        raise ArgumentError(
            f"group {group_id!r}: sample ids {padded!r} are not strings or start with "
            f"groupflow's padding prefix {PAD_PREFIX!r}, kept for a teacher call's "
            f"temporary rows; choose other ids"
        )
    dupes = sorted(sid for sid, n in Counter(ids).items() if n > 1)
    if dupes:
        raise ArgumentError(f"group {group_id!r}: sample ids appear twice: {dupes}")
    taken = sorted(f"{sid!r} (group {owner[sid]!r})" for sid in ids if sid in owner)
    if taken:
        raise ArgumentError(f"group {group_id!r}: sample ids already in use: {', '.join(taken)}")
    field_sets = {frozenset(r.fields) for r in rows}
    if len(field_sets) != 1:
        shapes = {r.sample_id: sorted(r.fields) for r in rows}
        raise ArgumentError(f"group {group_id!r}: rows have different fields: {shapes}")
    return field_sets.pop()
