"""The teacher scoring stage under virtual time: batching, timers, drain, demand, one call per
teacher at a time, failure policies, cancellation."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import PipelineConfig, ReplayBuffer, ScoringConfig
from groupflow.impl.errors import TeacherCallFailed
from groupflow.impl.pipeline import (
    Pipeline,
    ScoreRequest,
    TeacherStage,
    ThreadedScorer,
    build_pipeline,
)
from groupflow.impl.teachers import teacher_by_agent
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import GroupState, GroupView, assert_invariants
from tests.helpers import rows, scoring_buffer, written

GROUP_SIZE = 4


def stage_buffer() -> ReplayBuffer:
    return scoring_buffer(group_size=GROUP_SIZE, capacity=32)


def scoring(**overrides: object) -> ScoringConfig:
    settings: dict[str, object] = {"max_batch_groups": 8, "flush_after_s": 5.0}
    settings.update(overrides)
    return ScoringConfig(**settings)  # type: ignore[arg-type]


async def test_eight_groups_go_in_one_call(autojump_clock: trio.testing.MockClock) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = TeacherStage(buffer, scorer, scoring())
    ids = await written(buffer, 8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        stage.upstream_ended()
    assert [call.group_ids for call in scorer.calls] == [tuple(ids)]
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)
    metrics = stage.drain_metrics()
    assert (metrics.calls, metrics.groups, metrics.rows, metrics.reasons) == (1, 8, 32, {"full": 1})
    assert stage.drain_metrics().calls == 0
    assert_invariants(buffer.snapshot())


async def test_partial_batch_waits_for_the_timer(autojump_clock: trio.testing.MockClock) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = TeacherStage(buffer, scorer, scoring(dispatch="timer"))
    ids = await written(buffer, 3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        await trio.sleep(100)
        stage.upstream_ended()
    (call,) = scorer.calls
    assert call.group_ids == tuple(ids) and call.start == 5.0
    assert stage.drain_metrics().reasons == {"timer": 1}


async def test_partial_batch_goes_at_once_when_upstream_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = TeacherStage(buffer, scorer, scoring(dispatch="timer"))
    ids = await written(buffer, 3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        stage.upstream_ended()
    (call,) = scorer.calls
    assert call.start == 0.0


async def test_one_call_per_teacher_at_a_time_and_teachers_overlap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer(fixed=3.0)
    route = teacher_by_agent({"math": "t-math", "code": "t-code", "code-v2": "t-code"})
    stage = TeacherStage(buffer, scorer, scoring(max_batch_groups=2), route=route)
    math_ids = await written(buffer, 4, agent="math")
    code_ids = await written(buffer, 2, agent="code") + await written(buffer, 2, agent="code-v2")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in math_ids + code_ids:
            stage.submit(gid)
        stage.upstream_ended()
    by_teacher: dict[str, list[tuple[float, float]]] = {}
    for call in scorer.calls:
        by_teacher.setdefault(call.teacher, []).append((call.start, call.end))
    assert sorted(by_teacher) == ["t-code", "t-math"]
    for spans in by_teacher.values():  # the fake also asserts this as it runs
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    (m0, _), (c0, _) = by_teacher["t-math"][0], by_teacher["t-code"][0]
    assert m0 == c0 == 0.0, "two teachers' first calls overlap"


async def test_unmapped_agent_is_refused_naming_it() -> None:
    route = teacher_by_agent({"math": "t-math"})
    with pytest.raises(ValueError, match="'poetry'"):
        route(GroupView("g1", GroupState.WRITTEN, 0, agent="poetry"))
    assert teacher_by_agent({}, default="t0")(GroupView("g1", GroupState.WRITTEN, 0)) == "t0"


async def test_demand_dispatch_sends_once_the_step_is_all_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = TeacherStage(buffer, scorer, scoring(flush_after_s=60.0))
    ids = await written(buffer, 3)
    late = buffer.reserve(target_step=0)  # one rollout of step 0 still running
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        stage.demand(0)
        await trio.sleep(10)
        assert scorer.calls == [], "a rollout of the step is still running: keep waiting"
        await buffer.commit(
            late,
            rows(late, GROUP_SIZE),
            start_weight_version=0,
            end_weight_version=0,
            defer_ready=True,
        )
        stage.submit(late)
        await trio.sleep(5)
        stage.upstream_ended()
    (call,) = scorer.calls
    assert call.group_ids == (*ids, late) and call.start == 10.0
    assert stage.drain_metrics().reasons == {"demand": 1}


async def test_timer_dispatch_ignores_demand(autojump_clock: trio.testing.MockClock) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = TeacherStage(buffer, scorer, scoring(dispatch="timer", flush_after_s=7.0))
    ids = await written(buffer, 2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        stage.demand(0)
        await trio.sleep(20)
        stage.upstream_ended()
    assert scorer.calls[0].start == 7.0


async def test_retry_policy_retries_each_group_alone_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    discarded: list[tuple[str, str]] = []
    buffer = stage_buffer()
    # the batch fails; of the retries, the one for the second group fails again
    scorer = FakeScorer(fail=lambda i, r: i == 0 or (i >= 1 and r.groups[0].group_id.endswith("1")))
    stage = TeacherStage(
        buffer,
        scorer,
        scoring(max_batch_groups=3),
        on_discard=lambda view, why: discarded.append((view.group_id, why)),
    )
    ids = await written(buffer, 3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        stage.upstream_ended()
    assert [len(call.group_ids) for call in scorer.calls] == [3, 1, 1, 1]
    assert [buffer.state_of(g) for g in ids] == [
        GroupState.READY,
        GroupState.DISCARDED,
        GroupState.READY,
    ]
    assert discarded == [(ids[1], "failed")]
    m = stage.drain_metrics()
    assert (m.failures, m.retries, m.discards) == (2, 3, 1)
    assert_invariants(buffer.snapshot())


async def test_discard_policy_drops_the_batch(autojump_clock: trio.testing.MockClock) -> None:
    buffer = stage_buffer()
    stage = TeacherStage(
        buffer, FakeScorer(fail=lambda i, r: True), scoring(failure_policy="discard")
    )
    ids = await written(buffer, 2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run)
        for gid in ids:
            stage.submit(gid)
        stage.upstream_ended()
    assert {buffer.state_of(g) for g in ids} == {GroupState.DISCARDED}
    assert not buffer.store.list_ids()


async def test_fail_policy_fails_the_stage_and_cleans_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer = stage_buffer()
    stage = TeacherStage(buffer, FakeScorer(fail=lambda i, r: True), scoring(failure_policy="fail"))
    ids = await written(buffer, 2)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with pytest.raises(TeacherCallFailed, match="failure_policy='fail'"):
        await stage.run()
    assert {buffer.state_of(g) for g in ids} == {GroupState.DISCARDED}
    assert not buffer.store.list_ids()
    assert_invariants(buffer.snapshot())


async def test_too_many_failed_calls_in_a_row_fail_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer = stage_buffer()
    config = scoring(max_batch_groups=1, failure_policy="discard", max_consecutive_failed_batches=2)
    stage = TeacherStage(buffer, FakeScorer(fail=lambda i, r: True), config)
    ids = await written(buffer, 5)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with pytest.raises(TeacherCallFailed, match="3 calls in a row failed"):
        await stage.run()
    assert not buffer.store.list_ids()


async def test_cancelled_run_waits_for_the_scorer_thread_then_cleans_up() -> None:
    """The call in flight finishes (its groups end READY); the group still queued is dropped."""
    buffer = stage_buffer()
    entered, finished = threading.Event(), threading.Event()

    def blocking_score(request: ScoreRequest) -> None:
        entered.set()
        time.sleep(0.2)
        # the rows are still there: nobody cleared them while the teacher was reading
        request.store.get(request.sample_ids, ["input_ids"])
        request.store.add_fields({sid: {request.field: [-1.0]} for sid in request.sample_ids})
        finished.set()

    stage = TeacherStage(buffer, ThreadedScorer(blocking_score), scoring(max_batch_groups=2))
    ids = await written(buffer, 3)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stage.run)
            for gid in ids:
                stage.submit(gid)
            await trio.to_thread.run_sync(entered.wait)
            nursery.cancel_scope.cancel()
    assert finished.is_set()
    assert [buffer.state_of(g) for g in ids] == [
        GroupState.READY,
        GroupState.READY,
        GroupState.DISCARDED,
    ]
    assert_invariants(buffer.snapshot())


async def test_submit_refuses_groups_that_are_not_written() -> None:
    buffer = stage_buffer()
    stage = TeacherStage(buffer, FakeScorer(), scoring())
    gid = buffer.reserve(target_step=0)
    with pytest.raises(ValueError, match="only WRITTEN"):
        stage.submit(gid)


# -- demand through the whole pipeline: when the stage wakes, and for which teachers ---------


def _demand_pipeline(
    *, latency: Callable[[int], float], fail: frozenset[int] = frozenset(), teachers: int = 1
) -> tuple[Pipeline, FakeScorer]:
    """Two steps of two prompts, demand dispatch, a flush timer far beyond the run (1000 s),
    and the gate shut a step ahead, so step 1's prompts wait for step 0 to train: while step 0
    waits, the data is not done (no drain), and a batch that goes early goes for demand. Prompt
    `o` is scored by teacher `o % teachers`."""
    scorer = FakeScorer(fixed=0.5)
    names = [f"t{i}" for i in range(teachers)]
    pipeline = build_pipeline(
        PipelineConfig(
            prompts_per_step=2,
            num_generations_per_prompt=GROUP_SIZE,
            max_inflight_prompts=2,
            max_buffered_groups=4,
            gate_window=0,
            scoring=ScoringConfig(max_batch_groups=4, flush_after_s=1000.0, dispatch="demand"),
        ),
        prompts=[0, 1, 2, 3],
        generator=FakeGenerator(latency=latency, fail=fail),
        learner=FakeLearner(),
        scorer=scorer,
        route=teacher_by_agent({name: name for name in names}),
        agent_of=lambda ordinal: names[ordinal % teachers],
        train_fields=["input_ids"],
    )
    return pipeline, scorer


def _seeded_bug_demand_not_woken_by_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage wakes on demand only when the step or its issue changes, not when the last
    group that could still join the step leaves upstream (its rollout failed)."""
    monkeypatch.setattr(TeacherStage, "demand", _demand_ignoring_upstream)


def _demand_ignoring_upstream(self: TeacherStage, step: int | None, *, issued: bool = True) -> None:
    self._demanded_step = step
    self._demanded_issued = issued
    seen = (step, issued, False)
    if seen != self._demand_seen:
        self._demand_seen = seen
        self._wake_all()


async def test_a_rollout_that_fails_sends_the_steps_queued_batch_at_once_for_demand(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Demand changes with no group arriving: prompt 0 waits queued, prompt 1's rollout fails
    at 5 s and is given up. Nothing of the step can still join the queue, so the batch goes at
    5 s, for the reason "demand", not at the flush timer's 1000 s."""
    pipeline, scorer = _demand_pipeline(
        latency=lambda o: {0: 1.0, 1: 5.0}.get(o, 1.0), fail=frozenset({1})
    )
    with trio.fail_after(5000):
        result = await pipeline.run()
    first = scorer.calls[0]
    assert first.start == 5.0, "the batch waited for the timer after the step's last rollout failed"
    assert result.shortfall == {1} and result.trained == {0, 2, 3}
    step0 = result.steps[0]
    assert step0.scoring is not None and step0.scoring.reasons == {"demand": 1}


async def test_seeded_bug_demand_not_woken_when_the_last_rollout_fails_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seeded_bug_demand_not_woken_by_upstream(monkeypatch)
    with pytest.raises(AssertionError, match="waited for the timer"):
        await test_a_rollout_that_fails_sends_the_steps_queued_batch_at_once_for_demand(
            autojump_clock
        )


def _demanded_per_teacher(self: TeacherStage, queue: Any) -> bool:
    """Seeded bug: demand judged per teacher, sending only when this queue holds every group of
    the step that is written (another teacher's group counts as not yet here)."""
    step = self._demanded_step
    if step is None:
        return False
    here = sum(1 for item in queue if item.target_step == step)
    elsewhere = self.buffer.count_in(GroupState.WRITTEN, step) - here
    return here > 0 and elsewhere == 0 and not self._step_upstream(step)


async def test_a_step_split_across_two_teachers_sends_each_partial_batch_once_all_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each teacher's queue holds one group of the step: demand is judged for the step as a
    whole, so each sends its one group as soon as the step is all queued (2 s), not at the
    timer."""
    pipeline, scorer = _demand_pipeline(latency=lambda o: 1.0 + o, teachers=2)
    with trio.fail_after(5000):
        result = await pipeline.run()
    step0 = sorted((c.teacher, c.start) for c in scorer.calls if c.start < 3.0)
    assert step0 == [("t0", 2.0), ("t1", 2.0)], "a teacher waited for the timer"
    assert result.trained == {0, 1, 2, 3}


async def test_seeded_bug_demand_judged_per_teacher_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TeacherStage, "_demanded", _demanded_per_teacher)
    with pytest.raises(AssertionError, match="a teacher waited for the timer"):
        await test_a_step_split_across_two_teachers_sends_each_partial_batch_once_all_queued(
            autojump_clock
        )
