"""The train pump on its own terms: each step's record (what it waited, whether it trained, its
weight sync), the next weights synced before the position moves, the run's last step saved
however it ends (and never twice), a stop at the last step ending as a finished run does, what
it tells the watchdog, and the prompts given up named to the learner."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from groupflow.impl import CheckpointConfig
from groupflow.impl._pipeline import Pipeline, StepRecord, step_folders
from groupflow.impl.testing import FakeGenerator, FakeLearner
from tests.pipeline.test_runs import pipeline, run


@attrs.define
class _SlowSync(FakeGenerator):
    """A weight sync of `sync_s` seconds that notes what the position said while it ran."""

    sync_s: float = 5.0
    position: object = None
    seen: list[tuple[int, int, int]] = attrs.field(factory=list)
    """(version, position.loading, position.weight_version) at each sync."""

    async def sync_weights(self, version: int) -> None:
        p = self.position
        self.seen.append((version, p.loading, p.weight_version))  # type: ignore[attr-defined]
        await trio.sleep(self.sync_s)
        await super().sync_weights(version)


async def test_each_step_syncs_the_next_weights_and_records_the_sync(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The sync after step k loads version k + 1 while the position still says k (rollouts
    that end meanwhile carry `loading`), and the step's record holds its seconds."""
    generator = _SlowSync(latency=lambda o: 2.0)
    p, _, _, learner = pipeline(prompts=24, generator=generator)
    generator.position = p.position
    result = await run(p)
    assert generator.synced == [1, 2, 3]
    assert generator.seen == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]
    assert [s.sync_s for s in result.steps] == [5.0, 5.0, 5.0]
    assert [s.train_s for s in result.steps] == [learner.latency + 5.0] * 3


def _latency(ordinal: int) -> float:
    """Step 0's rollouts take 2 s, step 1's 5 s: all start at once, so step 1 (after step 0's
    2 s and 1 s of training) waits 2 s from 3 s."""
    return 2.0 if ordinal < 8 else 5.0


async def test_a_step_record_says_what_the_step_waited_and_whether_it_trained(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, learner = pipeline(
        prompts=24,
        max_inflight_prompts=16,
        max_buffered_groups=24,
        generator=FakeGenerator(latency=_latency, fail=frozenset(range(16, 24))),
    )
    result = await run(p)
    assert [(s.step, s.started, s.waited_s) for s in result.steps] == [
        (0, 0.0, 2.0),
        (1, 3.0, 2.0),
        (2, 6.0, 2.0),  # step 2's rollouts, admitted once step 0 trained, fail at 8 s
    ]
    assert [s.skipped for s in result.steps] == [False, False, True]
    assert result.steps[2].sync_s == 0.0 and result.steps[2].groups == 0
    assert [b.step for b in learner.batches] == [0, 1]  # the skipped step is not trained


async def test_the_learner_is_told_exactly_the_prompts_of_its_step_given_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, learner = pipeline(
        prompts=16, generator=FakeGenerator(latency=lambda o: 2.0, fail=frozenset({3, 12}))
    )
    await run(p)
    assert [(b.step, b.given_up) for b in learner.batches] == [(0, (3,)), (1, (12,))]


def _saved(p: Pipeline) -> list[int]:
    assert p.checkpointer is not None
    return [step for step, _ in step_folders(p.checkpointer.directory)]


def _with_checkpoints(
    tmp_path: Path, *, prompts: int, every_steps: int, learner: FakeLearner | None = None
) -> Pipeline:
    p, _, _, _ = pipeline(
        prompts=prompts,
        checkpoints=CheckpointConfig(
            tmp_path / "ckpt", every_steps=every_steps, write_in_thread=False
        ),
    )
    if learner is not None:
        p.train.learner = learner
    return p


@pytest.mark.parametrize(("every_steps", "saved"), [(3, [3, 5]), (5, [5]), (1, [1, 2, 3, 4, 5])])
async def test_a_finished_run_saves_its_last_step_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, every_steps: int, saved: list[int]
) -> None:
    """5 steps: saved where `every_steps` says and at step 5, which is saved once whichever
    saved it (a second save of one step would rewrite it for nothing)."""
    p = _with_checkpoints(tmp_path, prompts=40, every_steps=every_steps)
    await run(p)
    assert p.checkpointer is not None
    written = [int(path.name.removeprefix("step-")) for path in p.checkpointer.saved]
    assert _saved(p) == saved and written == saved
    assert p.status.stopped and not p.status.interrupted


@pytest.mark.parametrize(("stop_after", "interrupted"), [(2, True), (5, False)])
async def test_a_stop_saves_the_step_it_stopped_at_and_a_stop_at_the_last_step_finishes(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    stop_after: int,
    interrupted: bool,
) -> None:
    """A stop before the last step ends the run there, saved, as interrupted; one asked for
    during the last step ends it as a finished run (nothing was cut short)."""
    p = _with_checkpoints(tmp_path, prompts=40, every_steps=100)

    def stop(record: StepRecord) -> None:
        if record.step + 1 == stop_after:
            p.request_stop()

    p.train.on_step = stop
    result = await run(p)
    assert len(result.steps) == stop_after and _saved(p) == [stop_after]
    assert (p.status.interrupted, p.status.stopped) == (interrupted, not interrupted)


async def test_a_run_that_fails_saves_nothing_more(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    p = _with_checkpoints(
        tmp_path, prompts=40, every_steps=3, learner=FakeLearner(fail_steps=frozenset({4}))
    )
    with pytest.raises(BaseException):  # noqa: B017 (the run's failure, whatever wraps it)
        await run(p)
    assert _saved(p) == [3]


@pytest.mark.parametrize(
    ("prompts_per_step", "says"),
    [
        (5, "train step 0 waits for 5 prompts (0, 1, 2, 3, 4)"),
        (8, "train step 0 waits for 8 prompts (0, 1, 2, 3, 4, 5, 6, 7)"),
        (9, "train step 0 waits for 9 prompts (0, 1, 2, 3, 4, 5, 6, 7 and 1 more)"),
        (20, "train step 0 waits for 20 prompts (0, 1, 2, 3, 4, 5, 6, 7 and 12 more)"),
    ],
)
def test_the_watchdog_hears_which_prompts_a_step_waits_for(
    prompts_per_step: int, says: str
) -> None:
    p, _, _, _ = pipeline(
        prompts=2 * prompts_per_step,
        prompts_per_step=prompts_per_step,
        max_buffered_groups=2 * prompts_per_step,
    )
    assert p.train.waiting() == says


async def test_after_its_last_step_training_is_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p, _, _, _ = pipeline(prompts=16)
    await run(p)
    assert p.train.waiting() == "training done"


async def test_demand_dispatch_is_asked_for_by_the_step_training_waits_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A step of 8 groups in batches of 7 leaves one group queued; with demand dispatch the
    step's wait sends it at once, not when the 1,000 s timer fires."""
    p, _, _, _ = pipeline(prompts=16, scoring={"dispatch": "demand", "flush_after_s": 1000.0})
    start = trio.current_time()
    await run(p)
    assert trio.current_time() - start < 100


async def test_a_step_cancelled_while_it_trains_releases_its_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled in the learner's step (a crash, a second Ctrl-C): the step's rows are released
    though the run is cancelled (the release is shielded), and no step is said to be running."""
    p, _, _, learner = pipeline(prompts=16)
    learner.latency = 10.0
    with trio.move_on_after(5.0):  # step 0 trains from 2 s to 12 s
        await p.run()
    assert not p.train.in_step
    assert [g.state for g in p.buffer.groups()] == []
    assert not p.buffer.snapshot().store_ids


async def test_a_stage_that_is_the_only_one_has_no_later_scoring(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`later_scoring` holds the stages after the teacher's: none here, the teacher's own
    metrics being `scoring`."""
    p, _, scorer, _ = pipeline(prompts=16, scoring={})
    result = await run(p)
    assert [s.later_scoring for s in result.steps] == [{}, {}]
    assert scorer is not None and scorer.calls  # the teacher's stage did score


@pytest.mark.parametrize("stop_at_last", [False, True])
async def test_a_run_of_300_steps_ends_saves_and_stops_by_value(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, stop_at_last: bool
) -> None:
    """Steps past 256 are ints that Python does not share: the pump compares steps by value
    (a comparison by identity would train past the end, save a step twice, or take the last
    step's stop for an early one)."""
    p, _, _, _ = pipeline(
        prompts=300,
        prompts_per_step=1,
        max_inflight_prompts=2,
        max_batch_groups=1,
        max_buffered_groups=2,
        checkpoints=CheckpointConfig(tmp_path / "ckpt", every_steps=100, write_in_thread=False),
    )
    if stop_at_last:
        p.train.on_step = lambda record: p.request_stop() if record.step == 299 else None
    result = await run(p)
    assert p.checkpointer is not None
    written = [int(path.name.removeprefix("step-")) for path in p.checkpointer.saved]
    assert len(result.steps) == 300 and written == [100, 200, 300]
    assert p.status.stopped and not p.status.interrupted
    assert p.train.waiting() == "training done"
