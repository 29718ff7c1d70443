"""ReplayBuffer over MemoryStore: the lifecycle paths, selection, eviction and release, and
unready groups that hold capacity but are never selected or evicted.

Every buffer made through the `make_buffer` fixture (`conftest.py`) has the model's invariants
asserted on its final snapshot when the test ends."""

from __future__ import annotations

import pytest

from groupflow.impl import ReplayBuffer, Sampler
from groupflow.impl.errors import BufferFull, UnknownGroup
from groupflow.model import Actor, GroupState
from tests.helpers import (
    INPUT,
    REWARD,
    TEACHER,
    MakeBuffer,
    S,
    committed,
    group_in,
    released,
    row_ids,
    rows,
    world,
    written,
)


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


# -- group ids, counters and lookups -----------------------------------------------------


async def test_fresh_group_ids_number_the_reservations_from_g000000(buffer: ReplayBuffer) -> None:
    """Fresh ids count the reservations made, held or finished, so a run's ids read in order."""
    first = buffer.reserve(target_step=0)
    await buffer.discard(first)
    assert [first, buffer.reserve(target_step=0), buffer.reserve(target_step=1)] == [
        "g000000",
        "g000001",
        "g000002",
    ]


async def test_reserve_with_a_chosen_group_id_holds_the_group_under_it(
    buffer: ReplayBuffer,
) -> None:
    assert buffer.reserve(target_step=2, group_id="mine") == "mine"
    assert buffer.state_of("mine") is S.RESERVED
    assert buffer.group("mine").target_step == 2
    assert buffer.reserve(target_step=0) == "g000000"


@pytest.mark.parametrize(("capacity", "remembered"), [(4, 4096), (600, 4800)])
async def test_the_last_4096_finished_groups_or_8_per_slot_are_remembered(
    make_buffer: MakeBuffer, capacity: int, remembered: int
) -> None:
    """A late call on a group finished recently is refused as illegal, not unknown; older ones
    are forgotten, so a long run's memory stays flat."""
    buffer = make_buffer(capacity=capacity)
    finished = [await group_in(buffer, S.DISCARDED) for _ in range(remembered)]
    assert buffer.state_of(finished[0]) is S.DISCARDED
    last = await group_in(buffer, S.DISCARDED)
    with pytest.raises(UnknownGroup, match=repr(finished[0])):
        buffer.state_of(finished[0])
    assert buffer.state_of(finished[1]) is S.DISCARDED
    assert buffer.state_of(last) is S.DISCARDED


async def test_count_in_follows_the_groups_of_each_state_and_step(make_buffer: MakeBuffer) -> None:
    """Held groups per (state, step), kept as counters: the train and teacher pumps ask at
    every change while they wait."""
    buffer = make_buffer(capacity=6)

    def at(step: int) -> list[int]:
        return [buffer.count_in(state, step) for state in S]  # RESERVED .. DISCARDED

    first, second = buffer.reserve(target_step=1), buffer.reserve(target_step=1)
    other = buffer.reserve(target_step=2)
    assert (at(1), at(2)) == ([2, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0])
    await buffer.commit(first, rows(first), start_weight_version=0, end_weight_version=0)
    assert at(1) == [1, 0, 0, 1, 0, 0]
    await buffer.commit(
        second, rows(second), start_weight_version=0, end_weight_version=0, defer_ready=True
    )
    assert at(1) == [0, 1, 0, 1, 0, 0]
    buffer.take_for_scoring([second])
    assert at(1) == [0, 0, 1, 1, 0, 0]
    await buffer.mark_ready(second)
    assert at(1) == [0, 0, 0, 2, 0, 0]
    assert buffer.select(step=1, weight_version=0).group_ids == (first, second)
    assert at(1) == [0, 0, 0, 0, 2, 0]
    await buffer.release([first])
    assert at(1) == [0, 0, 0, 0, 1, 0]
    await buffer.release([second])
    await buffer.discard(other)
    assert (at(1), at(2)) == ([0] * 6, [0] * 6)


async def test_ordinals_in_names_the_numbered_groups_of_one_state_and_step(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(capacity=6)
    buffer.reserve(target_step=3, ordinal=1)
    await committed(buffer, target_step=3, defer=True, ordinal=2)
    unnumbered = await committed(buffer, target_step=3, defer=True)
    await committed(buffer, target_step=3, ordinal=4)
    await committed(buffer, target_step=4, defer=True, ordinal=5)
    assert buffer.ordinals_in(S.WRITTEN, 3) == {2}
    assert buffer.ordinals_in(S.RESERVED, 3) == {1}
    assert buffer.ordinals_in(S.READY, 3) == {4}
    assert buffer.ordinals_in(S.WRITTEN, 4) == {5}
    assert buffer.ordinals_in(S.SCORING, 3) == set()
    assert buffer.ordinals_in(S.WRITTEN, 9) == set()
    assert [g.ordinal for g in buffer.groups(S.WRITTEN, step=3)] == [2, None]
    assert buffer.groups(S.WRITTEN, step=3)[1].group_id == unnumbered


async def test_mark_ready_naming_a_field_the_rows_already_had_keeps_it(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(required_fields=(INPUT, TEACHER))
    gid = await committed(buffer, defer=True, fields=(INPUT,))
    buffer.take_for_scoring([gid])
    buffer.store.add_fields({sid: {TEACHER: 0.5} for sid in row_ids(gid)})
    assert await buffer.mark_ready(gid, [INPUT, TEACHER]) is S.READY
    assert buffer.group(gid).fields == {INPUT, TEACHER}


async def test_windowed_select_takes_weight_version_0_before_version_1(
    make_buffer: MakeBuffer,
) -> None:
    buffer = make_buffer(sampler=Sampler.WINDOWED, max_staleness_versions=5)
    v1 = await committed(buffer, start=1)
    v0 = await committed(buffer, start=0)
    assert buffer.select(step=0, weight_version=1).group_ids == (v0, v1)


@pytest.mark.parametrize("finished", ["released", "evicted"])
async def test_the_row_ids_of_a_finished_group_are_free_for_a_new_group(
    buffer: ReplayBuffer, finished: str
) -> None:
    if finished == "released":
        gid = await released(buffer)
    else:
        gid = await committed(buffer)
        assert await buffer.evict_stale(step=1, weight_version=0) == (gid,)
    other = buffer.reserve(target_step=1)
    view = await buffer.commit(other, rows(gid), start_weight_version=0, end_weight_version=0)
    assert view.sample_ids == (f"{gid}/0", f"{gid}/1")


async def test_numbers_past_256_are_compared_by_value(make_buffer: MakeBuffer) -> None:
    """Past 256, equal ints are distinct objects (a length just counted, a step read back from
    a file): capacity, batch sizes and steps must be compared by value."""
    buffer = make_buffer(capacity=300, group_size=1)
    ids = await written(buffer, 300, step=300)
    with pytest.raises(BufferFull, match="all 300 slots"):
        buffer.reserve(target_step=300)
    assert len(buffer.take_for_scoring(ids)) == 300
    assert await buffer.mark_ready_many(ids) == (S.READY,) * 300
    step = int("300")  # the groups' target step, as another object
    assert buffer.select(step=step, weight_version=0).group_ids == tuple(ids)
