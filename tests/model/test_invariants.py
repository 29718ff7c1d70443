"""The model's buffer invariants, checked against hand-built snapshots."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import attrs
import pytest

from groupflow.model import (
    INVARIANTS,
    BufferSnapshot,
    GroupState,
    GroupView,
    InvariantViolation,
    Violation,
    assert_invariants,
    check_invariants,
)
from groupflow.model.invariants import (
    capacity_respected,
    counts_consistent,
    one_state_per_group,
    ready_has_required_fields,
    rows_match_groups,
)

S = GroupState
GROUP_SIZE = 2
REQUIRED = frozenset({"input_ids", "teacher_logprobs"})
_ROW_OWNERS = {S.WRITTEN, S.SCORING, S.READY, S.CONSUMED}


def group(
    group_id: str,
    state: GroupState,
    *,
    rows: int | None = None,
    fields: frozenset[str] | None = None,
    awaiting_stage: bool = False,
) -> GroupView:
    """A group view; row-owning states get `GROUP_SIZE` rows named after the group."""
    if rows is None:
        rows = GROUP_SIZE if state in _ROW_OWNERS else 0
    if fields is None:
        fields = REQUIRED if state in _ROW_OWNERS else frozenset()
    return GroupView(
        group_id=group_id,
        state=state,
        target_step=0,
        sample_ids=tuple(f"{group_id}/{i}" for i in range(rows)),
        fields=fields,
        awaiting_stage=awaiting_stage,
    )


def snapshot(
    *groups: GroupView,
    store_ids: frozenset[str] | None = None,
    counts: Mapping[GroupState, int] | None = None,
    capacity: int = 8,
) -> BufferSnapshot:
    """A snapshot whose store and counters agree with `groups` unless given explicitly."""
    if store_ids is None:
        store_ids = frozenset(sid for g in groups if g.state in _ROW_OWNERS for sid in g.sample_ids)
    if counts is None:
        recount = Counter(g.state for g in groups)
        counts = {state: recount[state] for state in GroupState}
    return BufferSnapshot(
        groups=groups,
        store_ids=store_ids,
        counts=counts,
        capacity=capacity,
        group_size=GROUP_SIZE,
        required_fields=REQUIRED,
    )


def consistent() -> BufferSnapshot:
    """One group in every state a buffer holds, all in order."""
    return snapshot(
        group("reserved", S.RESERVED),
        group("written", S.WRITTEN, fields=frozenset({"input_ids"}), awaiting_stage=True),
        group("scoring", S.SCORING, fields=frozenset({"input_ids"})),
        group("ready", S.READY),
        group("consumed", S.CONSUMED),
        group("discarded", S.DISCARDED),
    )


def messages(violations: list[Violation]) -> str:
    return "\n".join(str(v) for v in violations)


# -- a consistent snapshot ---------------------------------------------------------------


def test_consistent_snapshot_has_no_violations() -> None:
    snap = consistent()
    assert check_invariants(snap) == []
    assert_invariants(snap)


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
def test_each_invariant_accepts_the_consistent_snapshot(
    check: Callable[[BufferSnapshot], list[Violation]],
) -> None:
    assert check(consistent()) == []


def test_empty_snapshot_has_no_violations() -> None:
    assert check_invariants(snapshot()) == []


def test_invariants_lists_every_check() -> None:
    assert set(INVARIANTS) == {
        one_state_per_group,
        ready_has_required_fields,
        rows_match_groups,
        counts_consistent,
        capacity_respected,
    }


# -- one_state_per_group -----------------------------------------------------------------


def test_group_listed_twice_is_reported_with_its_count() -> None:
    snap = snapshot(group("g1", S.RESERVED), group("g1", S.RESERVED), group("g2", S.RESERVED))
    violations = one_state_per_group(snap)
    assert len(violations) == 1
    assert violations[0].invariant == "one_state_per_group"
    assert "'g1'" in violations[0].message
    assert "2 times" in violations[0].message
    assert "g2" not in messages(violations)


# -- ready_has_required_fields -----------------------------------------------------------


def test_ready_group_lacking_a_required_field_is_reported() -> None:
    snap = snapshot(group("g1", S.READY, fields=frozenset({"input_ids"})))
    violations = ready_has_required_fields(snap)
    assert len(violations) == 1
    assert violations[0].invariant == "ready_has_required_fields"
    assert "'g1'" in violations[0].message
    assert "teacher_logprobs" in violations[0].message
    assert "input_ids" not in violations[0].message


def test_ready_group_still_awaiting_a_stage_is_reported() -> None:
    snap = snapshot(group("g1", S.READY, awaiting_stage=True))
    violations = ready_has_required_fields(snap)
    assert len(violations) == 1
    assert "'g1'" in violations[0].message
    assert "stage" in violations[0].message


def test_unready_groups_may_lack_fields() -> None:
    snap = snapshot(
        group("w", S.WRITTEN, fields=frozenset(), awaiting_stage=True),
        group("s", S.SCORING, fields=frozenset()),
    )
    assert ready_has_required_fields(snap) == []


# -- rows_match_groups -------------------------------------------------------------------


def test_row_missing_from_the_store_is_reported() -> None:
    g = group("g1", S.READY)
    snap = snapshot(g, store_ids=frozenset({"g1/0"}))
    violations = rows_match_groups(snap)
    assert len(violations) == 1
    assert "'g1'" in violations[0].message
    assert "g1/1" in violations[0].message


def test_orphan_row_in_the_store_is_reported() -> None:
    snap = snapshot(group("g1", S.READY), store_ids=frozenset({"g1/0", "g1/1", "stray"}))
    violations = rows_match_groups(snap)
    assert len(violations) == 1
    assert "'stray'" in violations[0].message
    assert "g1/0" not in violations[0].message


def test_rows_of_a_discarded_group_are_orphans() -> None:
    snap = snapshot(group("d", S.DISCARDED), store_ids=frozenset({"d/0"}))
    violations = rows_match_groups(snap)
    assert len(violations) == 1
    assert "'d/0'" in violations[0].message


def test_row_owned_by_two_groups_is_reported_with_both_owners() -> None:
    a = attrs.evolve(group("a", S.READY), sample_ids=("shared", "a/1"))
    b = attrs.evolve(group("b", S.WRITTEN), sample_ids=("shared", "b/1"))
    violations = rows_match_groups(snapshot(a, b))
    assert len(violations) == 1
    message = violations[0].message
    assert "'shared'" in message
    assert "'a'" in message
    assert "'b'" in message


@pytest.mark.parametrize("rows", [1, 3])
def test_wrong_row_count_is_reported(rows: int) -> None:
    snap = snapshot(group("g1", S.SCORING, rows=rows))
    violations = rows_match_groups(snap)
    assert len(violations) == 1
    message = violations[0].message
    assert "'g1'" in message
    assert f"has {rows} rows" in message
    assert f"group_size={GROUP_SIZE}" in message


def test_reserved_group_with_rows_is_reported() -> None:
    snap = snapshot(group("g1", S.RESERVED, rows=1), store_ids=frozenset({"g1/0"}))
    violations = rows_match_groups(snap)
    assert any(
        "'g1'" in v.message and "RESERVED" in v.message and "g1/0" in v.message for v in violations
    )
    assert all(v.invariant == "rows_match_groups" for v in violations)


# -- counts_consistent -------------------------------------------------------------------


def test_counter_that_disagrees_with_a_recount_is_reported() -> None:
    good = consistent()
    counts = {**good.counts, S.READY: 3}
    violations = counts_consistent(attrs.evolve(good, counts=counts))
    assert len(violations) == 1
    message = violations[0].message
    assert "READY" in message
    assert "says 3" in message
    assert "finds 1" in message


def test_missing_counter_counts_as_zero() -> None:
    good = consistent()
    counts: dict[GroupState, int] = {
        state: n for state, n in good.counts.items() if state is not S.WRITTEN
    }
    violations = counts_consistent(attrs.evolve(good, counts=counts))
    assert len(violations) == 1
    assert "WRITTEN" in violations[0].message
    assert "says 0" in violations[0].message


def test_counter_for_a_state_with_no_groups_must_be_zero() -> None:
    snap = snapshot(group("g", S.RESERVED), counts={S.RESERVED: 1, S.CONSUMED: 1})
    violations = counts_consistent(snap)
    assert len(violations) == 1
    assert "CONSUMED" in violations[0].message


# -- capacity_respected ------------------------------------------------------------------


def test_more_groups_than_capacity_is_reported() -> None:
    snap = snapshot(group("a", S.RESERVED), group("b", S.WRITTEN), group("c", S.READY), capacity=2)
    violations = capacity_respected(snap)
    assert len(violations) == 1
    assert "3 groups" in violations[0].message
    assert "capacity is 2" in violations[0].message


def test_unready_groups_count_against_capacity() -> None:
    snap = snapshot(
        group("r", S.RESERVED), group("w", S.WRITTEN), group("s", S.SCORING), capacity=2
    )
    assert len(capacity_respected(snap)) == 1


def test_discarded_groups_do_not_count_against_capacity() -> None:
    snap = snapshot(
        group("a", S.READY), group("d1", S.DISCARDED), group("d2", S.DISCARDED), capacity=1
    )
    assert capacity_respected(snap) == []


def test_exactly_full_is_allowed() -> None:
    assert capacity_respected(snapshot(group("a", S.READY), group("b", S.READY), capacity=2)) == []


# -- check_invariants / assert_invariants ------------------------------------------------


def broken() -> BufferSnapshot:
    """A snapshot that breaks three different invariants at once."""
    return snapshot(
        group("g1", S.READY, fields=frozenset({"input_ids"})),
        group("g2", S.RESERVED),
        store_ids=frozenset({"g1/0", "g1/1", "stray"}),
        capacity=1,
    )


def test_check_invariants_collects_violations_of_every_invariant() -> None:
    violations = check_invariants(broken())
    assert {v.invariant for v in violations} == {
        "ready_has_required_fields",
        "rows_match_groups",
        "capacity_respected",
    }


def test_assert_invariants_raises_an_assertion_error_listing_all_violations() -> None:
    with pytest.raises(InvariantViolation) as info:
        assert_invariants(broken())
    error: InvariantViolation = info.value  # typed even where pytest is not installed
    assert isinstance(error, AssertionError)
    assert error.violations == check_invariants(broken())
    message = str(error)
    assert len(message.splitlines()) == 3
    for v in error.violations:
        assert str(v) in message


def test_violation_str_names_the_invariant() -> None:
    assert str(Violation("rows_match_groups", "row 'x' lost")) == "rows_match_groups: row 'x' lost"
