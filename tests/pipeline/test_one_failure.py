"""A run fails once, for one reason: failures that arrive together (a fleet that goes down in
the same instant, two teachers failing side by side) end the run with the first one's error,
never an exception group, and what failed after it ends as cancelled, its prompt issued again
on resume. A route to a teacher the scorer lacks fails the run at once, naming the agent."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

from groupflow.impl import PipelineConfig, ScoringConfig, build_pipeline
from groupflow.impl._pipeline import Pipeline, RunStatus
from groupflow.impl._teachers import teacher_by_agent
from groupflow.impl.contract import ScoreRequest
from groupflow.impl.errors import PumpFailed, RolloutsFailed, RoutingError
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import decisions
from groupflow.model.shape import Shape
from groupflow.sim.run import INLINE, PUMP_DEMAND, simulate
from groupflow.sim.scenario import parse_scenario
from tests.helpers import HANG_S, STEP_OF_FOUR


def fleet(*, inflight: int = 4, prompts: int = 8) -> Pipeline:
    """Every rollout fails after the same second: the fleet is down."""
    config = PipelineConfig(
        shape=Shape(
            prompts_per_step=2,
            num_generations_per_prompt=2,
            max_inflight_prompts=inflight,
            max_buffered_groups=8,
        ),
        max_consecutive_failed_rollouts=1,
    )
    return build_pipeline(
        config,
        prompts=list(range(prompts)),
        generator=FakeGenerator(fail=frozenset(range(prompts))),
        learner=FakeLearner(),
        train_fields=["input_ids"],
    )


async def test_a_fleet_that_goes_down_at_once_fails_the_run_with_one_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = fleet()
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    cause = caught.value.__cause__
    assert isinstance(cause, RolloutsFailed), repr(cause)
    assert "2 rollouts in a row failed" in str(cause)
    # the two judged failures were given up; the rest ended as cancelled, issued again
    assert len(p.ledger.shortfall) == 2
    assert not p.buffer.store.list_ids()


def _scenario(teachers: int, *, extra: str) -> Any:
    names = [f"t{i}" for i in range(teachers)]
    blocks = "".join(f"[teachers.{n}]\nfixed_s = 1.0\n" for n in names)
    agents = "".join(f'a{i} = "{n}"\n' for i, n in enumerate(names))
    return parse_scenario(
        f"""
name = "together"
steps = 4
[pipeline]
prompts_per_step = {2 * teachers}
num_generations_per_prompt = 2
max_inflight_prompts = {2 * teachers}
max_buffered_groups = {4 * teachers}
[scoring]
max_batch_groups = 2
flush_after_s = 1.0
{extra}
[generation]
median_s = 1.0
sigma = 0.0
{blocks}
[agents]
{agents}
[train]
step_s = 1.0
[faults]
scorer_error_rate = 1.0
""",
        source="together.toml",
    )


@pytest.mark.parametrize(
    ("teachers", "extra", "error"),
    [
        (2, 'failure_policy = "fail"', "ScoringCallFailed"),
        (3, 'failure_policy = "discard"\nmax_consecutive_failed_batches = 1', "ScoringCallFailed"),
    ],
    ids=["fail-policy", "limit"],
)
@pytest.mark.parametrize("variant", [PUMP_DEMAND, INLINE], ids=lambda v: v.label)
def test_teachers_failing_together_fail_the_run_once_and_conform(
    teachers: int, extra: str, error: str, variant: Any
) -> None:
    """Under the inline baseline too, where the second failure's group keeps its permit
    until the shutdown drops it (released at once, it let a prompt in the model holds back)."""
    result = simulate(_scenario(teachers, extra=extra), variant, conform=True)
    assert result.outcome.startswith("failed:") and f"{error}(" in result.outcome, result.outcome
    assert "Group" not in result.outcome
    assert result.conformance is not None and result.conformance.ok, result.conformance


def test_a_fleet_down_at_once_conforms_in_the_simulator() -> None:
    scenario = _scenario(2, extra='failure_policy = "discard"')
    scenario = attrs.evolve(
        scenario,
        faults=attrs.evolve(scenario.faults, scorer_error_rate=0.0, rollout_failure_rate=1.0),
        pipeline=attrs.evolve(scenario.pipeline, max_consecutive_failed_rollouts=1),
    )
    result = simulate(scenario, PUMP_DEMAND, conform=True)
    assert "RolloutsFailed(" in result.outcome and "Group" not in result.outcome, result.outcome
    assert result.conformance is not None and result.conformance.ok, result.conformance


@attrs.define
class Forwarding:
    """A scorer that wraps another and does not declare `teachers` (so the build cannot check
    routes against it); it knows `have` only."""

    have: frozenset[str]
    inner: FakeScorer = attrs.field(factory=FakeScorer)

    async def score(self, request: ScoreRequest) -> None:
        if request.teacher not in self.have:
            raise RoutingError(f"no physical teacher {request.teacher!r}; have {sorted(self.have)}")
        await self.inner.score(request)


async def test_a_route_to_a_teacher_the_scorer_lacks_fails_the_run_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Counted as failed calls, the other teacher's successes kept the limit from tripping and
    the run 'succeeded' with half its prompts given up."""
    scorer = Forwarding(frozenset({"t-math"}))
    config = PipelineConfig(
        shape=STEP_OF_FOUR.evolve(max_batch_groups=2),
        scoring=ScoringConfig(flush_after_s=1.0, failure_policy="discard"),
    )
    p = build_pipeline(
        config,
        prompts=list(range(16)),
        generator=FakeGenerator(),
        learner=FakeLearner(),
        scorer=scorer,
        route=teacher_by_agent({"math": "t-math", "code": "t-code"}),
        agent_of=lambda o: "code" if o % 2 else "math",
        train_fields=["input_ids"],
    )
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    cause = caught.value.__cause__
    assert isinstance(cause, RoutingError), repr(cause)
    assert "agent 'code' routed to teacher 't-code'" in str(cause)
    assert "Forwarding" in str(cause)
    assert p.stage is not None and p.stage.drain_metrics().failures == 0
    assert not p.buffer.store.list_ids()


def test_seeded_bug_every_failure_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: no one-failure rule (every failure is judged, and each may fail the run), as
    before: the fleet test's run ends in an exception group of `RolloutsFailed`."""
    monkeypatch.setattr(RunStatus, "claim_failure", lambda self: True)
    monkeypatch.setattr(decisions, "failure_is_judged", lambda *, run_failed: True)
    p = fleet()

    async def main() -> BaseException | None:
        try:
            await p.run()
        except PumpFailed as exc:
            return exc.__cause__
        return None

    cause = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert isinstance(cause, BaseExceptionGroup), repr(cause)


def test_seeded_bug_a_routing_error_counted_as_a_failed_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeded bug: the stage treats a `RoutingError` as a failed call (it is an `Exception`
    like any other): the run ends without naming the route, as the test above would see."""
    import groupflow.impl._pipeline._scoring_stage as stage_module

    class NotRouting(Exception):
        pass

    monkeypatch.setattr(stage_module, "RoutingError", NotRouting)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        trio.run(
            test_a_route_to_a_teacher_the_scorer_lacks_fails_the_run_at_once,
            trio.testing.MockClock(autojump_threshold=0),
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
