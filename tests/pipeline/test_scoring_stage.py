"""The teacher scoring stage under virtual time: batching, timers, drain, demand, one call per
teacher at a time, failure policies, cancellation."""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import (
    BufferConfig,
    ExtraStage,
    MemoryStore,
    PipelineConfig,
    ReplayBuffer,
    ScoringConfig,
)
from groupflow.impl._pipeline import (
    Pipeline,
    QueueView,
    RunStatus,
    ScoringStage,
    ThreadedScorer,
    build_pipeline,
    leaves,
)
from groupflow.impl._pipeline._scoring_stage import chain
from groupflow.impl._teachers import teacher_by_agent
from groupflow.impl.contract import TEACHER_FIELD, Scorer, ScoreRequest
from groupflow.impl.errors import ConfigError, RoutingError, ScorerLost, ScoringCallFailed
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import GroupState, GroupView, assert_invariants
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.shape import Shape
from tests.helpers import (
    HANG_S,
    INPUT,
    REWARD,
    rows,
    running,
    scored_through,
    scoring_buffer,
    written,
)

GROUP_SIZE = 4


def stage_buffer() -> ReplayBuffer:
    return scoring_buffer(group_size=GROUP_SIZE, capacity=32)


def scoring(**overrides: object) -> ScoringConfig:
    settings: dict[str, object] = {"flush_after_s": 5.0}
    settings.update(overrides)
    return ScoringConfig(**settings)  # type: ignore[arg-type]


async def test_eight_groups_go_in_one_call(autojump_clock: trio.testing.MockClock) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(), max_batch_groups=8)
    ids = await written(buffer, 8)
    await scored_through(stage, ids)
    assert [call.group_ids for call in scorer.calls] == [tuple(ids)]
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)
    metrics = stage.drain_metrics()
    assert (metrics.calls, metrics.groups, metrics.rows, metrics.reasons) == (1, 8, 32, {"full": 1})
    assert stage.drain_metrics().calls == 0
    assert_invariants(buffer.snapshot())


async def test_partial_batch_waits_for_the_timer(autojump_clock: trio.testing.MockClock) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(dispatch="timer"), max_batch_groups=8)
    ids = await written(buffer, 3)
    async with running(stage, ids):
        await trio.sleep(100)
    (call,) = scorer.calls
    assert call.group_ids == tuple(ids) and call.start == 5.0
    assert stage.drain_metrics().reasons == {"timer": 1}


async def test_partial_batch_goes_at_once_when_upstream_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(dispatch="timer"), max_batch_groups=8)
    ids = await written(buffer, 3)
    await scored_through(stage, ids)
    (call,) = scorer.calls
    assert call.start == 0.0


async def test_one_call_per_teacher_at_a_time_and_teachers_overlap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer(fixed=3.0)
    route = teacher_by_agent({"math": "t-math", "code": "t-code", "code-v2": "t-code"})
    stage = ScoringStage(buffer, scorer, scoring(), max_batch_groups=2, route=route)
    math_ids = await written(buffer, 4, agent="math")
    code_ids = await written(buffer, 2, agent="code") + await written(buffer, 2, agent="code-v2")
    await scored_through(stage, math_ids + code_ids)
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
    stage = ScoringStage(buffer, scorer, scoring(flush_after_s=60.0), max_batch_groups=8)
    ids = await written(buffer, 3)
    late = buffer.reserve(target_step=0)  # one rollout of step 0 still running
    async with running(stage, ids):
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
    (call,) = scorer.calls
    assert call.group_ids == (*ids, late) and call.start == 10.0
    assert stage.drain_metrics().reasons == {"demand": 1}


async def test_timer_dispatch_ignores_demand(autojump_clock: trio.testing.MockClock) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(
        buffer, scorer, scoring(dispatch="timer", flush_after_s=7.0), max_batch_groups=8
    )
    ids = await written(buffer, 2)
    async with running(stage, ids):
        stage.demand(0)
        await trio.sleep(20)
    assert scorer.calls[0].start == 7.0


async def test_retry_policy_retries_each_group_alone_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    discarded: list[tuple[str, str]] = []
    buffer = stage_buffer()
    # the batch fails; of the retries, the one for the second group fails again
    scorer = FakeScorer(fail=lambda i, r: i == 0 or (i >= 1 and r.groups[0].group_id.endswith("1")))
    stage = ScoringStage(
        buffer,
        scorer,
        scoring(),
        max_batch_groups=3,
        on_discard=lambda view, why: discarded.append((view.group_id, why)),
    )
    ids = await written(buffer, 3)
    await scored_through(stage, ids)
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
    stage = ScoringStage(
        buffer,
        FakeScorer(fail=lambda i, r: True),
        scoring(failure_policy="discard"),
        max_batch_groups=8,
    )
    ids = await written(buffer, 2)
    await scored_through(stage, ids)
    assert {buffer.state_of(g) for g in ids} == {GroupState.DISCARDED}
    assert not buffer.store.list_ids()


async def test_fail_policy_fails_the_stage_and_cleans_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer = stage_buffer()
    stage = ScoringStage(
        buffer,
        FakeScorer(fail=lambda i, r: True),
        scoring(failure_policy="fail"),
        max_batch_groups=8,
    )
    ids = await written(buffer, 2)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with pytest.raises(ScoringCallFailed, match="failure_policy='fail'"):
        await stage.run()
    assert {buffer.state_of(g) for g in ids} == {GroupState.DISCARDED}
    assert not buffer.store.list_ids()
    assert_invariants(buffer.snapshot())


async def test_too_many_failed_calls_in_a_row_fail_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer = stage_buffer()
    config = scoring(failure_policy="discard", max_consecutive_failed_batches=2)
    stage = ScoringStage(buffer, FakeScorer(fail=lambda i, r: True), config, max_batch_groups=1)
    ids = await written(buffer, 5)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with pytest.raises(ScoringCallFailed, match="3 calls in a row failed"):
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

    stage = ScoringStage(buffer, ThreadedScorer(blocking_score), scoring(), max_batch_groups=2)
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
    stage = ScoringStage(buffer, FakeScorer(), scoring(), max_batch_groups=8)
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
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=GROUP_SIZE,
                max_inflight_prompts=2,
                max_buffered_groups=4,
                gate_window=0,
                max_batch_groups=4,
            ),
            scoring=ScoringConfig(flush_after_s=1000.0, dispatch="demand"),
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
    monkeypatch.setattr(ScoringStage, "demand", _demand_ignoring_upstream)


def _demand_ignoring_upstream(self: ScoringStage, step: int | None, *, issued: bool = True) -> None:
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


def _demanded_per_teacher(self: ScoringStage, queue: Any) -> bool:
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
    monkeypatch.setattr(ScoringStage, "_demanded", _demanded_per_teacher)
    with pytest.raises(AssertionError, match="a teacher waited for the timer"):
        await test_a_step_split_across_two_teachers_sends_each_partial_batch_once_all_queued(
            autojump_clock
        )


# -- what the stage reports: metrics, queues, what it holds --------------------------------


async def test_metrics_sum_calls_rows_queue_wait_and_call_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Five groups queued at 1 s: two full calls at 1 s and 4 s, then the last group by its
    timer (expired at 6 s while a call was in flight) as soon as the teacher is free, at 7 s."""
    buffer, scorer = stage_buffer(), FakeScorer(fixed=3.0)
    stage = ScoringStage(buffer, scorer, scoring(dispatch="timer"), max_batch_groups=2)
    ids = await written(buffer, 5)
    with trio.fail_after(HANG_S):
        async with running(stage):
            await trio.sleep(1)
            for gid in ids:
                stage.submit(gid)
            await trio.sleep(20)
    assert [(call.group_ids, call.start) for call in scorer.calls] == [
        (tuple(ids[:2]), 1.0),
        (tuple(ids[2:4]), 4.0),
        ((ids[4],), 7.0),
    ]
    metrics = stage.drain_metrics()
    assert (metrics.calls, metrics.groups, metrics.rows) == (3, 5, 20)
    assert metrics.reasons == {"full": 2, "timer": 1}
    assert metrics.rows_per_call == pytest.approx(20 / 3)
    assert metrics.queue_wait_s == pytest.approx(0 + 0 + 3 + 3 + 6)
    assert metrics.call_s == pytest.approx(9.0)
    assert stage.scored == 5
    assert stage.drain_metrics().rows_per_call == 0.0


async def test_mid_run_the_stage_reports_each_teachers_call_and_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """What the stall watchdog, the conformance check and a later stage's demand read: at 9 s
    teacher A has had a call of one group (step 500) in flight since 2 s, with two groups of
    step 300 queued behind it; teacher B holds one group of step 300, queued."""
    buffer, scorer = stage_buffer(), FakeScorer(fixed=10.0)
    stage = ScoringStage(
        buffer,
        scorer,
        scoring(flush_after_s=2.0, dispatch="timer"),
        max_batch_groups=3,
        route=teacher_by_agent({"a": "A", "b": "B"}),
        name="judge",
    )
    (first,) = await written(buffer, 1, step=500, agent="a")
    behind = await written(buffer, 2, step=300, agent="a")
    (other,) = await written(buffer, 1, step=300, agent="b")
    with trio.fail_after(HANG_S):
        async with running(stage):
            stage.submit(first)
            await trio.sleep(3)
            for gid in behind:
                stage.submit(gid)
            await trio.sleep(5.5)
            stage.submit(other)
            await trio.sleep(0.5)
            assert stage.waiting(trio.current_time()) == [
                "stage 'judge' teacher 'A': a call of 1 groups in flight for 7 s, 2 queued",
                "stage 'judge' teacher 'B': 1 queued",
            ]
            assert stage.backlog == 4
            assert stage.queues() == {
                "A": QueueView(tuple(behind), frozenset(), (first,)),
                "B": QueueView((other,), frozenset(), ()),
            }
            # steps past 256, made afresh: equal to the groups' steps, not the same objects
            probes = [*range(299, 302), *range(499, 502)]
            assert [stage.holds_step(step) for step in probes] == [
                False,
                True,
                False,
                False,
                True,
                False,
            ]
    assert stage.waiting(trio.current_time()) == []
    assert stage.backlog == 0
    assert not stage.holds_step(300)


# -- when a batch goes, and with which groups -----------------------------------------------


async def test_the_flush_timer_runs_from_the_oldest_queued_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(dispatch="timer"), max_batch_groups=8)
    ids = await written(buffer, 2)
    with trio.fail_after(HANG_S):
        async with running(stage):
            stage.submit(ids[0])
            await trio.sleep(3)
            stage.submit(ids[1])
            await trio.sleep(20)
    (call,) = scorer.calls
    assert call.group_ids == tuple(ids) and call.start == 5.0


async def test_retried_groups_go_first_and_alone_ahead_of_groups_queued_behind_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The full batch fails at 1 s; two groups queued meanwhile wait behind its retries."""
    buffer = stage_buffer()
    scorer = FakeScorer(fail=lambda i, r: i == 0)
    stage = ScoringStage(buffer, scorer, scoring(dispatch="timer"), max_batch_groups=2)
    ids = await written(buffer, 4)
    with trio.fail_after(HANG_S):
        async with running(stage):
            stage.submit(ids[0])
            stage.submit(ids[1])
            await trio.sleep(0.5)
            stage.submit(ids[2])
            stage.submit(ids[3])
            await trio.sleep(1.0)
            assert stage.queues() == {
                "teacher": QueueView((ids[1], ids[2], ids[3]), frozenset({ids[1]}), (ids[0],))
            }
    assert [call.group_ids for call in scorer.calls] == [
        tuple(ids[:2]),
        (ids[0],),
        (ids[1],),
        tuple(ids[2:]),
    ]
    assert stage.drain_metrics().reasons == {"full": 2, "retry": 2}
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)


async def test_a_checkpoint_flush_sends_only_the_queues_that_hold_its_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """At 7 s a checkpoint waits on a group queued at teacher A (busy until 15 s): A sends it
    as soon as it is free; teacher B's group waits for its own timer (11 s)."""
    buffer, scorer = stage_buffer(), FakeScorer(fixed=10.0)
    stage = ScoringStage(
        buffer,
        scorer,
        scoring(dispatch="timer"),
        max_batch_groups=8,
        route=teacher_by_agent({"a": "A", "b": "B"}),
    )
    first, pending = await written(buffer, 2, agent="a")
    (other,) = await written(buffer, 1, agent="b")
    with trio.fail_after(HANG_S):
        async with running(stage):
            stage.submit(first)
            await trio.sleep(6)
            stage.submit(pending)
            stage.submit(other)
            await trio.sleep(1)
            stage.flush({pending})
            await trio.sleep(30)
    assert sorted((c.teacher, c.group_ids, c.start) for c in scorer.calls) == [
        ("A", (first,), 5.0),
        ("A", (pending,), 15.0),
        ("B", (other,), 11.0),
    ]
    assert stage.drain_metrics().reasons == {"timer": 2, "checkpoint flush": 1}


async def test_a_batch_of_hundreds_of_groups_stops_at_max_batch_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = scoring_buffer(group_size=1, capacity=301), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(), max_batch_groups=300)
    ids = await written(buffer, 301)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S):
        await stage.run()
    assert [call.group_ids for call in scorer.calls] == [tuple(ids[:300]), (ids[300],)]
    assert stage.drain_metrics().reasons == {"full": 1, "drain": 1}


# -- failures ------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 2])
async def test_the_run_fails_at_the_first_failed_call_beyond_the_limit(
    autojump_clock: trio.testing.MockClock, limit: int
) -> None:
    """`max_consecutive_failed_batches=limit` allows that many failed calls in a row: the next
    one fails the run, and the groups it never sent are dropped at shutdown."""
    discarded: list[tuple[str, str]] = []
    buffer, scorer = stage_buffer(), FakeScorer(fail=lambda i, r: True)
    config = scoring(failure_policy="discard", max_consecutive_failed_batches=limit)
    stage = ScoringStage(
        buffer,
        scorer,
        config,
        max_batch_groups=1,
        on_discard=lambda view, why: discarded.append((view.group_id, why)),
    )
    ids = await written(buffer, 5)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    message = (
        rf"teacher 'teacher': {limit + 1} calls in a row failed "
        rf"\(max_consecutive_failed_batches={limit}\); last error: OSError"
    )
    with trio.fail_after(HANG_S), pytest.raises(ScoringCallFailed, match=message):
        await stage.run()
    assert len(scorer.calls) == limit + 1
    sent = limit + 1
    assert discarded == [(g, "failed") for g in ids[:sent]] + [(g, "shutdown") for g in ids[sent:]]
    metrics = stage.drain_metrics()
    assert (metrics.failures, metrics.discards, metrics.retries) == (sent, 5, 0)
    assert metrics.call_s == sent * 1.0


async def test_a_scored_call_resets_the_count_of_failed_calls_in_a_row(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A failed call, a scored one, then failed calls: with a limit of two, the third failure
    after the scored call fails the run, not the second, not the fourth."""
    buffer, scorer = stage_buffer(), FakeScorer(fail=lambda i, r: i != 1)
    config = scoring(failure_policy="discard", max_consecutive_failed_batches=2)
    stage = ScoringStage(buffer, scorer, config, max_batch_groups=1)
    ids = await written(buffer, 6)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S), pytest.raises(ScoringCallFailed, match="3 calls in a row failed"):
        await stage.run()
    assert [call.ok for call in scorer.calls] == [False, True, False, False, False]
    assert [buffer.state_of(g) for g in ids] == [
        GroupState.DISCARDED,
        GroupState.READY,
        *[GroupState.DISCARDED] * 4,
    ]


# -- what the stage is built from ----------------------------------------------------------


async def test_the_stages_options_and_demands_issue_are_keyword_only() -> None:
    buffer = stage_buffer()
    with pytest.raises(TypeError):
        ScoringStage(buffer, FakeScorer(), scoring(), 8)  # type: ignore[call-arg]
    stage = ScoringStage(buffer, FakeScorer(), scoring(), max_batch_groups=8)
    with pytest.raises(TypeError):
        stage.demand(0, False)  # type: ignore[call-arg]


class RecordingScorer(FakeScorer):
    """A `FakeScorer` that keeps every request it was given."""

    requests: list[ScoreRequest]

    async def score(self, request: ScoreRequest) -> None:
        self.requests.append(request)
        await super().score(request)


def recording_scorer() -> RecordingScorer:
    scorer = RecordingScorer()
    scorer.requests = []
    return scorer


async def test_a_cancelled_call_may_take_a_minute_to_return_unless_the_stage_says_otherwise(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """How long a teacher thread that ignores a cancel is waited for before it is abandoned."""
    buffer = stage_buffer()
    ids = await written(buffer, 2)
    waits = []
    for gid, given in zip(ids, [{}, {"abandon_after_s": 5.0}], strict=True):
        scorer = recording_scorer()
        stage = ScoringStage(buffer, scorer, scoring(), max_batch_groups=8, **given)  # type: ignore[arg-type]
        stage.submit(gid)
        stage.upstream_ended()
        with trio.fail_after(HANG_S):
            await stage.run()
        (request,) = scorer.requests
        waits.append(request.abandon_after_s)
    assert waits == [60.0, 5.0]


@pytest.mark.parametrize("refusal", [KeyError("no such agent"), ValueError("no such agent")])
async def test_a_route_that_refuses_a_group_fails_its_submit_naming_the_group(
    refusal: Exception,
) -> None:
    def route(group: GroupView) -> str:
        raise refusal

    buffer = stage_buffer()
    stage = ScoringStage(buffer, FakeScorer(), scoring(), max_batch_groups=8, route=route)
    (gid,) = await written(buffer, 1, agent="poetry")
    with pytest.raises(RoutingError, match=rf"no teacher for group '{gid}' \(agent 'poetry'\)"):
        stage.submit(gid)
    assert stage.queues() == {}
    assert buffer.state_of(gid) is GroupState.WRITTEN


def test_an_extra_stage_is_a_frozen_record_of_its_name_scorer_and_field() -> None:
    scorer = FakeScorer()
    extra = ExtraStage("verifier", scorer, REWARD)
    assert (extra.name, extra.scorer, extra.field) == ("verifier", scorer, REWARD)
    with pytest.raises(AttributeError):
        extra.name = "judge"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "field", "refused"),
    [
        ("", REWARD, "name"),
        (3, REWARD, "name"),
        ("verifier", "", "field"),
        ("verifier", None, "field"),
    ],
)
def test_an_extra_stage_refuses_a_name_or_field_that_is_not_a_non_empty_string(
    name: object, field: object, refused: str
) -> None:
    with pytest.raises(ConfigError, match=rf"ExtraStage\.{refused}=") as caught:
        ExtraStage(name, FakeScorer(), field)  # type: ignore[arg-type]
    assert caught.value.field == refused


# -- a chain of stages ---------------------------------------------------------------------


def reward_buffer() -> ReplayBuffer:
    """A buffer whose groups need the teacher's field and a verifier's reward."""
    config = BufferConfig(
        group_size=GROUP_SIZE, capacity=32, required_fields={INPUT, TEACHER_FIELD, REWARD}
    )
    return ReplayBuffer(config, MemoryStore())


def teacher_and_verifier(
    buffer: ReplayBuffer,
    *,
    on_discard: Callable[[GroupView, str], None] | None = None,
    teacher_scorer: Scorer | None = None,
    verifier_scorer: Scorer | None = None,
    verifier_config: ScoringConfig | None = None,
    batches: tuple[int, int] = (2, 2),
) -> tuple[ScoringStage, ScoringStage, Any, Any]:
    """The teacher's stage chained to a verifier's; by default the teacher takes 1 s a call
    and the verifier 2 s, two groups a call (`batches`). `on_discard` hears the verifier's drops."""
    teacher_scorer = teacher_scorer or FakeScorer(fixed=1.0)
    verifier_scorer = verifier_scorer or FakeScorer(fixed=2.0)
    teacher = ScoringStage(buffer, teacher_scorer, scoring(), max_batch_groups=batches[0])
    verifier = ScoringStage(
        buffer,
        verifier_scorer,
        verifier_config or scoring(),
        max_batch_groups=batches[1],
        route=lambda group: "verifier",
        field=REWARD,
        name="verifier",
        on_discard=on_discard,
    )
    chain([teacher, verifier])
    return teacher, verifier, teacher_scorer, verifier_scorer


async def teacher_then_verifier(teacher: ScoringStage, verifier: ScoringStage) -> None:
    """The teacher's stage runs to its end, then the verifier's hears that upstream has ended
    (as the supervisor tells the stages in order)."""
    await teacher.run()
    verifier.upstream_ended()


async def run_chain(teacher: ScoringStage, verifier: ScoringStage, ids: list[str]) -> None:
    """Both stages of a chain run until every group in `ids`, submitted to the teacher, has
    gone through the verifier."""
    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(teacher_then_verifier, teacher, verifier)
            nursery.start_soon(verifier.run)
            for gid in ids:
                teacher.submit(gid)
            teacher.upstream_ended()


async def test_a_chain_hands_each_scored_group_on_and_the_last_stage_makes_it_ready(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer = reward_buffer()
    teacher, verifier, teacher_scorer, verifier_scorer = teacher_and_verifier(buffer)
    ids = await written(buffer, 4)

    await run_chain(teacher, verifier, ids)
    batches = [tuple(ids[:2]), tuple(ids[2:])]
    assert [call.group_ids for call in teacher_scorer.calls] == batches
    assert [(call.group_ids, call.start) for call in verifier_scorer.calls] == [
        (batches[0], 1.0),
        (batches[1], 3.0),
    ]
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)
    assert teacher.closed and verifier.closed
    assert_invariants(buffer.snapshot())


async def test_groups_scored_once_the_next_stage_has_closed_are_dropped_not_left_written(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call that returns after the next stage's run ended (the run going down, a teacher's
    thread finishing late): its groups are dropped as the next stage's own were."""
    dropped: list[tuple[str, str]] = []
    buffer = reward_buffer()
    teacher, verifier, _, verifier_scorer = teacher_and_verifier(
        buffer, on_discard=lambda view, why: dropped.append((view.group_id, why))
    )
    with trio.CancelScope() as scope:
        scope.cancel()
        await verifier.run()
    assert verifier.closed
    ids = await written(buffer, 2)
    for gid in ids:
        teacher.submit(gid)
    teacher.upstream_ended()
    with trio.fail_after(HANG_S):
        await teacher.run()
    assert dropped == [(g, "shutdown") for g in ids]
    assert all(buffer.state_of(g) is GroupState.DISCARDED for g in ids)
    assert not verifier_scorer.calls and not buffer.store.list_ids()


async def test_a_stage_holding_a_call_the_run_failed_around_waits_to_be_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call that fails once another failure has failed the run is not judged: its group stays
    in flight, so the stage has not drained and does not return as if it had; it is dropped
    when the stage is cancelled."""
    status = RunStatus()
    dropped: list[tuple[str, str]] = []

    def failed_after_the_run(index: int, request: ScoreRequest) -> bool:
        status.claim_failure()  # another pump failed the run while the call was out
        status.mark_failed()
        return True

    buffer = stage_buffer()
    stage = ScoringStage(
        buffer,
        FakeScorer(fail=failed_after_the_run),
        scoring(),
        max_batch_groups=8,
        status=status,
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    (gid,) = await written(buffer, 1)
    stage.submit(gid)
    stage.upstream_ended()
    with trio.move_on_after(100) as waited:
        await stage.run()
    assert waited.cancelled_caught, "the stage returned while it still held a group"
    assert dropped == [(gid, "shutdown")]
    assert buffer.state_of(gid) is GroupState.DISCARDED
    assert stage.drain_metrics().failures == 0


# -- demand --------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [-1, 0, 1])
async def test_demand_sends_at_once_only_a_queue_holding_the_step_training_waits_on(
    autojump_clock: trio.testing.MockClock, offset: int
) -> None:
    """Training waits on a step one before, equal to or one after the queued groups' step
    (300; the demanded step is made afresh, equal to it but not the same object): only the
    step's own groups go at once, the others wait for the timer."""
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(flush_after_s=60.0), max_batch_groups=8)
    ids = await written(buffer, 2, step=300)
    demanded = list(range(299, 302))[offset + 1]
    with trio.fail_after(HANG_S):
        async with running(stage, ids):
            stage.demand(demanded)
            await trio.sleep(100)
    (call,) = scorer.calls
    reasons = stage.drain_metrics().reasons
    assert (call.start, reasons) == ((0.0, {"demand": 1}) if offset == 0 else (60.0, {"timer": 1}))


async def test_demand_waits_until_every_prompt_of_the_step_is_issued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    buffer, scorer = stage_buffer(), FakeScorer()
    stage = ScoringStage(buffer, scorer, scoring(flush_after_s=60.0), max_batch_groups=8)
    ids = await written(buffer, 2)
    with trio.fail_after(HANG_S):
        async with running(stage, ids):
            stage.demand(0, issued=False)
            await trio.sleep(10)
            assert not scorer.calls, "a prompt of the step may still be admitted into the batch"
            stage.demand(0)
            await trio.sleep(10)
    (call,) = scorer.calls
    assert call.start == 10.0 and stage.drain_metrics().reasons == {"demand": 1}


async def test_a_later_stages_demand_waits_for_the_steps_groups_still_at_the_stage_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The teacher scores a step's two groups one call each (1 s, then 10 s): the verifier
    holds the first from 1 s but sends it for demand only with the second, at 11 s."""
    buffer = reward_buffer()
    teacher_scorer = FakeScorer(cost=lambda request, index: 1.0 if index == 0 else 10.0)
    verifier_scorer = FakeScorer()
    teacher, verifier, _, _ = teacher_and_verifier(
        buffer,
        teacher_scorer=teacher_scorer,
        verifier_scorer=verifier_scorer,
        verifier_config=scoring(flush_after_s=1000.0),
        batches=(1, 8),
    )
    ids = await written(buffer, 2)

    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(teacher_then_verifier, teacher, verifier)
            nursery.start_soon(verifier.run)
            for stage in (teacher, verifier):
                stage.demand(0)
            for gid in ids:
                teacher.submit(gid)
            await trio.sleep(20)
            teacher.upstream_ended()
    assert [(call.group_ids, call.start) for call in verifier_scorer.calls] == [(tuple(ids), 11.0)]
    assert verifier.drain_metrics().reasons == {"demand": 1}
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)


# -- a call's failures ---------------------------------------------------------------------


class Actions:
    """An observer and recorder that keeps what the stage reports."""

    def __init__(self) -> None:
        self.seen: list[Action] = []
        self.drops: list[tuple[int, str | None, GroupState | None]] = []

    def on_action(self, action: Action) -> None:
        self.seen.append(action)

    def record(
        self,
        action: Action,
        *,
        group: str | None = None,
        was: GroupState | None = None,
        tokens: int | None = None,
    ) -> None:
        if action.kind is ActionKind.DROP:
            self.drops.append((action.ordinal, group, was))

    def kinds(self) -> list[ActionKind]:
        return [action.kind for action in self.seen]


async def test_a_lost_teacher_fails_the_run_and_its_groups_are_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A teacher whose thread ignored a cancel (`ScorerLost`) is not a failed call: no
    policy applies, the run fails, and the groups of the call (1 s to 3 s) are dropped at
    shutdown."""
    dropped: list[tuple[str, str]] = []
    actions = Actions()
    status = RunStatus(observer=actions, recorder=actions)
    buffer = stage_buffer()
    stage = ScoringStage(
        buffer,
        FakeScorer(fixed=2.0, fail=lambda i, r: True, error=lambda i, r: ScorerLost("lost")),
        scoring(),
        max_batch_groups=8,
        status=status,
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    ids = await written(buffer, 2, first_ordinal=3)
    await trio.sleep(1)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S), pytest.raises(ScorerLost):
        await stage.run()
    assert status.failed
    assert dropped == [(g, "shutdown") for g in ids]
    assert actions.drops == [(3, ids[0], GroupState.SCORING), (4, ids[1], GroupState.SCORING)]
    metrics = stage.drain_metrics()
    assert (metrics.failures, metrics.retries, metrics.discards) == (0, 0, 2)
    assert metrics.call_s == 2.0


@pytest.mark.parametrize(
    ("agents", "named"), [(["math"], "agent 'math'"), (["code", "math"], "agents 'code', 'math'")]
)
async def test_a_scorer_without_the_routed_teacher_fails_the_run_naming_the_agents(
    autojump_clock: trio.testing.MockClock, agents: list[str], named: str
) -> None:
    """A route to a teacher the scorer does not have is a configuration error: no policy
    applies (no retry, no discard), the run fails, naming the agents routed there. The call
    runs from 1 s to 3 s."""
    dropped: list[tuple[str, str]] = []
    status = RunStatus()
    buffer = stage_buffer()
    scorer = FakeScorer(
        fixed=2.0, fail=lambda i, r: True, error=lambda i, r: RoutingError("no such teacher")
    )
    stage = ScoringStage(
        buffer,
        scorer,
        scoring(),
        max_batch_groups=8,
        route=lambda group: "t9",
        status=status,
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    ids = [(await written(buffer, 1, agent=agent))[0] for agent in agents]
    await trio.sleep(1)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    message = (
        rf"^{named} routed to teacher 't9', which the scorer FakeScorer does not have: "
        "no such teacher$"
    )
    with trio.fail_after(HANG_S), pytest.raises(RoutingError, match=message):
        await stage.run()
    assert status.failed and len(scorer.calls) == 1
    assert dropped == [(g, "shutdown") for g in ids]
    metrics = stage.drain_metrics()
    assert (metrics.failures, metrics.call_s) == (0, 2.0)


class StrayWriter(FakeScorer):
    """A scorer whose calls, as they start, also write rows of their own outside their batch:
    `stray[g]` of them for the call holding group `g` first, named `stray/g.n`."""

    stray: dict[str, int]

    async def score(self, request: ScoreRequest) -> None:
        head = request.groups[0].group_id
        count = self.stray.get(head, 0)
        if count:
            request.store.put({f"stray/{head}.{n}": {INPUT: [n]} for n in range(count)})
        await super().score(request)


def stray_writer(stray: dict[str, int], **fake: Any) -> StrayWriter:
    scorer = StrayWriter(**fake)
    scorer.stray = stray
    return scorer


def charged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the failed calls' warnings say each scorer wrote outside its batch."""
    return re.findall(r"wrote rows outside its batch: (.*?)\"\)", caplog.text)


@pytest.mark.parametrize("stray", [1, 8, 9])
async def test_rows_a_scorer_writes_outside_its_batch_are_removed_and_fail_its_call(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, stray: int
) -> None:
    """The failure names them, eight at most; the error is not transient, so the groups are
    given up."""
    dropped: list[tuple[str, str]] = []
    buffer = stage_buffer()
    ids = await written(buffer, 2)
    stage = ScoringStage(
        buffer,
        stray_writer({ids[0]: stray}),
        scoring(),
        max_batch_groups=8,
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S):
        await stage.run()
    named = [f"stray/{ids[0]}.{n}" for n in range(min(stray, 8))]
    assert charged(caplog) == [f"{named}{' ...' if stray > 8 else ''} ({stray}, removed)"]
    assert dropped == [(g, "failed") for g in ids]
    assert not buffer.store.list_ids()


async def test_each_call_that_writes_rows_outside_its_batch_is_charged_with_its_own(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = stage_buffer()
    ids = await written(buffer, 2)
    stage = ScoringStage(buffer, stray_writer(dict.fromkeys(ids, 1)), scoring(), max_batch_groups=1)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S):
        await stage.run()
    assert charged(caplog) == [f"['stray/{gid}.0'] (1, removed)" for gid in ids]
    assert all(buffer.state_of(g) is GroupState.DISCARDED for g in ids)


async def test_a_call_is_not_charged_with_rows_written_while_another_call_was_out(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Teacher A's call (0 s to 1 s) writes a row outside its batch while teacher B's (0 s to
    5 s) is out: either could have written it, so neither is charged, and the row is left for
    the end of the run's sweep. A's next call (10 s), out alone, writes a row too: it is
    charged with that row, its own, only."""
    buffer = stage_buffer()
    first, later = await written(buffer, 2, agent="a")
    (other,) = await written(buffer, 1, agent="b")
    scorer = stray_writer(
        {first: 1, later: 1}, cost=lambda request, index: 5.0 if request.teacher == "B" else 1.0
    )
    stage = ScoringStage(
        buffer,
        scorer,
        scoring(),
        max_batch_groups=1,
        route=teacher_by_agent({"a": "A", "b": "B"}),
    )
    with trio.fail_after(HANG_S):
        async with running(stage):
            stage.submit(first)
            stage.submit(other)
            await trio.sleep(10)
            stage.submit(later)
    assert charged(caplog) == [f"['stray/{later}.0'] (1, removed)"]
    assert [buffer.state_of(g) for g in (first, other, later)] == [
        GroupState.READY,
        GroupState.READY,
        GroupState.DISCARDED,
    ]
    assert f"stray/{first}.0" in buffer.store.list_ids()


async def test_a_call_is_not_charged_with_rows_that_failed_calls_wrote(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Two calls write a row outside their batch and fail (their rows unchecked), the third
    is clean: it is not charged with theirs."""
    buffer = stage_buffer()
    ids = await written(buffer, 3)
    scorer = stray_writer(dict.fromkeys(ids[:2], 1), fail=lambda i, r: i < 2)
    stage = ScoringStage(buffer, scorer, scoring(failure_policy="discard"), max_batch_groups=1)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S):
        await stage.run()
    assert charged(caplog) == []
    assert [buffer.state_of(g) for g in ids] == [
        GroupState.DISCARDED,
        GroupState.DISCARDED,
        GroupState.READY,
    ]
    assert {f"stray/{g}.0" for g in ids[:2]} <= buffer.store.list_ids()


async def test_stray_rows_are_charged_to_no_call_while_another_call_of_the_chain_is_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The verifier's first call (1 s to 11 s) writes a row outside its batch: the teacher's
    call that returns meanwhile (at 2 s) is not charged with it, nor the verifier's, which
    the teacher's overlapped."""
    buffer = reward_buffer()
    ids = await written(buffer, 2)
    teacher_scorer = FakeScorer()
    verifier_scorer = stray_writer({ids[0]: 1}, fixed=10.0)
    teacher, verifier, _, _ = teacher_and_verifier(
        buffer,
        teacher_scorer=teacher_scorer,
        verifier_scorer=verifier_scorer,
        batches=(1, 1),
    )
    await run_chain(teacher, verifier, ids)
    assert [call.start for call in teacher_scorer.calls] == [0.0, 1.0]
    assert [call.start for call in verifier_scorer.calls] == [1.0, 11.0]
    assert (teacher.drain_metrics().failures, verifier.drain_metrics().failures) == (0, 0)
    assert all(buffer.state_of(g) is GroupState.READY for g in ids)
    assert f"stray/{ids[0]}.0" in buffer.store.list_ids()


@pytest.mark.parametrize("policy", ["retry", "discard"])
async def test_a_call_that_wrote_rows_before_it_failed_is_given_up_not_retried(
    autojump_clock: trio.testing.MockClock, policy: str
) -> None:
    """A retry would meet its own field already there: the group is given up, and the error
    says why, where a retry was possible at all."""
    error = OSError("the teacher went away mid-call")

    def write_then_fail(index: int, request: ScoreRequest) -> bool:
        some = request.sample_ids[1:3]
        request.store.add_fields({sid: {request.field: [-0.5]} for sid in some})
        return True

    dropped: list[tuple[str, str]] = []
    buffer = stage_buffer()
    scorer = FakeScorer(fail=write_then_fail, error=lambda i, r: error)
    stage = ScoringStage(
        buffer,
        scorer,
        scoring(failure_policy=policy),
        max_batch_groups=8,
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    (gid,) = await written(buffer, 1)
    stage.submit(gid)
    stage.upstream_ended()
    with trio.fail_after(HANG_S):
        await stage.run()
    assert len(scorer.calls) == 1 and dropped == [(gid, "failed")]
    notes = [
        f"the call wrote {TEACHER_FIELD!r} for 2 rows before it failed (e.g. '{gid}/1'), "
        "so its groups cannot be retried"
    ]
    assert getattr(error, "__notes__", []) == (notes if policy == "retry" else [])


# -- shutdown ------------------------------------------------------------------------------


async def test_a_cancelled_stage_drops_every_group_it_holds_and_reports_each(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The call in flight's groups first (SCORING), then the queue's in order (WRITTEN); a
    group without an ordinal is reported with -1."""
    dropped: list[tuple[str, str]] = []
    actions = Actions()
    buffer = stage_buffer()
    stage = ScoringStage(
        buffer,
        FakeScorer(fixed=10.0),
        scoring(),
        max_batch_groups=2,
        status=RunStatus(observer=actions, recorder=actions),
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    ids = [
        *await written(buffer, 2, first_ordinal=5),
        *await written(buffer, 1),
        *await written(buffer, 1, first_ordinal=8),
    ]
    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stage.run)
            for gid in ids:
                stage.submit(gid)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert dropped == [(g, "shutdown") for g in ids]
    assert actions.drops == [
        (5, ids[0], GroupState.SCORING),
        (6, ids[1], GroupState.SCORING),
        (-1, ids[2], GroupState.WRITTEN),
        (8, ids[3], GroupState.WRITTEN),
    ]
    assert all(buffer.state_of(g) is GroupState.DISCARDED for g in ids)
    assert stage.drain_metrics().discards == 4 and stage.backlog == 0
    assert_invariants(buffer.snapshot())


class LateScorer(FakeScorer):
    """Takes 5 s whatever cancels it, as a teacher thread the stage waits for does, then
    scores the batch (or fails it, as `fail` says)."""

    async def score(self, request: ScoreRequest) -> None:
        with trio.CancelScope(shield=True):
            await super().score(request)


async def test_a_call_that_returns_after_the_run_was_cancelled_drops_its_groups_in_the_next_stage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Both stages are cancelled at 1 s; the teacher's call returns at 5 s and hands its
    groups on to the verifier, which has closed: they are dropped there, not left WRITTEN."""
    dropped: list[tuple[str, str]] = []
    buffer = reward_buffer()
    teacher, verifier, _, _ = teacher_and_verifier(
        buffer,
        teacher_scorer=LateScorer(fixed=5.0),
        verifier_scorer=FakeScorer(),
        batches=(8, 8),
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    ids = await written(buffer, 2)
    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(teacher.run)
            nursery.start_soon(verifier.run)
            for gid in ids:
                teacher.submit(gid)
            teacher.upstream_ended()
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert trio.current_time() == 5.0
    assert dropped == [(g, "shutdown") for g in ids]
    assert all(buffer.state_of(g) is GroupState.DISCARDED for g in ids)
    assert not buffer.store.list_ids()


@pytest.mark.parametrize("policy", ["discard", "fail"])
async def test_a_call_that_fails_after_the_run_was_cancelled_is_judged_by_the_policy(
    autojump_clock: trio.testing.MockClock, policy: str
) -> None:
    """Cancelled at 1 s, the call fails at 5 s: its groups are given up (`discard`), or the
    run fails (`fail`), as if it had not been cancelled, rather than dropped for shutdown."""
    dropped: list[tuple[str, str]] = []
    actions = Actions()
    status = RunStatus(observer=actions, recorder=actions)
    buffer = stage_buffer()
    stage = ScoringStage(
        buffer,
        LateScorer(fixed=5.0, fail=lambda i, r: True),
        scoring(failure_policy=policy),
        max_batch_groups=8,
        status=status,
        on_discard=lambda view, why: dropped.append((view.group_id, why)),
    )
    ids = await written(buffer, 2)
    for gid in ids:
        stage.submit(gid)
    stage.upstream_ended()
    raised: list[BaseException] = []
    try:
        with trio.fail_after(HANG_S), trio.move_on_after(1):
            await stage.run()
    except Exception as exc:  # grouped with the cancel that met it
        raised = leaves(exc)
    assert trio.current_time() == 5.0
    assert [type(e) for e in raised] == ([ScoringCallFailed] if policy == "fail" else [])
    assert dropped == [(g, "failed" if policy == "discard" else "shutdown") for g in ids]
    assert ActionKind.SCORE_FAIL in actions.kinds() and not actions.drops
    assert status.failed is (policy == "fail")
    assert all(buffer.state_of(g) is GroupState.DISCARDED for g in ids)
