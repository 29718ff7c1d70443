"""The scheduling decisions, each against its documented rule, at the edges where a rule is
easiest to get wrong by one: a full buffer, the gate window, a full batch, a second retry, the
staleness window. The pipeline and the abstract scheduler both call these functions, so a wrong
edge here is wrong in both: these tests are what sees it directly (`bench/mutation.py` measures
how much of `model/decisions.py` they pin)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from groupflow.model import decisions
from groupflow.model.decisions import Hold
from groupflow.model.policy import CheckpointPolicy, Design, DispatchReason, FailurePolicy
from groupflow.model.shape import Shape

# -- admission ------------------------------------------------------------------------------


def _admission(**changes: object) -> Hold | None:
    facts: dict[str, object] = {
        "running": True,
        "free_permits": 1,
        "held_groups": 0,
        "max_buffered_groups": 2,
        "steps_ahead": 0,
        "gate_window": 1,
    }
    facts.update(changes)
    return decisions.admission(**facts)  # type: ignore[arg-type]


def test_a_prompt_is_admitted_when_nothing_holds_it() -> None:
    assert _admission() is None


@pytest.mark.parametrize(
    ("changes", "hold"),
    [
        ({"running": False}, Hold.SHUTDOWN),
        ({"free_permits": 0}, Hold.NO_PERMIT),
        ({"free_permits": -1}, Hold.NO_PERMIT),
        ({"held_groups": 2}, Hold.BUFFER_FULL),
        ({"held_groups": 3}, Hold.BUFFER_FULL),
        ({"steps_ahead": 2}, Hold.GATE),
    ],
)
def test_each_hold_names_its_reason(changes: dict[str, object], hold: Hold) -> None:
    assert _admission(**changes) is hold


def test_the_edges_admit_one_below_the_limit() -> None:
    """One slot left, exactly `gate_window` steps ahead: admitted."""
    assert _admission(held_groups=1, max_buffered_groups=2) is None
    assert _admission(steps_ahead=1, gate_window=1) is None
    assert _admission(steps_ahead=0, gate_window=0) is None
    assert _admission(steps_ahead=1, gate_window=0) is Hold.GATE


def test_the_holds_are_judged_in_order_shutdown_permit_buffer_gate() -> None:
    everything = {
        "running": False,
        "free_permits": 0,
        "held_groups": 5,
        "steps_ahead": 9,
    }
    order = [Hold.SHUTDOWN, Hold.NO_PERMIT, Hold.BUFFER_FULL, Hold.GATE]
    fixed = {"running": True, "free_permits": 1, "held_groups": 0, "steps_ahead": 0}
    keys = list(everything)
    for i, hold in enumerate(order):
        facts = {**fixed, **{k: everything[k] for k in keys[i:]}}
        assert _admission(**facts) is hold, facts


# -- the step, demand ------------------------------------------------------------------------


def test_a_step_is_issued_once_every_prompt_is_below_the_cursor_and_none_waits_again() -> None:
    assert decisions.step_issued([0, 1], cursor=2, reissue=())
    assert not decisions.step_issued([0, 1], cursor=1, reissue=())
    assert not decisions.step_issued([0, 1], cursor=2, reissue={1})
    assert decisions.step_issued([], cursor=0, reissue=())
    assert not decisions.step_issued([2, 3], cursor=1, reissue=()), "a later step, not issued"


@pytest.mark.parametrize(
    "facts",
    list(itertools.product([False, True], repeat=4)),
    ids=lambda f: "".join("01"[x] for x in f),
)
def test_demand_needs_every_one_of_its_four_facts(facts: tuple[bool, bool, bool, bool]) -> None:
    waits, issued, upstream, queued = facts
    got = decisions.demand_dispatch(
        training_waits=waits, step_issued=issued, step_upstream=upstream, step_queued_here=queued
    )
    assert got == (waits and issued and not upstream and queued)


def test_a_step_misses_the_prompts_neither_ready_nor_given_up() -> None:
    assert decisions.step_missing(range(4), ready={0}, given_up={2}) == [1, 3]
    assert decisions.step_missing(range(2), ready={0, 1}, given_up=()) == []


# -- dispatch --------------------------------------------------------------------------------


def _reasons(**changes: object) -> tuple[DispatchReason, ...]:
    facts: dict[str, object] = {
        "design": Design.PUMP,
        "run_failed": False,
        "queued": 1,
        "head_is_retry": False,
        "call_in_flight": False,
        "max_batch_groups": 3,
        "draining": False,
        "flush_requested": False,
        "demanded": False,
        "timer_expired": False,
    }
    facts.update(changes)
    return decisions.dispatch_reasons(**facts)  # type: ignore[arg-type]


def test_a_partial_batch_waits_with_no_reason() -> None:
    assert _reasons() == ()
    assert _reasons(queued=2) == ()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_is_retry": True}, DispatchReason.RETRY),
        ({"queued": 3}, DispatchReason.FULL),
        ({"queued": 4}, DispatchReason.FULL),
        ({"draining": True}, DispatchReason.DRAIN),
        ({"flush_requested": True}, DispatchReason.CHECKPOINT_FLUSH),
        ({"demanded": True}, DispatchReason.DEMAND),
        ({"timer_expired": True}, DispatchReason.TIMER),
    ],
)
def test_each_fact_alone_is_its_reason(changes: dict[str, object], reason: DispatchReason) -> None:
    assert _reasons(**changes) == (reason,)


def test_every_reason_at_once_comes_in_the_order_they_are_tried() -> None:
    got = _reasons(
        queued=3,
        head_is_retry=True,
        draining=True,
        flush_requested=True,
        demanded=True,
        timer_expired=True,
    )
    assert got == (
        DispatchReason.RETRY,
        DispatchReason.FULL,
        DispatchReason.DRAIN,
        DispatchReason.CHECKPOINT_FLUSH,
        DispatchReason.DEMAND,
        DispatchReason.TIMER,
    )
    assert list(got) == sorted(got, key=list(DispatchReason).index)


@pytest.mark.parametrize("changes", [{"run_failed": True}, {"queued": 0}, {"call_in_flight": True}])
def test_nothing_is_sent_after_a_failure_from_an_empty_queue_or_beside_a_call(
    changes: dict[str, object],
) -> None:
    everything = {"queued": 3, "head_is_retry": True, "draining": True, "timer_expired": True}
    assert _reasons(**{**everything, **changes}) == ()


def test_the_coalescing_design_waits_for_a_reason_as_the_pump_does() -> None:
    assert _reasons(design=Design.COALESCE) == ()
    assert _reasons(design=Design.COALESCE, queued=3) == (DispatchReason.FULL,)


def test_the_inline_baseline_sends_each_group_alone_at_once() -> None:
    assert _reasons(design=Design.INLINE) == (DispatchReason.INLINE,)
    assert _reasons(design=Design.INLINE, queued=5, timer_expired=True) == (DispatchReason.INLINE,)
    assert _reasons(design=Design.INLINE, call_in_flight=True) == ()


def test_a_batch_is_up_to_the_limit_and_a_retry_goes_alone() -> None:
    def size(**changes: object) -> int:
        facts: dict[str, object] = {
            "design": Design.PUMP,
            "queued": 5,
            "head_is_retry": False,
            "max_batch_groups": 3,
        }
        facts.update(changes)
        return decisions.batch_size(**facts)  # type: ignore[arg-type]

    assert size() == 3
    assert size(queued=2) == 2
    assert size(head_is_retry=True) == 1
    assert size(design=Design.INLINE) == 1
    assert size(design=Design.COALESCE) == 3


# -- checkpoints, failures, staleness --------------------------------------------------------


def test_a_resume_issues_again_what_was_issued_and_not_accounted_for() -> None:
    assert decisions.reissue_on_resume(5, {0, 2, 4}) == (1, 3)
    assert decisions.reissue_on_resume(0, set()) == ()
    assert decisions.reissue_on_resume(3, {0, 1, 2, 7}) == ()


def test_only_a_flush_checkpoint_waits_and_for_its_pending_prompts_in_order() -> None:
    assert decisions.flush_cut(CheckpointPolicy.FLUSH, [4, 1, 3]) == (1, 3, 4)
    assert decisions.flush_cut(CheckpointPolicy.UNCOMMITTED, [4, 1]) == ()
    assert decisions.flush_cut(CheckpointPolicy.NAIVE, [4, 1]) == ()


@pytest.mark.parametrize("policy", list(FailurePolicy))
@pytest.mark.parametrize("retries", [0, 1, 2])
@pytest.mark.parametrize("transient", [False, True])
def test_a_failed_group_is_retried_once_only_under_retry_and_only_if_transient(
    policy: FailurePolicy, retries: int, transient: bool
) -> None:
    expected = policy is FailurePolicy.RETRY and retries == 0 and transient
    assert decisions.retry_after_failure(policy, retries, transient=transient) is expected


def test_permanence_matters_under_retry_alone() -> None:
    assert [decisions.permanence_matters(p) for p in FailurePolicy] == [
        p is FailurePolicy.RETRY for p in FailurePolicy
    ]


def test_failures_are_judged_only_while_the_run_has_not_failed() -> None:
    assert decisions.failure_is_judged(run_failed=False) is True
    assert decisions.failure_is_judged(run_failed=True) is False


@pytest.mark.parametrize(
    ("weight_version", "start_version", "max_staleness", "stale"),
    [
        (5, 4, 1, False),
        (6, 4, 1, True),
        (4, 4, 0, False),
        (5, 4, 0, True),
        (4, 4, 1, False),  # a fresh group is never stale
        (4, 1, 3, False),  # 3 versions old, 3 allowed
        (9, 4, 2, True),
    ],
)
def test_the_staleness_window_holds_exactly_max_staleness_versions(
    weight_version: int, start_version: int, max_staleness: int, stale: bool
) -> None:
    got = decisions.too_stale(
        weight_version=weight_version, start_version=start_version, max_staleness=max_staleness
    )
    assert got is stale


# -- the config's safety conditions ----------------------------------------------------------


def _problems(max_buffered_groups: int = 4, **changes: object) -> list[str]:
    facts: dict[str, object] = {
        "shape": Shape(prompts_per_step=4, max_buffered_groups=max_buffered_groups),
        "design": Design.PUMP,
        "flush_timer": True,
        "demand": False,
    }
    facts.update(changes)
    return decisions.config_problems(**facts)  # type: ignore[arg-type]


def test_a_buffer_of_one_step_is_safe_and_one_group_less_is_not() -> None:
    assert _problems() == []
    assert _problems(max_buffered_groups=5) == []
    (problem,) = _problems(max_buffered_groups=3)
    assert "max_buffered_groups=3 is smaller than prompts_per_step=4" in problem
    assert "use max_buffered_groups >= 4" in problem


@pytest.mark.parametrize(
    ("design", "flush_timer", "demand", "unsafe"),
    [
        (Design.COALESCE, False, False, "coalescing design without a flush timer"),
        (Design.COALESCE, False, True, "coalescing design without a flush timer"),
        (Design.PUMP, False, False, "without a flush timer or demand dispatch"),
        (Design.PUMP, False, True, None),
        (Design.PUMP, True, False, None),
        (Design.COALESCE, True, False, None),
        (Design.INLINE, False, False, None),
    ],
)
def test_without_a_flush_timer_only_demand_saves_the_pump(
    design: Design, flush_timer: bool, demand: bool, unsafe: str | None
) -> None:
    got = _problems(design=design, flush_timer=flush_timer, demand=demand)
    if unsafe is None:
        assert got == []
    else:
        (problem,) = got
        assert unsafe in problem


def test_both_problems_are_reported_together() -> None:
    got = _problems(max_buffered_groups=1, design=Design.COALESCE, flush_timer=False)
    assert len(got) == 2


@pytest.mark.parametrize(
    "call",
    [
        lambda: decisions.step_issued([0], 1, ()),  # type: ignore[call-arg]
        lambda: decisions.step_missing([0], {0}, ()),  # type: ignore[call-arg]
        lambda: decisions.retry_after_failure(FailurePolicy.RETRY, 0, True),  # type: ignore[call-arg]
    ],
    ids=["step_issued", "step_missing", "retry_after_failure"],
)
def test_facts_are_passed_by_name_so_none_goes_in_the_wrong_place(
    call: Callable[[], object],
) -> None:
    with pytest.raises(TypeError):
        call()
