"""The replay buffer's persistence: what a checkpoint saves of it (its READY groups with their
rows) and every check a restore makes before it writes anything.

A saved state is never trusted: its format, its group size and required fields, its size
against the buffer's capacity and every group's rows are checked, and a state that fails is
refused as corrupt or as saved by another configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from groupflow.impl._core._buffer_config import BufferConfig
from groupflow.impl._core._slot import Slot, check_index
from groupflow.impl._core._store import Row
from groupflow.model import Actor, Event, fire, missing_fields
from groupflow.model.errors import ArgumentError, CheckpointCorrupt, CheckpointMismatch

STATE_DICT_FORMAT = "groupflow.buffer/1"


def restored_index(name: str, value: object) -> int:
    """`check_index` for a number read back from a saved state: a bad one is corruption."""
    try:
        return check_index(name, value)
    except ArgumentError as exc:
        raise CheckpointCorrupt(f"checkpoint {exc}") from exc


def saved_state(
    config: BufferConfig, ready: Sequence[tuple[Slot, Mapping[str, Any]]], next_id: int
) -> dict[str, Any]:
    """The state `ReplayBuffer.state_dict` returns: each READY slot with its rows read."""
    groups = [
        {
            "group_id": slot.group_id,
            "target_step": slot.target_step,
            "ordinal": slot.ordinal,
            "agent": slot.agent,
            "start_weight_version": slot.start_weight_version,
            "end_weight_version": slot.end_weight_version,
            "rows": [{"sample_id": sid, "fields": data[sid]} for sid in slot.sample_ids],
        }
        for slot, data in ready
    ]
    return {
        "format": STATE_DICT_FORMAT,
        "config": {
            "group_size": config.group_size,
            "required_fields": sorted(config.required_fields),
        },
        "next_group_id": next_id,
        "groups": groups,
    }


def checked_state(
    config: BufferConfig, state: Mapping[str, Any]
) -> tuple[int, Sequence[Mapping[str, Any]]]:
    """The next group id and the saved groups of `state`, once it is a buffer state saved
    under `config`'s group size and required fields that fits its capacity."""
    if state.get("format") != STATE_DICT_FORMAT:
        raise CheckpointCorrupt(
            f"not a groupflow buffer state: format is {state.get('format')!r}, "
            f"expected {STATE_DICT_FORMAT!r}"
        )
    saved = state["config"]
    if saved["group_size"] != config.group_size:
        raise CheckpointMismatch(
            f"checkpoint was saved with group_size={saved['group_size']}, this buffer has "
            f"group_size={config.group_size}"
        )
    if frozenset(saved["required_fields"]) != config.required_fields:
        raise CheckpointMismatch(
            f"checkpoint was saved with required_fields={sorted(saved['required_fields'])}, "
            f"this buffer requires {sorted(config.required_fields)}"
        )
    groups = state["groups"]
    if len(groups) > config.capacity:
        raise CheckpointMismatch(
            f"checkpoint holds {len(groups)} READY groups, more than this buffer's "
            f"capacity={config.capacity}"
        )
    return restored_index("next_group_id", state["next_group_id"]), groups


def restored_slots(
    groups: Sequence[Mapping[str, Any]],
    config: BufferConfig,
    *,
    check_rows: Callable[[str, Sequence[Row]], frozenset[str]],
) -> tuple[list[Slot], dict[str, dict[str, Any]]]:
    """The slots and rows of the saved groups, each checked as a commit checks its rows
    (`check_rows`), with the fields the buffer requires; a group that is not is corruption."""
    slots: list[Slot] = []
    rows: dict[str, dict[str, Any]] = {}
    for g in groups:
        gid = g["group_id"]
        if any(s.group_id == gid for s in slots):
            raise CheckpointCorrupt(f"checkpoint lists group {gid!r} twice")
        state = fire(gid, None, Event.RESTORE, actor=Actor.CHECKPOINT)
        restored = [Row(r["sample_id"], r["fields"]) for r in g["rows"]]
        try:
            fields = check_rows(gid, restored)
        except ArgumentError as exc:
            raise CheckpointCorrupt(f"checkpoint {exc}") from exc
        lacking = missing_fields(fields, config.required_fields)
        if lacking:
            raise CheckpointCorrupt(
                f"checkpoint group {gid!r} lacks required fields {sorted(lacking)}"
            )
        clash = sorted(r.sample_id for r in restored if r.sample_id in rows)
        if clash:
            raise CheckpointCorrupt(f"checkpoint group {gid!r} reuses sample ids {clash}")
        rows.update((r.sample_id, dict(r.fields)) for r in restored)
        slots.append(
            Slot(
                group_id=gid,
                target_step=restored_index("target_step", g["target_step"]),
                ordinal=g["ordinal"],
                agent=g["agent"],
                state=state,
                sample_ids=tuple(r.sample_id for r in restored),
                fields=fields,
                start_weight_version=g["start_weight_version"],
                end_weight_version=g["end_weight_version"],
            )
        )
    return slots, rows
