"""The inline-enricher baseline (what upstream ships), kept small and only for comparison.

The rollout awaits scoring of its own group right after commit, under one lock per physical
teacher, while still holding its generation permit: every call carries one group, and teacher
latency throttles generation. Everything else (buffer, rollout, train, supervisor) is shared
with the pump design, so the simulator and the checker compare the two on the same work.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from groupflow.impl.buffer import ReplayBuffer
from groupflow.impl.pipeline_config import ScoringConfig
from groupflow.impl.scorer import Scorer, ScoreRequest
from groupflow.impl.teacher_stage import TEACHER_FIELD, OnDiscard, StageMetrics
from groupflow.model import Actor, GroupState, GroupView
from groupflow.model.scheduler import FailurePolicy


class InlineScoring:
    """Scores one group per call under a per-teacher lock; retries alone once, by policy."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        scorer: Scorer,
        config: ScoringConfig,
        *,
        route: Callable[[GroupView], str] = lambda group: "teacher",
        field: str = TEACHER_FIELD,
        on_discard: OnDiscard | None = None,
    ) -> None:
        self.buffer = buffer
        self.scorer = scorer
        self.config = config
        self.route = route
        self.field = field
        self.on_discard = on_discard
        self._locks: dict[str, trio.Lock] = {}
        self._metrics = StageMetrics()

    def drain_metrics(self) -> StageMetrics:
        metrics, self._metrics = self._metrics, StageMetrics()
        return metrics

    async def score(self, group_id: str) -> None:
        """Score a WRITTEN group now; it ends READY, or DISCARDED under the failure policy.

        If the caller is cancelled or the run fails, the group is dropped once its call returned.
        """
        group = self.buffer.group(group_id)
        teacher = self.route(group)
        lock = self._locks.setdefault(teacher, trio.Lock())
        try:
            await self._score_under(lock, group, teacher)
        except BaseException:
            # cancelled, or failing the run (policy `fail`): the prompt is issued again on resume
            if self.buffer.state_of(group_id) not in (GroupState.WRITTEN, GroupState.SCORING):
                raise
            if self.on_discard is not None:  # first: the discard notifies others
                self.on_discard(group, "shutdown")
            with trio.CancelScope(shield=True):
                await self.buffer.discard(group_id, actor=Actor.SUPERVISOR)
            raise

    async def _score_under(self, lock: trio.Lock, group: GroupView, teacher: str) -> None:
        arrived = trio.current_time()
        metrics = self._metrics
        for attempt in (0, 1):
            async with lock:
                (view,) = self.buffer.take_for_scoring([group.group_id])
                started = trio.current_time()
                metrics.record_call([view], started - arrived, "inline")
                try:
                    await self.scorer.score(
                        ScoreRequest(teacher, (view,), self.buffer.store, self.field)
                    )
                except Exception:
                    metrics.failures += 1
                    if attempt == 0 and self.config.failure_policy is FailurePolicy.RETRY:
                        self.buffer.retry(group.group_id)
                        metrics.retries += 1
                        continue
                    if self.config.failure_policy is FailurePolicy.FAIL:
                        raise
                    with trio.CancelScope(shield=True):  # reported and dropped, or neither
                        if self.on_discard is not None:  # first: the discard notifies others
                            self.on_discard(view, "failed")
                        await self.buffer.discard(group.group_id, actor=Actor.STAGE)
                    metrics.discards += 1
                    return
                finally:
                    metrics.call_s += trio.current_time() - started
                self.buffer.mark_ready(group.group_id, [self.field])
                return
