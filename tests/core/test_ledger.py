"""The prompt ledger on its own: what it hands out, in which order, what it refuses, and what a
checkpoint of it records. A wrong answer here loses a prompt or trains it twice across a resume,
so every edge is pinned (`bench/mutation.py` measures these tests against `_ledger.py`)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from groupflow.impl._core import PromptLedger
from groupflow.impl._core._ordinals import OrdinalSet
from groupflow.impl._core._pulse import Pulse
from groupflow.impl.errors import CheckpointMismatch, Exhausted, LedgerInconsistent


class _CountingPulse:
    """Stands in for the buffer's pulse: counts notifications."""

    def __init__(self) -> None:
        self.notified = 0

    def notify(self) -> None:
        self.notified += 1


def _ledger(num_prompts: int | None = 5) -> tuple[PromptLedger, _CountingPulse, list[Any]]:
    pulse = _CountingPulse()
    told: list[tuple[str, Sequence[int]]] = []
    ledger = PromptLedger(
        num_prompts,
        changed=pulse,  # type: ignore[arg-type]
        on_settled=lambda what, ordinals: told.append((what, ordinals)),
    )
    return ledger, pulse, told


def _issue(ledger: PromptLedger, n: int) -> list[int]:
    return [ledger.issue() for _ in range(n)]


# -- issuing ----------------------------------------------------------------------------------


def test_fresh_ordinals_come_in_order_and_are_in_flight() -> None:
    ledger, _, _ = _ledger(3)
    assert ledger.peek() == 0
    assert _issue(ledger, 3) == [0, 1, 2]
    assert ledger.cursor == 3
    assert ledger.in_flight == {0, 1, 2}


def test_the_last_prompt_is_issued_and_then_the_source_is_exhausted() -> None:
    ledger, _, _ = _ledger(2)
    _issue(ledger, 1)
    assert not ledger.exhausted
    assert ledger.peek() == 1
    _issue(ledger, 1)
    assert ledger.peek() is None
    assert ledger.exhausted
    with pytest.raises(Exhausted, match=r"exhausted \(2 prompts issued\)"):
        ledger.issue()
    assert ledger.cursor == 2


def test_an_endless_source_never_runs_out() -> None:
    ledger, _, _ = _ledger(None)
    assert _issue(ledger, 100)[-1] == 99
    assert not ledger.exhausted
    assert ledger.peek() == 100


def test_a_large_source_stops_at_its_end() -> None:
    """Past the small ints Python shares, equal ordinals are distinct objects: the end of the
    source is found by value."""
    ledger, _, _ = _ledger(300)
    assert _issue(ledger, 300)[-1] == 299
    assert ledger.exhausted
    with pytest.raises(Exhausted):
        ledger.issue()


def test_the_hooks_and_the_revision_are_keyword_only() -> None:
    fields: list[Any] = [None, 0, OrdinalSet(), set(), deque(), set()]
    for extra in ([Pulse()], [Pulse(), None], [Pulse(), None, 0]):
        with pytest.raises(TypeError):
            PromptLedger(*fields, *extra)
    with pytest.raises(TypeError):
        PromptLedger(3).state_dict(set())  # type: ignore[call-arg]


def test_dropped_prompts_are_issued_again_first_in_the_order_dropped() -> None:
    ledger, _, _ = _ledger(6)
    _issue(ledger, 4)
    ledger.mark_dropped(2)
    ledger.mark_dropped(0)
    assert ledger.in_flight == {1, 3}
    assert list(ledger.reissue) == [2, 0]
    assert ledger.peek() == 2
    assert ledger.issue() == 2
    assert ledger.cursor == 4  # a re-issue does not move the cursor
    assert ledger.issue() == 0
    assert ledger.issue() == 4
    assert ledger.in_flight == {0, 1, 2, 3, 4}
    assert not ledger.reissue


def test_a_dropped_prompt_is_issued_again_after_the_source_is_exhausted() -> None:
    ledger, _, _ = _ledger(2)
    _issue(ledger, 2)
    ledger.mark_dropped(1)
    assert not ledger.exhausted
    assert ledger.issue() == 1
    assert ledger.exhausted


def test_a_drop_is_not_settled_and_is_not_told() -> None:
    ledger, pulse, told = _ledger()
    _issue(ledger, 1)
    ledger.mark_dropped(0)
    assert 0 not in ledger.settled
    assert list(ledger.trained) == []
    assert told == []
    assert pulse.notified == 1


# -- settling ---------------------------------------------------------------------------------


def test_the_trained_count_leaves_out_every_given_up_prompt() -> None:
    ledger, _, _ = _ledger()
    _issue(ledger, 2)
    ledger.mark_trained([0])
    ledger.mark_shortfall(1)
    assert len(ledger.trained) == 1


def test_trained_prompts_are_settled_told_and_notified() -> None:
    ledger, pulse, told = _ledger()
    _issue(ledger, 3)
    ledger.mark_trained([2, 0])
    assert ledger.in_flight == {1}
    assert set(ledger.settled) == {0, 2}
    assert 0 in ledger.trained and 2 in ledger.trained and 1 not in ledger.trained
    assert list(ledger.trained) == [0, 2]
    assert len(ledger.trained) == 2
    assert told == [("trained", (2, 0))]
    assert pulse.notified == 1


def test_a_given_up_prompt_is_settled_but_not_trained() -> None:
    ledger, pulse, told = _ledger()
    _issue(ledger, 3)
    ledger.mark_shortfall(1)
    ledger.mark_trained({0, 2})
    assert ledger.shortfall == {1}
    assert set(ledger.settled) == {0, 1, 2}
    assert 1 not in ledger.trained
    assert list(ledger.trained) == [0, 2]
    assert len(ledger.trained) == 2
    assert told[0] == ("given_up", (1,))
    assert told[1][0] == "trained" and sorted(told[1][1]) == [0, 2]
    assert pulse.notified == 2
    assert not ledger.in_flight


def test_training_a_prompt_twice_is_refused_naming_it() -> None:
    ledger, pulse, told = _ledger()
    _issue(ledger, 2)
    ledger.mark_trained([0])
    with pytest.raises(LedgerInconsistent, match=r"prompts \[0\] were already trained"):
        ledger.mark_trained([0, 1])
    assert ledger.in_flight == {1}  # nothing of the refused call happened
    assert told == [("trained", (0,))]
    assert pulse.notified == 1


def test_training_a_given_up_prompt_is_refused() -> None:
    ledger, _, _ = _ledger()
    _issue(ledger, 1)
    ledger.mark_shortfall(0)
    with pytest.raises(LedgerInconsistent, match=r"prompts \[0\] were already trained"):
        ledger.mark_trained([0])


@pytest.mark.parametrize("settle", ["trained", "shortfall", "dropped"])
def test_settling_a_prompt_not_in_flight_is_refused_naming_it(settle: str) -> None:
    ledger, pulse, told = _ledger()
    _issue(ledger, 1)
    mark: Callable[[], None] = {
        "trained": lambda: ledger.mark_trained([0, 3]),
        "shortfall": lambda: ledger.mark_shortfall(3),
        "dropped": lambda: ledger.mark_dropped(3),
    }[settle]
    with pytest.raises(LedgerInconsistent, match=r"prompts \[3\] are not in flight"):
        mark()
    assert ledger.in_flight == {0}
    assert 0 not in ledger.settled and not ledger.reissue and not ledger.shortfall
    assert told == [] and pulse.notified == 0


def test_without_a_listener_settling_still_works() -> None:
    ledger = PromptLedger(3)
    _issue(ledger, 2)
    ledger.mark_trained([0])
    ledger.mark_shortfall(1)
    assert list(ledger.trained) == [0] and ledger.shortfall == {1}


def test_every_change_moves_the_revision() -> None:
    ledger, _, _ = _ledger()
    seen = [ledger.revision]

    def changed() -> None:
        assert ledger.revision not in seen
        seen.append(ledger.revision)

    for act in (
        ledger.issue,
        ledger.issue,
        ledger.issue,
        lambda: ledger.mark_trained([0]),
        lambda: ledger.mark_shortfall(1),
        lambda: ledger.mark_dropped(2),
        ledger.issue,
        lambda: ledger.load_state_dict(ledger.state_dict(saved={2})),
    ):
        act()
        changed()


# -- what a checkpoint records ----------------------------------------------------------------


def _mid_run() -> PromptLedger:
    """Prompts 0..5 issued: 0 trained, 1 given up, 2 dropped (to issue again), 3, 4, 5 in flight."""
    ledger, _, _ = _ledger(8)
    _issue(ledger, 6)
    ledger.mark_trained([0])
    ledger.mark_shortfall(1)
    ledger.mark_dropped(2)
    return ledger


def test_a_checkpoint_records_trained_given_up_saved_and_what_to_issue_again() -> None:
    state = _mid_run().state_dict(saved={4})
    assert state == {
        "num_prompts": 8,
        "cursor": 6,
        "trained": [0],
        "shortfall": [1],
        "saved": [4],
        "reissue": [2, 3, 5],
    }


def test_a_saved_prompt_that_is_not_in_flight_is_refused() -> None:
    with pytest.raises(LedgerInconsistent, match=r"saved prompts \[0, 7\] are not in flight"):
        _mid_run().state_dict(saved={0, 4, 7})


def test_a_ledger_whose_cursor_and_flight_disagree_refuses_to_be_saved() -> None:
    ledger = _mid_run()
    ledger.in_flight.discard(5)  # lost: below the cursor, yet nowhere
    with pytest.raises(
        LedgerInconsistent, match=r"\[2, 3, 4, 5\] by the cursor, \[2, 3, 4\] by what"
    ):
        ledger.state_dict(saved=set())


def test_a_prompt_both_in_flight_and_to_issue_again_refuses_to_be_saved() -> None:
    ledger = _mid_run()
    ledger.reissue.append(3)
    with pytest.raises(
        LedgerInconsistent, match=r"\[2, 3, 4, 5\] by the cursor, \[2, 3, 3, 4, 5\]"
    ):
        ledger.state_dict(saved=set())


def test_a_prompt_trained_and_still_in_flight_refuses_to_be_saved() -> None:
    ledger = _mid_run()
    ledger.settled.add(5)  # trained, yet still in flight
    with pytest.raises(LedgerInconsistent, match=r"\[2, 3\] by the cursor, \[2, 3, 5\] by what"):
        ledger.state_dict(saved={4})


def test_a_resumed_ledger_issues_again_first_then_goes_on_from_the_cursor() -> None:
    state = _mid_run().state_dict(saved={4})
    resumed, pulse, told = _ledger(8)
    resumed.load_state_dict(state)
    assert resumed.cursor == 6
    assert list(resumed.trained) == [0]
    assert resumed.shortfall == {1}
    assert set(resumed.settled) == {0, 1}
    assert resumed.in_flight == {4}
    assert _issue(resumed, 5) == [2, 3, 5, 6, 7]
    assert resumed.exhausted
    resumed.mark_trained([2, 3, 4, 5, 6, 7])
    assert list(resumed.trained) == [0, 2, 3, 4, 5, 6, 7]
    with pytest.raises(LedgerInconsistent, match="already trained"):
        resumed.mark_trained([0])
    assert told == [("trained", (2, 3, 4, 5, 6, 7))] and pulse.notified == 1


def test_a_resumed_ledger_saves_what_it_loaded() -> None:
    state = _mid_run().state_dict(saved={4})
    resumed = PromptLedger(8)
    resumed.load_state_dict(state)
    assert resumed.state_dict(saved={4}) == state


@pytest.mark.parametrize("size", [7, 9, None])
def test_a_checkpoint_of_another_source_size_is_refused_naming_both(size: int | None) -> None:
    state = _mid_run().state_dict(saved=set())
    other = PromptLedger(size)
    with pytest.raises(CheckpointMismatch, match=f"covers 8 prompts, this run has {size}"):
        other.load_state_dict(state)
    assert other.cursor == 0 and not other.in_flight


def test_a_large_source_resumes_from_a_checkpoint_read_back_from_disk() -> None:
    ledger = PromptLedger(1000)
    _issue(ledger, 3)
    state = json.loads(json.dumps(ledger.state_dict(saved=set())))
    resumed = PromptLedger(1000)
    resumed.load_state_dict(state)
    assert _issue(resumed, 4) == [0, 1, 2, 3]


# -- the set of settled ordinals --------------------------------------------------------------


def test_ordinals_in_order_are_kept_as_a_low_water_mark() -> None:
    s = OrdinalSet()
    for o in (0, 1, 2):
        s.add(o)
    assert (s.below, s.above) == (3, set())
    s.add(1)
    assert (s.below, s.above) == (3, set())
    assert len(s) == 3 and list(s) == [0, 1, 2]


def test_ordinals_out_of_order_close_the_gap_when_it_fills() -> None:
    s = OrdinalSet([5, 2, 3])
    assert (s.below, s.above) == (0, {2, 3, 5})
    s.add(1)
    assert (s.below, s.above) == (0, {1, 2, 3, 5})
    s.add(0)
    assert (s.below, s.above) == (4, {5})
    assert list(s) == [0, 1, 2, 3, 5] and len(s) == 5
    assert repr(s) == "OrdinalSet(below=4, above=[5])"


def test_a_long_run_in_order_is_kept_as_its_mark_alone() -> None:
    """Past the small ints Python shares: the mark advances by value."""
    s = OrdinalSet(range(300))
    assert (s.below, s.above) == (300, set())


def test_membership_of_ordinals() -> None:
    s = OrdinalSet([0, 1, 4])
    assert [o in s for o in (-1, 0, 1, 2, 3, 4, 5)] == [
        False,
        True,
        True,
        False,
        False,
        True,
        False,
    ]
    strangers: list[object] = ["1", 1.0, None]
    assert not any(x in s for x in strangers)


def test_a_negative_ordinal_is_refused() -> None:
    with pytest.raises(ValueError, match="ordinals are >= 0, got -1"):
        OrdinalSet([-1])


def test_discarding_below_the_mark_splits_the_run() -> None:
    s = OrdinalSet(range(5))
    s.discard(2)
    assert (s.below, s.above) == (2, {3, 4})
    assert list(s) == [0, 1, 3, 4]
    s.discard(0)
    assert (s.below, s.above) == (0, {1, 3, 4})
    odd = OrdinalSet(range(6))
    odd.discard(3)
    assert (odd.below, odd.above) == (3, {4, 5})
    s.discard(4)
    s.discard(9)
    assert list(s) == [1, 3]
    s.discard(-1)
    assert list(s) == [1, 3]
    s.add(0)
    assert (s.below, s.above) == (2, {3})
