"""Parts written for asyncio, as an asyncio trainer writes them, for the tests of
`groupflow.impl.aio`: they await asyncio only (`asyncio.sleep`, `asyncio.Event`), count what
they were asked, and record what asyncio library they saw themselves run under."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import sniffio

from groupflow.impl import CheckpointConfig, PipelineConfig, ScoringConfig, aio, build_pipeline
from groupflow.impl._pipeline import Pipeline, StepRecord
from groupflow.impl.contract import GenerateRequest, Scorer, ScoreRequest, TokenRow, TrainBatch
from tests.helpers import STEP_OF_FOUR

FIELDS = frozenset({"input_ids", "prompt_length", "generation_logprobs"})


@attrs.define
class AsyncioGenerator:
    """A rollout takes `latency_s` of asyncio time; `hang` ones wait until cancelled, and with
    `ignore_cancel` past it (for `stubborn_s`)."""

    latency_s: float = 0.001
    hang: Callable[[int], bool] = lambda ordinal: False
    ignore_cancel: bool = False
    stubborn_s: float = 30.0
    fields: frozenset[str] = FIELDS
    started: int = 0
    cancelled: int = 0
    libraries: set[str] = attrs.field(factory=set)
    synced: list[int] = attrs.field(factory=list)

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        self.started += 1
        self.libraries.add(sniffio.current_async_library())
        asyncio.get_running_loop()  # this is asyncio code: it has asyncio's loop
        try:
            if self.hang(request.ordinal):
                await asyncio.Event().wait()
            await asyncio.sleep(self.latency_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            if not self.ignore_cancel:
                raise
            await asyncio.sleep(self.stubborn_s)
        return self.rows(request)

    @staticmethod
    def rows(request: GenerateRequest) -> list[dict[str, Any]]:
        return [
            {"input_ids": [request.ordinal, i], "prompt_length": 1, "generation_logprobs": [-1.0]}
            for i in range(request.num_generations)
        ]

    async def sync_weights(self, version: int) -> None:
        await asyncio.sleep(0)
        self.synced.append(version)


async def _a_call(latency_s: float, *, hang: bool, ignore_cancel: bool) -> None:
    """A call's wait on the loop: `latency_s`, or until cancelled when it `hang`s; with
    `ignore_cancel`, 30 s more past a cancel."""
    try:
        if hang:
            await asyncio.Event().wait()
        await asyncio.sleep(latency_s)
    except asyncio.CancelledError:
        if not ignore_cancel:
            raise
        await asyncio.sleep(30)


@attrs.define
class AsyncioScorer:
    """A teacher call takes `latency_s`; `ignore_cancel` keeps it going past a cancel."""

    latency_s: float = 0.002
    hang: bool = False
    ignore_cancel: bool = False
    teachers: frozenset[str] = frozenset({"teacher"})
    calls: int = 0

    async def score(self, request: ScoreRequest) -> None:
        self.calls += 1
        await _a_call(self.latency_s, hang=self.hang, ignore_cancel=self.ignore_cancel)
        request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})


@attrs.define
class AsyncioTeacher:
    """A `Teacher` written for asyncio: `score_shards` takes `latency_s` and answers `value`
    for every response token; `hang` ones wait until cancelled, and with `ignore_cancel` past
    it."""

    dp_size: int = 4
    latency_s: float = 0.002
    value: float = -0.25
    hang: bool = False
    ignore_cancel: bool = False
    fail: bool = False
    shards: list[list[int]] = attrs.field(factory=list)
    """The rows of each shard, per call."""
    padded: list[int] = attrs.field(factory=list)
    """The padding rows (copies of the last real row) of each call."""

    async def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[list[float]]]:
        self.shards.append([len(shard) for shard in shards])
        rows = [row for shard in shards for row in shard]
        self.padded.append(rows.count(rows[-1]) - 1)
        await _a_call(self.latency_s, hang=self.hang, ignore_cancel=self.ignore_cancel)
        if self.fail:
            raise TeacherDown("teacher rank 0 died")
        return [[[self.value] * row.response_length for row in shard] for shard in shards]


class TeacherDown(RuntimeError):
    """What `AsyncioTeacher(fail=True)` raises."""


class LearnerFailed(RuntimeError):
    """What `AsyncioLearner` raises at a step of `fail_at`."""


@attrs.define
class AsyncioLearner:
    """A step takes `latency_s`; its state (`steps`, the ordinals trained) is saved and
    restored by `async def` methods, as a learner whose weights live in actors has them."""

    latency_s: float = 0.001
    fail_at: int | None = None
    steps: int = 0
    trained: list[int] = attrs.field(factory=list)

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        await asyncio.sleep(self.latency_s)
        if batch.step == self.fail_at:
            raise LearnerFailed(f"the learner failed at step {batch.step}")
        self.steps += 1
        self.trained.extend(g.ordinal for g in batch.groups if g.ordinal is not None)
        return {"groups": float(len(batch.groups))}

    async def state_dict(self) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"steps": self.steps, "trained": list(self.trained)}

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        await asyncio.sleep(0)
        self.steps = state["steps"]
        self.trained = list(state["trained"])


@attrs.define
class Parts:
    generator: AsyncioGenerator = attrs.field(factory=AsyncioGenerator)
    scorer: AsyncioScorer = attrs.field(factory=AsyncioScorer)
    learner: AsyncioLearner = attrs.field(factory=AsyncioLearner)


def asyncio_pipeline(
    parts: Parts,
    *,
    folder: Path | None = None,
    prompts: int = 24,
    every_steps: int = 2,
    shutdown_timeout_s: float = 5.0,
    call_timeout_s: float = 30.0,
    on_step: Callable[[StepRecord], None] | None = None,
    declare: Callable[[Any], Any] = aio.part,
    scorer: Scorer | None = None,
) -> Pipeline:
    """A pipeline over `parts`, each declared with `declare` (`aio.part`), with checkpoints in
    `folder` when given; `scorer` (as it is) instead of `parts.scorer`."""
    config = PipelineConfig(
        shape=STEP_OF_FOUR,
        shutdown_timeout_s=shutdown_timeout_s,
        scoring=ScoringConfig(flush_after_s=0.01, call_timeout_s=call_timeout_s),
        checkpoints=None
        if folder is None
        else CheckpointConfig(folder=folder, every_steps=every_steps),
    )
    return build_pipeline(
        config,
        prompts=list(range(prompts)),
        generator=declare(parts.generator),
        learner=declare(parts.learner),
        scorer=declare(parts.scorer) if scorer is None else scorer,
        on_step=on_step,
    )
