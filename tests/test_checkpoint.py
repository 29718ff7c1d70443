"""Save and restore with groups WRITTEN and SCORING at the cut, a crash in between: no prompt
lost, none trained twice, under both pending policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from groupflow.impl import CheckpointConfig, PipelineConfig, ScoringConfig
from groupflow.impl.core import PromptLedger
from groupflow.impl.errors import CheckpointCorrupt, CheckpointMismatch
from groupflow.impl.pipeline import Pipeline, build_pipeline, load_checkpoint
from groupflow.impl.pipeline import _checkpoint_disk as checkpoint_disk
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import assert_invariants
from tests.helpers import HANG_S, crash_after_saves

PROMPTS = 24


def make(
    tmp: Path, policy: str, *, prompts_per_step: int = 4, fail: frozenset[int] = frozenset()
) -> Pipeline:
    config = PipelineConfig(
        prompts_per_step=prompts_per_step,
        num_generations_per_prompt=2,
        max_inflight_prompts=8,
        max_buffered_groups=12,
        gate_window=2,
        scoring=ScoringConfig(max_batch_groups=3, flush_after_s=4.0),
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
    first = make(tmp_path, "uncommitted", fail=frozenset({1, 9}))
    await crash_after_first_save(first, 4.0)
    saved = load_checkpoint(tmp_path)
    second = make(tmp_path / "resumed", "uncommitted", fail=frozenset({9}))
    await second.resume_from(saved)
    with trio.fail_after(HANG_S):
        result = await second.run()
    assert 1 in saved.ledger["shortfall"] and 1 in result.shortfall
    assert 9 in result.shortfall
    trained = set(saved.ledger["trained"]) | {
        g.ordinal for b in cast(FakeLearner, second.train.learner).batches for g in b.groups
    }
    assert trained == set(range(PROMPTS)) - {1, 9}


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
            prompts_per_step=1,
            num_generations_per_prompt=2,
            max_inflight_prompts=permits,
            max_buffered_groups=4,
            gate_window=gate,
            scoring=ScoringConfig(max_batch_groups=2, flush_after_s=0.1),
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
