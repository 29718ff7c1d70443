"""Save and restore with groups WRITTEN and SCORING at the cut, a crash in between: no prompt
lost, none trained twice, under both pending policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from groupflow.impl import CheckpointConfig, PipelineConfig, ScoringConfig
from groupflow.impl._core import PromptLedger, ReplayBuffer
from groupflow.impl._pipeline import (
    Checkpointer,
    Pipeline,
    RunStatus,
    TrainPosition,
    build_pipeline,
    load_checkpoint,
)
from groupflow.impl._pipeline import _checkpoint_disk as checkpoint_disk
from groupflow.impl.errors import CheckpointCorrupt, CheckpointMismatch
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import GroupState, assert_invariants
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.shape import Shape
from tests.helpers import HANG_S, crash_after_saves, new_buffer, written

PROMPTS = 24


def make(
    tmp: Path, policy: str, *, prompts_per_step: int = 4, fail: frozenset[int] = frozenset()
) -> Pipeline:
    config = PipelineConfig(
        shape=Shape(
            prompts_per_step=prompts_per_step,
            num_generations_per_prompt=2,
            max_inflight_prompts=8,
            max_buffered_groups=12,
            gate_window=2,
            max_batch_groups=3,
        ),
        scoring=ScoringConfig(flush_after_s=4.0),
        # written inline: a thread's real time would let the virtual clock jump
        checkpoints=CheckpointConfig(tmp, every_steps=1, policy=policy, write_in_thread=False),
    )
    return build_pipeline(
        config,
        prompts=list(range(PROMPTS)),
        generator=FakeGenerator(latency=lambda o: 1.0 + 1.0 * (o % 12), fail=fail),
        learner=FakeLearner(latency=0.5),
        scorer=FakeScorer(fixed=6.0),
        train_fields=["input_ids"],
    )


async def crash_after_first_save(p: Pipeline, extra_s: float) -> None:
    """Run until the first checkpoint is on disk, then `extra_s` more seconds, then die."""
    assert p.checkpointer is not None
    with trio.fail_after(HANG_S):
        await _crash(p, extra_s)


async def _crash(p: Pipeline, extra_s: float) -> None:
    assert p.checkpointer is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(p.run)
        while not p.checkpointer.saved:
            await trio.sleep(0.25)
        await trio.sleep(extra_s)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("policy", ["flush", "uncommitted"])
@pytest.mark.parametrize("extra_s", [0.0, 2.5, 9.0])
async def test_crash_and_resume_trains_each_prompt_once(
    policy: str, extra_s: float, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    first = make(tmp_path, policy)
    await crash_after_first_save(first, extra_s)
    saved = load_checkpoint(tmp_path)
    pending = saved.cut["WRITTEN"] + saved.cut["SCORING"]
    assert saved.cut["WRITTEN"] and saved.cut["SCORING"], "the cut must catch both states"
    ledger = saved.ledger
    if policy == "flush":
        assert set(pending) <= set(ledger["saved"])
    else:
        assert set(pending) <= set(ledger["reissue"])
    assert set(saved.cut["RESERVED"]) <= set(ledger["reissue"]) | set(ledger["saved"])

    second = make(tmp_path / "resumed", policy)
    await second.resume_from(saved)
    assert_invariants(second.buffer.snapshot())
    with trio.fail_after(HANG_S):
        result = await second.run()
    trained_before = set(ledger["trained"])
    trained_after = {
        g.ordinal for b in cast(FakeLearner, second.train.learner).batches for g in b.groups
    }
    assert not trained_before & trained_after, "a prompt was trained twice"
    assert trained_before | trained_after == set(range(PROMPTS)) - result.shortfall
    assert cast(FakeLearner, second.train.learner).steps == PROMPTS // 4
    assert not second.buffer.store.list_ids()


async def test_rollout_failures_stay_given_up_across_a_resume(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Prompt 5 is given up before the save of step 1, ahead of the prompts that step trained:
    the checkpoint loads all the same (a prompt given up is not a trained one out of place)."""
    first = make(tmp_path, "uncommitted", fail=frozenset({1, 5, 9}))
    await crash_after_first_save(first, 4.0)
    saved = load_checkpoint(tmp_path)
    assert saved.step == 1 and saved.ledger["shortfall"] == [1, 5]
    second = make(tmp_path / "resumed", "uncommitted", fail=frozenset({9}))
    await second.resume_from(saved)
    with trio.fail_after(HANG_S):
        result = await second.run()
    assert {1, 5} <= result.shortfall
    assert 9 in result.shortfall
    trained = set(saved.ledger["trained"]) | {
        g.ordinal for b in cast(FakeLearner, second.train.learner).batches for g in b.groups
    }
    assert trained == set(range(PROMPTS)) - {1, 5, 9}


async def test_resume_with_another_config_is_refused(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    await crash_after_first_save(make(tmp_path, "flush"), 0.0)
    saved = load_checkpoint(tmp_path)
    other = make(tmp_path / "other", "flush", prompts_per_step=6)
    with pytest.raises(CheckpointMismatch, match=r"prompts_per_step: saved 4, now 6"):
        await other.resume_from(saved)


async def test_a_failed_write_leaves_the_last_checkpoint_whole(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = make(tmp_path, "uncommitted")
    assert p.checkpointer is not None
    await crash_after_first_save(p, 0.0)
    good = load_checkpoint(tmp_path)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_disk, "_write_synced", disk_full)
    p.position.step += 1  # a later step, as if training went on
    with pytest.raises(OSError, match="disk full"):
        await p.checkpointer.save()
    assert load_checkpoint(tmp_path).path == good.path
    assert sorted(x.name for x in tmp_path.iterdir()) == [".lock", "latest", good.path.name]


def test_loading_a_folder_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path)


# -- a second crash before the prompts re-issued after the first are all issued again -------

SECOND_CRASH_PROMPTS = 5


def _second_crash_run(
    tmp: Path, *, permits: int, gate: int, latency: dict[int, float], on_step: Any = None
) -> Pipeline:
    """One prompt per step, a checkpoint after every step, under `uncommitted` (prompts in
    flight at a save are issued again). The permits and the gate are not part of the
    checkpoint's fingerprint: a resume may change them, as a user may."""
    return build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=1,
                num_generations_per_prompt=2,
                max_inflight_prompts=permits,
                max_buffered_groups=4,
                gate_window=gate,
                max_batch_groups=2,
            ),
            scoring=ScoringConfig(flush_after_s=0.1),
            checkpoints=CheckpointConfig(
                tmp, every_steps=1, policy="uncommitted", write_in_thread=False
            ),
        ),
        prompts=list(range(SECOND_CRASH_PROMPTS)),
        generator=FakeGenerator(latency=lambda o: latency.get(o, 1.0)),
        learner=FakeLearner(latency=0.5),
        scorer=FakeScorer(fixed=0.1),
        train_fields=["input_ids"],
        on_step=on_step,
    )


async def test_a_second_crash_before_the_reissued_prompts_are_all_issued_loses_none(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Crash 1 leaves prompts 1, 2 and 3 to be issued again; the resumed run has one permit and
    no gate window, so prompt 3 (two steps ahead) still waits to be issued again when training
    prompt 1 ends and the run saves; crash 2 comes right after that save. The third run trains the rest, and
    every prompt is trained exactly once over the three."""
    slow = {1: 50.0, 2: 50.0, 3: 50.0}
    first = _second_crash_run(tmp_path, permits=4, gate=3, latency=slow)
    await crash_after_saves(first, 1, poll_s=0.05)
    after_first = load_checkpoint(tmp_path)
    # and prompt 4, when trio ran its admission before the save
    assert {1, 2, 3} <= set(after_first.ledger["reissue"]), after_first.ledger

    waiting: list[tuple[int, ...]] = []
    second = _second_crash_run(tmp_path, permits=1, gate=0, latency={})
    second_on_step = second.train.on_step

    def record(step: Any) -> None:
        waiting.append(tuple(second.ledger.reissue))
        if second_on_step is not None:
            second_on_step(step)

    second.train.on_step = record
    await second.resume_from(after_first)
    await crash_after_saves(second, 1, poll_s=0.05)
    assert waiting and 3 in waiting[0], f"prompt 3 should still wait to be issued: {waiting}"
    after_second = load_checkpoint(tmp_path)
    assert after_second.step == after_first.step + 1
    assert 3 in after_second.ledger["reissue"], after_second.ledger

    third = _second_crash_run(tmp_path, permits=3, gate=2, latency={})
    await third.resume_from(after_second)
    with trio.fail_after(HANG_S):
        result = await third.run()
    trained = [
        *after_second.ledger["trained"],
        *(o for o in result.trained if o not in after_second.ledger["trained"]),
    ]
    assert sorted(trained) == list(range(SECOND_CRASH_PROMPTS)), trained
    assert not result.shortfall


async def test_seeded_bug_a_save_forgets_the_prompts_still_to_issue_again_is_caught(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger's save lists to issue again only what is in flight, forgetting re-issued
    prompts not admitted yet: the second checkpoint then loses prompt 3, which its own load
    refuses (each prompt below the cursor must be accounted for); prompt 2 goes with it when
    trio runs the save before prompt 2's admission."""

    def forgetful(self: PromptLedger, *, saved: set[int]) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "cursor": self.cursor,
            "trained": sorted(self.trained),
            "shortfall": sorted(self.shortfall),
            "saved": sorted(saved),
            "reissue": sorted(self.in_flight - saved),
        }

    monkeypatch.setattr(PromptLedger, "state_dict", forgetful)
    with pytest.raises(
        CheckpointCorrupt, match=r"step-000002.*prompts \[(2, )?3(, 4)?\] are below the cursor"
    ):
        await test_a_second_crash_before_the_reissued_prompts_are_all_issued_loses_none(
            tmp_path, autojump_clock
        )


# -- the checkpointer alone: when it saves, what a flush waits for, what it tells the stages --


class _Actions:
    """An observer that keeps the kinds of the actions reported."""

    def __init__(self) -> None:
        self.kinds: list[ActionKind] = []

    def on_action(self, action: Action) -> None:
        self.kinds.append(action.kind)


class _Stage:
    """A scoring stage as the checkpointer sees it: told which groups a flush waits for, then
    that the save is done with them. It scores the groups it is told of `score_s` later (None:
    never, as a teacher that hangs)."""

    def __init__(self, buffer: ReplayBuffer, nursery: trio.Nursery, score_s: float | None):
        self.buffer, self.nursery, self.score_s = buffer, nursery, score_s
        self.told: list[tuple[str, frozenset[str]]] = []

    def flush(self, group_ids: set[str]) -> None:
        self.told.append(("flush", frozenset(group_ids)))
        if self.score_s is not None:
            self.nursery.start_soon(self._score, sorted(group_ids))

    def end_flush(self) -> None:
        self.told.append(("end_flush", frozenset()))

    async def _score(self, group_ids: list[str]) -> None:
        assert self.score_s is not None
        await trio.sleep(self.score_s)
        written = [g for g in group_ids if self.buffer.state_of(g) is GroupState.WRITTEN]
        self.buffer.take_for_scoring(written)
        await self.buffer.mark_ready_many(group_ids)


def _checkpointer(
    folder: Path,
    buffer: ReplayBuffer,
    ledger: PromptLedger,
    *,
    step: int = 0,
    every_steps: int = 1,
    stage: _Stage | None = None,
    actions: _Actions | None = None,
) -> Checkpointer:
    """A checkpointer with a stateless learner, at `step`; a flush waits at most 10 s."""
    return Checkpointer(
        CheckpointConfig(
            folder,
            every_steps=every_steps,
            policy="flush",
            flush_timeout_s=10.0,
            write_in_thread=False,
        ),
        buffer,
        ledger,
        TrainPosition(step=step, weight_version=step),
        None,
        {"prompts_per_step": 2},
        stages=() if stage is None else (cast(Any, stage),),
        status=RunStatus(observer=actions),
    )


async def _pending_at_the_cut(buffer: ReplayBuffer, ledger: PromptLedger) -> set[str]:
    """Prompts 0 and 1 issued, their groups WRITTEN and SCORING: what a flush waits for."""
    ordinals = [ledger.issue(), ledger.issue()]
    ids = await written(buffer, 2, first_ordinal=ordinals[0])
    buffer.take_for_scoring(ids[1:])
    return set(ids)


@pytest.mark.parametrize(("score_s", "timed_out"), [(4.0, False), (None, True)])
async def test_a_flush_save_waits_for_the_groups_pending_at_the_cut(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, score_s: float | None, timed_out: bool
) -> None:
    """The stages are told to send the pending groups now and told when the save is done
    with them; scored in time, they are saved READY; not scored within `flush_timeout_s`, the
    save goes ahead without them (their prompts issued again), and the timeout is counted and
    reported as such."""
    buffer, ledger, actions = new_buffer(), PromptLedger(4), _Actions()
    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            stage = _Stage(buffer, nursery, score_s)
            checkpointer = _checkpointer(tmp_path, buffer, ledger, stage=stage, actions=actions)
            pending = await _pending_at_the_cut(buffer, ledger)
            began = trio.current_time()
            await checkpointer.save()
            waited = trio.current_time() - began
            nursery.cancel_scope.cancel()
    assert stage.told == [("flush", frozenset(pending)), ("end_flush", frozenset())]
    assert waited == pytest.approx(10.0 if timed_out else 4.0)
    assert checkpointer.flush_timeouts == (1 if timed_out else 0)
    report = ActionKind.FLUSH_TIMEOUT if timed_out else ActionKind.CHECKPOINT_SAVED
    assert actions.kinds == [ActionKind.CHECKPOINT, report, ActionKind.CHECKPOINT_WRITTEN]
    ledger_saved = load_checkpoint(tmp_path).ledger
    assert ledger_saved["reissue" if timed_out else "saved"] == [0, 1]


async def test_each_flush_that_times_out_is_counted(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    buffer, ledger = new_buffer(), PromptLedger(4)
    with trio.fail_after(HANG_S):
        async with trio.open_nursery() as nursery:
            checkpointer = _checkpointer(
                tmp_path, buffer, ledger, stage=_Stage(buffer, nursery, None)
            )
            await _pending_at_the_cut(buffer, ledger)
            for step in (1, 2):
                checkpointer.position.step = checkpointer.position.weight_version = step
                await checkpointer.save()
            nursery.cancel_scope.cancel()
    assert checkpointer.flush_timeouts == 2


async def test_a_checkpoint_is_saved_after_every_n_steps_only(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    checkpointer = _checkpointer(tmp_path, new_buffer(), PromptLedger(0), every_steps=3)
    for step in range(1, 8):
        checkpointer.position.step = checkpointer.position.weight_version = step
        await checkpointer.after_step()
    assert [p.name for p in checkpointer.saved] == ["step-000003", "step-000006"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000006"]


async def test_a_long_runs_checkpoint_saves_and_loads(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Step 300, 600 prompts trained: the step, the weight version and the lists' lengths are
    compared by value (CPython shares only small integers as one object)."""
    ledger = PromptLedger(600)
    ledger.load_state_dict(
        {
            "num_prompts": 600,
            "cursor": 600,
            "trained": list(range(600)),
            "shortfall": [],
            "saved": [],
            "reissue": [],
        }
    )
    await _checkpointer(tmp_path, new_buffer(), ledger, step=300).save()
    loaded = load_checkpoint(tmp_path)
    assert loaded.path.name == "step-000300" and loaded.step == loaded.weight_version == 300
    assert loaded.ledger["trained"] == list(range(600))
