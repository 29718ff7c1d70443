"""The lifecycle model: `fire`, the transition table's shape, readiness and the diagrams."""

from __future__ import annotations

import itertools
import re
from collections import Counter, deque
from collections.abc import Callable

import pytest

from groupflow.model import (
    TERMINAL_STATES,
    TRANSITIONS,
    Actor,
    Event,
    GroupState,
    Guard,
    IllegalTransition,
    Transition,
    fire,
    missing_fields,
    readiness,
    to_dot,
    to_mermaid,
    to_text_table,
    transitions_from,
)

SOURCES: tuple[GroupState | None, ...] = (None, *GroupState)
TABLE_KEYS = {(row.source, row.event) for row in TRANSITIONS}
ILLEGAL_PAIRS = [
    (source, event)
    for source, event in itertools.product(SOURCES, Event)
    if (source, event) not in TABLE_KEYS
]
GUARDED_KEYS = sorted(
    {(row.source, row.event) for row in TRANSITIONS if row.guard is not Guard.ALWAYS},
    key=str,
)


def _state_name(state: GroupState | None) -> str:
    return "(new)" if state is None else state.value


def _row_id(row: Transition) -> str:
    return f"{_state_name(row.source)}-{row.event.value}-{row.guard.value}"


def _pair_id(pair: tuple[GroupState | None, Event]) -> str:
    return f"{_state_name(pair[0])}-{pair[1].value}"


def _case_id(value: object) -> str:
    return _row_id(value) if isinstance(value, Transition) else str(value)


def _forbidden_actor_cases() -> list[tuple[Transition, Actor]]:
    return [(row, actor) for row in TRANSITIONS for actor in Actor if actor not in row.actors]


def _allowed_actor_cases() -> list[tuple[Transition, Actor]]:
    return [(row, actor) for row in TRANSITIONS for actor in sorted(row.actors, key=str)]


# -- fire: illegal moves -----------------------------------------------------------------


def test_illegal_pairs_exist_for_every_source() -> None:
    """The generated list is not vacuous: every source has at least one illegal event."""
    assert {source for source, _ in ILLEGAL_PAIRS} == set(SOURCES)


@pytest.mark.parametrize("pair", ILLEGAL_PAIRS, ids=_pair_id)
@pytest.mark.parametrize("actor", list(Actor), ids=str)
def test_event_without_a_row_raises_illegal_transition(
    pair: tuple[GroupState | None, Event], actor: Actor
) -> None:
    state, event = pair
    with pytest.raises(IllegalTransition) as info:
        fire("grp-7", state, event, actor=actor, guard=Guard.COMPLETE)
    message = str(info.value)
    assert "grp-7" in message
    assert _state_name(state) in message
    assert f"'{event.value}'" in message
    assert (info.value.group_id, info.value.state, info.value.event, info.value.actor) == (
        "grp-7",
        state,
        event,
        actor,
    )


def test_illegal_transition_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        fire("g", GroupState.CONSUMED, Event.SELECT, actor=Actor.TRAIN)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES, key=str), ids=str)
def test_terminal_state_message_says_nothing_is_allowed(state: GroupState) -> None:
    with pytest.raises(IllegalTransition, match="terminal"):
        fire("g", state, Event.DROP, actor=Actor.SUPERVISOR)


def test_illegal_event_message_lists_the_allowed_events() -> None:
    with pytest.raises(IllegalTransition) as info:
        fire("g", GroupState.WRITTEN, Event.SELECT, actor=Actor.TRAIN)
    assert "take_batch" in str(info.value)
    assert "drop" in str(info.value)


# -- fire: actors ------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "actor"), _forbidden_actor_cases(), ids=_case_id)
def test_legal_row_fired_by_a_forbidden_actor_raises(row: Transition, actor: Actor) -> None:
    with pytest.raises(IllegalTransition) as info:
        fire("grp-3", row.source, row.event, actor=actor, guard=row.guard)
    message = str(info.value)
    assert "grp-3" in message
    assert actor.value in message
    assert f"'{row.event.value}'" in message
    assert info.value.actor is actor
    assert info.value.state == row.source
    assert info.value.event is row.event


@pytest.mark.parametrize(("row", "actor"), _allowed_actor_cases(), ids=_case_id)
def test_legal_row_fired_by_an_allowed_actor_returns_its_target(
    row: Transition, actor: Actor
) -> None:
    assert fire("g", row.source, row.event, actor=actor, guard=row.guard) is row.target


def test_every_actor_is_allowed_somewhere_and_forbidden_somewhere() -> None:
    """Guards against a table where the actor checks above would be vacuous."""
    assert {a for _, a in _allowed_actor_cases()} == set(Actor)
    assert {a for _, a in _forbidden_actor_cases()} == set(Actor)


# -- fire: guards ------------------------------------------------------------------------


def test_the_guarded_events_are_commit_and_scored() -> None:
    assert GUARDED_KEYS == sorted(
        [(GroupState.RESERVED, Event.COMMIT), (GroupState.SCORING, Event.SCORED)], key=str
    )


@pytest.mark.parametrize("key", GUARDED_KEYS, ids=_pair_id)
def test_guarded_event_without_a_guard_raises_type_error(key: tuple[GroupState, Event]) -> None:
    state, event = key
    with pytest.raises(TypeError, match="guard"):
        fire("g", state, event, actor=Actor.ROLLOUT if event is Event.COMMIT else Actor.STAGE)


@pytest.mark.parametrize(
    ("state", "event", "actor", "guard", "target"),
    [
        (GroupState.RESERVED, Event.COMMIT, Actor.ROLLOUT, Guard.COMPLETE, GroupState.READY),
        (GroupState.RESERVED, Event.COMMIT, Actor.ROLLOUT, Guard.PENDING, GroupState.WRITTEN),
        (GroupState.SCORING, Event.SCORED, Actor.STAGE, Guard.COMPLETE, GroupState.READY),
        (GroupState.SCORING, Event.SCORED, Actor.STAGE, Guard.PENDING, GroupState.WRITTEN),
    ],
)
def test_guard_picks_the_matching_row(
    state: GroupState, event: Event, actor: Actor, guard: Guard, target: GroupState
) -> None:
    assert fire("g", state, event, actor=actor, guard=guard) is target


@pytest.mark.parametrize("guard", [Guard.COMPLETE, Guard.PENDING], ids=str)
def test_unguarded_event_ignores_the_guard(guard: Guard) -> None:
    assert (
        fire("g", GroupState.SCORING, Event.RETRY, actor=Actor.STAGE, guard=guard)
        is GroupState.WRITTEN
    )
    assert (
        fire("g", GroupState.READY, Event.SELECT, actor=Actor.TRAIN, guard=guard)
        is GroupState.CONSUMED
    )


# -- the table's shape -------------------------------------------------------------------


def test_terminal_states_are_consumed_and_discarded() -> None:
    assert TERMINAL_STATES == {GroupState.CONSUMED, GroupState.DISCARDED}


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES, key=str), ids=str)
def test_terminal_states_have_no_outgoing_rows(state: GroupState) -> None:
    assert transitions_from(state) == ()
    assert [row for row in TRANSITIONS if row.source is state] == []


def test_every_non_terminal_state_has_an_outgoing_row() -> None:
    for state in set(GroupState) - TERMINAL_STATES:
        assert transitions_from(state), f"{state} is a dead end but not terminal"


def test_every_state_is_reachable_from_a_creating_row() -> None:
    creating = [row for row in TRANSITIONS if row.source is None]
    assert creating, "no row creates a group"
    reached = {row.target for row in creating}
    queue = deque(reached)
    while queue:
        for row in transitions_from(queue.popleft()):
            if row.target not in reached:
                reached.add(row.target)
                queue.append(row.target)
    assert reached == set(GroupState)


def test_transitions_from_returns_exactly_the_rows_of_that_source() -> None:
    for source in SOURCES:
        assert transitions_from(source) == tuple(r for r in TRANSITIONS if r.source == source)
    assert sum(len(transitions_from(s)) for s in SOURCES) == len(TRANSITIONS)


@pytest.mark.parametrize("key", GUARDED_KEYS, ids=_pair_id)
def test_guarded_event_has_exactly_a_complete_and_a_pending_row(
    key: tuple[GroupState, Event],
) -> None:
    guards = sorted((row.guard for row in TRANSITIONS if (row.source, row.event) == key), key=str)
    assert guards == [Guard.COMPLETE, Guard.PENDING]


def test_no_source_event_mixes_always_with_guarded_rows() -> None:
    by_key: dict[tuple[GroupState | None, Event], set[Guard]] = {}
    for row in TRANSITIONS:
        by_key.setdefault((row.source, row.event), set()).add(row.guard)
    for key, guards in by_key.items():
        assert guards == {Guard.ALWAYS} or Guard.ALWAYS not in guards, key


def test_no_two_rows_share_source_event_and_guard() -> None:
    keys = Counter((row.source, row.event, row.guard) for row in TRANSITIONS)
    assert [key for key, n in keys.items() if n > 1] == []


def test_every_row_names_at_least_one_actor() -> None:
    assert all(row.actors for row in TRANSITIONS)


# -- readiness ---------------------------------------------------------------------------


def test_missing_fields_is_required_minus_present() -> None:
    assert missing_fields({"input_ids"}, {"input_ids", "teacher_logprobs"}) == {"teacher_logprobs"}
    assert missing_fields(["a", "b", "extra"], ["a", "b"]) == frozenset()
    assert missing_fields([], ("a",)) == {"a"}


def test_missing_fields_accepts_one_shot_iterables() -> None:
    assert missing_fields(iter(["a"]), iter(["a", "b"])) == {"b"}


def test_readiness_is_complete_when_all_fields_are_there() -> None:
    assert readiness({"a", "b", "extra"}, {"a", "b"}, awaiting_stage=False) is Guard.COMPLETE


def test_readiness_is_complete_when_nothing_is_required() -> None:
    assert readiness((), (), awaiting_stage=False) is Guard.COMPLETE


def test_readiness_is_pending_when_a_field_is_missing() -> None:
    assert readiness({"a"}, {"a", "b"}, awaiting_stage=False) is Guard.PENDING


def test_readiness_is_pending_while_a_stage_still_has_to_mark_the_group() -> None:
    assert readiness({"a", "b"}, {"a", "b"}, awaiting_stage=True) is Guard.PENDING


# -- diagrams ----------------------------------------------------------------------------


def _row_labels() -> Counter[tuple[str, str, str]]:
    return Counter(
        (
            "start" if row.source is None else row.source.value,
            row.target.value,
            row.event.value
            if row.guard is Guard.ALWAYS
            else f"{row.event.value} [{row.guard.value}]",
        )
        for row in TRANSITIONS
    )


def test_dot_has_one_edge_per_row() -> None:
    dot = to_dot()
    edges = re.findall(r'^\s*(\w+) -> (\w+) \[label="([^"\\]+)', dot, flags=re.MULTILINE)
    assert len(edges) == len(TRANSITIONS)
    assert Counter(edges) == _row_labels()
    assert dot.count("->") == len(TRANSITIONS)


def test_mermaid_has_one_edge_per_row() -> None:
    mermaid = to_mermaid()
    edges = re.findall(r"^\s*(\S+) --> (\w+): (\w+(?: \[\w+\])?) \(", mermaid, flags=re.MULTILINE)
    assert len(edges) == len(TRANSITIONS)
    relabelled = Counter(("start" if s == "[*]" else s, t, label) for s, t, label in edges)
    assert relabelled == _row_labels()
    exits = re.findall(r"^\s*(\w+) --> \[\*\]$", mermaid, flags=re.MULTILINE)
    assert sorted(exits) == sorted(s.value for s in TERMINAL_STATES)


def test_text_table_has_one_line_per_row() -> None:
    lines = to_text_table().splitlines()
    header, rule, *body = lines
    assert header.split()[:4] == ["from", "event", "guard", "to"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert len(body) == len(TRANSITIONS)
    for line, row in zip(body, TRANSITIONS, strict=True):
        cells = line.split()
        assert cells[0] == ("-" if row.source is None else row.source.value)
        assert cells[1] == row.event.value
        assert row.target.value in cells[2:4]
        for actor in row.actors:
            assert actor.value in line


@pytest.mark.parametrize("render", [to_dot, to_mermaid, to_text_table], ids=lambda f: f.__name__)
def test_diagram_mentions_every_state(render: Callable[..., str]) -> None:
    text = render()
    for state in GroupState:
        assert re.search(rf"\b{state.value}\b", text), f"{render.__name__} never mentions {state}"


@pytest.mark.parametrize("render", [to_dot, to_mermaid, to_text_table], ids=lambda f: f.__name__)
def test_diagram_renders_only_the_rows_it_is_given(render: Callable[..., str]) -> None:
    one_row = (TRANSITIONS[0],)
    text = render(one_row)
    assert TRANSITIONS[0].event.value in text
    assert Event.SELECT.value not in text
