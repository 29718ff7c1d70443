"""The inline-enricher baseline (what upstream ships), kept small and only for comparison.

The rollout awaits scoring of its own group right after commit, under one lock per physical
teacher, while still holding its generation permit: every call carries one group, and teacher
latency throttles generation. Everything else (buffer, rollout, train, supervisor) is shared
with the pump design, so the simulator and the checker compare the two on the same work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from groupflow.impl._core import Pulse, ReplayBuffer
from groupflow.impl._pipeline._config import ScoringConfig
from groupflow.impl._pipeline._failures import failure_detail, is_transient, log_failure
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._scorer import call_scorer
from groupflow.impl._pipeline._scoring_stage import (
    OnDiscard,
    QueueView,
    StageMetrics,
    route_group,
)
from groupflow.impl.contract import TEACHER_FIELD, Scorer, ScoreRequest
from groupflow.model import Actor, GroupState, GroupView, decisions
from groupflow.model.errors import ScorerLost, ScoringCallFailed
from groupflow.model.policy import Design, FailurePolicy
from groupflow.model.scheduler.actions import ActionKind


class InlineScoring:
    """Scores one group per call, in arrival order per teacher (a fair lock); a failed group
    is retried alone once, at the head of the line, by policy (a transient failure only, as
    in the stage)."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        scorer: Scorer,
        config: ScoringConfig,
        *,
        route: Callable[[GroupView], str] = lambda group: "teacher",
        field: str = TEACHER_FIELD,
        on_discard: OnDiscard | None = None,
        status: RunStatus | None = None,
        abandon_after_s: float = 60.0,
    ) -> None:
        self.buffer = buffer
        self.abandon_after_s = abandon_after_s
        self.scorer = scorer
        self.config = config
        self.route = route
        self.field = field
        self.on_discard = on_discard
        self.status = status if status is not None else RunStatus()
        self._waiting: dict[str, deque[str]] = {}
        """Per teacher: the groups waiting for its lock, in the order they get it."""
        self._again: set[str] = set()
        self._in_flight: dict[str, str] = {}
        self._changed = Pulse()
        self._metrics = StageMetrics()
        self._failed_in_a_row = 0

    def drain_metrics(self) -> StageMetrics:
        metrics, self._metrics = self._metrics, StageMetrics()
        return metrics

    def queues(self) -> dict[str, QueueView]:
        """Each teacher's line and call in flight, now."""
        teachers = set(self._waiting) | set(self._in_flight)
        return {
            t: QueueView(
                tuple(self._waiting.get(t, ())),
                frozenset(g for g in self._waiting.get(t, ()) if g in self._again),
                (self._in_flight[t],) if t in self._in_flight else (),
            )
            for t in teachers
        }

    def waiting(self, now: float) -> list[str]:
        """What each teacher holds, in words (for the stall watchdog)."""
        out = []
        for teacher in sorted(set(self._waiting) | set(self._in_flight)):
            parts = []
            if teacher in self._in_flight:
                parts.append(f"scoring group {self._in_flight[teacher]!r} (inline)")
            if self._waiting.get(teacher):
                parts.append(f"{len(self._waiting[teacher])} waiting")
            if parts:
                out.append(f"teacher {teacher!r}: {', '.join(parts)}")
        return out

    def teacher_for(self, group: GroupView) -> str:
        """The physical teacher that scores `group`; `RoutingError` if there is none."""
        return route_group(self.route, group)

    def enqueue(self, group_id: str) -> None:
        """Line a just-committed group up for its teacher's lock (synchronous: in the same
        step as the commit); `score` then waits for its turn."""
        teacher = self.route(self.buffer.group(group_id))
        self._waiting.setdefault(teacher, deque()).append(group_id)
        self._changed.notify()

    async def score(self, group_id: str, *, release: Callable[[], None]) -> None:
        """Score a group `enqueue`d before; it ends READY, or DISCARDED under the failure
        policy. `release` gives back the rollout's generation permit, in the same step as the
        group leaves scoring.

        If the caller is cancelled or the run fails, the group is dropped once its call returned.
        """
        group = self.buffer.group(group_id)
        teacher = self.route(group)
        try:
            await self._score(teacher, group_id, release)
        except BaseException:
            # cancelled: the prompt is issued again on resume
            was = self.buffer.state_of(group_id)
            if was in (GroupState.WRITTEN, GroupState.SCORING):

                def dropped() -> None:
                    self._forget(teacher, group_id)
                    self._account(group, "shutdown")
                    release()
                    self.status.report(
                        ActionKind.DROP, ordinal=_ordinal(group), group=group_id, was=was
                    )

                with trio.CancelScope(shield=True):
                    await self.buffer.discard(group_id, then=dropped, actor=Actor.SUPERVISOR)
            raise

    def _forget(self, teacher: str, group_id: str) -> None:
        line = self._waiting[teacher]
        if group_id in line:
            line.remove(group_id)
        if self._in_flight.get(teacher) == group_id:
            del self._in_flight[teacher]
        self._again.discard(group_id)
        self._changed.notify()

    def _account(self, group: GroupView, reason: str) -> None:
        if self.on_discard is not None:
            self.on_discard(group, reason)
        self._metrics.discards += 1

    async def _score(self, teacher: str, group_id: str, release: Callable[[], None]) -> None:
        line = self._waiting[teacher]
        arrived = trio.current_time()
        policy = self.config.failure_policy
        while True:  # a retried group goes again at once; a second failure drops it
            while True:
                reasons = decisions.dispatch_reasons(
                    design=Design.INLINE,
                    run_failed=self.status.failed,
                    queued=len(line),
                    head_is_retry=bool(line) and line[0] in self._again,
                    call_in_flight=teacher in self._in_flight,
                    max_batch_groups=1,
                    draining=False,
                    flush_requested=False,
                    demanded=False,
                    timer_expired=False,
                )
                if reasons and line[0] == group_id:
                    break
                await self._changed.wait()
            line.popleft()
            self._again.discard(group_id)
            (view,) = self.buffer.take_for_scoring([group_id], actor=Actor.STAGE)
            self._in_flight[teacher] = group_id
            started = trio.current_time()
            self._metrics.record_call([view], started - arrived, reasons[0])
            self.status.report(ActionKind.DISPATCH, teacher=teacher, detail=reasons[0])
            request = ScoreRequest(
                teacher, (view,), self.buffer.store, self.field, self.abandon_after_s
            )
            try:
                await call_scorer(self.scorer, request, timeout_s=self.config.call_timeout_s)
                await self.buffer.mark_ready_many([group_id], [self.field], actor=Actor.STAGE)
            except ScorerLost:
                self.status.fail()  # the group stays in flight: dropped at shutdown
                raise
            except Exception as exc:
                self._metrics.call_s += trio.current_time() - started
                if not decisions.failure_is_judged(run_failed=self.status.failed) or (
                    policy is FailurePolicy.FAIL and not self.status.claim_failure()
                ):
                    # the run fails already: the group keeps its call and its permit until the
                    # shutdown's cancel drops it (`score`), as the model drops it
                    await trio.sleep_forever()
                self._metrics.failures += 1
                self._failed_in_a_row += 1
                transient = is_transient(exc, self.config.transient_errors)
                retries = self.buffer.retries_of(group_id)
                if decisions.retry_after_failure(policy, retries, transient=transient):
                    self.buffer.retry(group_id, actor=Actor.STAGE)
                    self._metrics.retries += 1
                    line.appendleft(group_id)
                    self._again.add(group_id)
                    del self._in_flight[teacher]
                    self._changed.notify()
                    self.status.report(ActionKind.SCORE_FAIL, teacher=teacher)
                    self._log(teacher, group_id, exc, transient, retried=True)
                    self._check_failures(teacher, exc)
                    continue

                def judged(transient: bool = transient, view: GroupView = view) -> None:
                    # reported as the group goes, before its rows are cleared
                    self._forget(teacher, group_id)
                    release()
                    if policy is FailurePolicy.FAIL:
                        self._account(view, "shutdown")  # the run fails: issued again on resume
                        self.status.mark_failed()
                        self.status.report(ActionKind.SCORE_FAIL, teacher=teacher)
                        return
                    self._account(view, "failed")
                    self.status.report(
                        ActionKind.SCORE_FAIL,
                        teacher=teacher,
                        detail=failure_detail(policy, transient=transient),
                    )

                with trio.CancelScope(shield=True):
                    await self.buffer.discard(group_id, then=judged, actor=Actor.STAGE)
                self._log(teacher, group_id, exc, transient, retried=False)
                if policy is FailurePolicy.FAIL:
                    raise ScoringCallFailed(  # as the stage says it
                        f"teacher {teacher!r} failed scoring groups {[group_id]} and "
                        f"failure_policy='fail'"
                    ) from exc
                self._check_failures(teacher, exc)
                return
            self._metrics.call_s += trio.current_time() - started
            self._failed_in_a_row = 0
            self._forget(teacher, group_id)
            release()
            self.status.report(ActionKind.SCORED, teacher=teacher)
            return

    def _log(
        self, teacher: str, group_id: str, error: Exception, transient: bool, *, retried: bool
    ) -> None:
        log_failure(
            f"teacher {teacher!r}",
            [group_id],
            error,
            policy=self.config.failure_policy,
            transient=transient,
            retried=[group_id] if retried else [],
        )

    def _check_failures(self, teacher: str, error: Exception) -> None:
        """More failed calls in a row than the config allows fails the run (as in the stage)."""
        limit = self.config.max_consecutive_failed_batches
        if self._failed_in_a_row > limit and self.status.claim_failure():
            self.status.fail()
            raise ScoringCallFailed(
                f"teacher {teacher!r}: {self._failed_in_a_row} calls in a row failed "
                f"(max_consecutive_failed_batches={limit}); last error: {error!r}"
            ) from error


def _ordinal(group: GroupView) -> int:
    return -1 if group.ordinal is None else group.ordinal
