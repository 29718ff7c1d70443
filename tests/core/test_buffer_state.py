"""ReplayBuffer checkpoints: `state_dict` / `load_state_dict` round trips, and refusals that
write nothing.

Every buffer made through the `make_buffer` fixture (`conftest.py`) has the model's invariants
asserted on its final snapshot when the test ends."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest

from groupflow.impl import ReplayBuffer
from groupflow.impl.errors import CheckpointCorrupt
from tests.helpers import (
    INPUT,
    TEACHER,
    MakeBuffer,
    S,
    committed,
    group_in,
    new_buffer,
    row_ids,
    world,
)


async def checkpointed_buffer(make_buffer: MakeBuffer) -> ReplayBuffer:
    """Three READY groups with varied metadata, plus one each RESERVED, WRITTEN, CONSUMED."""
    buffer = make_buffer(capacity=6, required_fields=(INPUT, TEACHER))
    await committed(buffer, target_step=0, start=1, end=2, ordinal=10, agent="math")
    await group_in(buffer, S.RESERVED)
    scored = await committed(
        buffer, target_step=1, start=2, defer=True, fields=(INPUT,), ordinal=11
    )
    buffer.take_for_scoring([scored])
    buffer.store.add_fields({sid: {TEACHER: [0.25, 0.75]} for sid in row_ids(scored)})
    await buffer.mark_ready(scored, [TEACHER])
    await committed(
        buffer, target_step=1, start=3, fields=(INPUT, TEACHER, "generation_logprobs"), agent="code"
    )
    await group_in(buffer, S.WRITTEN, target_step=2)
    await group_in(buffer, S.CONSUMED, target_step=7)
    return buffer


def saved_rows(buffer: ReplayBuffer) -> dict[str, dict[str, Any]]:
    """Every field of every row of the buffer's READY groups."""
    out: dict[str, dict[str, Any]] = {}
    for g in buffer.groups(S.READY):
        out.update(buffer.store.get(list(g.sample_ids), sorted(g.fields)))
    return out


async def test_state_dict_roundtrip_restores_ready_groups(make_buffer: MakeBuffer) -> None:
    source = await checkpointed_buffer(make_buffer)
    state = json.loads(json.dumps(await source.state_dict()))
    restored = make_buffer(capacity=6, required_fields=(INPUT, TEACHER))
    await restored.load_state_dict(state)
    assert len(source.groups(S.READY)) == 3
    assert restored.groups() == source.groups(S.READY)
    assert saved_rows(restored) == saved_rows(source)
    assert restored.store.list_ids() == set(saved_rows(source))
    assert restored.counts()[S.READY] == 3
    assert sum(restored.counts().values()) == 3
    assert [restored.count_for_target_step(s) for s in (0, 1, 2, 7)] == [1, 2, 0, 0]
    assert [restored.count_in(S.READY, s) for s in (0, 1, 2, 7)] == [1, 2, 0, 0]


async def test_restored_groups_can_be_trained(make_buffer: MakeBuffer) -> None:
    source = await checkpointed_buffer(make_buffer)
    restored = make_buffer(capacity=6, required_fields=(INPUT, TEACHER))
    await restored.load_state_dict(await source.state_dict())
    selection = restored.select(step=1, weight_version=3)
    assert len(selection.groups) == 2
    await restored.release(selection.group_ids)
    assert len(restored) == 1


async def test_restored_buffer_continues_with_fresh_group_ids(make_buffer: MakeBuffer) -> None:
    source = await checkpointed_buffer(make_buffer)
    issued = {g.group_id for g in source.groups()}
    restored = make_buffer(capacity=8, required_fields=(INPUT, TEACHER))
    await restored.load_state_dict(await source.state_dict())
    fresh = {restored.reserve(target_step=0) for _ in range(3)}
    assert len(fresh) == 3
    assert not fresh & issued


async def test_a_restored_buffer_numbers_its_groups_on_from_the_saved_count(
    make_buffer: MakeBuffer,
) -> None:
    source = make_buffer()
    for _ in range(2):
        await group_in(source, S.DISCARDED)
    await committed(source)
    restored = make_buffer()
    await restored.load_state_dict(await source.state_dict())
    assert restored.reserve(target_step=0) == "g000003"


async def test_the_state_of_a_fresh_buffer_loads(buffer: ReplayBuffer) -> None:
    state = await buffer.state_dict()
    assert (state["next_group_id"], state["groups"]) == (0, [])
    restored = new_buffer()
    await restored.load_state_dict(state)
    assert restored.reserve(target_step=0) == "g000000"


async def test_fresh_ids_skip_restored_ids_even_when_the_counter_points_at_them(
    make_buffer: MakeBuffer,
) -> None:
    source = make_buffer()
    first = await committed(source)
    state = await source.state_dict()
    state["next_group_id"] = 0
    restored = make_buffer()
    await restored.load_state_dict(state)
    fresh = restored.reserve(target_step=0)
    assert fresh != first
    assert restored.state_of(first) is S.READY


async def test_state_dict_of_a_buffer_with_no_ready_groups_is_empty(buffer: ReplayBuffer) -> None:
    await group_in(buffer, S.WRITTEN)
    state = await buffer.state_dict()
    assert state["groups"] == []
    restored = new_buffer()
    await restored.load_state_dict(state)
    assert len(restored) == 0
    assert restored.store.list_ids() == frozenset()


@pytest.mark.parametrize("held", ["live", "finished"])
async def test_load_into_a_used_buffer_raises_runtime_error(
    make_buffer: MakeBuffer, held: str
) -> None:
    source = make_buffer()
    await committed(source)
    state = await source.state_dict()
    target = make_buffer()
    if held == "live":
        await committed(target)
    else:
        await group_in(target, S.DISCARDED)
    before = world(target)
    with pytest.raises(RuntimeError, match="fresh buffer"):
        await target.load_state_dict(state)
    assert world(target) == before


@pytest.mark.parametrize(
    ("saved", "loading", "fragments"),
    [
        pytest.param(
            {"group_size": 2},
            {"group_size": 3},
            ["group_size=2", "group_size=3"],
            id="group-size",
        ),
        pytest.param(
            {"group_size": 3},
            {"group_size": 2},
            ["group_size=3", "group_size=2"],
            id="group-size-larger",
        ),
        pytest.param(
            {"required_fields": (INPUT,)},
            {"required_fields": (INPUT, TEACHER)},
            ["['input_ids']", "['input_ids', 'teacher_logprobs']"],
            id="required-fields",
        ),
        pytest.param(
            {"required_fields": (INPUT, TEACHER)},
            {"required_fields": (INPUT,)},
            ["['input_ids', 'teacher_logprobs']", "requires ['input_ids']"],
            id="required-fields-more",
        ),
        pytest.param(
            {"capacity": 3},
            {"capacity": 2},
            ["3 READY groups", "capacity=2"],
            id="capacity",
        ),
    ],
)
async def test_load_of_an_incompatible_state_raises_and_writes_nothing(
    make_buffer: MakeBuffer, saved: dict[str, Any], loading: dict[str, Any], fragments: list[str]
) -> None:
    source = make_buffer(**saved)
    for _ in range(3 if "capacity" in saved else 1):
        await committed(source)
    state = await source.state_dict()
    target = make_buffer(**loading)
    with pytest.raises(ValueError) as info:
        await target.load_state_dict(state)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert target.store.list_ids() == frozenset()
    assert len(target) == 0


@pytest.mark.parametrize("fmt", ["something/9", "a", "groupflow.buffer/0", None])
async def test_load_of_a_foreign_format_raises(buffer: ReplayBuffer, fmt: str | None) -> None:
    with pytest.raises(ValueError, match="not a groupflow buffer state"):
        await buffer.load_state_dict({"format": fmt})
    assert buffer.store.list_ids() == frozenset()


async def test_a_state_that_fills_the_capacity_exactly_loads(make_buffer: MakeBuffer) -> None:
    source = make_buffer(capacity=3)
    for _ in range(3):
        await committed(source)
    target = make_buffer(capacity=3)
    await target.load_state_dict(await source.state_dict())
    assert len(target.groups(S.READY)) == 3


async def test_a_state_pickled_with_large_sizes_loads(make_buffer: MakeBuffer) -> None:
    """Sizes are compared by value: a group size read back from disk is another int object."""
    source = make_buffer(group_size=300, capacity=1)
    await committed(source)
    state = pickle.loads(pickle.dumps(await source.state_dict()))
    target = make_buffer(group_size=300, capacity=1)
    await target.load_state_dict(state)
    assert len(target.groups(S.READY)) == 1


async def test_groups_listed_in_any_order_load_and_a_group_listed_twice_is_corrupt(
    make_buffer: MakeBuffer,
) -> None:
    source = make_buffer(capacity=3)
    for _ in range(2):
        await committed(source)
    state = await source.state_dict()
    backwards = {**state, "groups": list(reversed(state["groups"]))}
    await make_buffer(capacity=3).load_state_dict(backwards)
    first = state["groups"][0]
    again = {**first, "group_id": "".join(first["group_id"]), "rows": []}
    twice = {**state, "groups": [*state["groups"], again]}
    with pytest.raises(CheckpointCorrupt, match="lists group .* twice"):
        await make_buffer(capacity=3).load_state_dict(twice)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(next_group_id=-1), r"checkpoint next_group_id must be an int >= 0"),
        (lambda s: s["groups"][0]["rows"].pop(), r"checkpoint group .*: got 1 rows"),
        (
            lambda s: s["groups"][0].update(target_step="x"),
            r"checkpoint target_step must be an int >= 0",
        ),
    ],
)
async def test_a_bad_number_or_bad_rows_in_a_state_are_corruption(
    make_buffer: MakeBuffer, edit: Any, message: str
) -> None:
    """Read back from disk, a bad value is the checkpoint's fault (`CheckpointCorrupt`), not the
    caller's (`ArgumentError`)."""
    source = make_buffer()
    await committed(source)
    state = copy.deepcopy(await source.state_dict())
    edit(state)
    with pytest.raises(CheckpointCorrupt, match=message):
        await make_buffer().load_state_dict(state)
