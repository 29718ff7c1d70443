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
from groupflow.impl.pipeline import GenerateRequest, Pipeline, ScoreRequest, StepRecord, TrainBatch

FIELDS = frozenset({"input_ids", "generation_logprobs"})


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
        return [
            {"input_ids": [request.ordinal, i], "generation_logprobs": [-1.0]}
            for i in range(request.num_generations)
        ]

    async def sync_weights(self, version: int) -> None:
        await asyncio.sleep(0)
        self.synced.append(version)


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
        try:
            if self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(self.latency_s)
        except asyncio.CancelledError:
            if not self.ignore_cancel:
                raise
            await asyncio.sleep(30)
        request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})


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
) -> Pipeline:
    """A pipeline over `parts`, each declared with `declare` (`aio.part`), with checkpoints in
    `folder` when given."""
    config = PipelineConfig(
        prompts_per_step=4,
        num_generations_per_prompt=2,
        max_inflight_prompts=4,
        max_buffered_groups=8,
        shutdown_timeout_s=shutdown_timeout_s,
        scoring=ScoringConfig(
            max_batch_groups=3, flush_after_s=0.01, call_timeout_s=call_timeout_s
        ),
        checkpoints=None
        if folder is None
        else CheckpointConfig(folder=folder, every_steps=every_steps),
    )
    return build_pipeline(
        config,
        prompts=list(range(prompts)),
        generator=declare(parts.generator),
        learner=declare(parts.learner),
        scorer=declare(parts.scorer),
        on_step=on_step,
    )
