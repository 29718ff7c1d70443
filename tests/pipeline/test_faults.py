"""Faults at the edges are contained and named: a generator that is down fails the run instead
of giving up prompt after prompt, and a run that gave up on every prompt says it failed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import PipelineConfig, build_pipeline
from groupflow.impl._pipeline import Pipeline, RolloutPump
from groupflow.impl.errors import NothingTrained, PumpFailed, RolloutsFailed
from groupflow.impl.testing import FakeGenerator, FakeLearner
from groupflow.model.shape import Shape
from groupflow.sim.run import PUMP_DEMAND, simulate
from groupflow.sim.scenario import parse_scenario
from tests.helpers import HANG_S


def make(fail: frozenset[int], *, prompts: int = 8, **settings: Any) -> Pipeline:
    config = PipelineConfig(
        shape=Shape(
            prompts_per_step=2,
            num_generations_per_prompt=2,
            max_inflight_prompts=settings.pop("max_inflight_prompts", 1),
            max_buffered_groups=4,
        ),
        **settings,
    )
    return build_pipeline(
        config,
        prompts=list(range(prompts)),
        generator=FakeGenerator(fail=fail),
        learner=FakeLearner(),
        train_fields=["input_ids"],
    )


async def test_a_generator_that_is_down_fails_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = make(frozenset(range(8)), max_consecutive_failed_rollouts=3, max_inflight_prompts=2)
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    cause = caught.value.__cause__
    assert isinstance(cause, RolloutsFailed)
    assert "4 rollouts in a row failed (max_consecutive_failed_rollouts=3)" in str(cause)
    assert "generation of prompt" in str(cause)
    assert not p.buffer.store.list_ids()
    assert p.status.failed


async def test_failures_between_commits_do_not_add_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = make(frozenset({0, 2, 4, 6}), max_consecutive_failed_rollouts=1)
    with trio.fail_after(HANG_S):
        result = await p.run()
    assert result.shortfall == {0, 2, 4, 6}
    assert result.trained == {1, 3, 5, 7}


async def test_two_in_a_row_over_a_limit_of_one_fail_the_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = make(frozenset({2, 3}), max_consecutive_failed_rollouts=1)
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    assert isinstance(caught.value.__cause__, RolloutsFailed)


async def test_a_run_that_gave_up_every_prompt_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = make(frozenset(range(4)), prompts=4, max_consecutive_failed_rollouts=10)
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    assert isinstance(caught.value.__cause__, NothingTrained)
    assert "every prompt was given up (4), none trained" in str(caught.value.__cause__)


def small_scenario(name: str, *, steps: int, teacher_s: float, extra: str = "") -> Any:
    """Two prompts of two rows per step, one teacher taking `teacher_s` per call."""
    return parse_scenario(
        f"""
name = "{name}"
steps = {steps}
[pipeline]
prompts_per_step = 2
num_generations_per_prompt = 2
max_inflight_prompts = 2
max_buffered_groups = 4
[scoring]
max_batch_groups = 2
flush_after_s = 1.0
[generation]
median_s = 1.0
[teachers.teacher]
fixed_s = {teacher_s}
[train]
step_s = 1.0
{extra}
""",
        source=f"{name}.toml",
    )


def test_sim_of_a_generator_that_is_down_fails_and_says_why() -> None:
    scenario = small_scenario(
        "down", steps=8, teacher_s=1.0, extra="[faults]\nrollout_failure_rate = 1.0"
    )
    result = simulate(scenario, PUMP_DEMAND, conform=True)
    assert result.outcome.startswith("failed:") and "RolloutsFailed" in result.outcome
    assert result.conformance is not None and result.conformance.ok, result.conformance


async def test_seeded_bug_a_count_that_commits_do_not_reset(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the count of failures in a row survives a commit, so scattered failures
    fail a healthy run; the test above that expects them to be given up would fail."""

    def never_reset(self: RolloutPump, value: int) -> None:
        if value:
            object.__setattr__(self, "_in_a_row", value)

    monkeypatch.setattr(
        RolloutPump,
        "failed_in_a_row",
        property(lambda self: getattr(self, "_in_a_row", 0), never_reset),
        raising=False,
    )
    p = make(frozenset({0, 2, 4, 6}), max_consecutive_failed_rollouts=1)
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    assert isinstance(caught.value.__cause__, RolloutsFailed)


# -- padding rows ------------------------------------------------------------------------


async def test_rows_with_the_padding_prefix_are_refused_at_commit() -> None:
    from groupflow.impl import BufferConfig, MemoryStore, ReplayBuffer, Row
    from groupflow.impl._core import PAD_PREFIX
    from groupflow.impl.errors import ArgumentError

    buffer = ReplayBuffer(BufferConfig(group_size=2, capacity=2), MemoryStore())
    gid = buffer.reserve(target_step=0, ordinal=0)
    rows = [Row(f"{PAD_PREFIX}x", {"a": 1}), Row("ok", {"a": 2})]
    with pytest.raises(ArgumentError, match="start with groupflow's padding prefix"):
        await buffer.commit(gid, rows, start_weight_version=0, end_weight_version=0)
    assert not buffer.store.list_ids()


def test_an_error_about_a_padding_row_names_the_row_it_copies() -> None:
    from groupflow.impl import MemoryStore
    from groupflow.impl._teachers import BatchMeta, score_teacher_batch
    from groupflow.impl.errors import TeacherOutputError

    class ShortOnPads:
        dp_size = 2

        def score_shards(self, shards: Any) -> list[list[Sequence[float]]]:
            out: list[list[Sequence[float]]] = [
                [[-0.5] * r.response_length for r in shard] for shard in shards
            ]
            out[-1][-1] = []  # the last row of the last shard: the padding row
            return out

    store = MemoryStore()
    store.put({f"r{i}": {"input_ids": [1, 2, 3], "prompt_length": 1} for i in range(3)})
    with pytest.raises(TeacherOutputError, match=r"a padding row \(copy of 'r2'\) \(0 values"):
        score_teacher_batch(store, ShortOnPads(), BatchMeta(("r0", "r1", "r2")))
    assert store.list_ids() == {"r0", "r1", "r2"}, "the padding row was cleared"


# -- teachers that hang or write what they should not -----------------------------------

import logging  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from groupflow.impl import ScoreRequest, ScoringConfig, ThreadedScorer  # noqa: E402
from groupflow.impl.errors import ScorerLost  # noqa: E402
from groupflow.impl.testing import FakeScorer  # noqa: E402
from groupflow.sim.verify.conformance import Conformance, bounds_for  # noqa: E402


def scored(scorer: Any, *, prompts: int = 4, **scoring: Any) -> Pipeline:
    settings: dict[str, Any] = {"flush_after_s": 1.0}
    settings.update(scoring)
    shutdown = settings.pop("shutdown_timeout_s", 60.0)
    inflight = settings.pop("max_inflight_prompts", 2)
    config = PipelineConfig(
        shape=Shape(
            prompts_per_step=2,
            num_generations_per_prompt=2,
            max_inflight_prompts=inflight,
            max_buffered_groups=4,
            max_batch_groups=1,
        ),
        shutdown_timeout_s=shutdown,
        scoring=ScoringConfig(**settings),
    )
    return build_pipeline(
        config,
        prompts=list(range(prompts)),
        generator=FakeGenerator(),
        learner=FakeLearner(),
        scorer=scorer,
        train_fields=["input_ids"],
        lanes={"teacher": 0},  # for the conformance checker
    )


class HangsOn:
    """Scores like `FakeScorer`, except that calls holding prompt `ordinal` never return."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.inner = FakeScorer(fixed=1.0)

    async def score(self, request: ScoreRequest) -> None:
        if any(g.ordinal == self.ordinal for g in request.groups):
            await trio.sleep_forever()
        await self.inner.score(request)


async def test_a_call_that_hangs_times_out_and_fails_under_the_policy(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    p = scored(HangsOn(1), call_timeout_s=30.0)
    with trio.fail_after(HANG_S):
        result = await p.run()
    assert result.shortfall == {1}, "retried once, timed out again, given up"
    assert result.trained == {0, 2, 3}
    assert "ScoringTimeout" in caplog.text and "call_timeout_s=30" in caplog.text
    assert not p.buffer.store.list_ids()


async def test_a_blocking_teacher_that_ignores_cancellation_cannot_keep_the_run_alive() -> None:
    """Real threads, real time: the call limit passes, then the grace (shutdown_timeout_s),
    then the run fails naming the teacher and the rows its thread may still touch."""
    release = threading.Event()

    def stuck(request: ScoreRequest) -> None:
        release.wait(120)  # ignores cancellation: nothing can interrupt a thread

    # limits of seconds, not tenths: the thread must have begun before the call limit passes,
    # or the call counts as cancelled before it began (retried), which a loaded machine can do
    p = scored(ThreadedScorer(stuck), call_timeout_s=2.0, shutdown_timeout_s=2.0)
    checker = Conformance(bounds_for(p.config, prompts=4))
    checker.attach(p)
    started = time.perf_counter()
    try:
        with trio.fail_after(100), pytest.raises(PumpFailed) as caught:
            await p.run()
    finally:
        release.set()
    assert time.perf_counter() - started < 60  # far less than the thread's 120 s
    cause = caught.value.__cause__
    assert isinstance(cause, ScorerLost)
    assert "teacher 'teacher' ignored cancellation" in str(cause)
    assert checker.ok, checker.failure  # the model allows it: an abort, then drops
    assert re.search(r"may still read or write rows \['p\d-\d/0', 'p\d-\d/1'\]", str(cause))


async def test_a_scorer_that_writes_nothing_fails_its_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class WritesNothing:
        async def score(self, request: ScoreRequest) -> None:
            await trio.sleep(1.0)

    p = scored(WritesNothing(), max_consecutive_failed_batches=10)
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    assert "every prompt was given up" in str(caught.value.__cause__)
    assert not p.buffer.store.list_ids()


async def test_a_call_that_wrote_half_its_rows_is_not_retried(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class HalfThenFails:
        async def score(self, request: ScoreRequest) -> None:
            await trio.sleep(1.0)
            if any(g.ordinal == 2 for g in request.groups):
                first = request.sample_ids[0]
                request.store.add_fields({first: {request.field: [-0.5]}})
                raise ConnectionError("lost the server half way")
            request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})

    p = scored(HalfThenFails())
    with trio.fail_after(HANG_S):
        result = await p.run()
    assert result.shortfall == {2}
    assert "so its groups cannot be retried" in caplog.text
    assert not p.buffer.store.list_ids()


class AddsRows:
    """Scores every row, and writes a row of its own with the call holding prompt 1."""

    async def score(self, request: ScoreRequest) -> None:
        await trio.sleep(1.0)
        request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})
        if any(g.ordinal == 1 for g in request.groups):
            request.store.put({"my-own-row": {"input_ids": [1]}})


async def test_a_scorer_that_adds_rows_fails_its_call_and_its_rows_go(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    p = scored(AddsRows(), max_inflight_prompts=1)
    with trio.fail_after(HANG_S):
        result = await p.run()
    assert 1 in result.shortfall
    assert "wrote rows outside its batch: ['my-own-row'] (1, removed)" in caplog.text
    assert not p.buffer.store.list_ids()


async def test_rows_nobody_owns_at_the_end_of_a_run_are_removed_and_named(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    from groupflow.impl._core import PAD_PREFIX

    class LeavesAPad(FakeScorer):
        async def score(self, request: ScoreRequest) -> None:
            await super().score(request)
            if not self.calls[:-1]:
                request.store.put({f"{PAD_PREFIX}forgotten": {"input_ids": [1]}})

    p = scored(LeavesAPad(fixed=1.0))
    with caplog.at_level(logging.WARNING, logger="groupflow.pipeline"), trio.fail_after(HANG_S):
        await p.run()
    assert p.rows_removed == 1
    assert "removed 1 rows no group owned at the end of the run" in caplog.text
    assert not p.buffer.store.list_ids()


def test_sim_with_an_absurd_teacher_latency_ends() -> None:
    scenario = small_scenario("absurd", steps=3, teacher_s=1e12)
    result = simulate(scenario, PUMP_DEMAND, conform=True)
    assert result.outcome.startswith("failed:"), result.outcome
    assert "calls in a row failed" in result.outcome
    assert result.conformance is not None and result.conformance.ok, result.conformance


async def test_seeded_bug_a_stage_that_trusts_what_the_scorer_wrote(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the write check the call succeeds, and the stray row outlives every call (only
    the end-of-run sweep finds it): the test above that expects a failed call would fail."""
    from groupflow.impl._pipeline import ScoringStage

    async def trusting(self: ScoringStage, teacher: str) -> None:
        return None

    monkeypatch.setattr(ScoringStage, "_check_writes", trusting)
    p = scored(AddsRows(), max_inflight_prompts=1)
    with trio.fail_after(HANG_S):
        result = await p.run()
    assert 1 not in result.shortfall and p.rows_removed == 1


async def test_seeded_bug_no_sweep_at_the_end_of_a_run(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the end-of-run sweep, and without the write check, the stray row outlives the
    run (the issue's 48 orphan rows after a "successful" run)."""
    from groupflow.impl._pipeline import ScoringStage

    async def none(self: Any, **kwargs: Any) -> list[str]:
        return []

    async def trusting(self: ScoringStage, teacher: str) -> None:
        return None

    monkeypatch.setattr(ScoringStage, "_check_writes", trusting)
    monkeypatch.setattr(type(scored(AddsRows()).buffer), "stray_rows", none)
    p = scored(AddsRows(), max_inflight_prompts=1)
    with trio.fail_after(HANG_S):
        await p.run()
    assert p.buffer.store.list_ids() == {"my-own-row"}


async def test_ctrl_c_in_a_pipeline_is_a_keyboard_interrupt_after_cleanup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """trio groups what crosses a nursery; `except KeyboardInterrupt` around `run` must work."""

    class CtrlC(FakeGenerator):
        async def generate(self, request: Any) -> Any:
            if request.ordinal == 3:
                raise KeyboardInterrupt
            return await super().generate(request)

    p = build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=2,
                max_inflight_prompts=2,
                max_buffered_groups=4,
                max_batch_groups=2,
            ),
            scoring=ScoringConfig(flush_after_s=1.0),
        ),
        prompts=list(range(8)),
        generator=CtrlC(),
        learner=FakeLearner(),
        scorer=FakeScorer(fixed=1.0),
        train_fields=["input_ids"],
    )
    with trio.fail_after(HANG_S):
        try:
            await p.run()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the interrupt was lost")
    assert not p.buffer.store.list_ids()
    assert 3 in p.ledger.reissue, "the interrupted prompt is issued again on resume"


async def test_a_call_cancelled_before_its_thread_begins_is_not_waited_for() -> None:
    """Cancelled while waiting for a worker thread, the call never begins: nothing reads the
    rows, so it is not waited for (the crash test of the trainer waited 60 s for it, then
    raised `ScorerLost`). With every thread token taken, the call cannot begin at all."""
    from groupflow.impl import MemoryStore

    calls: list[ScoreRequest] = []
    scorer = ThreadedScorer(calls.append)
    request = ScoreRequest("t", (), MemoryStore(), "f", abandon_after_s=30.0)
    limiter = trio.to_thread.current_default_thread_limiter()
    held = [object() for _ in range(int(limiter.total_tokens))]
    for borrower in held:
        limiter.acquire_on_behalf_of_nowait(borrower)
    try:
        began = time.monotonic()
        with trio.fail_after(10), trio.move_on_after(0.2):
            await scorer.score(request)
        assert time.monotonic() - began < 5, "the cancelled call was waited for"
    finally:
        for borrower in held:
            limiter.release_on_behalf_of(borrower)
    await trio.sleep(0.1)
    assert calls == []


class _SyncFailsAt(FakeGenerator):
    """A generator whose weight sync to `version` fails (say, a server that refuses it)."""

    version: int = 3

    async def sync_weights(self, version: int) -> None:
        await trio.sleep(0.5)
        if version == self.version:
            raise RuntimeError(f"sync to version {version} refused")


def _failing_sync(gate_window: int = 1) -> Pipeline:
    return build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=2,
                max_inflight_prompts=4,
                max_buffered_groups=6,
                gate_window=gate_window,
            ),
        ),
        prompts=list(range(12)),
        generator=_SyncFailsAt(latency=lambda ordinal: 0.3),
        learner=FakeLearner(latency=0.2),
        train_fields=["input_ids"],
    )


async def test_a_failed_run_says_what_it_trained_gave_up_and_left_unfinished(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The run fails at its third sync, with groups of later steps READY: its error carries
    the run's result, and every prompt issued is in exactly one of its sets."""
    p = _failing_sync()
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed) as caught:
        await p.run()
    result = caught.value.result
    assert result == p.result()
    assert result.trained == frozenset(range(4))
    assert result.unfinished >= {4, 5}  # the failed step's: issued again on resume
    assert not result.shortfall and not result.trained & result.unfinished
    assert result.trained | result.unfinished == frozenset(range(p.ledger.cursor))


async def test_a_run_that_fails_with_groups_ready_ahead_leaves_no_row(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The groups of the steps after the failed one are READY when it fails: the run's exit
    drops them and clears their rows, as any group of a run that ends."""
    p = _failing_sync(gate_window=2)
    with trio.fail_after(HANG_S), pytest.raises(PumpFailed):
        await p.run()
    assert p.rollout.commits > 6, "nothing was READY ahead: the test shows nothing"
    assert not p.buffer.store.list_ids(), "rows left in the store"
    assert not p.buffer.groups(), p.buffer.snapshot()


async def test_seeded_bug_ready_groups_kept_at_the_exit_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the exit drops nothing (READY groups stay with their rows, as before the
    model learned to drop them)."""

    async def exit_only(self: Pipeline) -> None:
        self.status.exit()

    monkeypatch.setattr(Pipeline, "_exit", exit_only)
    with pytest.raises(AssertionError, match="rows left in the store"):
        await test_a_run_that_fails_with_groups_ready_ahead_leaves_no_row(autojump_clock)
