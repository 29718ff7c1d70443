"""The whole pipeline under virtual time: rollout, teacher stage (or the inline baseline),
train pump, watchdog, supervisor."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import MemoryStore, PipelineConfig, ScoringConfig, StallAction
from groupflow.impl._core import Fields
from groupflow.impl._pipeline import (
    Pipeline,
    RolloutPump,
    RunResult,
    StallWatchdog,
    StepRecord,
    build_pipeline,
)
from groupflow.impl._teachers import teacher_by_agent
from groupflow.impl.errors import PumpFailed, Stalled
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import LIVE_STATES, GroupState, assert_invariants
from groupflow.model.shape import Shape, split_shape

RECIPE = Shape(
    prompts_per_step=8,
    num_generations_per_prompt=4,
    max_inflight_prompts=8,
    max_buffered_groups=16,
    max_batch_groups=7,
)


def pipeline(
    *,
    prompts: int = 16,
    scoring: dict[str, Any] | None = None,
    generator: FakeGenerator | None = None,
    scorer: FakeScorer | None = None,
    **config: Any,
) -> tuple[Pipeline, FakeGenerator, FakeScorer | None, FakeLearner]:
    """A run of `prompts` on `RECIPE` with some `config` changed (the shape's sizes by their
    own names), scored by `scoring` (the `ScoringConfig`'s settings; None: no scoring stage)."""
    shape, rest = split_shape(config, RECIPE)
    scoring_config = None
    if scoring is not None:
        scoring_config = ScoringConfig(**{"flush_after_s": 5.0, **scoring})
        scorer = scorer or FakeScorer()
    else:
        scorer = None
    generator = generator or FakeGenerator(latency=lambda o: 2.0)
    learner = FakeLearner()
    built = build_pipeline(
        PipelineConfig(shape=shape, scoring=scoring_config, **rest),
        prompts=list(range(prompts)),
        generator=generator,
        learner=learner,
        scorer=scorer,
        train_fields=["input_ids", "generation_logprobs"],
    )
    return built, generator, scorer, learner


async def run(p: Pipeline) -> RunResult:
    with trio.fail_after(10_000):  # virtual seconds: longer than this, the run has hung
        return await p.run()


def assert_clean_end(p: Pipeline) -> None:
    """After a run: no group half-way, the invariants hold, the ledger accounts for everything."""
    assert not any(g.state in LIVE_STATES - {GroupState.READY} for g in p.buffer.groups())
    assert_invariants(p.buffer.snapshot())
    assert not p.ledger.in_flight or all(
        any(g.ordinal == o for g in p.buffer.groups(GroupState.READY)) for o in p.ledger.in_flight
    )


async def test_recipe_trains_every_prompt_once(autojump_clock: trio.testing.MockClock) -> None:
    p, generator, scorer, learner = pipeline(scoring={})
    result = await run(p)
    assert result.trained == frozenset(range(16)) and not result.shortfall
    assert [len(b.groups) for b in learner.batches] == [8, 8]
    assert all(
        set(row) == {"input_ids", "generation_logprobs", "teacher_reference_logprobs"}
        for b in learner.batches
        for row in b.rows.values()
    )
    assert not p.buffer.store.list_ids() and len(p.buffer) == 0
    assert scorer is not None and all(len(c.group_ids) <= 7 for c in scorer.calls)
    assert generator.most_running == 8
    assert_clean_end(p)


async def test_eight_groups_one_call_when_inflight_allows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, scorer, _ = pipeline(
        scoring={}, max_batch_groups=8, max_inflight_prompts=16, gate_window=0, prompts=8
    )
    await run(p)
    assert scorer is not None
    assert [len(c.group_ids) for c in scorer.calls] == [8]
    (step,) = p.train.history
    assert step.scoring is not None and step.scoring.calls == 1 and step.scoring.rows == 32


async def test_permit_is_free_while_scoring_and_held_in_the_baseline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow: dict[str, Any] = {"fixed": 10.0}
    pump, pump_gen, _, _ = pipeline(scoring={}, scorer=FakeScorer(**slow), gate_window=1)
    inline, inline_gen, _, _ = pipeline(
        scoring={"design": "inline"}, scorer=FakeScorer(**slow), gate_window=1
    )
    await run(pump)
    start = trio.current_time()
    await run(inline)
    assert pump.rollout.permit_seconds_scoring == 0.0
    assert inline.rollout.permit_seconds_scoring > 0.0
    assert pump.stage is not None and inline.inline is not None
    pump_calls = sum(s.scoring.calls for s in pump.train.history if s.scoring)
    inline_calls = sum(s.scoring.calls for s in inline.train.history if s.scoring)
    assert inline_calls == 16, "the baseline makes one call per group"
    assert pump_calls < inline_calls
    assert trio.current_time() - start > pump.train.history[-1].started


class _PermitWitness(MemoryStore):
    """Records, at each write of a group's rows, the ordinals whose rollouts hold a permit."""

    def __init__(self) -> None:
        super().__init__()
        self.rollout: Any = None
        self.held_at_put: list[set[int]] = []

    def put(self, rows: Mapping[str, Fields]) -> None:
        self.held_at_put.append(set(self.rollout.holding))
        super().put(rows)


async def _permits_at_each_write(design: str) -> list[set[int]]:
    store = _PermitWitness()
    p = build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=2,
                max_inflight_prompts=1,
                max_buffered_groups=4,
                max_batch_groups=2,
            ),
            scoring=ScoringConfig(flush_after_s=1.0, design=design),
        ),
        prompts=list(range(6)),
        generator=FakeGenerator(latency=lambda o: 1.0),
        learner=FakeLearner(),
        scorer=FakeScorer(fixed=0.5),
        store=store,
        train_fields=["input_ids"],
    )
    store.rollout = p.rollout
    await run(p)
    return store.held_at_put


@pytest.mark.parametrize("design", ["inline", "pump"])
async def test_a_rollout_holds_its_permit_until_its_rows_are_written(
    design: str, autojump_clock: trio.testing.MockClock
) -> None:
    """With one permit, each group's rows are written while its own rollout still holds it: a
    permit freed before the write would let the next rollout start, and more rollouts than
    `max_inflight_prompts` hold rows that are not in the store yet."""
    held = await _permits_at_each_write(design)
    assert len(held) == 6
    assert all(len(h) == 1 for h in held), f"a permit was free during a write: {held}"


async def test_seeded_bug_permit_released_before_the_rows_are_written_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = RolloutPump._generate_and_commit

    async def early(self: RolloutPump, ordinal: int, gid: str) -> None:
        self._release(ordinal)  # the bug: the permit goes back as the rollout is generated
        await original(self, ordinal, gid)

    monkeypatch.setattr(RolloutPump, "_generate_and_commit", early)
    with pytest.raises(AssertionError, match="a permit was free during a write"):
        await test_a_rollout_holds_its_permit_until_its_rows_are_written("pump", autojump_clock)


@pytest.mark.parametrize("design", ["inline", "pump"])
async def test_every_teacher_call_is_counted_in_exactly_one_step_record(
    design: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Calls that wait in line, or are still on the wire, while a step's metrics are drained
    land in the next step's record: summed over the records as each step wrote them, every
    call, group and call-second is there once (a call counted into a record already written
    is lost to `metrics.jsonl` and to the figures benchmarks print from it)."""
    scorer = FakeScorer(fixed=3.0)
    p, _, _, _ = pipeline(scoring={"design": design}, scorer=scorer, gate_window=1, prompts=32)
    written: list[tuple[int, int, float]] = []

    def on_step(record: StepRecord) -> None:  # what `groupflow train` writes, when it does
        assert record.scoring is not None
        written.append((record.scoring.calls, record.scoring.groups, record.scoring.call_s))

    p.train.on_step = on_step
    await run(p)
    assert sum(w[0] for w in written) == len(scorer.calls)
    assert sum(w[1] for w in written) == sum(len(c.group_ids) for c in scorer.calls) == 32
    assert sum(w[2] for w in written) == pytest.approx(3.0 * len(scorer.calls))


async def test_failed_rollout_is_shortfall_and_the_step_trains_without_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, learner = pipeline(scoring={}, generator=FakeGenerator(fail=frozenset({3})))
    result = await run(p)
    assert result.shortfall == {3} and result.trained == frozenset(range(16)) - {3}
    assert [len(b.groups) for b in learner.batches] == [7, 8]
    assert p.train.history[0].shortfall == 1
    assert_clean_end(p)


async def test_teacher_failure_under_fail_policy_fails_the_run_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, _ = pipeline(
        scoring={"failure_policy": "fail"}, scorer=FakeScorer(fail=lambda i, r: i == 1)
    )
    with pytest.raises(PumpFailed) as caught:
        await run(p)
    assert caught.value.pump == "teacher"
    assert_clean_end(p)


async def test_hung_teacher_is_caught_by_the_watchdog(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, _ = pipeline(
        scoring={},
        scorer=FakeScorer(fixed=1e9),
        stall_timeout_s=120.0,
        stall_action="abort",
    )
    with pytest.raises(PumpFailed) as caught:
        await run(p)
    assert caught.value.pump == "stall watchdog"
    assert isinstance(caught.value.__cause__, Stalled)
    words = str(caught.value.__cause__)
    assert "stage 'teacher' teacher 'teacher': a call of" in words, words
    assert "in flight for 1" in words and "train step 0 waits for" in words, words
    assert "(0, 0, 0)" not in words
    assert trio.current_time() < 400
    assert_clean_end(p)


async def test_without_scoring_groups_are_ready_at_commit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, learner = pipeline(scoring=None, prompts=12)
    result = await run(p)
    assert result.trained == frozenset(range(12))
    assert [len(b.groups) for b in learner.batches] == [8, 4]
    assert p.stage is None


async def test_two_teachers_score_concurrently(autojump_clock: trio.testing.MockClock) -> None:
    scorer = FakeScorer(fixed=5.0)
    config = PipelineConfig(
        shape=RECIPE.evolve(max_batch_groups=4), scoring=ScoringConfig(flush_after_s=5.0)
    )
    p = build_pipeline(
        config,
        prompts=list(range(8)),
        generator=FakeGenerator(),
        learner=FakeLearner(),
        scorer=scorer,
        route=teacher_by_agent({"math": "t-math", "code": "t-code"}),
        agent_of=lambda o: "math" if o % 2 else "code",
        train_fields=["input_ids"],
    )
    await run(p)
    starts = {c.teacher: c.start for c in scorer.calls}
    assert set(starts) == {"t-math", "t-code"} and starts["t-math"] == starts["t-code"]


async def test_gate_holds_the_next_step_until_training_reaches_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    started: dict[int, float] = {}

    def latency(ordinal: int) -> float:
        started[ordinal] = trio.current_time()
        return 2.0

    p, _, _, _ = pipeline(
        scoring={}, generator=FakeGenerator(latency=latency), gate_window=0, prompts=24
    )
    await run(p)
    for step in (1, 2):
        trained_previous = p.train.history[step - 1]
        done = trained_previous.started + trained_previous.waited_s + trained_previous.train_s
        assert min(started[o] for o in range(8 * step, 8 * step + 8)) >= done


async def test_capacity_of_one_step_is_enough_and_never_overdrawn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, _ = pipeline(scoring={}, max_buffered_groups=8, gate_window=2, prompts=24)
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(p.buffer))
            await p.buffer.changed.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        result = await run(p)
        nursery.cancel_scope.cancel()
    assert result.trained == frozenset(range(24))
    assert most == 8


async def test_watchdog_warns_once_per_stall_and_keeps_going(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning for a stall however long it lasts (a warning per period flooded the
    terminal: hundreds of lines for one hung call); progress, then a new stall, warns again."""
    moved = [0]
    watchdog = StallWatchdog(
        lambda: moved[0],
        timeout_s=60.0,
        action=StallAction.WARN,
        waiting=lambda now: f"teacher 't' stuck at {now:.0f}",
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog.run)
        await trio.sleep(600)
        assert watchdog.warnings == 1
        moved[0] += 1
        await trio.sleep(600)
        nursery.cancel_scope.cancel()
    assert watchdog.warnings == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "groupflow.watchdog"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("no progress for 60 s, since the start (stall_timeout_s=60)")
    assert "teacher 't' stuck at 60" in lines[0]
    assert re.search(r"since 6\d\d s into the run", lines[1]), lines[1]


async def test_watchdog_resets_on_progress(autojump_clock: trio.testing.MockClock) -> None:
    ticks = iter(range(1_000_000))
    watchdog = StallWatchdog(lambda: next(ticks), timeout_s=60.0, action=StallAction.ABORT)
    with trio.move_on_after(500):
        await watchdog.run()
    assert watchdog.warnings == 0
