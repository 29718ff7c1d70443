"""Memory per train step over a long simulated run: what the pipeline keeps as steps go by.

Runs the real pipeline under trio's virtual clock (fake generator, teacher and learner, 2
prompts x 2 generations per step, a failed rollout every 50 prompts) for `--steps` steps, and
measures Python's allocated memory (tracemalloc) when training is half way and at the end, with
the pipeline still alive. Prints bytes per step between the two, with the train history kept
whole (`keep_steps=None`) and as by default, side by side.
Run: `python bench/memory_per_step.py [--steps N]`.
"""

from __future__ import annotations

import argparse
import gc
import logging
import tracemalloc
from collections.abc import Mapping

import trio
import trio.testing

from groupflow.impl import PipelineConfig, ScoreRequest, ScoringConfig, TrainBatch, build_pipeline
from groupflow.impl._pipeline import Pipeline
from groupflow.impl.testing import FakeGenerator
from groupflow.model.shape import Shape


class _QuietGenerator(FakeGenerator):
    """The fake generator, without its record of weight syncs (the fakes' records of what
    they did would be the only growth: these stand-ins keep none)."""

    async def sync_weights(self, version: int) -> None:
        pass


class _Learner:
    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        await trio.sleep(0.1)
        return {"groups": float(len(batch.groups))}

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        pass


class _Scorer:
    async def score(self, request: ScoreRequest) -> None:
        await trio.sleep(0.5)
        request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})


def _build(steps: int, keep_steps: int | None) -> Pipeline:
    config = PipelineConfig(
        shape=Shape(
            prompts_per_step=2,
            num_generations_per_prompt=2,
            max_inflight_prompts=4,
            max_buffered_groups=8,
            max_batch_groups=2,
        ),
        scoring=ScoringConfig(flush_after_s=1.0),
    )
    return build_pipeline(
        config,
        prompts=range(steps * 2),
        generator=_QuietGenerator(latency=lambda o: 1.0, fails=lambda o: o % 50 == 7),
        learner=_Learner(),
        scorer=_Scorer(),
        train_fields=["input_ids"],
        keep_steps=keep_steps,
        data_digest="bench",
    )


async def _measure(steps: int, keep_steps: int | None) -> tuple[int, int]:
    pipeline = _build(steps, keep_steps)
    early = steps // 2  # bounded records (recent group ids, the last steps) are full by then
    sizes: list[int] = []

    async def sample() -> None:
        for target in (early, steps):
            while pipeline.position.step < target:
                await pipeline.buffer.changed.wait()
            gc.collect()
            sizes.append(tracemalloc.get_traced_memory()[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        await pipeline.run()
    return sizes[0], sizes[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the failed rollouts, one line each
    if args.steps < 10:
        parser.error(f"--steps must be >= 10, got {args.steps}")
    print(f"{'train history':<22} {'MB at half':>10} {'MB at end':>10} {'bytes/step':>11}")
    for label, keep in (("kept whole", None), ("default (last 1000)", 1000)):
        tracemalloc.start()
        early, end = trio.run(
            _measure, args.steps, keep, clock=trio.testing.MockClock(autojump_threshold=0)
        )
        tracemalloc.stop()
        per_step = (end - early) / (args.steps - args.steps // 2)
        print(f"{label:<22} {early / 1e6:>10.2f} {end / 1e6:>10.2f} {per_step:>11.1f}")


if __name__ == "__main__":
    main()
