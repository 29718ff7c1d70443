"""Stand-ins for the generator, the teacher and the learner that take virtual time.

They let the real pumps run under `trio.testing.MockClock`; the simulator's latency models
(seeded distributions, faults) build on the same shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl.rollout import GenerateRequest
from groupflow.impl.scorer import ScoreRequest
from groupflow.impl.train import TrainBatch


@attrs.define
class FakeGenerator:
    """Each rollout takes `latency(ordinal)` seconds; the ordinals in `fail` raise instead."""

    latency: Callable[[int], float] = lambda ordinal: 1.0
    fail: frozenset[int] = frozenset()
    running: int = 0
    most_running: int = 0

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await trio.sleep(self.latency(request.ordinal))
            if request.ordinal in self.fail:
                raise RuntimeError(f"generation of prompt {request.ordinal} failed")
            return [
                {"input_ids": [request.ordinal, i], "generation_logprobs": [-1.0]}
                for i in range(request.num_generations)
            ]
        finally:
            self.running -= 1


@attrs.frozen
class Call:
    teacher: str
    group_ids: tuple[str, ...]
    rows: int
    start: float
    end: float


@attrs.define
class FakeScorer:
    """A teacher call costs `fixed + per_row * rows` seconds; `fail(index, request)` makes a
    call raise. Calls to one teacher must never overlap (checked as it runs)."""

    fixed: float = 1.0
    per_row: float = 0.0
    fail: Callable[[int, ScoreRequest], bool] = lambda index, request: False
    calls: list[Call] = attrs.field(factory=list)
    busy: set[str] = attrs.field(factory=set)

    async def score(self, request: ScoreRequest) -> None:
        if request.teacher in self.busy:
            raise AssertionError(f"two calls at once on teacher {request.teacher!r}")
        self.busy.add(request.teacher)
        start = trio.current_time()
        index = len(self.calls)
        try:
            await trio.sleep(self.fixed + self.per_row * len(request.sample_ids))
            if self.fail(index, request):
                raise OSError(f"teacher {request.teacher!r} call {index} failed")
            request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})
        finally:
            self.busy.discard(request.teacher)
            ids = tuple(g.group_id for g in request.groups)
            self.calls.append(
                Call(request.teacher, ids, len(request.sample_ids), start, trio.current_time())
            )


@attrs.define
class FakeLearner:
    """Each step takes `latency` seconds and records what it trained on."""

    latency: float = 1.0
    batches: list[TrainBatch] = attrs.field(factory=list)

    steps: int = 0
    """Steps in the weights: restored with a checkpoint, like a real model's."""

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        await trio.sleep(self.latency)
        self.batches.append(batch)
        self.steps += 1
        return {"groups": float(len(batch.groups))}

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps = state["steps"]
