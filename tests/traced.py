"""Traced pipeline runs the trace and replay tests share: the real `build_pipeline` over the
simulator's fakes under virtual time, the live conformance check beside the trace, and a crash
(cancel the run, as the simulator does) with a resume from the newest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import trio

from groupflow.impl import CheckpointConfig, PipelineConfig, ScoringConfig
from groupflow.impl._pipeline import Pipeline, build_pipeline, load_checkpoint, single_error
from groupflow.impl.errors import PumpFailed
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model.shape import split_shape
from groupflow.sim.verify.conformance import Conformance, bounds_for
from tests.helpers import STEP_OF_FOUR

PROMPTS = 16


def config(policy: str = "flush", **overrides: Any) -> PipelineConfig:
    """Four prompts a step, a checkpoint after every step, a teacher slower than generation;
    `overrides` by the flat names (the shape's sizes among them)."""
    shape = STEP_OF_FOUR
    settings: dict[str, Any] = dict(
        # each run's folder is given by `build`
        checkpoints=CheckpointConfig(".", every_steps=1, policy=policy, write_in_thread=False),
        scoring=ScoringConfig(flush_after_s=2.0),
    )
    shape, rest = split_shape(overrides, shape)
    return PipelineConfig(shape=shape, **{**settings, **rest})


@attrs.define
class TracedRun:
    trace: Path
    checker: Conformance
    pipelines: list[Pipeline] = attrs.field(factory=list)
    crashed: bool = False
    resumed: bool = False
    failed: bool = False


def build(
    tmp: Path,
    run: TracedRun,
    cfg: PipelineConfig,
    *,
    fail_steps: frozenset[int] = frozenset(),
    batch_s: float | None = None,
) -> Pipeline:
    if cfg.checkpoints is not None:
        folder = tmp / f"run-{len(run.pipelines)}"
        cfg = attrs.evolve(cfg, checkpoints=attrs.evolve(cfg.checkpoints, folder=folder))
    pipeline = build_pipeline(
        cfg,
        prompts=list(range(PROMPTS)),
        generator=FakeGenerator(latency=lambda o: 1.0 + o % 3),
        learner=FakeLearner(fail_steps=fail_steps),
        scorer=FakeScorer(fixed=3.0),
        train_fields=["input_ids", "generation_logprobs"],
        trace=run.trace,
    )
    if batch_s is not None:
        assert pipeline.trace is not None
        pipeline.trace.write_in_batches(batch_s)
    run.pipelines.append(pipeline)
    run.checker.attach(pipeline)
    return pipeline


async def _run(pipeline: Pipeline, run: TracedRun) -> None:
    try:
        await pipeline.run()
    except PumpFailed:
        run.failed = True


async def _until_stop(pipeline: Pipeline, run: TracedRun, stop_at: float) -> None:
    """Run `pipeline`; at `stop_at` (virtual seconds from now) the user asks it to stop."""

    async def stop() -> None:
        await trio.sleep(stop_at)
        pipeline.request_stop()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop)
        await _run(pipeline, run)
        nursery.cancel_scope.cancel()


async def _until_crash(pipeline: Pipeline, run: TracedRun, crash_at: float) -> bool:
    """Run `pipeline`; at `crash_at` (virtual seconds from now) the process dies: the checker
    and the trace hear it first, then the run is cancelled."""

    async def die(scope: trio.CancelScope) -> None:
        await trio.sleep(crash_at)
        run.checker.crash()
        assert pipeline.trace is not None
        pipeline.trace.crash()
        scope.cancel()

    with trio.CancelScope() as scope:
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(die, scope)
                await _run(pipeline, run)
                nursery.cancel_scope.cancel()
    return scope.cancelled_caught


async def traced_run(
    tmp: Path,
    *,
    policy: str = "flush",
    crash_at: float | None = None,
    stop_at: float | None = None,
    resume: bool = True,
    fail_steps: frozenset[int] = frozenset(),
    batch_s: float | None = None,
    **overrides: Any,
) -> TracedRun:
    """One run traced to `tmp/trace.jsonl`: crashed at `crash_at` and (with `resume`) started
    again from its newest checkpoint, or from scratch when none was saved yet; or stopped by
    the user at `stop_at` (`Pipeline.request_stop`); with `batch_s`,
    the trace is written in batches (`TraceWriter.write_in_batches`)."""
    cfg = config(policy, **overrides)
    run = TracedRun(tmp / "trace.jsonl", Conformance(bounds_for(cfg, prompts=PROMPTS)))
    with trio.fail_after(10_000):  # virtual seconds: past this the run has hung
        pipeline = build(tmp, run, cfg, fail_steps=fail_steps, batch_s=batch_s)
        if stop_at is not None:
            await _until_stop(pipeline, run, stop_at)
            return run
        if crash_at is None:
            await _run(pipeline, run)
            return run
        run.crashed = await _until_crash(pipeline, run, crash_at)
        if not run.crashed or not resume:
            return run
        first = tmp / "run-0"
        pipeline = build(tmp, run, cfg, fail_steps=fail_steps, batch_s=batch_s)
        if any(first.glob("step-*")):
            await pipeline.resume_from(load_checkpoint(first))
            run.resumed = True
        run.checker.compare()
        await _run(pipeline, run)
    return run


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
