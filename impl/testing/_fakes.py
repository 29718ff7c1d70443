"""Stand-ins for the generator, the teacher and the learner that take virtual time.

They let the real pumps run under `trio.testing.MockClock`. Each can log what it did to a shared
`Trace` (the simulator hashes it and draws the timeline from it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio
import trio.lowlevel
import trio.testing

from groupflow.impl.contract import GenerateRequest, ScoreRequest, TrainBatch


@attrs.frozen
class Span:
    """Something that took time: a rollout, a teacher call, a train step."""

    kind: str
    """"generate", "score" or "train"."""
    lane: str
    """Who did it: the teacher's name for a call, "train" for a step, the ordinal for a rollout."""
    start: float
    end: float
    detail: str = ""
    ok: bool = True


@attrs.define
class Trace:
    spans: list[Span] = attrs.field(factory=list)

    def add(self, span: Span) -> None:
        self.spans.append(span)


@attrs.define
class FakeGenerator:
    """Each rollout takes `latency(ordinal)` seconds; the ordinals in `fail` (or for which
    `fails(ordinal)` is true) raise instead."""

    latency: Callable[[int], float] = lambda ordinal: 1.0
    fail: frozenset[int] = frozenset()
    fails: Callable[[int], bool] = lambda ordinal: False
    trace: Trace | None = None
    running: int = 0
    most_running: int = 0
    busy_seconds: float = 0.0
    """Rollout-seconds spent generating: over the elapsed time, the concurrency achieved."""
    synced: list[int] = attrs.field(factory=list)
    """The weight versions `sync_weights` was told of, in order."""
    fields: frozenset[str] = frozenset({"input_ids", "generation_logprobs"})

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        start = trio.current_time()
        ok = False
        try:
            await trio.sleep(self.latency(request.ordinal))
            if request.ordinal in self.fail or self.fails(request.ordinal):
                raise RuntimeError(f"generation of prompt {request.ordinal} failed")
            ok = True
            return [
                {"input_ids": [request.ordinal, i], "generation_logprobs": [-1.0]}
                for i in range(request.num_generations)
            ]
        finally:
            self.running -= 1
            end = trio.current_time()
            self.busy_seconds += end - start
            if self.trace is not None:
                self.trace.add(Span("generate", str(request.ordinal), start, end, ok=ok))

    async def sync_weights(self, version: int) -> None:
        self.synced.append(version)


@attrs.frozen
class Call:
    teacher: str
    group_ids: tuple[str, ...]
    rows: int
    start: float
    end: float
    ok: bool = True


def _linear_cost(fixed: float, per_row: float) -> Callable[[ScoreRequest, int], float]:
    def cost(request: ScoreRequest, index: int) -> float:
        return fixed + per_row * len(request.sample_ids)

    return cost


@attrs.define
class FakeScorer:
    """A teacher call costs `cost(request, call_index)` seconds (by default `fixed + per_row *
    rows`); `fail(index, request)` makes a call raise, `error(index, request)` (by default an
    `OSError`, a transient failure) what it raises. Calls to one teacher must never overlap
    (checked as it runs)."""

    fixed: float = 1.0
    per_row: float = 0.0
    fail: Callable[[int, ScoreRequest], bool] = lambda index, request: False
    error: Callable[[int, ScoreRequest], Exception] | None = None
    cost: Callable[[ScoreRequest, int], float] | None = None
    trace: Trace | None = None
    calls: list[Call] = attrs.field(factory=list)
    busy: set[str] = attrs.field(factory=set)
    started: int = 0
    """Calls started: a call's index is its place in this count (calls to two teachers overlap,
    so they finish, and are listed in `calls`, in another order)."""

    async def score(self, request: ScoreRequest) -> None:
        if request.teacher in self.busy:
            raise AssertionError(f"two calls at once on teacher {request.teacher!r}")
        self.busy.add(request.teacher)
        start = trio.current_time()
        index = self.started
        self.started += 1
        cost = self.cost or _linear_cost(self.fixed, self.per_row)
        ok = False
        try:
            await trio.sleep(cost(request, index))
            if self.fail(index, request):
                if self.error is not None:
                    raise self.error(index, request)
                raise OSError(f"teacher {request.teacher!r} call {index} failed")
            request.store.add_fields({sid: {request.field: [-0.5]} for sid in request.sample_ids})
            ok = True
        finally:
            self.busy.discard(request.teacher)
            end = trio.current_time()
            ids = tuple(g.group_id for g in request.groups)
            self.calls.append(Call(request.teacher, ids, len(request.sample_ids), start, end, ok))
            if self.trace is not None:
                self.trace.add(Span("score", request.teacher, start, end, f"{len(ids)} groups", ok))


@attrs.define
class FakeLearner:
    """Each step takes `latency` seconds and records what it trained on. A `blocking` learner
    keeps the event loop quiet for its step, as a learner that computes in the loop's thread
    does, or one in a worker thread whose loop has nothing else to do: the tasks ready when the
    step starts run first (until every task waits), then the virtual clock jumps over the step
    and no other task runs meanwhile (work in worker threads, the simulated rollouts' included,
    goes on and is noticed after)."""

    latency: float = 1.0
    trace: Trace | None = None
    fail_steps: frozenset[int] = frozenset()
    blocking: bool = False
    """Train steps that raise after taking their time."""
    batches: list[TrainBatch] = attrs.field(factory=list)
    steps: int = 0
    """Steps in the weights: restored with a checkpoint, like a real model's."""

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        start = trio.current_time()
        if self.blocking:
            clock = trio.lowlevel.current_clock()
            if not isinstance(clock, trio.testing.MockClock):
                raise TypeError("a blocking FakeLearner needs trio's MockClock (virtual time)")
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(self.latency)
            await trio.lowlevel.checkpoint()
        else:
            await trio.sleep(self.latency)
        if batch.step in self.fail_steps:
            raise RuntimeError(f"train step {batch.step} failed")
        self.batches.append(batch)
        self.steps += 1
        if self.trace is not None:
            self.trace.add(Span("train", "train", start, trio.current_time(), f"step {batch.step}"))
        return {"groups": float(len(batch.groups))}

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps = state["steps"]
