"""An asyncio controller over groupflow, shaped like NeMo RL's SingleController: an asyncio
program with a watchdog pump of its own, rollouts on Ray actors whose `ObjectRef`s it awaits,
teacher scoring on Ray actors (a teacher's data-parallel ranks) through groupflow's stage, a checkpoint, a crash (the run's
task cancelled) and a resume.

Run it: `python examples/asyncio_controller.py [RUN_DIR]` (needs the `ray` extra; a temporary
folder by default). It prints a line per phase and checks, at the end, that every prompt was
trained exactly once across the crash. CI runs it (tests/meta/test_examples.py) in its Ray step,
and docs/asyncio.md quotes it.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from groupflow.impl import keep_ray_local

keep_ray_local()  # before Ray's import: a local Ray stays on 127.0.0.1

import ray

# --8<-- [start:imports]
from groupflow.impl import (
    CheckpointConfig,
    GenerateRequest,
    Pipeline,
    PipelineConfig,
    RunResult,
    ScoringConfig,
    Shape,
    StepRecord,
    TrainBatch,
    aio,
    build_pipeline,
    load_checkpoint,
    ray_session,
)
from groupflow.impl.contract import TEACHER_FIELD, TokenRow

# --8<-- [end:imports]

PROMPTS = 48
PROMPT_LENGTH = 2
STALL_S = 60.0
CALL_S = 60.0


@ray.remote
class RolloutWorker:
    """A rollout engine: samples a prompt's responses with the weights it was last given."""

    def __init__(self) -> None:
        self.version = 0

    def generate(self, ordinal: int, n: int) -> list[dict[str, Any]]:
        return [
            {
                "input_ids": [ordinal % 7, ordinal % 5, ordinal, i, self.version],
                "prompt_length": PROMPT_LENGTH,
                "generation_logprobs": [-1.0, -1.0, -1.0],
            }
            for i in range(n)
        ]

    def load(self, version: int) -> int:
        self.version = version
        return version


@ray.remote
class TeacherRank:
    """One data-parallel rank of a teacher: the log-probability of each response token."""

    def score(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[list[float]]:
        return [[-0.1 * (t % 10) for t in ids[prompt:]] for ids, prompt in rows]


# --8<-- [start:parts]
class RayGenerator:
    """Rollouts on Ray actors, awaited as asyncio awaits an ObjectRef."""

    fields = frozenset({"input_ids", "prompt_length", "generation_logprobs"})

    def __init__(self, workers: Sequence[Any]) -> None:
        self.workers = workers

    async def generate(self, request: GenerateRequest) -> list[dict[str, Any]]:
        worker = self.workers[request.ordinal % len(self.workers)]
        ref = worker.generate.remote(request.ordinal, request.num_generations)
        async with asyncio.timeout(CALL_S):  # every call to an engine has a total bound
            rows: list[dict[str, Any]] = await ref
        return rows

    async def sync_weights(self, version: int) -> None:
        refs = [w.load.remote(version) for w in self.workers]
        async with asyncio.timeout(CALL_S):
            await asyncio.gather(*refs)


class RayTeacher:
    """A teacher whose data-parallel ranks are Ray actors: shard i goes to rank i. groupflow
    pads the batch to the ranks, shards it, and checks every value that comes back."""

    def __init__(self, ranks: Sequence[Any]) -> None:
        self.ranks = ranks
        self.dp_size = len(ranks)

    async def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[list[float]]]:
        refs = [
            rank.score.remote([(row.input_ids, row.prompt_length) for row in shard])
            for rank, shard in zip(self.ranks, shards, strict=True)
        ]
        async with asyncio.timeout(CALL_S):
            return list(await asyncio.gather(*refs))


class Learner:
    """Its state lives where an asyncio trainer keeps it (here, in the object)."""

    def __init__(self) -> None:
        self.trained: list[int] = []

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        await asyncio.sleep(0.01)  # an optimizer step on the trainer's workers
        self.trained.extend(g.ordinal for g in batch.groups if g.ordinal is not None)
        teacher = [v for row in batch.rows.values() for v in row[TEACHER_FIELD]]
        return {"groups": float(len(batch.groups)), "teacher_logprob": sum(teacher) / len(teacher)}

    async def state_dict(self) -> dict[str, Any]:
        return {"trained": list(self.trained)}

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trained = list(state["trained"])


# --8<-- [end:parts]


class Controller:
    """The asyncio side: it owns the loop, the Ray actors and a watchdog of its own, and runs
    groupflow's pipeline beside them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        # mypy cannot see the `.remote` that Ray's decorator adds
        self.workers = [RolloutWorker.remote() for _ in range(2)]  # type: ignore[attr-defined]
        self.teacher_ranks = [TeacherRank.remote() for _ in range(2)]  # type: ignore[attr-defined]
        self.steps: asyncio.Queue[StepRecord] = asyncio.Queue()

    def build(self, learner: Learner) -> Pipeline:
        config = PipelineConfig(
            shape=Shape(
                prompts_per_step=4,
                num_generations_per_prompt=2,
                max_inflight_prompts=4,
                max_buffered_groups=8,
                max_batch_groups=4,
            ),
            scoring=ScoringConfig(flush_after_s=0.05, call_timeout_s=60),
            checkpoints=CheckpointConfig(folder=self.folder, every_steps=2),
        )
        # --8<-- [start:wiring]
        return build_pipeline(
            config,
            prompts=list(range(PROMPTS)),
            generator=aio.part(RayGenerator(self.workers)),
            scorer=aio.teacher_scorer({"teacher": RayTeacher(self.teacher_ranks)}),
            learner=aio.part(learner),
            train_fields=["input_ids", "generation_logprobs"],  # + the teacher's field
            on_step=self.steps.put_nowait,  # on the loop's thread: hand over, never block
        )
        # --8<-- [end:wiring]

    async def watchdog(self, pipeline: Pipeline) -> None:
        """The controller's own pump beside the run: it reads what groupflow reports, and asks
        the run to stop (after the step in progress, with a checkpoint) when steps stall."""
        while True:
            try:
                async with asyncio.timeout(STALL_S):
                    record = await self.steps.get()
            except TimeoutError:
                print(f"  no step for {STALL_S} s: asking the run to stop")
                pipeline.request_stop()
                return
            if record.step % 4 == 0:
                print(f"  step {record.step}: {record.groups} groups, {pipeline.status.phase.name}")

    async def run(
        self, learner: Learner, *, crash_after_saves: int | None = None
    ) -> RunResult | None:
        pipeline = self.build(learner)
        saves = pipeline.checkpointer.saved if pipeline.checkpointer else []
        # --8<-- [start:run]
        checkpoint = load_checkpoint(self.folder) if any(self.folder.glob("step-*")) else None
        watchdog = asyncio.create_task(self.watchdog(pipeline))
        run = asyncio.create_task(aio.run(pipeline, resume=checkpoint))
        try:
            if crash_after_saves is None:
                return await run
            while len(saves) < crash_after_saves:
                await asyncio.sleep(0.01)
            run.cancel()  # the crash: groupflow drains, then CancelledError
            await asyncio.gather(run, return_exceptions=True)
            return None
        finally:
            watchdog.cancel()
        # --8<-- [end:run]


async def main(folder: Path) -> None:
    controller = Controller(folder)
    print("run 1: until the second checkpoint, then a crash")
    await controller.run(Learner(), crash_after_saves=2)
    print("run 2: resumed from the newest checkpoint")
    learner = Learner()
    result = await controller.run(learner)
    assert result is not None
    trained = sorted(learner.trained)
    assert trained == list(range(PROMPTS)), f"trained {trained}"
    print(
        f"every one of {PROMPTS} prompts trained exactly once; this run's steps: {len(result.steps)}"
    )


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "run"
    where.mkdir(parents=True, exist_ok=True)
    with ray_session():
        asyncio.run(main(where / "checkpoints"))
