"""`score_teacher_batch`: DP padding and its cleanup, output validation, routing to teachers.

A plain-python teacher stands in for the model here; tests/teachers/test_torch_teacher.py runs the torch one.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest

from groupflow.impl import MemoryStore
from groupflow.impl._teachers import (
    PAD_PREFIX,
    AliasMap,
    BatchMeta,
    RoutingConfig,
    resolve_teacher,
    score_teacher_batch,
)
from groupflow.impl.contract import TEACHER_FIELD, Teacher, TokenRow
from groupflow.impl.errors import DuplicateDataError, TeacherOutputError
from groupflow.model import GroupState, GroupView


def logprob(token: int, position: int) -> float:
    return -((token * 31 + position) % 17 + 1) / 10


@attrs.define
class ListTeacher:
    """Scores each token by a fixed rule; records the shards it saw."""

    dp: int = 1
    seen: list[list[TokenRow]] = attrs.field(factory=list)
    tamper: str = ""

    @property
    def dp_size(self) -> int:
        return self.dp

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        self.seen = [list(s) for s in shards]
        out: list[list[Sequence[float]]] = [
            [[logprob(t, i) for i, t in enumerate(r.input_ids[r.prompt_length :])] for r in shard]
            for shard in shards
        ]
        if self.tamper == "drop_row":
            out[0] = out[0][:-1]
        elif self.tamper == "short":
            out[0][0] = out[0][0][:-1]
        elif self.tamper == "nan":
            out[-1][-1] = [float("nan")] * len(out[-1][-1])
        elif self.tamper == "positive":  # a probability above 1
            out[0][0] = [0.7] * len(out[0][0])
        elif self.tamper == "shift":  # right total, wrong rows per shard
            out[0].append(out[-1].pop())
        elif self.tamper == "raise":
            raise RuntimeError("teacher rank 0 died")
        return out


class BrokenClearStore(MemoryStore):
    def clear(self, sample_ids, *, missing_ok=False):  # type: ignore[no-untyped-def]
        raise OSError("store unreachable")


def filled(n: int, store: MemoryStore | None = None) -> tuple[MemoryStore, BatchMeta]:
    store = store if store is not None else MemoryStore()
    rows = {
        f"s{i}": {"input_ids": [i, i + 1, i + 2, i + 3, i + 4], "prompt_length": 2}
        for i in range(n)
    }
    store.put(rows)
    return store, BatchMeta(tuple(rows), frozenset({"input_ids", "prompt_length"}))


def test_three_rows_pad_to_four_and_the_pad_goes() -> None:
    store, meta = filled(3)
    teacher = ListTeacher(dp=4)
    out = score_teacher_batch(store, teacher, meta)
    assert out.fields == meta.fields | {TEACHER_FIELD}
    assert [len(s) for s in teacher.seen] == [1, 1, 1, 1]
    assert teacher.seen[3][0] == teacher.seen[2][0], "the pad copies the last real row"
    assert store.list_ids() == {"s0", "s1", "s2"}
    values = store.get(["s1"], [TEACHER_FIELD])["s1"][TEACHER_FIELD]
    assert values == [logprob(t, i) for i, t in enumerate([3, 4, 5])]


def test_no_padding_when_divisible() -> None:
    store, meta = filled(4)
    teacher = ListTeacher(dp=2)
    score_teacher_batch(store, teacher, meta)
    assert [len(s) for s in teacher.seen] == [2, 2]
    assert not any(r == teacher.seen[1][-1] for r in teacher.seen[0])


@pytest.mark.parametrize("tamper", ["drop_row", "short", "nan", "positive", "shift"])
def test_bad_output_is_refused_naming_rows_and_writes_nothing(tamper: str) -> None:
    store, meta = filled(3)
    with pytest.raises(TeacherOutputError, match="s0|rows"):
        score_teacher_batch(store, ListTeacher(dp=2, tamper=tamper), meta)
    if tamper == "shift":
        with pytest.raises(TeacherOutputError, match="shards"):
            score_teacher_batch(store, ListTeacher(dp=2, tamper=tamper), meta)
    assert store.list_ids() == {"s0", "s1", "s2"}, "pad rows cleared"
    assert all(TEACHER_FIELD not in store.fields_of(s) for s in meta.sample_ids)


def test_failed_call_clears_pads() -> None:
    store, meta = filled(3)
    with pytest.raises(RuntimeError, match="rank 0 died"):
        score_teacher_batch(store, ListTeacher(dp=4, tamper="raise"), meta)
    assert not any(s.startswith(PAD_PREFIX) for s in store.list_ids())


class HalfPutStore(MemoryStore):
    """Writes the first row of a put of pad rows, then fails: a store that went down mid-write."""

    def put(self, rows, **kw):  # type: ignore[no-untyped-def]
        if any(sid.startswith(PAD_PREFIX) for sid in rows):
            first = next(iter(rows))
            super().put({first: rows[first]}, **kw)
            raise OSError("store went down mid-write")
        super().put(rows, **kw)


def test_a_pad_write_that_fails_part_way_leaves_no_pad_rows() -> None:
    """The pad rows are written inside the cleanup's reach: a put that fails after its first row
    leaves nothing behind (written before the `try`, that row stayed until the end-of-run sweep)."""
    store, meta = filled(3, HalfPutStore())
    with pytest.raises(OSError, match="mid-write"):
        score_teacher_batch(store, ListTeacher(dp=4), meta)
    assert store.list_ids() == {"s0", "s1", "s2"}


def test_failed_call_and_failed_cleanup_both_surface() -> None:
    store, meta = filled(3, BrokenClearStore())
    with pytest.raises(BaseExceptionGroup) as caught:
        score_teacher_batch(store, ListTeacher(dp=4, tamper="raise"), meta)
    kinds = {type(e) for e in caught.value.exceptions}
    assert kinds == {RuntimeError, OSError}


def test_pad_ids_cannot_collide_with_real_rows() -> None:
    store, meta = filled(1)
    score_teacher_batch(store, ListTeacher(dp=8), meta)
    assert store.list_ids() == {"s0"}
    with pytest.raises(DuplicateDataError):
        store.put({"s0": {}})


def test_prompt_length_must_leave_a_response() -> None:
    store = MemoryStore()
    store.put({"a": {"input_ids": [1, 2], "prompt_length": 2}})
    with pytest.raises(ValueError, match="'a': prompt_length=2"):
        score_teacher_batch(store, ListTeacher(), BatchMeta(("a",)))


def test_teacher_protocol() -> None:
    assert isinstance(ListTeacher(), Teacher)


def group(agent: str | None) -> GroupView:
    return GroupView("g1", GroupState.WRITTEN, 0, agent=agent)


def test_routing_by_alias_and_shared_checkpoints() -> None:
    aliases = AliasMap.build(
        {"math": "math-teacher", "proofs": "math-teacher-v2", "code": "code-teacher"},
        {
            "math-teacher": "/ckpt/qwen-math",
            "math-teacher-v2": "/ckpt/qwen-math",
            "code-teacher": "/ckpt/coder",
        },
    )
    strict = RoutingConfig()
    assert resolve_teacher(group("math"), aliases, strict) == "/ckpt/qwen-math"
    assert resolve_teacher(group("proofs"), aliases, strict) == "/ckpt/qwen-math"
    assert aliases.physical_teachers == {"/ckpt/qwen-math", "/ckpt/coder"}
    with pytest.raises(ValueError, match="'poetry'"):
        resolve_teacher(group("poetry"), aliases, strict)
    with pytest.raises(ValueError, match="None"):
        resolve_teacher(group(None), aliases, strict)
    lenient = RoutingConfig(default_alias="code-teacher")
    assert resolve_teacher(group("poetry"), aliases, lenient) == "/ckpt/coder"


def test_alias_map_refuses_aliases_without_checkpoint() -> None:
    with pytest.raises(ValueError, match="'ghost'"):
        AliasMap.build({"math": "ghost"}, {})
