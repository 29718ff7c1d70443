"""The running pipeline conforms to the checked model: every action a simulated run takes is
one the model allows from the model's state, and the live state matches the model's after each.

Every shipped scenario runs under every design and dispatch, faults, crash and resume included;
then the pipeline is broken on purpose and the checker must name the action and both states.
"""

from __future__ import annotations

from typing import Any

import pytest

from groupflow.cli import main
from groupflow.impl._pipeline import _rollout as rollout_module
from groupflow.impl._pipeline import _scoring_stage as stage_module
from groupflow.model import decisions
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.sim.run import (
    BOUND,
    INLINE,
    PUMP_DEMAND,
    PUMP_TIMER,
    conform_steps,
    runs,
    simulate,
)
from groupflow.sim.scenario import load_scenario, parse_scenario, shipped_scenarios
from groupflow.sim.verify.conformance import Conformance, ConformanceError, bounds_for

VARIANTS = [INLINE, PUMP_TIMER, PUMP_DEMAND, BOUND]


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        pytest.param(name, variant, id=f"{name}-{variant.label}")
        for name in shipped_scenarios()
        for variant in VARIANTS
        # the inline baseline has no second stage: `groupflow sim` leaves it out there
        if runs(load_scenario(name), variant)
    ],
)
def test_every_shipped_scenario_conforms(name: str, variant: Any) -> None:
    scenario = load_scenario(name)
    result = simulate(scenario, variant, steps=conform_steps(scenario), conform=True)
    summary = result.conformance
    assert summary is not None
    assert summary.ok, summary.failure
    assert summary.actions > 0
    assert result.outcome == "ok"


def test_crash_and_resume_conform_on_other_seeds() -> None:
    scenario = load_scenario("faults")
    for seed in (1, 2, 3):
        result = simulate(scenario, PUMP_DEMAND, seed=seed, conform=True)
        assert result.crashed
        assert result.conformance is not None
        assert result.conformance.ok, result.conformance.failure


class _IgnoresTheGate:
    """The rollout's view of `decisions` with admission that forgets the gate window."""

    def __getattr__(self, name: str) -> Any:
        return getattr(decisions, name)

    @staticmethod
    def admission(**facts: Any) -> decisions.Hold | None:
        return decisions.admission(**{**facts, "gate_window": 1_000_000})


def test_admission_that_ignores_the_gate_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollout_module, "decisions", _IgnoresTheGate())
    result = simulate(load_scenario("shipped-recipe-wide"), PUMP_DEMAND, conform=True)
    summary = result.conformance
    assert summary is not None and not summary.ok
    assert summary.failure is not None
    assert "the model does not allow" in summary.failure
    assert "admit prompt" in summary.failure and "for step 2" in summary.failure
    assert "model: running step 0" in summary.failure and "live:" in summary.failure


class _EagerDispatch:
    """The stage's view of `decisions` that sends any partial batch at once, for a reason the
    model has never heard of."""

    def __getattr__(self, name: str) -> Any:
        return getattr(decisions, name)

    @staticmethod
    def dispatch_reasons(**facts: Any) -> tuple[str, ...]:
        return decisions.dispatch_reasons(**facts)[:1] or (
            ("eager",) if facts["queued"] and not facts["call_in_flight"] else ()
        )


def test_dispatch_for_no_reason_the_model_knows_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stage_module, "decisions", _EagerDispatch())
    result = simulate(load_scenario("shipped-recipe"), PUMP_DEMAND, conform=True)
    summary = result.conformance
    assert summary is not None and summary.failure is not None
    assert "teacher 0: send a batch (eager)" in summary.failure
    assert "model:" in summary.failure and "live:" in summary.failure


def test_a_state_that_differs_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that forgets to record a retried group as such: the queues match, the flags
    do not."""
    original = stage_module.ScoringStage.queues

    def forgetful(self: stage_module.ScoringStage) -> dict[str, stage_module.QueueView]:
        return {
            t: stage_module.QueueView(v.queued, frozenset(), v.in_flight)
            for t, v in original(self).items()
        }

    monkeypatch.setattr(stage_module.ScoringStage, "queues", forgetful)
    result = simulate(load_scenario("faults"), PUMP_DEMAND, conform=True)
    summary = result.conformance
    assert summary is not None and summary.failure is not None
    assert "the live state differs from the model's: groups:" in summary.failure


def test_checker_refuses_an_action_from_the_wrong_state() -> None:
    config = load_scenario("shipped-recipe").pipeline
    checker = Conformance(bounds_for(config, prompts=16))
    checker.on_action(Action(ActionKind.COMMIT, 0))
    assert checker.failure is not None and "rollout of prompt 0 finishes" in checker.failure
    with pytest.raises(ConformanceError, match="does not allow action 1"):
        checker.raise_if_failed()


def test_cli_conform_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--scenario", "faults", "--design", "pump", "--conform"]) == 0
    out = capsys.readouterr().out
    assert "conforms to the model" in out and "actions checked" in out


def _scenario(extra: str, *, pipeline: str = "", scoring: str = "") -> Any:
    text = f"""
name = "variation"
steps = 6
[pipeline]
prompts_per_step = 4
num_generations_per_prompt = 2
max_inflight_prompts = 4
max_buffered_groups = 8
{pipeline}
[scoring]
max_batch_groups = 3
flush_after_s = 2.0
{scoring}
[generation]
median_s = 3.0
sigma = 0.5
[teachers.teacher]
fixed_s = 6.0
[train]
step_s = 1.0
{extra}
"""
    return parse_scenario(text, source="variation.toml")


def _kinds(trace: tuple[Action, ...]) -> list[str]:
    return [str(a.kind) for a in trace]


@pytest.mark.parametrize("variant", [INLINE, PUMP_TIMER, PUMP_DEMAND], ids=lambda v: v.label)
def test_admission_goes_on_during_a_flush_and_conforms(variant: Any) -> None:
    """The issue's case: a flush checkpoint after every step, a 6 s teacher, 4 prompts per
    step. Prompts are admitted while the checkpoint waits for its cut, in the model as in the
    pipeline."""
    scenario = _scenario("", pipeline="[checkpoints]\nevery_steps = 1")
    result = simulate(scenario, variant, conform=True)
    summary = result.conformance
    assert summary is not None
    assert summary.ok, summary.failure
    kinds = _kinds(summary.trace)
    flushing = False
    admitted_while_flushing = 0
    for action in summary.trace:
        if action.kind == "checkpoint":
            flushing = True
        elif action.kind in ("checkpoint_saved", "flush_timeout"):
            flushing = False
        elif action.kind == "admit" and flushing:
            admitted_while_flushing += 1
    assert kinds.count("checkpoint") == 6
    assert admitted_while_flushing > 0


@pytest.mark.parametrize(
    ("pipeline", "scoring", "faults", "outcome"),
    [
        pytest.param(
            '[checkpoints]\nevery_steps = 1\npolicy = "uncommitted"',
            "",
            "",
            "ok",
            id="uncommitted",
        ),
        pytest.param(
            "[checkpoints]\nevery_steps = 2\nflush_timeout_s = 1.0",
            "",
            "",
            "ok",
            id="flush-timeout",
        ),
        pytest.param(
            "",
            'failure_policy = "discard"',
            "scorer_error_calls = [0, 2, 3]",
            "ok",
            id="discard-policy",
        ),
        pytest.param(
            "", 'failure_policy = "fail"', "scorer_error_calls = [2]", "failed", id="fail-policy"
        ),
        pytest.param(
            "",
            "max_consecutive_failed_batches = 1",
            "scorer_error_calls = [1, 2, 3, 4]",
            "failed",
            id="too-many-failures",
        ),
        pytest.param(
            "", "", "scorer_permanent_error_calls = [0, 2, 3]", "ok", id="permanent-failures"
        ),
        pytest.param(
            "",
            'failure_policy = "discard"',
            "scorer_permanent_error_calls = [1]\nscorer_error_calls = [2]",
            "ok",
            id="permanent-under-discard",
        ),
        pytest.param("", "", "train_error_steps = [2]", "failed", id="train-step-fails"),
        pytest.param("", "", "rollout_failure_rate = 1.0", "failed", id="generator-down"),
        pytest.param(
            "max_consecutive_failed_rollouts = 100",
            "",
            "rollout_failure_rate = 1.0",
            "failed",
            id="nothing-trained",
        ),
        pytest.param(
            "[checkpoints]\nevery_steps = 1",
            "",
            "crash_at_s = 40.0\nscorer_error_calls = [1]",
            "ok",
            id="crash-and-resume",
        ),
    ],
)
@pytest.mark.parametrize("variant", [INLINE, PUMP_DEMAND], ids=lambda v: v.label)
def test_policies_and_faults_conform(
    variant: Any, pipeline: str, scoring: str, faults: str, outcome: str
) -> None:
    scenario = _scenario(f"[faults]\n{faults}", pipeline=pipeline, scoring=scoring)
    result = simulate(scenario, variant, conform=True)
    summary = result.conformance
    assert summary is not None
    assert summary.ok, summary.failure
    assert result.outcome.split(":")[0] == outcome, result.outcome
    if outcome == "failed":
        assert "exit" in _kinds(summary.trace)


@pytest.mark.parametrize("variant", [INLINE, PUMP_DEMAND], ids=lambda v: v.label)
@pytest.mark.parametrize(
    "scoring",
    [
        pytest.param('failure_policy = "fail"', id="fail-policy"),
        pytest.param("max_consecutive_failed_batches = 1", id="too-many-failures"),
    ],
)
def test_runs_that_fail_during_checkpoints_conform(variant: Any, scoring: str) -> None:
    """The review's case: a run fails while a flush checkpoint or a train step is under way;
    several seeds so the failure lands in different places."""
    scenario = _scenario(
        "[faults]\nscorer_error_rate = 0.3",
        pipeline="[checkpoints]\nevery_steps = 1",
        scoring=scoring,
    )
    for seed in range(8):
        result = simulate(scenario, variant, seed=seed, conform=True)
        summary = result.conformance
        assert summary is not None
        assert summary.ok, (seed, summary.failure)


@pytest.mark.parametrize("variant", [INLINE, PUMP_DEMAND], ids=lambda v: v.label)
def test_permanent_failures_are_given_up_in_the_model_as_in_the_run(variant: Any) -> None:
    """Calls failing with an error retrying cannot fix: reported as permanent, their groups
    given up at once (the shortfall), and the model agrees action by action."""
    scenario = _scenario("[faults]\nscorer_permanent_error_calls = [0, 2]")
    result = simulate(scenario, variant, conform=True)
    summary = result.conformance
    assert summary is not None
    assert summary.ok, summary.failure
    failures = [a for a in summary.trace if a.kind == "score_fail"]
    assert [a.detail for a in failures] == ["permanent", "permanent"]
    assert result.shortfall > 0 and result.outcome == "ok"
