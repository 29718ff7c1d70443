"""The scoring stages: the teacher's batches committed groups per physical teacher, scores each
batch in one call, and marks the groups; a later stage (a verifier, a reward model: `ExtraStage`)
takes the groups the one before it scored, in one queue of its own, the same way. A group is READY
once the last stage has marked it.

`submit` is synchronous and never waits: the rollout calls it right after its commit, when its
generation permit is already free, so teacher latency never throttles generation. Each physical
teacher has one worker task and so at most one call in flight; different teachers run
concurrently. When a batch goes, and how big it is, is decided by
`groupflow.model.decisions` (`dispatch_reasons`, `batch_size`, `demand_dispatch`), the functions
the checked model calls: full, a retried group alone, drain once upstream ended, a checkpoint's
flush, demand, the timer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import trio

from groupflow.impl._core import Pulse, ReplayBuffer
from groupflow.impl._pipeline._config import ScoringConfig
from groupflow.impl._pipeline._failures import failure_detail, is_transient, log_failure
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._part_name import part_name
from groupflow.impl._pipeline._pump import PumpKind, single_error
from groupflow.impl._pipeline._scorer import call_scorer
from groupflow.impl.contract import TEACHER_FIELD, Scorer, ScoreRequest
from groupflow.model import Actor, Event, GroupState, GroupView, decisions
from groupflow.model.errors import (
    CallOrderError,
    ConfigError,
    IllegalTransition,
    RoutingError,
    ScorerLost,
    ScoringCallFailed,
    TeacherOutputError,
)
from groupflow.model.policy import Design, Dispatch, FailurePolicy
from groupflow.model.scheduler.actions import ActionKind


@attrs.frozen
class ExtraStage:
    """A scoring stage after the teacher's (`build_pipeline(extra_stages=...)`): a verifier or a
    reward model that writes `field` for every row of the groups the teacher has scored. Its
    `scorer` is called with `request.teacher == name`, so one scorer may serve several stages.
    It batches, retries and fails under the same `ScoringConfig` as the teacher stage."""

    name: str = attrs.field()
    scorer: Scorer
    field: str = attrs.field()

    @name.validator
    @field.validator
    def _check_text(self, attribute: attrs.Attribute[str], value: object) -> None:
        if not isinstance(value, str) or not value:
            raise ConfigError(
                f"ExtraStage.{attribute.name}={value!r} must be a non-empty string",
                field=attribute.name,
                config="ExtraStage",
            )


def route_group(route: Callable[[GroupView], str], group: GroupView) -> str:
    """`route(group)`, its refusal turned into a `RoutingError` naming the group."""
    try:
        return route(group)
    except (LookupError, ValueError) as exc:
        raise RoutingError(
            f"no teacher for group {group.group_id!r} (agent {group.agent!r}): {exc}"
        ) from exc


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


@attrs.frozen
class QueueView:
    """One teacher's queue at an instant (for observers: the conformance check, metrics)."""

    queued: tuple[str, ...]
    """Group ids waiting, in the order they will go."""
    again: frozenset[str]
    """Those of them queued again after a failed call."""
    in_flight: tuple[str, ...]
    """Group ids of the call in flight."""


OnDiscard = Callable[[GroupView, str], None]
"""Told of every group the stage discards, with why ("failed" or "shutdown")."""


class ScoringStage:
    """A STAGE pump: see the module docstring."""

    kind = PumpKind.STAGE

    def __init__(
        self,
        buffer: ReplayBuffer,
        scorer: Scorer,
        config: ScoringConfig,
        *,
        max_batch_groups: int,
        route: Callable[[GroupView], str] = lambda group: "teacher",
        field: str = TEACHER_FIELD,
        on_discard: OnDiscard | None = None,
        status: RunStatus | None = None,
        abandon_after_s: float = 60.0,
        name: str = "teacher",
    ) -> None:
        self.name = name
        self.buffer = buffer
        """Changed as the stage (`Actor.STAGE`), and as the supervisor for the drops at
        shutdown: its policy, carried out here."""
        self.scorer = scorer
        self.config = config
        self.max_batch_groups = max_batch_groups
        """Groups per call, at most: the run's `Shape`'s."""
        self.route = route
        self.field = field
        self.on_discard = on_discard
        self.status = status if status is not None else RunStatus()
        self.abandon_after_s = abandon_after_s
        """How long a cancelled call may take to return (`ScoreRequest.abandon_after_s`)."""
        self._queues: dict[str, deque[_Queued]] = {}
        self._in_flight: dict[str, tuple[GroupView, ...]] = {}
        self._call_started: dict[str, float] = {}
        self._nursery: trio.Nursery | None = None
        self._changed = Pulse()
        """Wakes `run`: the backlog changed, or upstream ended."""
        self._wake: dict[str, Pulse] = {}
        """Wakes one teacher's worker: its queue changed, or something every queue reads."""
        self._demand_seen: tuple[int | None, bool, bool] = (None, True, False)
        self._draining = False
        self._demanded_step: int | None = None
        self._demanded_issued = False
        self._flush_ids: set[str] = set()
        self._failed_in_a_row = 0
        self._unchecked = False
        """A call of this stage ended unchecked (another call was in flight, or it failed): rows
        written outside a batch since the last check may be any call's (`_check_writes`)."""
        self._unattributed: set[str] = set()
        """Rows outside every batch found when no call could be charged with them: left for the
        end of the run's sweep, never charged to a later call."""
        self._metrics = StageMetrics()
        self.scored = 0
        """Groups scored since the start (for the stall watchdog)."""
        self.next: ScoringStage | None = None
        """The stage that takes the groups this one scored and that still lack a field."""
        self.previous: ScoringStage | None = None
        """The stage that hands groups to this one (None: the rollout does)."""
        self.linked: tuple[ScoringStage, ...] = (self,)
        """Every stage of the chain this one is in (`chain`)."""
        self.closed = False
        """`run` has returned or raised and dropped what it held: groups handed to it now are
        dropped by the stage that hands them (`_call`)."""

    # -- what other pumps call (all synchronous) -------------------------------------------

    def teacher_for(self, group: GroupView) -> str:
        """The physical teacher that scores `group`; `RoutingError` if there is none."""
        return route_group(self.route, group)

    def submit(self, group_id: str) -> None:
        """Queue a WRITTEN group for its teacher (the rollout, after its commit; or the stage
        before this one, after its call). Never waits."""
        group = self.buffer.group(group_id)
        if group.state is not GroupState.WRITTEN:
            raise IllegalTransition(
                f"submit({group_id!r}): only WRITTEN groups can be scored, it is {group.state}",
                group_id=group_id,
                state=group.state,
                event=Event.TAKE_BATCH,
                actor=Actor.STAGE,
            )
        if self._draining:
            raise CallOrderError(
                f"submit({group_id!r}) after upstream ended: the stage is draining"
            )
        teacher = self.teacher_for(group)
        self._enqueue(teacher, _Queued(group_id, group.target_step, trio.current_time()))

    def upstream_ended(self) -> None:
        """Nothing more will be submitted: send what is queued, then return from `run`."""
        self._draining = True
        self._wake_all()

    def demand(self, step: int | None, *, issued: bool = True) -> None:
        """Training waits on `step` (None: it does not wait); `issued`: every prompt of the
        step has been handed out (`decisions.step_issued`)."""
        self._demanded_step = step
        self._demanded_issued = issued
        # the train pump says this at every change of the buffer while it waits: wake the
        # workers only when what the demand rule reads (but their own queues) has changed
        seen = (step, issued, step is not None and self._step_upstream(step))
        if seen != self._demand_seen:
            self._demand_seen = seen
            self._wake_all()

    def flush(self, group_ids: set[str]) -> None:
        """A checkpoint waits on these groups: send them now, full batch or not."""
        self._flush_ids |= group_ids
        self._wake_all()

    def end_flush(self) -> None:
        """The checkpoint has been saved (or gave up waiting): its groups are ordinary again."""
        self._flush_ids.clear()

    def drain_metrics(self) -> StageMetrics:
        metrics, self._metrics = self._metrics, StageMetrics()
        return metrics

    def waiting(self, now: float) -> list[str]:
        """What each teacher of this stage holds at `now`, in words (for the stall watchdog)."""
        out = []
        for teacher in sorted(set(self._queues) | set(self._in_flight)):
            views = self._in_flight.get(teacher, ())
            queued = len(self._queues.get(teacher, ()))
            parts = []
            if views:
                age = now - self._call_started.get(teacher, now)
                parts.append(f"a call of {len(views)} groups in flight for {age:.0f} s")
            if queued:
                parts.append(f"{queued} queued")
            if parts:
                out.append(f"stage {self.name!r} teacher {teacher!r}: {', '.join(parts)}")
        return out

    @property
    def backlog(self) -> int:
        """Groups queued or in a call."""
        return sum(map(len, self._queues.values())) + sum(map(len, self._in_flight.values()))

    def holds_step(self, step: int) -> bool:
        """Whether a group admitted for `step` is queued here or in a call of this stage."""
        return any(item.target_step == step for q in self._queues.values() for item in q) or any(
            view.target_step == step for views in self._in_flight.values() for view in views
        )

    def queues(self) -> dict[str, QueueView]:
        """Each teacher's queue and call in flight, now."""
        return {
            teacher: QueueView(
                tuple(item.group_id for item in queue),
                frozenset(item.group_id for item in queue if item.retry),
                tuple(v.group_id for v in self._in_flight.get(teacher, ())),
            )
            for teacher, queue in self._queues.items()
        }

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
        except Exception:
            self.status.fail()  # the run fails first: the drops below are its shutdown
            raise
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                try:
                    await self.drop_leftovers()
                finally:
                    self.closed = True

    # -- internals -----------------------------------------------------------------------

    async def _wait_for_change(self, deadline: float = math.inf) -> None:
        with trio.move_on_at(deadline):
            await self._changed.wait()

    def _wake_all(self) -> None:
        """Every worker re-reads what it dispatches on, and `run` its loop condition."""
        for pulse in self._wake.values():
            pulse.notify()
        self._changed.notify()

    def _enqueue(self, teacher: str, item: _Queued, *, front: bool = False) -> None:
        queue = self._queues.get(teacher)
        if queue is None:
            queue = self._queues[teacher] = deque()
            self._wake[teacher] = Pulse()
            if self._nursery is not None:
                self._nursery.start_soon(self._worker, teacher, name=f"teacher {teacher}")
        if front:
            queue.appendleft(item)
        else:
            queue.append(item)
        self._wake[teacher].notify()
        self._changed.notify()

    async def _worker(self, teacher: str) -> None:
        queue = self._queues[teacher]
        wake = self._wake[teacher]
        while True:
            picked = self._next_batch(queue)
            if picked is not None:
                await self._call(teacher, *picked)
                self._changed.notify()
                continue
            if self._draining and not queue:
                return
            # once the run failed nothing is sent: wait to be cancelled, not for a timer that
            # could only expire again and again
            timed = queue and not self.status.failing
            deadline = queue[0].arrived + self.config.flush_after_s if timed else math.inf
            with trio.move_on_at(deadline):
                await wake.wait()

    def _next_batch(self, queue: deque[_Queued]) -> tuple[list[_Queued], str] | None:
        if not queue:
            return None
        head_is_retry = queue[0].retry
        reasons = decisions.dispatch_reasons(
            design=Design.PUMP,
            # failing, not only failed: a call left in flight by a failure that came second
            # (`_failed`) is this worker's until the run ends
            run_failed=self.status.failing,
            queued=len(queue),
            head_is_retry=head_is_retry,
            call_in_flight=False,  # this worker's call, if any, has returned
            max_batch_groups=self.max_batch_groups,
            draining=self._draining,
            flush_requested=bool(self._flush_ids)
            and any(item.group_id in self._flush_ids for item in queue),
            demanded=self._demanded(queue),
            timer_expired=trio.current_time() >= queue[0].arrived + self.config.flush_after_s,
        )
        if not reasons:
            return None
        size = decisions.batch_size(
            design=Design.PUMP,
            queued=len(queue),
            head_is_retry=head_is_retry,
            max_batch_groups=self.max_batch_groups,
        )
        batch = [queue.popleft()]
        while queue and len(batch) < size and not queue[0].retry:
            batch.append(queue.popleft())
        return batch, reasons[0]

    def _demanded(self, queue: deque[_Queued]) -> bool:
        step = self._demanded_step
        if self.config.dispatch is not Dispatch.DEMAND or step is None:
            return False
        return decisions.demand_dispatch(
            training_waits=True,
            step_issued=self._demanded_issued,
            step_upstream=self._step_upstream(step),
            step_queued_here=any(item.target_step == step for item in queue),
        )

    def _step_upstream(self, step: int) -> bool:
        """A group of `step` may still join this stage: its rollout runs, or a stage before
        this one holds it."""
        if self.buffer.count_in(GroupState.RESERVED, step):
            return True
        stage = self.previous
        while stage is not None:
            if stage.holds_step(step):
                return True
            stage = stage.previous
        return False

    async def _call(self, teacher: str, batch: list[_Queued], reason: str) -> None:
        ids = [item.group_id for item in batch]
        views = self.buffer.take_for_scoring(ids, actor=Actor.STAGE)
        self._in_flight[teacher] = views
        self._call_started[teacher] = trio.current_time()
        self._flush_ids.difference_update(ids)
        started = trio.current_time()
        self._metrics.record_call(views, sum(started - item.arrived for item in batch), reason)
        self.status.report(ActionKind.DISPATCH, teacher=teacher, detail=reason)
        request = ScoreRequest(
            teacher, views, self.buffer.store, self.field, abandon_after_s=self.abandon_after_s
        )
        checked = False
        try:
            await call_scorer(self.scorer, request, timeout_s=self.config.call_timeout_s)
            checked = True
            await self._check_writes(teacher)
            # the field names are checked against the store: a scorer that did not write
            # them has failed its call
            states = await self.buffer.mark_ready_many(ids, [self.field], actor=Actor.STAGE)
            self._hand_on(ids, states)
        except ScorerLost:
            self._metrics.call_s += trio.current_time() - started
            self.status.fail()  # its groups stay in flight: dropped when the stage ends
            raise
        except RoutingError as exc:
            # a route to a teacher the scorer does not have is a configuration error, not a
            # failed call: no policy makes the next call go better
            self._metrics.call_s += trio.current_time() - started
            if not self.status.claim_failure():
                return  # the run fails already; these groups are dropped when the stage ends
            self.status.fail()
            agents = sorted({str(v.agent) for v in views})
            raise RoutingError(
                f"agent{'s' if len(agents) > 1 else ''} {', '.join(map(repr, agents))} "
                f"routed to teacher {teacher!r}, which the scorer {part_name(self.scorer)} "
                f"does not have: {exc}"
            ) from exc
        except Exception as exc:
            self._metrics.call_s += trio.current_time() - started
            self._unchecked |= not checked
            if not decisions.failure_is_judged(run_failed=self.status.failed):
                return  # the run fails already; these groups are dropped when the stage ends
            await self._failed(teacher, views, exc)
            return
        self._metrics.call_s += trio.current_time() - started
        del self._in_flight[teacher]
        self._failed_in_a_row = 0
        self.scored += len(views)
        self.status.report(ActionKind.SCORED, teacher=teacher)
        if self.next is not None and self.next.closed:
            # the run is going down and the next stage has already dropped what it held (a
            # call of this one returned late, its thread finishing): drop these too
            with trio.CancelScope(shield=True):
                await self.next.drop_leftovers()

    def _hand_on(self, ids: Sequence[str], states: Sequence[GroupState]) -> None:
        """Groups the call left WRITTEN still lack a later stage's field: that stage takes
        them, in the batch's order, before the call is reported (the model moves them to the
        next stage's queue as it hears `scored`)."""
        if self.next is None:
            return
        for gid, state in zip(ids, states, strict=True):
            if state is GroupState.WRITTEN:
                self.next.submit(gid)

    async def _check_writes(self, teacher: str) -> None:
        """A scorer writes its field into its batch's rows and nowhere else: rows of its own
        are removed and fail the call, named. Checked when no other call is in flight (in any
        stage of the chain) and every call since the last check was checked, so the rows are
        this call's; rows found otherwise are nobody's to charge (the end of the run sweeps
        them up, with the rest)."""
        if sum(len(stage._in_flight) for stage in self.linked) > 1:
            self._unchecked = True
            return
        known = set().union(*(stage._unattributed for stage in self.linked))
        stray = [sid for sid in await self.buffer.stray_rows() if sid not in known]
        if any(stage._unchecked for stage in self.linked):
            for stage in self.linked:
                stage._unchecked = False
            self._unattributed.update(stray)
            return
        if stray:
            await self.buffer.remove_rows(stray)
            raise TeacherOutputError(
                f"teacher {teacher!r}'s scorer wrote rows outside its batch: {stray[:8]}"
                f"{' ...' if len(stray) > 8 else ''} ({len(stray)}, removed)"
            )

    async def _failed(self, teacher: str, views: tuple[GroupView, ...], error: Exception) -> None:
        """Apply the failure policy to the groups of a failed call (still SCORING), as one
        step: the groups to drop go first (one store call), then the retries are queued, then
        the failure is reported. Only a transient error is retried (`is_transient`): one
        that stays would fail the retry too, so its groups are given up at once."""
        policy = self.config.failure_policy
        if policy is FailurePolicy.FAIL and not self.status.claim_failure():
            return  # another failure fails the run: these groups are dropped when it ends
        self._metrics.failures += 1
        self._failed_in_a_row += 1
        transient = is_transient(error, self.config.transient_errors)
        ids = [v.group_id for v in views]
        if transient and policy is FailurePolicy.RETRY:
            written = await self.buffer.rows_with(
                [s for v in views for s in v.sample_ids], self.field
            )
            if written:  # a retry would meet its own field already there: give up instead
                error.add_note(
                    f"the call wrote {self.field!r} for {len(written)} rows before it failed "
                    f"(e.g. {written[0]!r}), so its groups cannot be retried"
                )
                transient = False
        if policy is FailurePolicy.FAIL:

            def failed_run() -> None:
                self._account(views, "shutdown")  # the run fails: issued again on resume
                del self._in_flight[teacher]
                self.status.mark_failed()
                self.status.report(ActionKind.SCORE_FAIL, teacher=teacher)

            with trio.CancelScope(shield=True):
                await self.buffer.discard_many(ids, then=failed_run, actor=Actor.STAGE)
            log_failure(
                self._who(teacher), ids, error, policy=policy, transient=transient, retried=()
            )
            raise ScoringCallFailed(
                f"{self._who(teacher)} failed scoring groups {ids} and failure_policy='fail'"
            ) from error
        again = [
            v
            for v in views
            if decisions.retry_after_failure(
                policy, self.buffer.retries_of(v.group_id), transient=transient
            )
        ]
        drop = [v for v in views if v not in again]

        def judged() -> None:
            # the groups given up are gone: the retries queue and the failure is reported in
            # the same step, before their rows are cleared
            self._account(drop, "failed")
            for view in reversed(again):
                self.buffer.retry(view.group_id, actor=Actor.STAGE)
                self._metrics.retries += 1
                self._enqueue(
                    teacher,
                    _Queued(view.group_id, view.target_step, trio.current_time(), True),
                    front=True,
                )
            del self._in_flight[teacher]
            self.status.report(
                ActionKind.SCORE_FAIL,
                teacher=teacher,
                detail=failure_detail(policy, transient=transient),
            )

        with trio.CancelScope(shield=True):
            await self.buffer.discard_many(
                (v.group_id for v in drop), then=judged, actor=Actor.STAGE
            )
        log_failure(
            self._who(teacher),
            ids,
            error,
            policy=policy,
            transient=transient,
            retried=[v.group_id for v in again],
        )
        over = self._failed_in_a_row > self.config.max_consecutive_failed_batches
        if over and self.status.claim_failure():
            raise ScoringCallFailed(
                f"{self._who(teacher)}: {self._failed_in_a_row} calls in a row failed "
                f"(max_consecutive_failed_batches={self.config.max_consecutive_failed_batches}); "
                f"last error: {error!r}"
            ) from error

    def _who(self, lane: str) -> str:
        """How messages name a queue: `teacher 't0'` in the teacher's stage, `stage
        'verifier'` in a later one (a verifier is not a teacher)."""
        return f"teacher {lane!r}" if self.field == TEACHER_FIELD else f"stage {lane!r}"

    def _account(self, views: Sequence[GroupView], reason: str) -> None:
        for view in views:
            if self.on_discard is not None:
                self.on_discard(view, reason)
            self._metrics.discards += 1

    async def drop_leftovers(self) -> None:
        """After a cancelled or failed run: every group still queued or in a call is dropped,
        one at a time, each reported (its call, if any, has returned, or its thread was
        abandoned and the run fails with `ScorerLost`). Until nothing is left: a rollout may
        commit a group into a queue already emptied while a drop waits on the store. The run's
        exit calls it again, for a commit that landed after the stage had stopped."""
        while True:
            teacher = next((t for t, views in self._in_flight.items() if views), None)
            if teacher is not None:
                view, *rest = self._in_flight[teacher]

                def dropped_in_flight(
                    view: GroupView = view, rest: list[GroupView] = rest, teacher: str = teacher
                ) -> None:
                    self._in_flight[teacher] = tuple(rest)
                    self._drop_reported(view, GroupState.SCORING)

                await self.buffer.discard(
                    view.group_id, then=dropped_in_flight, actor=Actor.SUPERVISOR
                )
                continue
            queue = next((q for q in self._queues.values() if q), None)
            if queue is None:
                break
            view = self.buffer.group(queue[0].group_id)

            def dropped_queued(queue: deque[_Queued] = queue, view: GroupView = view) -> None:
                queue.popleft()
                self._drop_reported(view, view.state)

            await self.buffer.discard(view.group_id, then=dropped_queued, actor=Actor.SUPERVISOR)
        self._in_flight.clear()

    def _drop_reported(self, view: GroupView, was: GroupState) -> None:
        self._account([view], "shutdown")
        self.status.report(
            ActionKind.DROP,
            ordinal=-1 if view.ordinal is None else view.ordinal,
            group=view.group_id,
            was=was,
        )


def chain(stages: Sequence[ScoringStage]) -> None:
    """Link `stages` in order: each hands the groups it scored, still lacking a field, to the
    next, and knows every stage of the chain (see `ScoringStage.next`)."""
    linked = tuple(stages)
    for before, after in zip(linked, linked[1:], strict=False):
        before.next = after
        after.previous = before
    for stage in linked:
        stage.linked = linked
