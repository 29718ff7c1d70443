"""ReplayBuffer: bad input, wrong states and wrong actors raise, and change nothing.

Every buffer made through the `make_buffer` fixture (`conftest.py`) has the model's invariants
asserted on its final snapshot when the test ends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from groupflow.impl import ReplayBuffer, Row
from groupflow.impl.errors import BufferFull, MissingDataError, UnknownGroup
from groupflow.model import Actor, GroupState, IllegalTransition, assert_invariants
from tests.helpers import (
    INPUT,
    TEACHER,
    MakeBuffer,
    S,
    call,
    committed,
    group_in,
    released,
    row_ids,
    rows,
    world,
)

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
    kwargs: dict[str, Any] = {"start_weight_version": 0, "end_weight_version": 0} | versions
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


async def test_a_change_fires_as_the_actor_named_only(buffer: ReplayBuffer) -> None:
    gid = await group_in(buffer, S.WRITTEN)
    with pytest.raises(IllegalTransition, match="train may not fire"):
        buffer.take_for_scoring([gid], actor=Actor.TRAIN)
    (view,) = buffer.take_for_scoring([gid], actor=Actor.STAGE)
    assert view.state is S.SCORING


POSITIONAL_OPTIONS = [
    pytest.param(None, "reserve", lambda g: (0,), id="reserve"),
    pytest.param(S.RESERVED, "commit", lambda g: (g, rows(g), 0, 0), id="commit"),
    pytest.param(S.WRITTEN, "take_for_scoring", lambda g: ([g], Actor.STAGE), id="take"),
    pytest.param(S.SCORING, "mark_ready", lambda g: (g, (), Actor.STAGE), id="mark-ready"),
    pytest.param(
        S.SCORING, "mark_ready_many", lambda g: ([g], (), Actor.STAGE), id="mark-ready-many"
    ),
    pytest.param(S.SCORING, "retry", lambda g: (g, Actor.STAGE), id="retry"),
    pytest.param(S.RESERVED, "discard", lambda g: (g, Actor.ROLLOUT), id="discard"),
    pytest.param(S.RESERVED, "discard_many", lambda g: ([g], Actor.ROLLOUT), id="discard-many"),
    pytest.param(S.READY, "select", lambda g: (0, 0), id="select"),
    pytest.param(S.READY, "evict_stale", lambda g: (1, 0), id="evict"),
    pytest.param(S.READY, "groups", lambda g: (S.READY, 0), id="groups"),
    pytest.param(None, "stray_rows", lambda g: (True,), id="stray-rows"),
]


@pytest.mark.parametrize(("state", "method", "args"), POSITIONAL_OPTIONS)
async def test_options_passed_by_position_are_refused_and_change_nothing(
    buffer: ReplayBuffer,
    state: GroupState | None,
    method: str,
    args: Callable[[str], tuple[Any, ...]],
) -> None:
    """Steps, versions, actors and flags are keyword-only: `select(3, 2)` or `retry(g, actor)`
    would be too easy to misread or to pass in the wrong order."""
    gid = await group_in(buffer, state) if state is not None else "unused"
    before = world(buffer)
    with pytest.raises(TypeError):
        await call(getattr(buffer, method), *args(gid))
    assert world(buffer) == before


async def test_a_refused_reservation_names_the_group_id_asked_for(make_buffer: MakeBuffer) -> None:
    buffer = make_buffer(capacity=1)
    buffer.reserve(target_step=0)
    with pytest.raises(BufferFull, match="cannot reserve 'mine': all 1 slots"):
        buffer.reserve(target_step=0, group_id="mine")
    with pytest.raises(BufferFull, match="cannot reserve a new group: all 1 slots"):
        buffer.reserve(target_step=0)
    with pytest.raises(IllegalTransition, match="'mine'") as info:
        buffer.reserve(target_step=0, group_id="mine", actor=Actor.TRAIN)
    assert info.value.group_id == "mine"
    with pytest.raises(IllegalTransition, match=r"\(new\)") as info:
        buffer.reserve(target_step=0, actor=Actor.TRAIN)
    assert info.value.group_id == "(new)"


TWICE = [
    pytest.param(S.WRITTEN, lambda b, ids: b.take_for_scoring(ids), id="take"),
    pytest.param(S.SCORING, lambda b, ids: b.mark_ready_many(ids), id="mark-ready-many"),
    pytest.param(
        S.WRITTEN, lambda b, ids: b.discard_many(ids, actor=Actor.STAGE), id="discard-many"
    ),
    pytest.param(S.CONSUMED, lambda b, ids: b.release(ids), id="release"),
]


@pytest.mark.parametrize(("state", "act"), TWICE)
async def test_a_call_listing_a_group_twice_names_that_group_only_and_changes_nothing(
    buffer: ReplayBuffer, state: GroupState, act: Callable[[ReplayBuffer, list[str]], Any]
) -> None:
    twice = await group_in(buffer, state)
    once = await group_in(buffer, state)
    before = world(buffer)
    with pytest.raises(ValueError, match=rf"listed twice: \[{twice!r}\]$"):
        await call(act, buffer, [twice, once, twice])
    assert world(buffer) == before


async def test_a_refused_release_names_the_first_group_not_consumed(buffer: ReplayBuffer) -> None:
    consumed = await group_in(buffer, S.CONSUMED)
    written = await group_in(buffer, S.WRITTEN)
    ready = await group_in(buffer, S.READY, target_step=1)
    with pytest.raises(IllegalTransition) as info:
        await buffer.release([consumed, written, ready])
    assert (info.value.group_id, info.value.state) == (written, S.WRITTEN)
    assert f"{written!r} is WRITTEN, {ready!r} is READY" in str(info.value)
