"""Faults at the edges are contained and named: a generator that is down fails the run instead
of giving up prompt after prompt, and a run that gave up on every prompt says it failed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import (
    NothingTrained,
    PipelineConfig,
    PumpFailed,
    RolloutsFailed,
    build_pipeline,
)
from groupflow.impl.pipeline import Pipeline, RolloutPump
from groupflow.sim.fakes import FakeGenerator, FakeLearner
from groupflow.sim.run import PUMP_DEMAND, simulate
from groupflow.sim.scenario import parse_scenario

HANG_S = 10_000  # virtual seconds: a run that takes this long has hung


def make(fail: frozenset[int], *, prompts: int = 8, **settings: Any) -> Pipeline:
    config = PipelineConfig(
        prompts_per_step=2,
        num_generations_per_prompt=2,
        max_inflight_prompts=settings.pop("max_inflight_prompts", 1),
        max_buffered_groups=4,
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


def test_sim_of_a_generator_that_is_down_fails_and_says_why() -> None:
    scenario = parse_scenario(
        """
name = "down"
steps = 8
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
fixed_s = 1.0
[train]
step_s = 1.0
[faults]
rollout_failure_rate = 1.0
""",
        source="down.toml",
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
    from groupflow.impl import ArgumentError, BufferConfig, MemoryStore, ReplayBuffer, Row
    from groupflow.impl.core import PAD_PREFIX

    buffer = ReplayBuffer(BufferConfig(group_size=2, capacity=2), MemoryStore())
    gid = buffer.reserve(target_step=0, ordinal=0)
    rows = [Row(f"{PAD_PREFIX}x", {"a": 1}), Row("ok", {"a": 2})]
    with pytest.raises(ArgumentError, match="start with groupflow's padding prefix"):
        await buffer.commit(gid, rows, start_weight_version=0, end_weight_version=0)
    assert not buffer.store.list_ids()


def test_an_error_about_a_padding_row_names_the_row_it_copies() -> None:
    from groupflow.impl import BatchMeta, MemoryStore, TeacherOutputError, score_teacher_batch

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
