"""The exhaustive checker: the outcomes the README reports, pinned on small bounds, and every
reported trace replayed through the model's own transition function."""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from groupflow.cli import _check as cmd_check
from groupflow.cli import main
from groupflow.model import GroupState, IllegalTransition, decisions, scheduler
from groupflow.model.scheduler import (
    Action,
    Bounds,
    CheckpointPolicy,
    Design,
    DispatchReason,
    NotEnabled,
    apply,
    checks,
    guards,
    initial_state,
    reduction,
    transitions,
)
from groupflow.model.scheduler import state as state_module
from groupflow.model.scheduler.actions import ActionKind
from groupflow.model.scheduler.checks import check_state
from groupflow.model.scheduler.explorer import Finding, Report, explore, is_deadlocked, random_walks
from groupflow.model.shape import Shape

SAFE: dict[str, Any] = dict(prompts=4, teachers=2)
"""Two teachers, on the default shape: steps of two prompts, three permits, four buffer slots,
batches of two, a gate of one step."""


def _kinds(report: Report) -> set[str]:
    return {f.kind for f in report.findings}


def _assert_replays(finding: Finding, bounds: Bounds) -> None:
    """The trace is a real run of the model, and its last state shows the violation."""
    last = finding.replay(bounds)[-1]
    if finding.kind == "illegal_transition":
        assert finding.refused is not None
        with pytest.raises(IllegalTransition):
            apply(last, bounds, finding.refused)
    elif finding.kind == "deadlock":
        assert is_deadlocked(last, bounds)
    elif finding.kind == "stuck":
        assert not is_deadlocked(last, bounds)
    else:
        assert finding.kind in {v.invariant for v in check_state(last, bounds)}


@pytest.mark.parametrize("design", list(Design))
def test_safe_bounds_with_timer_have_no_violation(design: Design) -> None:
    bounds = Bounds(**SAFE, design=design, crashes=1, rollout_failures=1, batch_failures=1)
    report = explore(bounds)
    assert report.complete and report.findings == (), [f.explain(bounds) for f in report.findings]
    assert report.final_states > 0


@pytest.mark.parametrize("policy", ["retry", "discard", "fail"])
def test_failure_policies_are_safe(policy: str) -> None:
    bounds = Bounds(**SAFE, batch_failures=2, failure_policy=policy, checkpoints=0)
    assert explore(bounds).ok


def test_discarding_at_shutdown_is_safe() -> None:
    assert explore(Bounds(**SAFE, drain_on_shutdown=False, crashes=1)).ok


@pytest.mark.parametrize("design", list(Design))
def test_capacity_below_a_step_deadlocks_every_design_even_with_timer(design: Design) -> None:
    bounds = Bounds(
        prompts=6,
        shape=Shape(
            prompts_per_step=3, max_inflight_prompts=3, max_batch_groups=2, max_buffered_groups=2
        ),
        design=design,
    )
    report = explore(bounds)
    assert "deadlock" in _kinds(report)
    for finding in report.findings:
        _assert_replays(finding, bounds)


def test_pump_without_timer_waits_for_a_group_the_gate_holds_back() -> None:
    bounds = Bounds(**SAFE, shape=Shape(gate_window=0), flush_timer=False)
    report = explore(bounds)
    (finding,) = report.findings
    assert finding.kind == "deadlock"
    _assert_replays(finding, bounds)
    last = finding.replay(bounds)[-1]
    assert last.free_permits == bounds.shape.max_inflight_prompts, (
        "pump: no permit is held while batches wait"
    )


def test_pump_without_timer_is_saved_by_demand_dispatch() -> None:
    bounds = Bounds(**SAFE, shape=Shape(gate_window=0), flush_timer=False, demand=True, crashes=1)
    assert explore(bounds).ok


def test_demand_judged_per_teacher_would_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step spanning two teachers: if each teacher only looked at its own queue, neither
    would see that training waits on it."""

    def per_teacher(s: scheduler.SchedState, b: Bounds, teacher: int) -> bool:
        ordinals = b.step_ordinals(s.step)
        lacking = {
            g.ordinal for g in s.groups if g.ordinal in ordinals and g.state.value != "READY"
        }
        return bool(lacking) and lacking <= set(s.pending[teacher])

    monkeypatch.setattr(guards, "_demanded", per_teacher)
    bounds = Bounds(**SAFE, shape=Shape(gate_window=0), flush_timer=False, demand=True)
    assert "deadlock" in _kinds(explore(bounds))


def test_coalesce_without_timer_deadlocks_when_waiting_groups_hold_every_permit() -> None:
    """Three permits, three teachers, batches of two: one waiting group per teacher holds
    every permit, and no batch can ever fill."""
    bounds = Bounds(
        prompts=6,
        shape=Shape(
            prompts_per_step=2, max_inflight_prompts=3, max_batch_groups=2, max_buffered_groups=4
        ),
        teachers=3,
        design="coalesce",
        flush_timer=False,
    )
    report = explore(bounds)
    (finding,) = report.findings
    assert finding.kind == "deadlock"
    last = finding.replay(bounds)[-1]
    assert last.free_permits == 0
    assert all(0 < len(q) < bounds.shape.max_batch_groups for q in last.pending)


def test_coalesce_batch_larger_than_permits_never_fills() -> None:
    bounds = Bounds(
        prompts=4,
        shape=Shape(
            prompts_per_step=2, max_inflight_prompts=2, max_batch_groups=3, max_buffered_groups=4
        ),
        teachers=1,
        design="coalesce",
        flush_timer=False,
    )
    report = explore(bounds)
    assert _kinds(report) == {"deadlock"}
    _assert_replays(report.findings[0], bounds)


def test_inline_never_waits_for_a_batch() -> None:
    bounds = Bounds(
        **SAFE, shape=Shape(gate_window=0), design="inline", flush_timer=False, crashes=1
    )
    assert explore(bounds).ok


def test_naive_checkpoint_loses_prompts() -> None:
    """The upstream behaviour: READY groups and the cursor only. A crash loses what was in flight."""
    bounds = Bounds(
        **SAFE, crashes=1, checkpoint_policies=[CheckpointPolicy.NAIVE], interrupts=False
    )
    report = explore(bounds)
    assert "prompt_ledger" in _kinds(report)
    for finding in report.findings:
        _assert_replays(finding, bounds)


def test_checker_catches_a_restore_that_trains_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded bug: the checkpoint re-issues the prompts of the READY groups it also saves."""
    original = transitions._ledger

    def leaky(s: scheduler.SchedState, b: Bounds) -> scheduler.Saved:
        saved = original(s, b)
        return saved._replace(reissue=tuple(sorted(saved.reissue + saved.ready)))

    monkeypatch.setattr(transitions, "_ledger", leaky)
    bounds = Bounds(**SAFE, crashes=1, interrupts=False)
    report = explore(bounds)
    assert {"prompt_ledger", "trained_twice", "illegal_transition"} & _kinds(report)
    for finding in report.findings:
        _assert_replays(finding, bounds)


def test_checker_catches_a_leaked_permit(monkeypatch: pytest.MonkeyPatch) -> None:
    original = transitions._HANDLERS[ActionKind.ROLLOUT_FAIL]

    def leak(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState:
        after = original(s, b, a)
        return after._replace(free_permits=s.free_permits)

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.ROLLOUT_FAIL, leak)
    bounds = Bounds(**SAFE, rollout_failures=1, checkpoints=0, interrupts=False)
    assert "permits" in _kinds(explore(bounds))


def test_checker_catches_a_cancel_that_forgets_its_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a rollout cancelled at shutdown is not recorded to be issued again. The exit
    check compares the run's own record with the checkpoint's rule, so the prompt is lost."""
    original = transitions._HANDLERS[ActionKind.CANCEL]

    def forgetful(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState:
        after = original(s, b, a)
        return after._replace(reissue=s.reissue)

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.CANCEL, forgetful)
    bounds = Bounds(**SAFE, checkpoints=0)
    report = explore(bounds)
    assert "exit_ledger" in _kinds(report)
    for finding in report.findings:
        _assert_replays(finding, bounds)


def test_stuck_is_reported_when_the_run_cannot_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded livelock: a teacher call that can only fail and be retried forever."""

    def never_scored(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState:
        return s  # the call "returns" without changing anything: the run loops in place

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.SCORED, never_scored)
    bounds = Bounds(
        prompts=2,
        shape=Shape(prompts_per_step=2, max_inflight_prompts=3, max_batch_groups=2),
        checkpoints=0,
        interrupts=False,
    )
    assert "stuck" in _kinds(explore(bounds))


def test_apply_refuses_an_action_that_is_not_enabled() -> None:
    bounds = Bounds(**SAFE)
    with pytest.raises(NotEnabled, match="train"):
        apply(initial_state(bounds), bounds, Action(ActionKind.TRAIN, detail="step 0"))


def test_bounds_name_what_the_config_would_refuse() -> None:
    assert (
        Bounds(
            shape=Shape(max_inflight_prompts=3, max_batch_groups=3),
        ).problems()
        == []
    )
    (problem,) = Bounds(
        shape=Shape(prompts_per_step=3, max_buffered_groups=2),
    ).problems()
    assert "max_buffered_groups=2" in problem and "prompts_per_step=3" in problem
    assert Bounds(flush_timer=False).problems()
    assert Bounds(flush_timer=False, demand=True).problems() == []


def test_cli_reports_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "check",
                "--design",
                "all",
                "--teachers",
                "2",
                "--gate-window",
                "0",
                "--no-flush-timer",
                "--checkpoints",
                "0",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "deadlock" in out and "admit prompt 0" in out
    assert main(["check", "--checkpoints", "0"]) == 0
    assert "no violations" in capsys.readouterr().out


def test_cli_json_traces_replay(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "check",
        "--json",
        "--design",
        "coalesce",
        "--teachers",
        "3",
        "--prompts",
        "6",
        "--no-flush-timer",
    ]
    assert main(args) == 1
    (report,) = json.loads(capsys.readouterr().out)
    bounds = Bounds(prompts=6, teachers=3, design="coalesce", flush_timer=False)
    (violation,) = report["violations"]
    trace = tuple(Action.from_json(step) for step in report["violations"][0]["trace"])
    _assert_replays(Finding(violation["kind"], violation["message"], trace), bounds)


def test_cli_says_when_the_config_would_refuse_the_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            ["check", "--prompts-per-step", "3", "--max-buffered-groups", "2", "--checkpoints", "0"]
        )
        == 1
    )
    captured = capsys.readouterr()
    assert "PipelineConfig would refuse" in captured.err and "max_buffered_groups=2" in captured.err
    assert "deadlock" in captured.out


def test_progress_line_on_long_runs_only() -> None:
    """Quiet for short runs; on a non-terminal, a line every ten seconds or so."""
    stream = io.StringIO()
    line = cmd_check._ProgressLine(stream, "checking pump")
    for seconds in (0.5, 1.9, 2.5, 5.0, 13.0):
        line(1000, 3000, 10, seconds)
    line.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("checking pump: 1,000 states, 3,000 transitions, frontier 10")


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(dict(stages=0), id="ready-at-commit"),
        pytest.param(dict(stages=2, teachers=2, batch_failures=1), id="two-stages"),
        pytest.param(dict(sampler="windowed", max_staleness=0, crashes=1), id="windowed"),
        pytest.param(dict(train_failures=1, aborts=1, crashes=1), id="failed-step-and-abort"),
        pytest.param(dict(demand=True, crashes=1, batch_failures=1), id="shipped-default"),
    ],
)
def test_modelled_behaviours_are_safe(extra: dict[str, object]) -> None:
    """Each behaviour the pipeline has (or the model adds for it) explored with faults."""
    bounds = Bounds(**{**SAFE, "teachers": 1, **extra})
    report = explore(bounds)
    assert report.ok, [f.explain(bounds) for f in report.findings]


def test_two_stages_move_groups_scored_to_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a verifier after the teacher, a group is SCORED -> WRITTEN in between: the explorer
    reaches a state with a group at the second stage's queue."""
    bounds = Bounds(
        prompts=2, shape=Shape(prompts_per_step=2), stages=2, checkpoints=0, interrupts=False
    )
    state = initial_state(bounds)
    for action in [
        Action(ActionKind.ADMIT, 0),
        Action(ActionKind.COMMIT, 0),
        Action(ActionKind.DISPATCH, lane=0, detail="timer"),
        Action(ActionKind.SCORED, lane=0),
    ]:
        state = apply(state, bounds, action)
    assert state.pending[bounds.lanes - 1] == (0,)
    assert state.groups[0].state.value == "WRITTEN"


def test_checker_catches_a_windowed_sampler_that_trains_stale_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded bug: the windowed sampler ignores staleness when it selects."""

    def everything(s: scheduler.SchedState, b: Bounds) -> list[scheduler.Group]:
        ready = [g for g in s.groups if g.state.value == "READY"]
        return sorted(ready, key=lambda g: (g.version, g.ordinal))

    # the guards (may training start?) and the train step (what it selects) both ask it
    monkeypatch.setattr(guards, "_selectable", everything)
    monkeypatch.setattr(transitions, "_selectable", everything)
    bounds = Bounds(**SAFE, sampler="windowed", max_staleness=0, checkpoints=0)
    report = explore(bounds)
    assert "stale_trained" in _kinds(report)
    for finding in report.findings:
        _assert_replays(finding, bounds)


def test_checker_catches_a_demand_rule_that_never_fires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded bug in the one shared rule (the pipeline's stage calls it too): demand dispatch
    that never fires leaves the pump without a timer stuck."""
    monkeypatch.setattr(decisions, "demand_dispatch", lambda **facts: False)
    bounds = Bounds(**SAFE, shape=Shape(gate_window=0), flush_timer=False, demand=True)
    assert "deadlock" in _kinds(explore(bounds))


DEMAND_WITH_TIMER = Bounds(**SAFE, flush_timer=True, demand=True)
"""The shipped setting: a flush timer and demand dispatch (a step spans both teachers)."""


def test_demand_with_a_timer_is_prompt_in_every_state() -> None:
    assert explore(DEMAND_WITH_TIMER).ok
    assert explore(attrs.evolve(DEMAND_WITH_TIMER, crashes=1, batch_failures=1)).ok
    assert explore(attrs.evolve(DEMAND_WITH_TIMER, stages=2, teachers=1)).ok


@pytest.mark.parametrize(
    ("bug", "seeded"),
    [
        ("never fires", lambda **facts: False),
        (
            "fires while the step can still grow",
            lambda **f: f["training_waits"] and f["step_queued_here"],
        ),
        (
            "fires before the step is all issued",
            lambda **f: f["training_waits"] and not f["step_upstream"] and f["step_queued_here"],
        ),
    ],
)
def test_checker_with_a_timer_catches_a_wrong_demand_rule(
    monkeypatch: pytest.MonkeyPatch, bug: str, seeded: Callable[..., bool]
) -> None:
    """Seeded bugs in the one shared rule, with the flush timer on: every waiting batch may go
    for the timer, so none of these deadlocks, and only the promptness property sees them."""
    monkeypatch.setattr(decisions, "demand_dispatch", seeded)
    report = explore(DEMAND_WITH_TIMER)
    assert _kinds(report) == {"demand"}, bug
    for finding in report.findings:
        _assert_replays(finding, DEMAND_WITH_TIMER)


def test_checker_with_a_timer_catches_demand_judged_per_teacher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: each teacher judges demand on its own queue; with the timer on nothing
    deadlocks, but training waits for the timer on a step split across the two teachers."""

    def per_teacher(s: scheduler.SchedState, b: Bounds, lane: int) -> bool:
        ordinals = b.step_ordinals(s.step)
        lacking = {
            g.ordinal for g in s.groups if g.ordinal in ordinals and g.state.value != "READY"
        }
        issued = decisions.step_issued(ordinals, cursor=s.cursor, reissue=s.reissue)
        return issued and bool(lacking) and lacking <= set(s.pending[lane])

    monkeypatch.setattr(guards, "_demanded", per_teacher)
    report = explore(DEMAND_WITH_TIMER)
    assert _kinds(report) == {"demand"}
    (finding,) = report.findings
    assert "no batch is demanded" in finding.message
    _assert_replays(finding, DEMAND_WITH_TIMER)


def test_random_walks_find_what_the_explorer_finds() -> None:
    bounds = Bounds(**SAFE, shape=Shape(gate_window=0), flush_timer=False, checkpoints=0)
    report = random_walks(bounds, walks=200, seed=1)
    assert "deadlock" in {f.kind for f in report.findings}
    for finding in report.findings:
        _assert_replays(finding, bounds)
    clean = random_walks(Bounds(**SAFE, crashes=2, batch_failures=2), walks=100, seed=1)
    assert clean.ok and clean.finished > 0


def test_cli_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--simulate", "50", "--prompts", "12", "--teachers", "3"]) == 0
    assert "50 walks" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [{}, dict(crashes=1, teachers=2)], ids=["one-teacher", "crash"])
def test_permanent_failures_under_retry_are_safe_and_reached(extra: dict[str, object]) -> None:
    """A failed call may be permanent (its groups given up at once, not retried): no
    violation, and the variant adds states (it is reached: a group given up without a retry
    spends one failure where the retried one spends two)."""
    settings: dict[str, Any] = {**SAFE, "teachers": 1, "batch_failures": 2, "checkpoints": 0}
    settings.update(extra)
    with_permanent = Bounds(**settings, permanent_failures=True)
    report = explore(with_permanent)
    assert report.ok, [f.explain(with_permanent) for f in report.findings]
    assert report.states > explore(Bounds(**settings)).states


def test_a_permanent_failure_gives_its_groups_up_at_once() -> None:
    bounds = Bounds(
        prompts=2,
        shape=Shape(prompts_per_step=2),
        checkpoints=0,
        batch_failures=1,
        permanent_failures=True,
    )
    state = initial_state(bounds)
    for action in [
        Action(ActionKind.ADMIT, 0),
        Action(ActionKind.COMMIT, 0),
        Action(ActionKind.DISPATCH, lane=0, detail="timer"),
    ]:
        state = apply(state, bounds, action)
    permanent = Action(ActionKind.SCORE_FAIL, lane=0, detail=scheduler.PERMANENT_FAILURE)
    transient = apply(state, bounds, Action(ActionKind.SCORE_FAIL, lane=0))
    assert transient.groups[0].again and transient.shortfall == 0
    after = apply(state, bounds, permanent)
    assert after.groups == () and after.shortfall == 1 and after.rows == 0
    assert "permanent error" in scheduler.describe(permanent, bounds)
    off = Bounds(prompts=2, shape=Shape(prompts_per_step=2), checkpoints=0, batch_failures=1)
    with pytest.raises(NotEnabled):
        apply(state, off, permanent)


@pytest.mark.parametrize("policy", ["discard", "fail"])
def test_permanent_failures_change_nothing_where_the_policy_gives_up_anyway(policy: str) -> None:
    """Under `discard` and `fail` the model never offers the permanent variant (the pipeline
    never reports it there): the same states with the setting on or off."""
    settings: dict[str, Any] = {**SAFE, "batch_failures": 2, "checkpoints": 0}
    on = explore(Bounds(**settings, failure_policy=policy, permanent_failures=True))
    off = explore(Bounds(**settings, failure_policy=policy))
    assert on.ok and (on.states, on.transitions) == (off.states, off.transitions)


def test_cli_permanent_failures_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", "--json", "--batch-failures", "2", "--checkpoints", "0"]
    assert main([*args, "--permanent-failures"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["bounds"]["permanent_failures"] is True and report["violations"] == []
    assert main(args) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert plain["bounds"]["permanent_failures"] is False
    assert report["states"] > plain["states"]


def _dispatch_reasons_reached(bounds: Bounds) -> set[str]:
    """Every reason a batch is sent for, over every state the model reaches under `bounds`."""
    start = initial_state(bounds)
    seen, frontier, reasons = {start}, [start], set()
    while frontier:
        state = frontier.pop()
        for action in guards.enabled(state, bounds):
            if action.kind is ActionKind.DISPATCH:
                reasons.add(str(action.detail))
            after = scheduler.transition(state, bounds, action)
            if after not in seen:
                seen.add(after)
                frontier.append(after)
    return reasons


def _timer_and_demand() -> set[str]:
    bounds = Bounds(prompts=4, teachers=1, flush_timer=True, demand=True, checkpoints=0)
    return _dispatch_reasons_reached(bounds)


def test_the_timer_is_explored_under_demand_dispatch() -> None:
    """Demand dispatch sends a batch when training waits on it; the flush timer still sends one
    that training does not wait on yet. The model must take both paths: a model that let
    demand stand in for the timer would check a scheduler the pipeline is not. (Seeded bug:
    `test_seeded_bug_demand_silences_the_timer_is_caught`.)"""
    reached = _timer_and_demand()
    assert {"timer", "demand"} <= reached, reached


def test_seeded_bug_demand_silences_the_timer_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: under demand dispatch the model never lets the flush timer expire. No
    invariant fails (demand alone is deadlock-free), so only the test above notices."""
    real = guards.dispatch_reasons

    def no_timer_under_demand(s: Any, b: Bounds, lane: int) -> Any:
        return real(s, attrs.evolve(b, flush_timer=False) if b.demand else b, lane)

    monkeypatch.setattr(guards, "dispatch_reasons", no_timer_under_demand)
    bounds = Bounds(prompts=4, teachers=1, flush_timer=True, demand=True, checkpoints=0)
    assert explore(bounds).ok, "the seeded bug breaks no invariant"
    assert "timer" not in _timer_and_demand()


def _timer_explored_under_demand(report: Report) -> bool:
    """The checker's own search sent a batch for the flush timer and one for demand."""
    return {DispatchReason.TIMER, DispatchReason.DEMAND} <= report.dispatched


def _demand_silences_the_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: under demand dispatch the flush timer never expires
    (`timer_expired=b.flush_timer and not b.demand`)."""
    real = guards.dispatch_reasons
    without_timer = functools.cache(lambda b: attrs.evolve(b, flush_timer=False))

    def no_timer_under_demand(s: Any, b: Bounds, lane: int) -> Any:
        return real(s, without_timer(b) if b.demand else b, lane)

    monkeypatch.setattr(guards, "dispatch_reasons", no_timer_under_demand)


@pytest.mark.parametrize(
    "bounds",
    [
        pytest.param(DEMAND_WITH_TIMER, id="two-teachers"),
        pytest.param(attrs.evolve(DEMAND_WITH_TIMER, crashes=1, batch_failures=1), id="faults"),
        pytest.param(attrs.evolve(DEMAND_WITH_TIMER, stages=2, teachers=1), id="two-stages"),
    ],
)
@pytest.mark.parametrize("seeded", [False, True], ids=["model", "demand-silences-the-timer"])
def test_the_checker_explores_the_timer_under_demand_dispatch(
    monkeypatch: pytest.MonkeyPatch, bounds: Bounds, seeded: bool
) -> None:
    """The explorer's own coverage (`Report.dispatched`, the reasons its transitions sent a
    batch for), without replaying a trace: under demand dispatch with a timer both the timer
    and demand send batches. The seeded bug breaks no invariant and deadlocks nothing, so the
    verdict stays clean; the coverage is what tells it from the model."""
    if seeded:
        _demand_silences_the_timer(monkeypatch)
    report = explore(bounds)
    assert report.ok
    assert _timer_explored_under_demand(report) is not seeded, sorted(report.dispatched)


_FOOTPRINT_BOUNDS = [
    Bounds(prompts=3, crashes=1, rollout_failures=1, batch_failures=2, checkpoints=2),
    Bounds(prompts=3, train_failures=1, aborts=1, crashes=1, permanent_failures=True),
    Bounds(prompts=3, teachers=2, stages=2, demand=True, failure_policy="fail", batch_failures=1),
    Bounds(prompts=3, sampler="windowed", max_staleness=0, rollout_failures=1, crashes=1),
    Bounds(prompts=3, design="coalesce", drain_on_shutdown=False, crashes=1),
    Bounds(prompts=2, checkpoint_policies={CheckpointPolicy.NAIVE}, crashes=1, stages=0),
]


def _reachable(bounds: Bounds, limit: int) -> list[scheduler.SchedState]:
    """Up to `limit` states reachable under `bounds`, breadth-first, through the plain model."""
    start = initial_state(bounds)
    seen, order = {start}, [start]
    for state in order:
        if len(order) >= limit:
            break
        for action in guards.enabled(state, bounds):
            try:
                after = scheduler.transition(state, bounds, action)
            except IllegalTransition:
                continue
            if after not in seen:
                seen.add(after)
                order.append(after)
    return order[:limit]


def _after(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState | str:
    try:
        return scheduler.transition(s, b, a)
    except IllegalTransition as exc:
        return str(exc)


def _with_ready_of(
    s: scheduler.SchedState, other: scheduler.SchedState
) -> tuple[scheduler.Group, ...]:
    """The READY groups of `s`, with all but what `ready_groups` reads of them changed, and the
    other groups of `other`: the same `ready_groups` as `s`, and as much else as fits."""
    ready = [
        g._replace(permit=not g.permit, retries=g.retries + 1, stage=g.stage + 1, again=not g.again)
        for g in s.groups
        if g.state is GroupState.READY
    ]
    taken = {g.ordinal for g in ready}
    rest = [g for g in other.groups if g.state is not GroupState.READY and g.ordinal not in taken]
    return tuple(sorted(ready + rest, key=lambda g: g.ordinal))


@pytest.mark.parametrize("bounds", _FOOTPRINT_BOUNDS, ids=range(len(_FOOTPRINT_BOUNDS)))
def test_handlers_read_and_write_what_the_explorer_reuses(bounds: Bounds) -> None:
    """The explorer computes each handler once per value of the fields `TOUCHES` names and
    reuses the result, and lists a core's actions once with every budget left: on states
    mixing the fields of two reachable ones, each handler gives what those fields say, and
    `enabled`, `ample` and `check_state` read of the outer part no more than its mask."""
    states = _reachable(bounds, 600)
    outer = state_module.OUTER_FIELDS
    for i, s in enumerate(states):
        other = states[(i * 7 + 3) % len(states)]
        mask = state_module.outer_mask(state_module.outer_of(s))
        same_mask = [
            t
            for t in (other, states[(i * 13 + 5) % len(states)])
            if state_module.outer_mask(state_module.outer_of(t)) == mask
        ]
        for t in same_mask:  # another outer part with the same mask
            mixed = state_module.join(state_module.core_of(s), state_module.outer_of(t))
            assert guards.enabled(mixed, bounds) == guards.enabled(s, bounds)
            actions = guards.enabled(s, bounds)
            assert reduction.ample(mixed, bounds, actions) == reduction.ample(s, bounds, actions)
            assert check_state(mixed, bounds) == check_state(s, bounds)
        budgets: dict[str, Any] = {name: 1 for name in state_module.BUDGET_FIELDS}
        every_budget = s._replace(**budgets)
        gated = [
            a
            for a in guards.enabled(every_budget, bounds)
            if a.kind not in guards.BUDGET_OF or getattr(s, guards.BUDGET_OF[a.kind])
        ]
        assert gated == guards.enabled(s, bounds)
        for a in guards.enabled(s, bounds):
            after = _after(s, bounds, a)
            how = transitions.footprint(a)
            if how is transitions.Footprint.RESTART:
                elsewhere = state_module.join(state_module.core_of(other), state_module.outer_of(s))
                assert _after(elsewhere, bounds, a) == after, a
                continue
            touched = transitions.TOUCHES[a.kind]
            mixed = other._replace(**{name: getattr(s, name) for name in touched})
            expected = (
                after
                if isinstance(after, str)
                else mixed._replace(**{name: getattr(after, name) for name in touched})
            )
            assert _after(mixed, bounds, a) == expected, a
            if isinstance(after, str):
                continue
            changed = {
                n for n in scheduler.SchedState._fields if getattr(after, n) != getattr(s, n)
            }
            if how is transitions.Footprint.LOCAL:
                assert not touched & set(outer), a
            elif how is transitions.Footprint.SPEND:
                budget = transitions.SPENDS[a.kind]
                assert touched & set(outer) == {budget}, a
                assert getattr(after, budget) == getattr(s, budget) - 1, a
            elif how is transitions.Footprint.OUTER:
                assert changed <= set(outer), a
            elif how is transitions.Footprint.SNAPSHOT:
                assert touched & set(outer) == {"writing"}, a
                elsewhere = state_module.join(state_module.core_of(s), state_module.outer_of(other))
                kept = state_module.join(state_module.core_of(after), state_module.outer_of(other))
                assert _after(elsewhere, bounds, a) == kept._replace(writing=after.writing), a
                assert changed - set(outer) <= {"cut"}, a
                same_ready = other._replace(
                    **{name: getattr(s, name) for name in transitions.SNAPSHOT_READS},
                    groups=_with_ready_of(s, other),
                )
                snapshot = _after(same_ready, bounds, a)
                assert not isinstance(snapshot, str), a
                assert (snapshot.cut, snapshot.writing) == (after.cut, after.writing), a


def test_seeded_bug_a_snapshot_that_reads_the_outer_part_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded bug: the snapshot a checkpoint writes depends on the budget left, which its
    footprint (`SNAPSHOT`: the core only) says it does not read, so the explorer would reuse
    it in states that differ there."""
    original = transitions._HANDLERS[ActionKind.CHECKPOINT_SAVED]

    def budgeted(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState:
        after = original(s, b, a)
        assert after.writing is not None
        return after._replace(writing=after.writing._replace(step=s.checkpoints_left))

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.CHECKPOINT_SAVED, budgeted)
    with pytest.raises(AssertionError):
        test_handlers_read_and_write_what_the_explorer_reuses(_FOOTPRINT_BOUNDS[0])
    with pytest.raises(AssertionError):
        test_the_explorer_visits_what_a_plain_search_visits(_FOOTPRINT_BOUNDS[0])


def test_seeded_bug_a_snapshot_that_reads_the_one_being_written_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded bug: the snapshot depends on the one being written, which `TOUCHES` names
    (so states mixing the touched fields agree) but a `SNAPSHOT` footprint says is not read:
    only the check of that footprint, on the same core with another outer part, sees it."""
    original = transitions._HANDLERS[ActionKind.CHECKPOINT_SAVED]

    def rewritten(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState:
        after = original(s, b, a)
        assert after.writing is not None
        return after._replace(writing=after.writing._replace(step=s.writing is not None))

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.CHECKPOINT_SAVED, rewritten)
    with pytest.raises(AssertionError, match="checkpoint_saved"):
        test_handlers_read_and_write_what_the_explorer_reuses(_FOOTPRINT_BOUNDS[0])


def _groups_counted(s: scheduler.SchedState) -> int:
    return len(s.groups)


def _ready_retries(s: scheduler.SchedState) -> int:
    return sum(g.retries for g in s.groups if g.state is GroupState.READY)


@pytest.mark.parametrize("read", [_groups_counted, _ready_retries], ids=["count", "retries"])
def test_seeded_bug_a_snapshot_that_reads_more_of_the_groups_than_ready_groups_is_caught(
    monkeypatch: pytest.MonkeyPatch, read: Callable[[scheduler.SchedState], int]
) -> None:
    """A seeded bug: the snapshot depends on how many groups the buffer holds, READY or not, or
    on the READY groups' retries, which `TOUCHES` names (the groups) but `SNAPSHOT_READS` says
    is not read (only `ready_groups`: their ordinals and versions), so the explorer would reuse
    one snapshot in states that differ there."""
    original = transitions._HANDLERS[ActionKind.CHECKPOINT_SAVED]

    def counted(s: scheduler.SchedState, b: Bounds, a: Action) -> scheduler.SchedState:
        after = original(s, b, a)
        assert after.writing is not None
        return after._replace(writing=after.writing._replace(step=read(s)))

    monkeypatch.setitem(transitions._HANDLERS, ActionKind.CHECKPOINT_SAVED, counted)
    with pytest.raises(AssertionError, match="checkpoint_saved"):
        test_handlers_read_and_write_what_the_explorer_reuses(_FOOTPRINT_BOUNDS[0])
    with pytest.raises(AssertionError):
        test_the_explorer_visits_what_a_plain_search_visits(_FOOTPRINT_BOUNDS[0])


@pytest.mark.parametrize("bounds", _FOOTPRINT_BOUNDS, ids=range(len(_FOOTPRINT_BOUNDS)))
def test_canonical_reads_and_writes_what_the_explorer_reuses(bounds: Bounds) -> None:
    """The explorer computes `canonical` once per value of `CANONICAL_FIELDS` and, apart,
    once per groups value: on states mixing the fields of two reachable ones (and on final
    ones), it keeps every other field, what it makes of those fields is what they say, it is
    `canonical_groups` of the groups after `canonical_without_groups` of the rest, and it
    leaves a canonical state as it is (the explorer numbers a key met again as a successor
    without canonicalizing it again)."""
    from groupflow.model.scheduler import canonical as canonical_module

    fields = canonical_module.CANONICAL_FIELDS
    states = _reachable(bounds, 600)
    for i, s in enumerate(states):
        other = states[(i * 7 + 3) % len(states)]
        for t in (s, s._replace(phase=scheduler.Phase.DONE)):
            canon = canonical_module.canonical(t, bounds)
            rest = canonical_module.canonical_without_groups(t)
            groups = canonical_module.canonical_groups(t.groups, bounds)
            assert canon == rest._replace(groups=groups)
            assert (canon is t) == (rest is t and groups is t.groups)
            assert canonical_module.canonical(canon, bounds) == canon
            kept = set(scheduler.SchedState._fields) - fields
            assert all(getattr(rest, n) == getattr(t, n) for n in kept)
            mixed = other._replace(**{n: getattr(t, n) for n in fields})
            after = canonical_module.canonical_without_groups(mixed)
            assert after == mixed._replace(**{n: getattr(rest, n) for n in fields})


def test_seeded_bug_a_canonical_form_that_moves_again_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seeded bug: the canonical form reverses the prompts to issue again each time it is
    taken, so a canonical state is not its own canonical form, which the explorer's one key
    table (a key met again is not canonicalized again) relies on."""
    from groupflow.model.scheduler import canonical as canonical_module

    original = canonical_module.canonical_without_groups

    def reversing(s: scheduler.SchedState) -> scheduler.SchedState:
        out = original(s)
        return out._replace(reissue=out.reissue[::-1]) if len(set(out.reissue)) > 1 else out

    monkeypatch.setattr(canonical_module, "canonical_without_groups", reversing)
    with pytest.raises(AssertionError):
        for bounds in _FOOTPRINT_BOUNDS:
            test_canonical_reads_and_writes_what_the_explorer_reuses(bounds)


def _misread_checks(bounds: Bounds, by_fields: tuple[tuple[frozenset[str], Any], ...]) -> list[str]:
    """Where a check of `by_fields` gives, on a state mixing the fields of two reachable ones,
    other than what the fields it names say (the state they come from)."""
    states = _reachable(bounds, 6000)[::10]  # deep enough that steps are trained
    out = []
    for i, s in enumerate(states):
        other = states[(i * 7 + 3) % len(states)]
        ghost = s._replace(trained_twice=1)  # never reachable: the check must see it
        for t in (s, s._replace(phase=scheduler.Phase.DONE), ghost):
            for names, check in by_fields:
                mixed = other._replace(**{n: getattr(t, n) for n in names})
                if check(mixed, bounds) != check(t, bounds):
                    out.append(f"{check.__name__} reads more than {sorted(names)}")
    return out


@pytest.mark.parametrize("bounds", _FOOTPRINT_BOUNDS, ids=range(len(_FOOTPRINT_BOUNDS)))
def test_checks_read_what_the_explorer_reuses(bounds: Bounds) -> None:
    """The explorer computes each check of `BY_FIELDS` once per value of the fields it names
    and reuses the result: on states mixing the fields of two reachable ones, each check
    gives what those fields say; and `check_state` is those checks, then `check_rest`."""
    assert not _misread_checks(bounds, checks.BY_FIELDS)
    for s in _reachable(bounds, 200):
        parts = [v for _, check in checks.BY_FIELDS for v in check(s, bounds)]
        assert check_state(s, bounds) == parts + list(checks.check_rest(s, bounds))


def test_seeded_bug_a_check_that_reads_an_undeclared_field_is_caught() -> None:
    """A seeded bug: the ledger's check is declared without `reissue`, so the explorer would
    reuse its verdict in states that differ there."""
    seeded = tuple((names - {"reissue"}, check) for names, check in checks.BY_FIELDS)
    assert _misread_checks(_FOOTPRINT_BOUNDS[0], seeded)


@pytest.mark.parametrize("bounds", _FOOTPRINT_BOUNDS[:3], ids=range(3))
def test_the_explorer_visits_what_a_plain_search_visits(bounds: Bounds) -> None:
    """Without reductions, the explorer's states and transitions are those of a plain
    breadth-first search through `enabled` and `transition`."""
    start = initial_state(bounds)
    seen, order, moves = {start}, [start], 0
    for state in order:
        if state.phase is scheduler.Phase.DONE:
            continue
        for action in guards.enabled(state, bounds):
            after = scheduler.transition(state, bounds, action)
            moves += 1
            if after not in seen:
                seen.add(after)
                order.append(after)
    report = explore(bounds, reduce=False)
    assert (report.states, report.transitions) == (len(order), moves)
