"""Save and restore with groups WRITTEN and SCORING at the cut, a crash in between: no prompt
lost, none trained twice, under both pending policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from groupflow.impl import CheckpointConfig, PipelineConfig, ScoringConfig
from groupflow.impl.errors import CheckpointMismatch
from groupflow.impl.pipeline import Pipeline, build_pipeline, load_checkpoint
from groupflow.impl.pipeline import _checkpoint_disk as checkpoint_disk
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import assert_invariants

PROMPTS = 24
HANG_S = 10_000  # virtual seconds: a run that takes this long has hung


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
