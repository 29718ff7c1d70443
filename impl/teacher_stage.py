"""The teacher scoring stage: batches committed groups per physical teacher, scores each batch in
one call, and marks the groups ready.

`submit` is synchronous and never waits: the rollout calls it right after its commit, when its
generation permit is already free, so teacher latency never throttles generation. Each physical
teacher has one worker task and so at most one call in flight; different teachers run
concurrently. A batch is sent when full (`max_batch_groups`), when its oldest group has waited
`flush_after_s`, at once when upstream has ended (drain), and, with demand dispatch, at once when
training waits on a step whose missing groups are all queued here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import attrs
import trio

from groupflow.impl._errors import single_error
from groupflow.impl.buffer import ReplayBuffer
from groupflow.impl.pipeline_config import Dispatch, ScoringConfig
from groupflow.impl.pulse import Pulse
from groupflow.impl.pump import PumpKind
from groupflow.impl.scorer import Scorer, ScoreRequest
from groupflow.model import Actor, GroupState, GroupView
from groupflow.model.scheduler import FailurePolicy

TEACHER_FIELD = "teacher_reference_logprobs"


class TeacherCallFailed(RuntimeError):
    """A teacher call failed and the failure policy says to fail the run, or too many calls in
    a row failed (`max_consecutive_failed_batches`)."""


@attrs.define
class StageMetrics:
    """What the stage did since the metrics were last drained (once per train step)."""

    calls: int = 0
    groups: int = 0
    rows: int = 0
    failures: int = 0
    retries: int = 0
    discards: int = 0
    queue_wait_s: float = 0.0
    """Summed over groups: from submit to the start of their call."""
    call_s: float = 0.0
    """Summed over calls: time inside the scorer."""
    reasons: dict[str, int] = attrs.field(factory=dict)
    """Calls by what sent them: full, timer, drain, demand, retry."""

    @property
    def rows_per_call(self) -> float:
        return self.rows / self.calls if self.calls else 0.0

    def record_call(self, views: Sequence[GroupView], waited_s: float, reason: str) -> None:
        """A call started: its groups, their rows, how long they waited, what sent it."""
        self.calls += 1
        self.groups += len(views)
        self.rows += sum(len(v.sample_ids) for v in views)
        self.queue_wait_s += waited_s
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


@attrs.frozen
class _Queued:
    group_id: str
    target_step: int
    arrived: float
    retry: bool = False


OnDiscard = Callable[[GroupView, str], None]
"""Told of every group the stage discards, with why ("failed" or "shutdown")."""


class TeacherStage:
    """A STAGE pump: see the module docstring."""

    kind = PumpKind.STAGE

    def __init__(
        self,
        buffer: ReplayBuffer,
        scorer: Scorer,
        config: ScoringConfig,
        *,
        route: Callable[[GroupView], str] = lambda group: "teacher",
        field: str = TEACHER_FIELD,
        on_discard: OnDiscard | None = None,
        name: str = "teacher",
    ) -> None:
        self.name = name
        self.buffer = buffer
        self.scorer = scorer
        self.config = config
        self.route = route
        self.field = field
        self.on_discard = on_discard
        self._queues: dict[str, deque[_Queued]] = {}
        self._in_flight: dict[str, tuple[GroupView, ...]] = {}
        self._nursery: trio.Nursery | None = None
        self._changed = Pulse()
        self._draining = False
        self._demanded_step: int | None = None
        self._flush_ids: set[str] = set()
        self._failed_in_a_row = 0
        self._metrics = StageMetrics()
        self.scored = 0
        """Groups scored since the start (for the stall watchdog)."""

    # -- what other pumps call (all synchronous) -------------------------------------------

    def submit(self, group_id: str) -> None:
        """Queue a WRITTEN group for its teacher. Never waits."""
        group = self.buffer.group(group_id)
        if group.state is not GroupState.WRITTEN:
            raise ValueError(
                f"submit({group_id!r}): only WRITTEN groups can be scored, it is {group.state}"
            )
        if self._draining:
            raise RuntimeError(f"submit({group_id!r}) after upstream ended: the stage is draining")
        teacher = self.route(group)
        self._enqueue(teacher, _Queued(group_id, group.target_step, trio.current_time()))

    def upstream_ended(self) -> None:
        """Nothing more will be submitted: send what is queued, then return from `run`."""
        self._draining = True
        self._changed.notify()

    def demand(self, step: int | None) -> None:
        """Training waits on `step`, all of whose prompts have been admitted (None: it does not
        wait). With demand dispatch, queued groups of that step go at once once none of the
        step's rollouts is still running."""
        self._demanded_step = step
        self._changed.notify()

    def flush(self, group_ids: set[str]) -> None:
        """A checkpoint waits on these groups: send them now, full batch or not."""
        self._flush_ids |= group_ids
        self._changed.notify()

    def drain_metrics(self) -> StageMetrics:
        metrics, self._metrics = self._metrics, StageMetrics()
        return metrics

    @property
    def backlog(self) -> int:
        """Groups queued or in a call."""
        return sum(map(len, self._queues.values())) + sum(map(len, self._in_flight.values()))

    # -- the pump ------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            with single_error():
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    for teacher in self._queues:
                        nursery.start_soon(self._worker, teacher, name=f"teacher {teacher}")
                    while not (self._draining and self.backlog == 0):
                        await self._wait_for_change()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self._discard_leftovers()

    # -- internals -----------------------------------------------------------------------

    async def _wait_for_change(self, deadline: float = math.inf) -> None:
        with trio.move_on_at(deadline):
            await self._changed.wait()

    def _enqueue(self, teacher: str, item: _Queued, *, front: bool = False) -> None:
        queue = self._queues.get(teacher)
        if queue is None:
            queue = self._queues[teacher] = deque()
            if self._nursery is not None:
                self._nursery.start_soon(self._worker, teacher, name=f"teacher {teacher}")
        if front:
            queue.appendleft(item)
        else:
            queue.append(item)
        self._changed.notify()

    async def _worker(self, teacher: str) -> None:
        queue = self._queues[teacher]
        while True:
            picked = self._next_batch(queue)
            if picked is not None:
                await self._call(teacher, *picked)
                self._changed.notify()
                continue
            if self._draining and not queue:
                return
            deadline = queue[0].arrived + self.config.flush_after_s if queue else math.inf
            await self._wait_for_change(deadline)

    def _next_batch(self, queue: deque[_Queued]) -> tuple[list[_Queued], str] | None:
        if not queue:
            return None
        if queue[0].retry:
            return [queue.popleft()], "retry"
        size = self.config.max_batch_groups
        if len(queue) >= size:
            reason = "full"
        elif self._draining:
            reason = "drain"
        elif self._flush_ids and any(item.group_id in self._flush_ids for item in queue):
            reason = "checkpoint flush"
        elif trio.current_time() >= queue[0].arrived + self.config.flush_after_s:
            reason = "timer"
        elif self._demanded(queue):
            reason = "demand"
        else:
            return None
        batch: list[_Queued] = []
        while queue and len(batch) < size and not queue[0].retry:
            batch.append(queue.popleft())
        return batch, reason

    def _demanded(self, queue: deque[_Queued]) -> bool:
        step = self._demanded_step
        if self.config.dispatch is not Dispatch.DEMAND or step is None:
            return False
        if not any(item.target_step == step for item in queue):
            return False
        return not any(g.target_step == step for g in self.buffer.groups(GroupState.RESERVED))

    async def _call(self, teacher: str, batch: list[_Queued], reason: str) -> None:
        views = self.buffer.take_for_scoring(item.group_id for item in batch)
        self._in_flight[teacher] = views
        self._flush_ids.difference_update(item.group_id for item in batch)
        started = trio.current_time()
        metrics = self._metrics
        metrics.record_call(views, sum(started - item.arrived for item in batch), reason)
        request = ScoreRequest(teacher, views, self.buffer.store, self.field)
        try:
            await self.scorer.score(request)
        except Exception as exc:
            metrics.call_s += trio.current_time() - started
            await self._failed(teacher, views, exc)
            return
        metrics.call_s += trio.current_time() - started
        del self._in_flight[teacher]
        self._failed_in_a_row = 0
        self.scored += len(views)
        for view in views:
            self.buffer.mark_ready(view.group_id, [self.field])

    async def _failed(self, teacher: str, views: tuple[GroupView, ...], error: Exception) -> None:
        """Apply the failure policy to the groups of a failed call (still SCORING)."""
        self._metrics.failures += 1
        self._failed_in_a_row += 1
        policy = self.config.failure_policy
        ids = [v.group_id for v in views]
        if policy is FailurePolicy.FAIL:
            raise TeacherCallFailed(
                f"teacher {teacher!r} failed scoring groups {ids} and failure_policy='fail'"
            ) from error
        if self._failed_in_a_row > self.config.max_consecutive_failed_batches:
            raise TeacherCallFailed(
                f"teacher {teacher!r}: {self._failed_in_a_row} calls in a row failed "
                f"(max_consecutive_failed_batches={self.config.max_consecutive_failed_batches}); "
                f"last error: {error!r}"
            ) from error
        with trio.CancelScope(shield=True):  # each group is retried or dropped, all of them
            for view in reversed(views):
                again = policy is FailurePolicy.RETRY and self.buffer.retries_of(view.group_id) == 0
                if again:
                    self.buffer.retry(view.group_id)
                    self._metrics.retries += 1
                    self._enqueue(
                        teacher,
                        _Queued(view.group_id, view.target_step, trio.current_time(), True),
                        front=True,
                    )
                else:
                    await self._discard([view], "failed")
        del self._in_flight[teacher]

    async def _discard(self, views: Iterable[GroupView], reason: str) -> None:
        actor = Actor.STAGE if reason == "failed" else Actor.SUPERVISOR
        for view in views:
            if self.on_discard is not None:  # first: the discard's notification wakes others
                self.on_discard(view, reason)
            await self.buffer.discard(view.group_id, actor=actor)
            self._metrics.discards += 1

    async def _discard_leftovers(self) -> None:
        """After a cancelled or failed run: every group still queued or in a call is dropped
        (its call, if any, has returned: a threaded scorer is never abandoned)."""
        leftovers = [v for views in self._in_flight.values() for v in views]
        for queue in self._queues.values():
            leftovers += [self.buffer.group(item.group_id) for item in queue]
            queue.clear()
        self._in_flight.clear()
        await self._discard(leftovers, "shutdown")
