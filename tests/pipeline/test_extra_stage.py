"""A second scoring stage after the teacher's (`build_pipeline(extra_stages=...)`): a verifier
that writes a reward for every row. A group is READY once both stages have marked it; the
pipeline conforms to the model with two stages (`Bounds.stages == 2`), across failed calls,
crashes and resumes under both checkpoint policies; the wiring is checked before anything runs.

Seeded bugs, each caught by the test named after it: a stage that reports its call before it
hands the groups on; a verifier whose demand dispatch forgets the groups still at the teacher;
a checkpoint that flushes the teacher's stage only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from groupflow.impl import CheckpointConfig, ExtraStage, ScoreRequest
from groupflow.impl._pipeline import (
    Checkpointer,
    Pipeline,
    PipelineConfig,
    RunStatus,
    ScoringConfig,
    build_pipeline,
    lanes_for,
    load_checkpoint,
)
from groupflow.impl._pipeline import _scoring_stage as stage_module
from groupflow.impl.contract import TEACHER_FIELD
from groupflow.impl.errors import ConfigError, RoutingError
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import GroupState
from groupflow.sim.run import PUMP_DEMAND, PUMP_TIMER, VERIFIER, simulate
from groupflow.sim.scenario import load_scenario
from groupflow.sim.verify.conformance import Conformance, bounds_for
from tests.helpers import STEP_OF_FOUR

REWARD = "reward"


def config(max_batch_groups: int = 3, **scoring: Any) -> PipelineConfig:
    settings: dict[str, Any] = {"flush_after_s": 2.0}
    settings.update(scoring)
    return PipelineConfig(
        shape=STEP_OF_FOUR.evolve(max_batch_groups=max_batch_groups),
        scoring=ScoringConfig(**settings),
    )


class Verifier(FakeScorer):
    """Checks that the teacher scored every row before it, then writes the reward."""

    async def score(self, request: ScoreRequest) -> None:
        lacking = request.store.missing_fields(list(request.sample_ids), [TEACHER_FIELD])
        assert not lacking, f"the verifier met rows the teacher had not scored: {lacking}"
        await super().score(request)


def build(
    cfg: PipelineConfig,
    *,
    learner: FakeLearner | None = None,
    verifier: FakeScorer | None = None,
    prompts: int = 16,
    slow: bool = False,
    **kwargs: Any,
) -> Pipeline:
    return build_pipeline(
        cfg,
        prompts=list(range(prompts)),
        generator=FakeGenerator(latency=lambda o: (30.0 if slow else 1.0) + (o * 7) % 5),
        learner=learner if learner is not None else FakeLearner(),
        scorer=FakeScorer(fixed=0.5),
        extra_stages=[ExtraStage(VERIFIER, verifier or Verifier(fixed=0.3), REWARD)],
        lanes=lanes_for(["teacher"], later=[VERIFIER]),
        **kwargs,
    )


def checker(cfg: PipelineConfig, prompts: int = 16) -> Conformance:
    return Conformance(bounds_for(cfg, prompts=prompts, stages=2))


async def test_every_trained_row_has_both_fields_and_the_verifier_came_second(
    autojump_clock: trio.testing.MockClock,
) -> None:
    learner = FakeLearner()
    verifier = Verifier(fixed=0.3)
    cfg = config()
    check = checker(cfg)
    pipeline = build(cfg, learner=learner, verifier=verifier)
    check.attach(pipeline)
    with trio.fail_after(10_000):
        result = await pipeline.run()
    check.raise_if_failed()
    assert check.actions > 0
    assert result.trained == frozenset(range(16))
    for batch in learner.batches:
        for row in batch.rows.values():
            assert TEACHER_FIELD in row and REWARD in row
    assert verifier.calls and {c.teacher for c in verifier.calls} == {VERIFIER}
    assert sum(c.rows for c in verifier.calls) == 16 * 2
    later = [record.later_scoring[VERIFIER] for record in result.steps]
    assert sum(m.groups for m in later) == 16
    assert pipeline.stages == (pipeline.stage, *pipeline.later_stages)
    assert pipeline.fingerprint["fields"] == sorted(
        ["input_ids", "generation_logprobs", TEACHER_FIELD, REWARD]
    )


async def test_failed_verifier_calls_are_retried_or_given_up_and_conform(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cfg = config()
    check = checker(cfg)
    verifier = Verifier(fixed=0.3, fail=lambda index, request: index % 3 == 1)
    pipeline = build(cfg, verifier=verifier)
    check.attach(pipeline)
    with trio.fail_after(10_000):
        result = await pipeline.run()
    check.raise_if_failed()
    assert any(not c.ok for c in verifier.calls)
    assert result.trained | result.shortfall == frozenset(range(16))
    assert not result.trained & result.shortfall


@pytest.mark.parametrize("policy", ["flush", "uncommitted"])
@pytest.mark.parametrize("crash_at", [5.0, 9.5, 13.0])
async def test_a_crash_and_resume_with_two_stages_trains_every_prompt_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, policy: str, crash_at: float
) -> None:
    cfg = config()
    cfg = attrs.evolve(
        cfg,
        checkpoints=CheckpointConfig(tmp_path, every_steps=1, policy=policy, write_in_thread=False),
    )
    check = checker(cfg)
    first_learner = FakeLearner()
    pipeline = build(cfg, learner=first_learner)
    check.attach(pipeline)
    with trio.CancelScope() as scope:

        async def crash() -> None:
            await trio.sleep(crash_at)
            check.crash()  # the checker hears the crash first: what the dying run says is not the model's
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(crash)
            await pipeline.run()
    assert scope.cancelled_caught, "the run should still be running at the crash"
    learner = FakeLearner()
    resumed = build(cfg, learner=learner)
    check.attach(resumed)
    if any(tmp_path.glob("step-*")):
        await resumed.resume_from(load_checkpoint(tmp_path))
    check.compare()
    with trio.fail_after(10_000):
        await resumed.run()
    check.raise_if_failed()
    saved = resumed.resumed.step if resumed.resumed is not None else 0
    before = [g.ordinal for b in first_learner.batches[:saved] for g in b.groups]
    after = [g.ordinal for b in learner.batches for g in b.groups]
    assert None not in before + after
    assert sorted(o for o in before + after if o is not None) == list(range(16)), (before, after)


@pytest.mark.parametrize("variant", [PUMP_TIMER, PUMP_DEMAND], ids=lambda v: v.label)
def test_the_verifier_scenario_conforms_and_is_deterministic(variant: Any) -> None:
    scenario = load_scenario("verifier")
    first = simulate(scenario, variant, steps=8, seed=2, conform=True)
    assert first.conformance is not None
    assert first.conformance.ok, first.conformance.failure
    assert first.outcome == "ok" and first.steps == 8
    assert any(s.kind == "score" and s.lane == VERIFIER for s in first.spans)
    again = simulate(scenario, variant, steps=8, seed=2)
    assert again.trace_hash == first.trace_hash


def test_the_inline_baseline_refuses_a_verifier_scenario() -> None:
    from groupflow.sim.run import INLINE

    with pytest.raises(ValueError, match=r"\[verifier\] stage.*--design pump"):
        simulate(load_scenario("verifier"), INLINE, steps=2)


# -- the wiring, refused before anything runs ------------------------------------------------


class _Served(FakeScorer):
    teachers = frozenset({"teacher"})


class _ReadsReward(FakeScorer):
    reads = frozenset({"input_ids", REWARD})


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"scoring": None, "scorer": None}, ConfigError, "need the teacher stage first"),
        ({"design": "inline"}, ConfigError, "need design='pump'"),
        ({"stages": 2}, ConfigError, "at most 2 scoring stages"),
        ({"field": TEACHER_FIELD}, ConfigError, "share the field"),
        ({"name": "teacher"}, ConfigError, "has the name of a teacher"),
        ({"verifier": _Served()}, RoutingError, "serves \\['teacher'\\], not 'verifier'"),
        ({"teacher": _ReadsReward()}, ConfigError, "reads \\['reward'\\], which only its own"),
        ({"verifier": _ReadsReward()}, ConfigError, "stage 'verifier'.*reads \\['reward'\\]"),
        ({"not_a_stage": True}, ConfigError, "not an ExtraStage"),
    ],
)
def test_bad_extra_stages_are_refused_at_build(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    cfg = config(design=change.get("design", "pump"))
    if "scoring" in change:
        cfg = PipelineConfig(
            shape=STEP_OF_FOUR.evolve(max_batch_groups=2),
        )
    spec = ExtraStage(
        change.get("name", VERIFIER),
        change.get("verifier", FakeScorer()),
        change.get("field", REWARD),
    )
    stages: list[Any] = [spec] * change.get("stages", 1)
    if change.get("not_a_stage"):
        stages = [spec, "verifier"]
    with pytest.raises(error, match=match):
        build_pipeline(
            cfg,
            prompts=list(range(8)),
            generator=FakeGenerator(),
            learner=FakeLearner(),
            scorer=None if "scorer" in change else change.get("teacher", FakeScorer()),
            extra_stages=stages,
        )


@pytest.mark.parametrize(("name", "field"), [("", REWARD), (VERIFIER, ""), (VERIFIER, 3)])
def test_an_extra_stage_needs_a_name_and_a_field(name: Any, field: Any) -> None:
    with pytest.raises(ConfigError, match="must be a non-empty string"):
        ExtraStage(name, FakeScorer(), field)


# -- seeded bugs -----------------------------------------------------------------------------


@pytest.fixture
def reports_before_handing_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Seeded bug: the stage hands its scored groups to the next stage only after it has
    reported the call (an observer then sees groups in no queue)."""
    original_report = RunStatus.report
    held: list[tuple[stage_module.ScoringStage, list[str]]] = []

    def hand_on(self: stage_module.ScoringStage, ids: Any, states: Any) -> None:
        if self.next is not None:
            held.append(
                (
                    self.next,
                    [g for g, s in zip(ids, states, strict=True) if s is GroupState.WRITTEN],
                )
            )

    def report(self: Any, kind: Any, **kwargs: Any) -> None:
        original_report(self, kind, **kwargs)
        while held:
            nxt, ids = held.pop()
            for gid in ids:
                nxt.submit(gid)

    monkeypatch.setattr(stage_module.ScoringStage, "_hand_on", hand_on)
    monkeypatch.setattr(RunStatus, "report", report)
    yield


def test_seeded_bug_reports_before_handing_on_is_caught(reports_before_handing_on: None) -> None:
    result = simulate(load_scenario("verifier"), PUMP_DEMAND, steps=4, conform=True)
    assert result.conformance is not None and result.conformance.failure is not None
    assert "the live state differs from the model's" in result.conformance.failure
    assert "call returns, its groups scored" in result.conformance.failure


def test_seeded_bug_verifier_demand_forgets_the_teacher_stage_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: a later stage's demand dispatch counts only running rollouts as upstream,
    not the groups of the step the teacher still holds, so it sends a step's groups while
    more are coming: the model refuses that dispatch."""

    def only_rollouts(self: stage_module.ScoringStage, step: int) -> bool:
        return any(g.target_step == step for g in self.buffer.groups(GroupState.RESERVED))

    monkeypatch.setattr(stage_module.ScoringStage, "_step_upstream", only_rollouts)
    result = simulate(load_scenario("verifier"), PUMP_DEMAND, steps=10, conform=True)
    assert result.conformance is not None and result.conformance.failure is not None
    assert "the model does not allow" in result.conformance.failure
    assert "stage 2: send a batch (demand)" in result.conformance.failure


async def _flush_timeouts(autojump_clock: trio.testing.MockClock, tmp_path: Path) -> int:
    cfg = PipelineConfig(
        shape=STEP_OF_FOUR,
        checkpoints=CheckpointConfig(
            tmp_path, every_steps=1, policy="flush", flush_timeout_s=20.0, write_in_thread=False
        ),
        scoring=ScoringConfig(flush_after_s=1000.0, dispatch="timer"),
    )
    pipeline = build(cfg, slow=True)
    with trio.fail_after(100_000):
        await pipeline.run()
    assert pipeline.checkpointer is not None
    return pipeline.checkpointer.flush_timeouts


async def test_a_flush_save_sends_both_stages_at_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    assert await _flush_timeouts(autojump_clock, tmp_path) == 0


async def test_seeded_bug_flush_reaches_the_teacher_only_is_caught(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the checkpointer flushes the first stage only; the groups then wait at the
    verifier for its timer, and the save gives up waiting."""
    original = Checkpointer._flush

    async def teacher_only(self: Checkpointer, ordinals: set[int]) -> bool:
        self.stages = self.stages[:1]
        return await original(self, ordinals)

    monkeypatch.setattr(Checkpointer, "_flush", teacher_only)
    assert await _flush_timeouts(autojump_clock, tmp_path) > 0


class _Steps(trio.abc.Instrument):
    """Counts task steps, and cancels `scope` past `limit`: a busy loop, which never lets the
    virtual clock move, fails at once instead of hanging the test."""

    def __init__(self, scope: trio.CancelScope, limit: int) -> None:
        self.steps = 0
        self.scope = scope
        self.limit = limit

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1
        if self.steps > self.limit:
            self.scope.cancel()


async def test_a_verifier_failing_under_fail_stops_the_run_while_the_teacher_holds_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The verifier's failure reaches the supervisor at once: the teacher stage, holding a
    queued group whose flush timer has run out, is cancelled, not left spinning on a timer
    that can no longer send anything (the pipeline machine found that busy loop)."""
    from groupflow.impl.errors import PumpFailed, ScoringCallFailed

    cfg = config(failure_policy="fail", dispatch="timer", flush_after_s=0.5, max_batch_groups=1)
    check = checker(cfg)
    pipeline = build(cfg, verifier=Verifier(fixed=0.3, fail=lambda index, request: True))
    check.attach(pipeline)
    with trio.CancelScope() as spun:
        steps = _Steps(spun, limit=5_000)
        trio.lowlevel.add_instrument(steps)
        try:
            with pytest.raises(PumpFailed) as failed, trio.fail_after(1_000):
                await pipeline.run()
        finally:
            trio.lowlevel.remove_instrument(steps)
    assert not spun.cancelled_caught, f"a busy loop: {steps.steps} task steps"
    cause = failed.value.__cause__
    assert isinstance(cause, ScoringCallFailed), cause  # the stage's verdict, not a teacher's
    assert str(cause).startswith("stage 'verifier' failed scoring groups"), cause
    check.raise_if_failed()
    assert steps.steps < 5_000, steps.steps
    assert all(stage.closed for stage in pipeline.stages)
