"""ReplayBuffer over MemoryStore: the lifecycle paths, bad input, checkpoints, store failures
and cancellation.

Every buffer made through the `make_buffer` fixture has the model's invariants asserted on its
final snapshot when the test ends, so each scenario below is also checked for consistency.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import pytest
import trio

from groupflow.impl import (
    BufferConfig,
    BufferFull,
    MemoryStore,
    MissingDataError,
    ReplayBuffer,
    Row,
    Sampler,
    SampleStore,
    UnknownGroup,
)
from groupflow.model import Actor, GroupState, IllegalTransition, assert_invariants

S = GroupState
INPUT = "input_ids"
TEACHER = "teacher_logprobs"
REWARD = "reward"

MakeBuffer = Callable[..., ReplayBuffer]


# -- helpers -----------------------------------------------------------------------------


def new_buffer(
    *, store: SampleStore | None = None, blocking: bool = False, **config: Any
) -> ReplayBuffer:
    """A buffer with group_size=2, capacity=4 and `input_ids` required, unless overridden."""
    settings: dict[str, Any] = {"group_size": 2, "capacity": 4, "required_fields": (INPUT,)}
    settings.update(config)
    return ReplayBuffer(
        BufferConfig(**settings), MemoryStore(blocking=blocking) if store is None else store
    )


@pytest.fixture
def make_buffer() -> Iterator[MakeBuffer]:
    """`new_buffer`, and at teardown `assert_invariants` on every buffer it made."""
    made: list[ReplayBuffer] = []

    def make(**kwargs: Any) -> ReplayBuffer:
        buffer = new_buffer(**kwargs)
        made.append(buffer)
        return buffer

    yield make
    for buffer in made:
        assert_invariants(buffer.snapshot())


@pytest.fixture
def buffer(make_buffer: MakeBuffer) -> ReplayBuffer:
    return make_buffer()


def rows(prefix: str, n: int = 2, fields: Sequence[str] = (INPUT,)) -> list[Row]:
    """`n` rows with ids `prefix/0..n-1`, each holding every field in `fields`."""
    return [Row(f"{prefix}/{i}", {f: [i, len(f)] for f in fields}) for i in range(n)]


def row_ids(group_id: str, n: int = 2) -> set[str]:
    return {f"{group_id}/{i}" for i in range(n)}


async def committed(
    buffer: ReplayBuffer,
    *,
    target_step: int = 0,
    start: int = 0,
    end: int | None = None,
    defer: bool = False,
    fields: Sequence[str] | None = None,
    **reserve: Any,
) -> str:
    """Reserve and commit a group; READY unless `defer`. Rows carry the required fields."""
    gid = buffer.reserve(target_step=target_step, **reserve)
    if fields is None:
        fields = sorted(buffer.config.required_fields | {INPUT})
    await buffer.commit(
        gid,
        rows(gid, buffer.config.group_size, fields),
        start_weight_version=start,
        end_weight_version=start if end is None else end,
        defer_ready=defer,
    )
    return gid


async def group_in(buffer: ReplayBuffer, state: GroupState, *, target_step: int = 0) -> str:
    """A new group brought to `state` (CONSUMED: selected, not yet released)."""
    if state is S.RESERVED:
        return buffer.reserve(target_step=target_step)
    if state is S.DISCARDED:
        gid = buffer.reserve(target_step=target_step)
        await buffer.discard(gid)
        return gid
    gid = await committed(buffer, target_step=target_step, defer=state in (S.WRITTEN, S.SCORING))
    if state is S.SCORING:
        buffer.take_for_scoring([gid])
    if state is S.CONSUMED:
        assert buffer.select(step=target_step, weight_version=0).group_ids == (gid,)
    assert buffer.state_of(gid) is state
    return gid


async def released(buffer: ReplayBuffer, *, target_step: int = 0) -> str:
    """A group that was consumed and released: finished and no longer held."""
    gid = await group_in(buffer, S.CONSUMED, target_step=target_step)
    await buffer.release([gid])
    return gid


def world(buffer: ReplayBuffer) -> tuple[Any, dict[str, frozenset[str]]]:
    """What a failed call must leave untouched: the buffer's snapshot and the store's rows."""
    store = buffer.store
    assert isinstance(store, MemoryStore)
    return buffer.snapshot(), {sid: store.fields_of(sid) for sid in store.list_ids()}


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a buffer method, sync or async."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"group_size": 0}, "group_size must be a positive int, got 0"),
        ({"group_size": -3}, "group_size must be a positive int, got -3"),
        ({"group_size": True}, "group_size must be a positive int, got True"),
        ({"capacity": 0}, "capacity must be a positive int, got 0"),
        ({"capacity": 2.5}, "capacity must be a positive int, got 2.5"),
        (
            {"max_staleness_versions": -1},
            "max_staleness_versions must be an int >= 0 or None, got -1",
        ),
        ({"sampler": Sampler.WINDOWED}, "needs max_staleness_versions"),
        ({"sampler": "windowed"}, "needs max_staleness_versions"),
    ],
)
def test_bad_config_raises_value_error_naming_the_value(
    overrides: dict[str, Any], fragment: str
) -> None:
    settings: dict[str, Any] = {"group_size": 2, "capacity": 4}
    settings.update(overrides)
    with pytest.raises(ValueError, match=fragment):
        BufferConfig(**settings)


def test_required_fields_as_a_bare_string_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"'input_ids'"):
        BufferConfig(group_size=2, capacity=4, required_fields="input_ids")


def test_config_converts_sampler_names_and_field_lists() -> None:
    config = BufferConfig(
        group_size=2,
        capacity=4,
        required_fields=[INPUT, TEACHER],
        sampler="windowed",
        max_staleness_versions=0,
    )
    assert config.sampler is Sampler.WINDOWED
    assert config.required_fields == frozenset({INPUT, TEACHER})


# -- happy paths -------------------------------------------------------------------------


async def test_commit_without_defer_makes_the_group_ready(buffer: ReplayBuffer) -> None:
    gid = buffer.reserve(target_step=3, ordinal=7, agent="math")
    assert buffer.state_of(gid) is S.RESERVED
    view = await buffer.commit(gid, rows(gid), start_weight_version=1, end_weight_version=2)
    assert view == buffer.group(gid)
    assert view.state is S.READY
    assert view.sample_ids == (f"{gid}/0", f"{gid}/1")
    assert view.fields == {INPUT}
    assert not view.awaiting_stage
    assert (view.target_step, view.ordinal, view.agent) == (3, 7, "math")
    assert (view.start_weight_version, view.end_weight_version) == (1, 2)
    assert buffer.store.get(list(view.sample_ids), [INPUT]) == {
        r.sample_id: dict(r.fields) for r in rows(gid)
    }
    assert buffer.counts()[S.READY] == 1
    assert buffer.counts()[S.RESERVED] == 0


async def test_reserve_hands_out_distinct_ids(buffer: ReplayBuffer) -> None:
    ids = {buffer.reserve(target_step=0) for _ in range(4)}
    assert len(ids) == 4
    assert len(buffer) == 4


async def test_deferred_group_is_scored_to_ready(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(required_fields=(INPUT, TEACHER))
    gid = buffer.reserve(target_step=0)
    view = await buffer.commit(
        gid, rows(gid), start_weight_version=0, end_weight_version=0, defer_ready=True
    )
    assert view.state is S.WRITTEN
    assert view.awaiting_stage
    taken = buffer.take_for_scoring([gid])
    assert [g.state for g in taken] == [S.SCORING]
    assert buffer.state_of(gid) is S.SCORING
    buffer.store.add_fields({sid: {TEACHER: [0.5]} for sid in view.sample_ids})
    assert await buffer.mark_ready(gid, [TEACHER]) is S.READY
    ready = buffer.group(gid)
    assert ready.state is S.READY
    assert ready.fields == {INPUT, TEACHER}
    assert not ready.awaiting_stage


async def test_defer_with_every_field_present_still_waits_for_the_stage(
    buffer: ReplayBuffer,
) -> None:
    gid = await committed(buffer, defer=True)
    assert buffer.state_of(gid) is S.WRITTEN
    assert buffer.select(step=0, weight_version=0).group_ids == ()
    buffer.take_for_scoring([gid])
    assert await buffer.mark_ready(gid) is S.READY


async def test_mark_ready_with_fields_still_missing_returns_to_written(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(required_fields=(INPUT, TEACHER, REWARD))
    gid = await committed(buffer, defer=True, fields=(INPUT,))
    buffer.take_for_scoring([gid])
    buffer.store.add_fields({sid: {TEACHER: 0.1} for sid in row_ids(gid)})
    assert await buffer.mark_ready(gid, [TEACHER]) is S.WRITTEN
    assert buffer.group(gid).fields == {INPUT, TEACHER}
    assert not buffer.group(gid).awaiting_stage
    buffer.take_for_scoring([gid])
    buffer.store.add_fields({sid: {REWARD: 1.0} for sid in row_ids(gid)})
    assert await buffer.mark_ready(gid, [REWARD]) is S.READY


async def test_retry_returns_to_written_and_counts(buffer: ReplayBuffer) -> None:
    gid = await committed(buffer, defer=True)
    assert buffer.retries_of(gid) == 0
    for expected in (1, 2):
        buffer.take_for_scoring([gid])
        assert buffer.retry(gid) == expected
        assert buffer.state_of(gid) is S.WRITTEN
        assert buffer.retries_of(gid) == expected
    buffer.take_for_scoring([gid])
    assert await buffer.mark_ready(gid) is S.READY
    assert buffer.retries_of(gid) == 2


async def test_take_for_scoring_moves_every_listed_group(buffer: ReplayBuffer) -> None:
    a = await committed(buffer, defer=True)
    b = await committed(buffer, defer=True)
    c = await committed(buffer, defer=True)
    taken = buffer.take_for_scoring([c, a])
    assert [g.group_id for g in taken] == [c, a]
    assert [buffer.state_of(g) for g in (a, b, c)] == [S.SCORING, S.WRITTEN, S.SCORING]


async def test_in_order_select_picks_only_the_step_in_reservation_order(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(capacity=5)
    a0 = await committed(buffer, target_step=0, start=3)
    b1 = await committed(buffer, target_step=1)
    c0 = await committed(buffer, target_step=0, start=1)
    d0 = await committed(buffer, target_step=0, start=2)
    selection = buffer.select(step=0, weight_version=3)
    assert selection.group_ids == (a0, c0, d0)
    assert (selection.step, selection.weight_version) == (0, 3)
    assert selection.sample_ids == tuple(f"{g}/{i}" for g in (a0, c0, d0) for i in range(2))
    assert [g.state for g in selection.groups] == [S.CONSUMED] * 3
    assert all(buffer.state_of(g) is S.CONSUMED for g in (a0, c0, d0))
    assert buffer.state_of(b1) is S.READY


async def test_in_order_select_respects_max_groups(buffer: ReplayBuffer) -> None:
    a = await committed(buffer)
    b = await committed(buffer)
    assert buffer.select(step=0, weight_version=0, max_groups=1).group_ids == (a,)
    assert buffer.state_of(b) is S.READY
    assert buffer.select(step=0, weight_version=0, max_groups=0).group_ids == ()
    assert buffer.state_of(b) is S.READY


async def test_windowed_select_picks_fresh_enough_groups_oldest_version_first(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(capacity=5, sampler=Sampler.WINDOWED, max_staleness_versions=2)
    v5 = await committed(buffer, target_step=0, start=5)
    v3 = await committed(buffer, target_step=7, start=3)
    v1 = await committed(buffer, target_step=0, start=1)
    v4 = await committed(buffer, target_step=2, start=4)
    selection = buffer.select(step=0, weight_version=5)
    assert selection.group_ids == (v3, v4, v5)
    assert buffer.state_of(v1) is S.READY


async def test_windowed_select_respects_max_groups(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(sampler=Sampler.WINDOWED, max_staleness_versions=10)
    late = await committed(buffer, start=4)
    early = await committed(buffer, start=2)
    assert buffer.select(step=0, weight_version=4, max_groups=1).group_ids == (early,)
    assert buffer.state_of(late) is S.READY


async def test_select_with_nothing_ready_changes_nothing(buffer: ReplayBuffer) -> None:
    await committed(buffer, target_step=1)
    before = world(buffer)
    assert buffer.select(step=0, weight_version=0).groups == ()
    assert world(buffer) == before


async def test_release_clears_rows_and_lets_the_group_go(buffer: ReplayBuffer) -> None:
    keep = await committed(buffer, target_step=1)
    gid = await group_in(buffer, S.CONSUMED)
    assert buffer.store.list_ids() == row_ids(gid) | row_ids(keep)
    assert buffer.free_capacity == 2
    await buffer.release([gid])
    assert buffer.state_of(gid) is S.CONSUMED
    assert buffer.store.list_ids() == row_ids(keep)
    assert buffer.free_capacity == 3
    assert len(buffer) == 1
    assert buffer.counts()[S.CONSUMED] == 0
    with pytest.raises(ValueError, match="no longer held"):
        buffer.group(gid)


async def test_in_order_evict_stale_drops_past_steps_and_too_old_versions(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(capacity=5, max_staleness_versions=2)
    past_step = await committed(buffer, target_step=1, start=5)
    too_old = await committed(buffer, target_step=2, start=2)
    current = await committed(buffer, target_step=2, start=3)
    future = await committed(buffer, target_step=3, start=5)
    evicted = await buffer.evict_stale(step=2, weight_version=5)
    assert evicted == (past_step, too_old)
    assert buffer.state_of(past_step) is S.DISCARDED
    assert buffer.state_of(too_old) is S.DISCARDED
    assert buffer.store.list_ids() == row_ids(current) | row_ids(future)
    assert [buffer.state_of(g) for g in (current, future)] == [S.READY, S.READY]


async def test_in_order_evict_without_a_staleness_limit_ignores_versions(
    buffer: ReplayBuffer,
) -> None:
    old_version = await committed(buffer, target_step=4, start=0)
    assert await buffer.evict_stale(step=4, weight_version=1000) == ()
    assert buffer.state_of(old_version) is S.READY


async def test_windowed_evict_stale_drops_only_too_old_versions(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(sampler=Sampler.WINDOWED, max_staleness_versions=2)
    past_step = await committed(buffer, target_step=0, start=4)
    too_old = await committed(buffer, target_step=9, start=1)
    evicted = await buffer.evict_stale(step=9, weight_version=4)
    assert evicted == (too_old,)
    assert buffer.state_of(past_step) is S.READY
    assert buffer.store.list_ids() == row_ids(past_step)


@pytest.mark.parametrize(
    ("state", "actor"),
    [
        (S.RESERVED, Actor.ROLLOUT),
        (S.WRITTEN, Actor.STAGE),
        (S.WRITTEN, Actor.SUPERVISOR),
        (S.WRITTEN, Actor.CHECKPOINT),
        (S.SCORING, Actor.STAGE),
        (S.SCORING, Actor.SUPERVISOR),
        (S.SCORING, Actor.CHECKPOINT),
        (S.READY, Actor.TRAIN),
    ],
    ids=str,
)
async def test_discard_clears_the_rows(
    buffer: ReplayBuffer, state: GroupState, actor: Actor
) -> None:
    keep = await committed(buffer, target_step=1)
    gid = await group_in(buffer, state)
    await buffer.discard(gid, actor=actor)
    assert buffer.state_of(gid) is S.DISCARDED
    assert buffer.store.list_ids() == row_ids(keep)
    assert len(buffer) == 1
    assert buffer.counts()[state] == (1 if state is S.READY else 0)


async def test_count_for_target_step_counts_live_groups_only(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(capacity=6)
    live = {
        state: await group_in(buffer, state, target_step=3)
        for state in (S.RESERVED, S.WRITTEN, S.SCORING)
    }
    await committed(buffer, target_step=4)
    ready = await committed(buffer, target_step=3)
    assert buffer.count_for_target_step(3) == 4
    assert buffer.count_for_target_step(4) == 1
    assert buffer.select(step=3, weight_version=0).group_ids == (ready,)
    assert buffer.count_for_target_step(3) == 3
    await buffer.release([ready])
    assert buffer.count_for_target_step(3) == 3
    await buffer.discard(live[S.RESERVED])
    assert buffer.count_for_target_step(3) == 2
    assert buffer.count_for_target_step(99) == 0


# -- unready groups ----------------------------------------------------------------------


async def test_unready_groups_fill_the_buffer(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(capacity=3)
    for state in (S.RESERVED, S.WRITTEN, S.SCORING):
        await group_in(buffer, state)
    assert buffer.free_capacity == 0
    before = world(buffer)
    with pytest.raises(BufferFull, match="all 3 slots"):
        buffer.reserve(target_step=0)
    assert world(buffer) == before


async def test_consumed_groups_hold_capacity_until_released(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(capacity=1)
    gid = await group_in(buffer, S.CONSUMED)
    with pytest.raises(BufferFull):
        buffer.reserve(target_step=1)
    await buffer.release([gid])
    buffer.reserve(target_step=1)


@pytest.mark.parametrize("sampler", list(Sampler), ids=str)
async def test_unready_groups_are_never_selected(make_buffer: MakeBuffer, sampler: Sampler) -> None:
    buffer = make_buffer(capacity=4, sampler=sampler, max_staleness_versions=5)
    unready = [await group_in(buffer, state) for state in (S.RESERVED, S.WRITTEN, S.SCORING)]
    ready = await committed(buffer)
    assert buffer.select(step=0, weight_version=0).group_ids == (ready,)
    assert [buffer.state_of(g) for g in unready] == [S.RESERVED, S.WRITTEN, S.SCORING]


@pytest.mark.parametrize("sampler", list(Sampler), ids=str)
async def test_unready_groups_are_never_evicted(make_buffer: MakeBuffer, sampler: Sampler) -> None:
    buffer = make_buffer(capacity=4, sampler=sampler, max_staleness_versions=0)
    unready = [await group_in(buffer, state) for state in (S.RESERVED, S.WRITTEN, S.SCORING)]
    ready = await committed(buffer)
    assert await buffer.evict_stale(step=100, weight_version=100) == (ready,)
    assert [buffer.state_of(g) for g in unready] == [S.RESERVED, S.WRITTEN, S.SCORING]


# -- bad input raises and changes nothing ------------------------------------------------

BAD_COMMITS = [
    pytest.param(
        lambda gid, other: rows(gid, 1),
        {},
        ValueError,
        ["got 1 rows", "group_size is 2"],
        id="too-few-rows",
    ),
    pytest.param(
        lambda gid, other: rows(gid, 3),
        {},
        ValueError,
        ["got 3 rows", "group_size is 2"],
        id="too-many-rows",
    ),
    pytest.param(
        lambda gid, other: [Row(f"{gid}/0", {INPUT: 1}), Row(f"{gid}/0", {INPUT: 2})],
        {},
        ValueError,
        ["appear twice", "'{gid}/0'"],
        id="duplicate-sample-ids",
    ),
    pytest.param(
        lambda gid, other: [Row(f"{other}/1", {INPUT: 1}), Row(f"{gid}/1", {INPUT: 2})],
        {},
        ValueError,
        ["already in use", "'{other}/1' (group '{other}')"],
        id="sample-id-of-another-group",
    ),
    pytest.param(
        lambda gid, other: [Row(f"{gid}/0", {INPUT: 1}), Row(f"{gid}/1", {INPUT: 2, "extra": 3})],
        {},
        ValueError,
        ["different fields", "extra"],
        id="differing-field-sets",
    ),
    pytest.param(
        lambda gid, other: rows(gid, 2, ("other",)),
        {},
        ValueError,
        ["lack required fields ['input_ids']", "defer_ready"],
        id="missing-required-fields",
    ),
    pytest.param(
        lambda gid, other: rows(gid),
        {"start_weight_version": 5, "end_weight_version": 4},
        ValueError,
        ["end_weight_version=4", "start_weight_version=5"],
        id="end-before-start",
    ),
    pytest.param(
        lambda gid, other: rows(gid),
        {"start_weight_version": -1, "end_weight_version": 0},
        ValueError,
        ["start_weight_version", "-1"],
        id="negative-start-version",
    ),
    pytest.param(
        lambda gid, other: rows(gid),
        {"start_weight_version": 0, "end_weight_version": -2},
        ValueError,
        ["end_weight_version", "-2"],
        id="negative-end-version",
    ),
    pytest.param(
        lambda gid, other: [{"sample_id": f"{gid}/0"}, {"sample_id": f"{gid}/1"}],
        {},
        TypeError,
        ["Row objects"],
        id="not-row-objects",
    ),
]


@pytest.mark.parametrize(("make_rows", "versions", "error", "fragments"), BAD_COMMITS)
async def test_bad_commit_raises_and_changes_nothing(
    buffer: ReplayBuffer,
    make_rows: Callable[[str, str], list[Any]],
    versions: dict[str, int],
    error: type[Exception],
    fragments: list[str],
) -> None:
    other = await committed(buffer)
    gid = buffer.reserve(target_step=0)
    before = world(buffer)
    kwargs = {"start_weight_version": 0, "end_weight_version": 0} | versions
    with pytest.raises(error) as info:
        await buffer.commit(gid, make_rows(gid, other), **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment.format(gid=gid, other=other) in message
    assert world(buffer) == before
    await buffer.commit(gid, rows(gid), start_weight_version=0, end_weight_version=0)
    assert buffer.state_of(gid) is S.READY


async def test_commit_of_an_unknown_group_raises_unknown_group(buffer: ReplayBuffer) -> None:
    await committed(buffer)
    before = world(buffer)
    with pytest.raises(UnknownGroup, match="'nobody'") as info:
        await buffer.commit("nobody", rows("nobody"), start_weight_version=0, end_weight_version=0)
    assert isinstance(info.value, LookupError)
    assert world(buffer) == before


@pytest.mark.parametrize("state", [S.WRITTEN, S.SCORING, S.READY, S.CONSUMED, S.DISCARDED], ids=str)
async def test_commit_of_a_committed_or_finished_group_is_illegal(
    buffer: ReplayBuffer, state: GroupState
) -> None:
    gid = await group_in(buffer, state)
    before = world(buffer)
    with pytest.raises(IllegalTransition) as info:
        await buffer.commit(gid, rows(f"{gid}-again"), start_weight_version=0, end_weight_version=0)
    assert (info.value.group_id, info.value.state) == (gid, state)
    assert gid in str(info.value)
    assert str(state) in str(info.value)
    assert world(buffer) == before


async def test_commit_of_a_released_group_is_illegal(buffer: ReplayBuffer) -> None:
    gid = await released(buffer)
    before = world(buffer)
    with pytest.raises(IllegalTransition, match="CONSUMED"):
        await buffer.commit(gid, rows(f"{gid}-again"), start_weight_version=0, end_weight_version=0)
    assert world(buffer) == before


@pytest.mark.parametrize("state", [S.RESERVED, S.READY, S.DISCARDED], ids=str)
async def test_reserve_with_a_used_group_id_raises(buffer: ReplayBuffer, state: GroupState) -> None:
    gid = await group_in(buffer, state)
    before = world(buffer)
    with pytest.raises(ValueError, match=f"'{gid}' is already used") as info:
        buffer.reserve(target_step=0, group_id=gid)
    assert str(state) in str(info.value)
    assert world(buffer) == before
    assert buffer.state_of(gid) is state


async def test_reserve_of_a_negative_target_step_raises(buffer: ReplayBuffer) -> None:
    before = world(buffer)
    with pytest.raises(ValueError, match="target_step must be an int >= 0, got -1"):
        buffer.reserve(target_step=-1)
    assert world(buffer) == before


@pytest.mark.parametrize("odd_state", [S.RESERVED, S.SCORING, S.READY, S.DISCARDED], ids=str)
async def test_take_for_scoring_with_one_non_written_group_moves_none(
    make_buffer: MakeBuffer, odd_state: GroupState
) -> None:
    buffer = make_buffer(capacity=5)
    first = await group_in(buffer, S.WRITTEN)
    odd = await group_in(buffer, odd_state)
    last = await group_in(buffer, S.WRITTEN)
    before = world(buffer)
    with pytest.raises(IllegalTransition) as info:
        buffer.take_for_scoring([first, odd, last])
    assert info.value.group_id == odd
    assert str(odd_state) in str(info.value)
    assert world(buffer) == before


async def test_take_for_scoring_with_an_unknown_id_moves_none(buffer: ReplayBuffer) -> None:
    gid = await group_in(buffer, S.WRITTEN)
    before = world(buffer)
    with pytest.raises(UnknownGroup, match="'ghost'"):
        buffer.take_for_scoring([gid, "ghost"])
    assert world(buffer) == before


async def test_take_for_scoring_with_a_repeated_id_moves_none(buffer: ReplayBuffer) -> None:
    gid = await group_in(buffer, S.WRITTEN)
    before = world(buffer)
    with pytest.raises(ValueError, match="listed twice"):
        buffer.take_for_scoring([gid, gid])
    assert world(buffer) == before


@pytest.mark.parametrize("state", [S.RESERVED, S.WRITTEN, S.SCORING, S.READY], ids=str)
async def test_release_of_a_non_consumed_group_raises_and_releases_nothing(
    buffer: ReplayBuffer, state: GroupState
) -> None:
    consumed = await group_in(buffer, S.CONSUMED, target_step=5)
    other = await group_in(buffer, state)
    before = world(buffer)
    with pytest.raises(ValueError, match=f"'{other}' is {state}"):
        await buffer.release([consumed, other])
    assert world(buffer) == before
    assert buffer.state_of(consumed) is S.CONSUMED


async def test_release_of_an_unknown_group_raises(buffer: ReplayBuffer) -> None:
    consumed = await group_in(buffer, S.CONSUMED)
    before = world(buffer)
    with pytest.raises(UnknownGroup, match="'ghost'"):
        await buffer.release([consumed, "ghost"])
    assert world(buffer) == before


async def test_release_of_a_group_listed_twice_raises_and_releases_nothing(
    buffer: ReplayBuffer,
) -> None:
    """Like take_for_scoring: a repeated id is a caller error reported before anything moves."""
    gid = await group_in(buffer, S.CONSUMED)
    before = world(buffer)
    with pytest.raises(ValueError, match="twice"):
        await buffer.release([gid, gid])
    assert world(buffer) == before


@pytest.mark.parametrize("finished", ["discarded", "released"])
async def test_discard_of_a_finished_group_is_illegal(buffer: ReplayBuffer, finished: str) -> None:
    await committed(buffer, target_step=1)
    gid = await group_in(buffer, S.DISCARDED) if finished == "discarded" else await released(buffer)
    state = buffer.state_of(gid)
    before = world(buffer)
    with pytest.raises(IllegalTransition, match="terminal") as info:
        await buffer.discard(gid, actor=Actor.SUPERVISOR)
    assert info.value.state is state
    assert world(buffer) == before


async def test_discard_of_an_unknown_group_raises(buffer: ReplayBuffer) -> None:
    with pytest.raises(UnknownGroup, match="'ghost'"):
        await buffer.discard("ghost")


WRONG_ACTORS = [
    pytest.param(
        S.WRITTEN,
        lambda b, g: b.discard(g, actor=Actor.ROLLOUT),
        Actor.ROLLOUT,
        id="discard-written-by-rollout",
    ),
    pytest.param(
        S.SCORING,
        lambda b, g: b.discard(g, actor=Actor.TRAIN),
        Actor.TRAIN,
        id="discard-scoring-by-train",
    ),
    pytest.param(
        S.READY,
        lambda b, g: b.discard(g, actor=Actor.ROLLOUT),
        Actor.ROLLOUT,
        id="discard-ready-by-rollout",
    ),
    pytest.param(
        S.RESERVED,
        lambda b, g: b.discard(g, actor=Actor.STAGE),
        Actor.STAGE,
        id="discard-reserved-by-stage",
    ),
    pytest.param(
        S.RESERVED,
        lambda b, g: b.commit(
            g, rows(g), start_weight_version=0, end_weight_version=0, actor=Actor.STAGE
        ),
        Actor.STAGE,
        id="commit-by-stage",
    ),
    pytest.param(
        S.WRITTEN,
        lambda b, g: b.take_for_scoring([g], actor=Actor.TRAIN),
        Actor.TRAIN,
        id="take-by-train",
    ),
    pytest.param(
        S.SCORING,
        lambda b, g: b.mark_ready(g, actor=Actor.ROLLOUT),
        Actor.ROLLOUT,
        id="mark-ready-by-rollout",
    ),
    pytest.param(
        S.SCORING,
        lambda b, g: b.retry(g, actor=Actor.SUPERVISOR),
        Actor.SUPERVISOR,
        id="retry-by-supervisor",
    ),
    pytest.param(
        S.READY,
        lambda b, g: b.select(step=0, weight_version=0, actor=Actor.STAGE),
        Actor.STAGE,
        id="select-by-stage",
    ),
    pytest.param(
        S.READY,
        lambda b, g: b.evict_stale(step=1, weight_version=0, actor=Actor.ROLLOUT),
        Actor.ROLLOUT,
        id="evict-by-rollout",
    ),
    pytest.param(
        None,
        lambda b, g: b.reserve(target_step=0, actor=Actor.TRAIN),
        Actor.TRAIN,
        id="reserve-by-train",
    ),
]


@pytest.mark.parametrize(("state", "act", "actor"), WRONG_ACTORS)
async def test_call_by_a_forbidden_actor_raises_and_changes_nothing(
    buffer: ReplayBuffer,
    state: GroupState | None,
    act: Callable[[ReplayBuffer, str], Any],
    actor: Actor,
) -> None:
    gid = await group_in(buffer, state) if state is not None else "unused"
    before = world(buffer)
    with pytest.raises(IllegalTransition) as info:
        await call(act, buffer, gid)
    assert info.value.actor is actor
    assert str(actor) in str(info.value)
    assert world(buffer) == before


WRONG_STATE_CALLS = [
    pytest.param(S.WRITTEN, lambda b, g: b.mark_ready(g), id="mark-ready-of-written"),
    pytest.param(S.READY, lambda b, g: b.mark_ready(g), id="mark-ready-of-ready"),
    pytest.param(S.WRITTEN, lambda b, g: b.retry(g), id="retry-of-written"),
    pytest.param(S.DISCARDED, lambda b, g: b.retry(g), id="retry-of-discarded"),
    pytest.param(
        S.CONSUMED, lambda b, g: b.discard(g, actor=Actor.TRAIN), id="discard-of-consumed"
    ),
]


@pytest.mark.parametrize(("state", "act"), WRONG_STATE_CALLS)
async def test_call_in_the_wrong_state_raises_and_changes_nothing(
    buffer: ReplayBuffer, state: GroupState, act: Callable[[ReplayBuffer, str], Any]
) -> None:
    gid = await group_in(buffer, state)
    before = world(buffer)
    with pytest.raises(IllegalTransition) as info:
        await call(act, buffer, gid)
    assert info.value.state is state
    assert world(buffer) == before


async def test_mark_ready_with_a_bare_string_raises_type_error(buffer: ReplayBuffer) -> None:
    gid = await group_in(buffer, S.SCORING)
    before = world(buffer)
    with pytest.raises(TypeError, match="collection of names"):
        await buffer.mark_ready(gid, INPUT)
    assert world(buffer) == before


@pytest.mark.parametrize(
    "act",
    [
        pytest.param(lambda b: b.select(step=-1, weight_version=0), id="select-negative-step"),
        pytest.param(lambda b: b.select(step=0, weight_version=-1), id="select-negative-version"),
        pytest.param(
            lambda b: b.select(step=0, weight_version=0, max_groups=-1),
            id="select-negative-max-groups",
        ),
        pytest.param(lambda b: b.evict_stale(step=-1, weight_version=0), id="evict-negative-step"),
        pytest.param(
            lambda b: b.evict_stale(step=0, weight_version=-1), id="evict-negative-version"
        ),
    ],
)
async def test_negative_step_or_version_raises_and_changes_nothing(
    make_buffer: MakeBuffer, act: Callable[[ReplayBuffer], Any]
) -> None:
    buffer = make_buffer(max_staleness_versions=0)
    await committed(buffer, start=3)
    before = world(buffer)
    with pytest.raises(ValueError, match="must be an int >= 0, got -1"):
        await call(act, buffer)
    assert world(buffer) == before


# -- checkpoint: state_dict / load_state_dict --------------------------------------------


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
            {"required_fields": (INPUT,)},
            {"required_fields": (INPUT, TEACHER)},
            ["['input_ids']", "['input_ids', 'teacher_logprobs']"],
            id="required-fields",
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


async def test_load_of_a_foreign_format_raises(buffer: ReplayBuffer) -> None:
    with pytest.raises(ValueError, match="not a groupflow buffer state"):
        await buffer.load_state_dict({"format": "something/9"})
    assert buffer.store.list_ids() == frozenset()


# -- a store that fails mid-write --------------------------------------------------------


class HalfWritingStore(MemoryStore):
    """Writes the first half of the rows it is given, then fails."""

    def __init__(self, *, blocking: bool = False) -> None:
        super().__init__(blocking=blocking)
        self.ids_at_failure: frozenset[str] | None = None

    def put(self, rows: Any) -> None:
        items = list(rows.items())
        super().put(dict(items[: len(items) // 2]))
        self.ids_at_failure = self.list_ids()
        raise OSError("store connection lost mid-write")


@pytest.mark.parametrize("blocking", [False, True], ids=["inline", "thread"])
async def test_failed_store_write_clears_partial_rows_and_keeps_the_group_reserved(
    make_buffer: MakeBuffer, blocking: bool
) -> None:
    store = HalfWritingStore(blocking=blocking)
    buffer = make_buffer(store=store, group_size=4)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(5):
        with pytest.raises(OSError, match="mid-write"):
            await buffer.commit(gid, rows(gid, 4), start_weight_version=0, end_weight_version=0)
        assert store.ids_at_failure == {f"{gid}/0", f"{gid}/1"}
        assert store.list_ids() == frozenset()
        assert buffer.state_of(gid) is S.RESERVED
        assert buffer.group(gid).sample_ids == ()
        assert_invariants(buffer.snapshot())
        await buffer.discard(gid)
    assert buffer.state_of(gid) is S.DISCARDED
    assert len(buffer) == 0


# -- a blocking store --------------------------------------------------------------------


class ThreadRecordingStore(MemoryStore):
    """A blocking MemoryStore that records the thread of every call that writes or clears."""

    def __init__(self) -> None:
        super().__init__(blocking=True)
        self.threads: list[threading.Thread] = []

    def put(self, rows: Any) -> None:
        self.threads.append(threading.current_thread())
        super().put(rows)

    def clear(self, sample_ids: Any, *, missing_ok: bool = False) -> None:
        self.threads.append(threading.current_thread())
        super().clear(sample_ids, missing_ok=missing_ok)


async def test_blocking_store_works_end_to_end_through_worker_threads(
    make_buffer: MakeBuffer,
) -> None:
    store = ThreadRecordingStore()
    buffer = make_buffer(store=store, required_fields=(INPUT, TEACHER), max_staleness_versions=1)
    with trio.fail_after(5):
        scored = await committed(buffer, defer=True, fields=(INPUT,))
        buffer.take_for_scoring([scored])
        store.add_fields({sid: {TEACHER: 1.0} for sid in row_ids(scored)})
        assert await buffer.mark_ready(scored, [TEACHER]) is S.READY
        stale = await committed(buffer, target_step=0, start=0)
        dropped = await committed(buffer, defer=True)
        await buffer.discard(dropped, actor=Actor.STAGE)
        assert await buffer.evict_stale(step=0, weight_version=2) == (scored, stale)
        kept = await committed(buffer, target_step=1, start=2)
        state = await buffer.state_dict()
        selection = buffer.select(step=1, weight_version=2)
        assert selection.group_ids == (kept,)
        await buffer.release(selection.group_ids)
        restored = make_buffer(store=MemoryStore(blocking=True), required_fields=(INPUT, TEACHER))
        await restored.load_state_dict(state)
    assert restored.groups()[0].group_id == kept
    assert store.list_ids() == frozenset()
    assert len(store.threads) == 8  # 4 puts; clears: 1 discard, 2 evictions, 1 release
    assert all(t is not threading.main_thread() for t in store.threads)
    assert_invariants(buffer.snapshot())


# -- cancellation ------------------------------------------------------------------------


class SlowStore(MemoryStore):
    """A blocking store whose puts and clears sleep in their worker thread."""

    def __init__(self, delay: float = 0.2) -> None:
        super().__init__(blocking=True)
        self.delay = delay
        self.slow = True
        self.started = threading.Event()
        self.finished = threading.Event()

    def _slowly(self, write: Callable[[], None]) -> None:
        if not self.slow:
            write()
            return
        self.started.set()
        time.sleep(self.delay)
        write()
        self.finished.set()

    def put(self, rows: Any) -> None:
        self._slowly(partial(MemoryStore.put, self, rows))

    def clear(self, sample_ids: Any, *, missing_ok: bool = False) -> None:
        ids = list(sample_ids)
        self._slowly(partial(MemoryStore.clear, self, ids, missing_ok=missing_ok))


async def cancel_mid_call(store: SlowStore, fn: Callable[[], Any]) -> None:
    """Run `fn` and cancel it from outside once the store's thread is inside a slow call."""
    store.started.clear()
    store.finished.clear()
    store.slow = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fn)
        while not store.started.is_set():
            await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    store.slow = False


async def test_cancelled_commit_still_finishes_its_write(make_buffer: MakeBuffer) -> None:
    store = SlowStore()
    buffer = make_buffer(store=store)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(5):
        await cancel_mid_call(
            store,
            partial(buffer.commit, gid, rows(gid), start_weight_version=0, end_weight_version=0),
        )
    assert store.finished.is_set(), "the worker thread was abandoned mid-write"
    assert store.list_ids() == row_ids(gid)
    assert buffer.state_of(gid) is S.READY
    assert_invariants(buffer.snapshot())


async def test_cancelled_evict_stale_leaves_the_buffer_consistent() -> None:
    """Cancelled while clearing the first of two stale groups: every group must end either
    still READY with its rows, or DISCARDED, let go and cleared, so a later call can finish.

    (Built with `new_buffer`: the invariants are asserted here, not again at teardown.)"""
    store = SlowStore()
    buffer = new_buffer(store=store)
    store.slow = False
    first = await committed(buffer, target_step=0)
    second = await committed(buffer, target_step=0)
    with trio.fail_after(5):
        await cancel_mid_call(store, partial(buffer.evict_stale, step=1, weight_version=0))
        assert store.finished.is_set()
        assert_invariants(buffer.snapshot())
        await buffer.evict_stale(step=1, weight_version=0)
    assert [buffer.state_of(g) for g in (first, second)] == [S.DISCARDED, S.DISCARDED]
    assert store.list_ids() == frozenset()
    assert len(buffer) == 0


async def test_cancelled_release_leaves_the_buffer_consistent(make_buffer: MakeBuffer) -> None:
    store = SlowStore()
    buffer = make_buffer(store=store)
    store.slow = False
    first = await committed(buffer)
    second = await committed(buffer)
    selection = buffer.select(step=0, weight_version=0)
    with trio.fail_after(5):
        await cancel_mid_call(store, partial(buffer.release, selection.group_ids))
        assert store.finished.is_set()
        assert_invariants(buffer.snapshot())
        still_held = [g.group_id for g in buffer.groups()]
        await buffer.release(still_held)
    assert [buffer.state_of(g) for g in (first, second)] == [S.CONSUMED, S.CONSUMED]
    assert store.list_ids() == frozenset()


async def test_mark_ready_refuses_fields_the_store_does_not_hold(buffer: ReplayBuffer) -> None:
    gid = await group_in(buffer, S.SCORING)
    before = world(buffer)
    with pytest.raises(MissingDataError, match=rf"group '{gid}' lacks \['{TEACHER}'\]"):
        await buffer.mark_ready(gid, [TEACHER])
    assert world(buffer) == before


async def test_mark_ready_many_is_all_or_none(buffer: ReplayBuffer) -> None:
    first = await group_in(buffer, S.SCORING)
    second = await group_in(buffer, S.SCORING)
    buffer.store.add_fields({sid: {TEACHER: 1.0} for sid in row_ids(first)})
    before = world(buffer)
    with pytest.raises(MissingDataError, match=second):
        await buffer.mark_ready_many([first, second], [TEACHER])
    assert world(buffer) == before
    buffer.store.add_fields({sid: {TEACHER: 1.0} for sid in row_ids(second)})
    assert await buffer.mark_ready_many([first, second], [TEACHER]) == (S.READY, S.READY)


async def test_discard_many_is_all_or_none(buffer: ReplayBuffer) -> None:
    written = await group_in(buffer, S.WRITTEN)
    consumed = await group_in(buffer, S.CONSUMED)
    before = world(buffer)
    with pytest.raises(IllegalTransition):
        await buffer.discard_many([written, consumed], actor=Actor.STAGE)
    assert world(buffer) == before
    other = await group_in(buffer, S.SCORING)
    await buffer.discard_many([written, other], actor=Actor.STAGE)
    assert {buffer.state_of(written), buffer.state_of(other)} == {S.DISCARDED}
    assert_invariants(buffer.snapshot())


async def test_a_handle_fires_as_its_actor_only(buffer: ReplayBuffer) -> None:
    gid = await group_in(buffer, S.WRITTEN)
    train = buffer.as_actor(Actor.TRAIN)
    with pytest.raises(IllegalTransition, match="train may not fire"):
        train.take_for_scoring([gid])
    (view,) = buffer.as_actor(Actor.STAGE).take_for_scoring([gid])
    assert view.state is S.SCORING


def test_memory_store_names_the_fields_rows_lack() -> None:
    store = MemoryStore()
    store.put({"a": {"x": 1}, "b": {"x": 1, "y": 2}})
    assert store.missing_fields(["a", "b", "c"], ["x", "y"]) == {"a": ["y"], "c": ["x", "y"]}
    assert store.missing_fields(["b"], ["x", "y"]) == {}
