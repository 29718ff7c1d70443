"""What a teacher call costs against its rows, timed before a run: calls of one group up to a
full batch, a few of each, while nothing else asks the engines for work.

A run's own calls mostly have one size (the inline design scores one group a call, the pump a
full batch), so they cannot tell a call's fixed cost from its cost per row; a what-if of the
other design rests on that split, and `groupflow sim --from-run` reads it from the run
folder's `teacher-probe.json`, which `write_probe` writes and `read_probe` checks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from groupflow.impl._core import MemoryStore
from groupflow.impl._pipeline import call_scorer
from groupflow.impl._teachers._batch import check_teacher_output
from groupflow.impl.contract import Scorer, ScoreRequest, TokenRow
from groupflow.model import GroupState, GroupView
from groupflow.model.errors import TeacherOutputError, TraceCorrupt

PROBE_FILE = "teacher-probe.json"
PROBE_REPEATS = 3
"""Timed calls of each size per teacher (after one warm-up call that is not recorded)."""
_FORMAT = 1
"""The probe file's format: `read_probe` refuses any other."""


def _count(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _seconds(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{attribute.name} must be finite seconds >= 0, got {value!r}")


def _name(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a teacher's name, got {value!r}")


@attrs.frozen
class ProbeCall:
    """One timed call: the teacher, its rows and their tokens (for a fit that reads a cost per
    token), and its seconds."""

    teacher: str = attrs.field(validator=_name)
    rows: int = attrs.field(validator=_count)
    tokens: int = attrs.field(validator=_count)
    seconds: float = attrs.field(validator=_seconds)


def stored_groups(
    rows: Sequence[TokenRow], rows_per_group: int
) -> tuple[MemoryStore, list[GroupView]]:
    """`rows` in a store of their own (`r0`, `r1`, ...) as groups of `rows_per_group` awaiting
    a teacher: what a `ScoreRequest` carries outside a pipeline (benchmarks, the probe)."""
    store = MemoryStore()
    ids = [f"r{i}" for i in range(len(rows))]
    store.put(
        {
            sid: {"input_ids": list(row.input_ids), "prompt_length": row.prompt_length}
            for sid, row in zip(ids, rows, strict=True)
        }
    )
    views = [
        GroupView(
            group_id=f"g{g}",
            state=GroupState.SCORING,
            target_step=0,
            sample_ids=tuple(ids[g * rows_per_group : (g + 1) * rows_per_group]),
            fields=frozenset(),
            awaiting_stage=True,
            start_weight_version=0,
            end_weight_version=0,
            ordinal=g,
            agent=None,
        )
        for g in range(len(ids) // rows_per_group)
    ]
    return store, views


async def probe_teachers(
    scorer: Scorer,
    teachers: Sequence[str],
    rows: Sequence[TokenRow],
    *,
    rows_per_group: int,
    sizes: Sequence[int],
    call_limit_s: float,
    repeats: int = PROBE_REPEATS,
) -> list[ProbeCall]:
    """Time each teacher's calls of `sizes` groups (of `rows_per_group` of `rows` each),
    `repeats` of each size in turn, after one warm-up call of the largest. Each call is
    bounded by `call_limit_s` (`call_scorer`: `ScoringTimeout`) and must write a value per
    response token of every row (`TeacherOutputError`). Times are trio's clock, so a virtual
    clock times a fake scorer."""
    if not sizes or min(sizes) < 1 or max(sizes) * rows_per_group > len(rows):
        raise ValueError(
            f"probe sizes {list(sizes)} of {rows_per_group} rows need 1 to "
            f"{len(rows) // rows_per_group} groups: {len(rows)} rows were given"
        )
    store, views = stored_groups(rows, rows_per_group)
    most = max(sizes)
    calls: list[ProbeCall] = []
    field = 0
    for teacher in teachers:
        for number, groups in enumerate([most] + [s for _ in range(repeats) for s in sizes]):
            field += 1
            request = ScoreRequest(teacher, tuple(views[:groups]), store, f"probe{field}")
            start = trio.current_time()
            await call_scorer(scorer, request, timeout_s=call_limit_s)
            seconds = trio.current_time() - start
            _check_written(request, rows[: groups * rows_per_group])
            if number:  # the first is the warm-up
                tokens = sum(len(row.input_ids) for row in rows[: groups * rows_per_group])
                calls.append(ProbeCall(teacher, groups * rows_per_group, tokens, seconds))
    return calls


def _check_written(request: ScoreRequest, rows: Sequence[TokenRow]) -> None:
    """What the call wrote, checked as a teacher's output is (`check_teacher_output`)."""
    ids = list(request.sample_ids)
    lacking = request.store.missing_fields(ids, [request.field])
    if lacking:
        raise TeacherOutputError(
            f"teacher {request.teacher!r}: a probe call of {len(ids)} rows wrote nothing for "
            f"{len(lacking)} of them"
        )
    written = request.store.get(ids, [request.field])
    try:
        check_teacher_output(ids, rows, [written[sid][request.field] for sid in ids])
    except TeacherOutputError as error:
        raise TeacherOutputError(f"teacher {request.teacher!r}, a probe call: {error}") from None


def write_probe(path: Path, calls: Sequence[ProbeCall]) -> None:
    """`calls` as the run folder's probe file (`read_probe` reads it back), written whole or
    not at all: a run killed while writing it leaves no half file for a resume to keep."""
    text = json.dumps({"format": _FORMAT, "calls": [attrs.asdict(c) for c in calls]}, indent=1)
    part = path.with_name(f".{path.name}.part")
    part.write_text(text + "\n")
    os.replace(part, path)


def read_probe(path: Path) -> tuple[ProbeCall, ...]:
    """The calls `write_probe` wrote at `path`, each checked; `TraceCorrupt` naming the file
    and what is wrong otherwise."""
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TraceCorrupt(f"{path}: not a teacher probe ({error})") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise TraceCorrupt(f"{path}: not a teacher probe of format {_FORMAT}")
    calls = data.get("calls")
    if not isinstance(calls, list):
        raise TraceCorrupt(f"{path}: its 'calls' is not a list")
    out = []
    for i, call in enumerate(calls):
        try:
            out.append(ProbeCall(**call))
        except TypeError:
            raise TraceCorrupt(f"{path}: call {i} is not a probe call: {call!r}") from None
        except ValueError as error:
            raise TraceCorrupt(f"{path}: call {i}: {error}") from None
    return tuple(out)


__all__ = [
    "PROBE_FILE",
    "PROBE_REPEATS",
    "ProbeCall",
    "probe_teachers",
    "read_probe",
    "stored_groups",
    "write_probe",
]
