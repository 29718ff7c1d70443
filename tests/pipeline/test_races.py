"""Cancellation, shutdown and slow store calls meeting the pipeline at awkward moments.

Each test is a scenario a review found broken; each checks that every group ends terminal or
READY, no row is orphaned, and the ledger accounts for every prompt.
"""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import trio
import trio.testing

from groupflow.impl import CheckpointConfig, MemoryStore, PipelineConfig, Row, ScoringConfig
from groupflow.impl._pipeline import (
    InlineScoring,
    ScoringStage,
    ThreadedScorer,
    build_pipeline,
    load_checkpoint,
)
from groupflow.impl.contract import TEACHER_FIELD, ScoreRequest
from groupflow.impl.errors import PumpFailed
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model import GroupState, assert_invariants
from groupflow.model.shape import Shape
from tests.helpers import scoring_buffer, written


class _FailingTeacher:
    """Fails each call a while after it starts; `entered` is set once a call is in its thread,
    so a test cancels at that moment however slow the machine is."""

    def __init__(self) -> None:
        self.entered = threading.Event()

    def __call__(self, request: ScoreRequest) -> None:
        self.entered.set()
        time.sleep(0.2)
        raise OSError("teacher crashed")

    async def wait_entered(self) -> None:
        while not self.entered.is_set():
            await trio.sleep(0.01)


async def test_stage_cancelled_while_handling_a_failed_call_drops_every_group() -> None:
    buffer = scoring_buffer(group_size=2, capacity=8)
    told: list[tuple[str, str]] = []
    teacher = _FailingTeacher()
    stage = ScoringStage(
        buffer,
        ThreadedScorer(teacher),
        ScoringConfig(flush_after_s=5.0, failure_policy="discard"),
        max_batch_groups=8,
        on_discard=lambda view, why: told.append((view.group_id, why)),
    )
    ids = await written(buffer, 3, first_ordinal=0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stage.run)
            for gid in ids:
                stage.submit(gid)
            stage.upstream_ended()
            await teacher.wait_entered()
            nursery.cancel_scope.cancel()
    assert {buffer.state_of(g) for g in ids} == {GroupState.DISCARDED}
    assert sorted(gid for gid, _ in told) == sorted(ids), "each drop reported exactly once"
    assert not buffer.store.list_ids() and stage.backlog == 0


async def test_inline_cancelled_after_a_failed_call_reports_the_drop_once() -> None:
    buffer = scoring_buffer(group_size=2, capacity=8)
    told: list[tuple[str, str]] = []
    teacher = _FailingTeacher()
    inline = InlineScoring(
        buffer,
        ThreadedScorer(teacher),
        ScoringConfig(flush_after_s=1.0, failure_policy="discard"),
        on_discard=lambda view, why: told.append((view.group_id, why)),
    )
    (gid,) = await written(buffer, 1, first_ordinal=0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            inline.enqueue(gid)
            nursery.start_soon(functools.partial(inline.score, gid, release=lambda: None))
            await teacher.wait_entered()
            nursery.cancel_scope.cancel()
    assert buffer.state_of(gid) is GroupState.DISCARDED
    assert told == [(gid, "failed")]
    assert not buffer.store.list_ids()


class _SlowWrites(MemoryStore):
    """A blocking store whose writes for prompts 2 and 3 take a while."""

    def put(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        if any(sid.startswith(("p2-", "p3-")) for sid in rows):
            time.sleep(0.3)
        super().put(rows)


async def test_training_ends_while_a_commit_write_is_in_flight() -> None:
    """The stage hears its upstream ended only once the rollouts have really returned."""
    p = build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=2,
                max_inflight_prompts=4,
                max_buffered_groups=8,
                max_batch_groups=3,
            ),
            scoring=ScoringConfig(flush_after_s=0.05),
        ),
        prompts=list(range(4)),
        generator=FakeGenerator(latency=lambda o: 0.01),
        learner=FakeLearner(latency=0.01),
        scorer=FakeScorer(fixed=0.02),
        store=_SlowWrites(blocking=True),
        train_fields=["input_ids"],
        num_steps=1,
    )
    with trio.fail_after(60):
        await p.run()
    assert all(g.state is GroupState.READY for g in p.buffer.groups())
    assert_invariants(p.buffer.snapshot())


async def test_failed_train_step_releases_its_rows(autojump_clock: trio.testing.MockClock) -> None:
    class BrokenLearner(FakeLearner):
        async def train_step(self, batch: Any) -> Mapping[str, float]:
            raise RuntimeError("CUDA out of memory")

    p = build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=2,
                max_inflight_prompts=4,
                max_buffered_groups=8,
            ),
        ),
        prompts=list(range(4)),
        generator=FakeGenerator(),
        learner=BrokenLearner(),
        train_fields=["input_ids"],
    )
    with trio.fail_after(10_000):
        try:
            await p.run()
        except PumpFailed as failure:
            assert failure.pump == "train"
    assert not any(g.state is GroupState.CONSUMED for g in p.buffer.groups())
    assert_invariants(p.buffer.snapshot())
    assert {0, 1} <= p.ledger.in_flight, "untrained prompts stay in flight, to be issued again"


async def test_a_step_whose_prompts_all_failed_still_opens_the_gate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=1,
                num_generations_per_prompt=1,
                max_inflight_prompts=2,
                max_buffered_groups=4,
                gate_window=0,
            ),
        ),
        prompts=list(range(3)),
        generator=FakeGenerator(fail=frozenset({0})),
        learner=FakeLearner(),
        train_fields=["input_ids"],
    )
    with trio.fail_after(10_000):
        result = await p.run()
    assert result.trained == {1, 2} and result.shortfall == {0}


class _SlowThreadReads(MemoryStore):
    def get(self, sample_ids: Iterable[str], fields: Iterable[str]) -> dict[str, dict[str, Any]]:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return super().get(list(sample_ids), list(fields))


async def test_group_turning_ready_during_a_save_is_reissued_not_lost() -> None:
    def make(directory: Path) -> Any:
        return build_pipeline(
            PipelineConfig(
                shape=Shape(
                    prompts_per_step=2,
                    num_generations_per_prompt=1,
                    max_inflight_prompts=4,
                    max_buffered_groups=8,
                    max_batch_groups=3,
                ),
                checkpoints=CheckpointConfig(
                    directory, every_steps=1, policy="uncommitted", write_in_thread=False
                ),
                scoring=ScoringConfig(flush_after_s=1.0),
            ),
            prompts=list(range(2)),
            generator=FakeGenerator(latency=lambda o: 0.01),
            learner=FakeLearner(latency=0.01),
            scorer=FakeScorer(fixed=0.01),
            store=_SlowThreadReads(blocking=True),
            train_fields=["input_ids"],
        )

    directory = Path(tempfile.mkdtemp())
    p = make(directory)
    ids = []
    for _ in range(2):
        ordinal = p.ledger.issue()
        gid = p.buffer.reserve(target_step=0, ordinal=ordinal)
        await p.buffer.commit(
            gid,
            [Row(f"{gid}/0", {"input_ids": [ordinal]})],
            start_weight_version=0,
            end_weight_version=0,
            defer_ready=True,
        )
        ids.append(gid)
    p.buffer.take_for_scoring(ids)
    p.buffer.store.add_fields({f"{g}/0": {TEACHER_FIELD: [0.0]} for g in ids})
    await p.buffer.mark_ready(ids[0], [TEACHER_FIELD])

    async def scored_during_the_save() -> None:
        await trio.sleep(0.1)
        await p.buffer.mark_ready(ids[1], [TEACHER_FIELD])

    assert p.checkpointer is not None
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scored_during_the_save)
            await p.checkpointer.save()
    saved = load_checkpoint(directory)
    assert [g["ordinal"] for g in saved.buffer["groups"]] == saved.ledger["saved"] == [0]
    assert saved.ledger["reissue"] == [1]
    resumed = make(directory / "resumed")
    await resumed.resume_from(saved)
    with trio.fail_after(60):
        result = await resumed.run()
    assert result.trained == {0, 1}
