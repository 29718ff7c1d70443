"""The train pump (the TERMINAL): trains each step once its prompts are all READY or given up.

In-order sampling: step `s` trains the groups of prompts `s * prompts_per_step` onwards. The
pump waits until every such prompt has a READY group or was given up on, selects, trains, moves
the train position (which opens the admission gate for the next step), then releases the rows.
While it waits on a step whose prompts have all been admitted, it tells the stage, so demand
dispatch can send the step's queued groups at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import attrs
import trio

from groupflow.impl._core import PromptLedger, ReplayBuffer
from groupflow.impl._pipeline._checkpoint import Checkpointer
from groupflow.impl._pipeline._config import PipelineConfig
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._pump import PumpKind
from groupflow.impl._pipeline._rollout import TrainPosition
from groupflow.impl._pipeline._scoring_stage import ScoringStage, StageMetrics
from groupflow.impl.contract import StatelessLearner, TrainBatch
from groupflow.model import Actor, GroupState, decisions
from groupflow.model.errors import NothingTrained
from groupflow.model.scheduler.actions import ActionKind


class _Scoring(Protocol):
    def drain_metrics(self) -> StageMetrics: ...


@attrs.frozen
class StepRecord:
    """What one train step saw."""

    step: int
    groups: int
    shortfall: int
    """Prompts of the step given up on."""
    started: float
    waited_s: float
    """Time the step waited for its groups."""
    train_s: float
    stats: Mapping[str, float]
    scoring: StageMetrics | None
    sync_s: float = 0.0
    """Time `sync_weights` took (part of `train_s`)."""
    skipped: bool = False
    """Every prompt of the step was given up: the learner was not called, nor the weight sync."""
    later_scoring: Mapping[str, StageMetrics] = attrs.field(factory=dict)
    """What each stage after the teacher's (`ExtraStage`) did, by its name."""


class TrainPump:
    kind = PumpKind.TERMINAL

    def __init__(
        self,
        buffer: ReplayBuffer,
        ledger: PromptLedger,
        learner: StatelessLearner,
        *,
        config: PipelineConfig,
        position: TrainPosition,
        num_steps: int,
        fields: Sequence[str],
        status: RunStatus | None = None,
        stages: Sequence[ScoringStage] = (),
        scoring: _Scoring | None = None,
        checkpointer: Checkpointer | None = None,
        sync_weights: Callable[[int], Awaitable[None]] | None = None,
        keep_steps: int | None = 1000,
        on_step: Callable[[StepRecord], None] | None = None,
        name: str = "train",
    ) -> None:
        self.name = name
        self.buffer = buffer
        self.status = status if status is not None else RunStatus()
        self.in_step = False
        """A step is running: its groups are CONSUMED and not yet trained."""
        self.ledger = ledger
        self.learner = learner
        self.config = config
        self.position = position
        self.num_steps = num_steps
        self.fields = list(fields)
        self.stages = tuple(stages)
        """The scoring stages, told which step training waits on (demand dispatch)."""
        self.scoring = scoring
        """Where scoring metrics are drained from after each step (the stage or the baseline)."""
        self.checkpointer = checkpointer
        """Saves after the steps it is due, between train steps (nothing is selected meanwhile)."""
        self.sync_weights = sync_weights
        """Awaited with the new weight version after each step the learner trained, before
        the position moves (rollouts started meanwhile still carry the old version)."""
        self.history: deque[StepRecord] = deque(maxlen=keep_steps)
        """The newest `keep_steps` steps' records (all of them for None): a long run's memory
        stays flat; `on_step` hears every record as it is made."""
        self.on_step = on_step
        self.stop_requested = False
        """`request_stop` was called: no further step starts."""

    @property
    def done(self) -> bool:
        """Every step is trained: what is left of the run is its end."""
        return self.position.step >= self.num_steps

    def waiting(self) -> str:
        """What training is doing, in words (for the stall watchdog)."""
        step = self.position.step
        if self.in_step:
            return f"train step {step} running"
        if self.done:
            return "training done"
        ready = self.buffer.ordinals_in(GroupState.READY, step)
        missing = decisions.step_missing(
            self.step_ordinals(step), ready=ready, given_up=self.ledger.shortfall
        )
        return f"train step {step} waits for {len(missing)} prompts ({_ordinals(missing)})"

    def request_stop(self) -> None:
        """Stop between steps: the step training now finishes (a step waiting for its groups is
        given up on), a checkpoint is saved if checkpoints are on and this step's was not, and
        the run shuts down the way it does after its last step."""
        self.stop_requested = True
        self.buffer.changed.notify()

    async def run(self) -> None:
        while self.position.step < self.num_steps and not self.stop_requested:
            await self._train(self.position.step)
        if self.stop_requested and self.position.step < self.num_steps:
            await self._stop_early()
            return
        if not self.ledger.trained and self.ledger.shortfall:
            self.status.fail()
            raise NothingTrained(
                f"every prompt was given up ({len(self.ledger.shortfall)}), none trained: "
                f"see the warnings for why each rollout or teacher call failed"
            )
        await self._save_last_step()
        self.status.stop()

    async def _stop_early(self) -> None:
        await self._save_last_step()
        self.status.interrupt()

    async def _save_last_step(self) -> None:
        """The run's last step is saved however it ends (stopped, or its steps trained, a
        number `every_steps` need not divide), unless it was saved already or the run failed."""
        checkpointer = self.checkpointer
        if checkpointer is not None and not self.status.failed:
            last = checkpointer.last
            if last is None or last["step"] != self.position.step:
                await checkpointer.save()

    def step_ordinals(self, step: int) -> range:
        size = self.config.shape.prompts_per_step
        stop = (step + 1) * size
        if self.ledger.num_prompts is not None:
            stop = min(stop, self.ledger.num_prompts)
        return range(step * size, stop)

    async def _train(self, step: int) -> None:
        started = trio.current_time()
        await self._wait_for(step)
        if self.stop_requested:
            return
        waited = trio.current_time() - started
        if self.status.failed:
            await trio.sleep_forever()  # no step starts once the run failed
        selection = self.buffer.select(
            step=step, weight_version=self.position.weight_version, actor=Actor.TRAIN
        )
        self.in_step = True
        self.status.report(ActionKind.TRAIN, detail=f"step {step}")
        skipped = not selection.groups
        stats: Mapping[str, float] = {}
        sync_s = 0.0
        try:
            if not skipped:
                rows = await self.buffer.read(selection.sample_ids, self.fields)
                given_up = tuple(sorted(set(self.step_ordinals(step)) & self.ledger.shortfall))
                batch = TrainBatch(
                    step, self.position.weight_version, selection.groups, rows, given_up
                )
                stats = await self.learner.train_step(batch)
                if self.sync_weights is not None:
                    sync_started = trio.current_time()
                    # from here a rollout may meet the new weights: groups that end from now
                    # on say so (their end weight version)
                    self.position.loading = self.position.weight_version + 1
                    await self.sync_weights(self.position.weight_version + 1)
                    sync_s = trio.current_time() - sync_started
        except BaseException as exc:
            # the step did not happen: its rows go, its prompts stay in flight (issued again
            # on resume, since no checkpoint records them trained)
            with trio.CancelScope(shield=True):
                await self.buffer.release(selection.group_ids)
            self.in_step = False
            if isinstance(exc, Exception):
                self.status.mark_failed()
                self.status.report(ActionKind.TRAIN_FAIL, detail=f"step {step}")
            else:
                self.status.report(ActionKind.TRAIN_CANCELLED, detail=f"step {step}")
            raise
        # the rows go first (shielded: a cancel must not strand the step), then the ledger
        # and the position move in the same step, unless the run failed meanwhile
        with trio.CancelScope(shield=True):
            await self.buffer.release(selection.group_ids)
        if self.status.failed:
            self.in_step = False
            self.status.report(ActionKind.TRAIN_CANCELLED, detail=f"step {step}")
            await trio.sleep_forever()  # the supervisor cancels this pump
        ordinals = [g.ordinal for g in selection.groups if g.ordinal is not None]
        self.ledger.mark_trained(ordinals)
        self.position.advance()
        self.in_step = False
        self.status.report(ActionKind.TRAINED, detail=f"step {step}")
        record = StepRecord(
            step=step,
            groups=len(selection.groups),
            shortfall=len(set(self.step_ordinals(step)) & self.ledger.shortfall),
            started=started,
            waited_s=waited,
            train_s=trio.current_time() - started - waited,
            stats=dict(stats),
            scoring=None if self.scoring is None else self.scoring.drain_metrics(),
            sync_s=sync_s,
            skipped=skipped,
            later_scoring={stage.name: stage.drain_metrics() for stage in self.stages[1:]},
        )
        self.history.append(record)
        if self.on_step is not None:
            self.on_step(record)
        if self.checkpointer is not None:
            await self.checkpointer.after_step()

    async def _wait_for(self, step: int) -> None:
        ordinals = self.step_ordinals(step)
        seen: tuple[int, int] | None = None
        issued = False
        try:
            while True:
                # what the step waits for moves only with the ledger or the step's READY
                # groups: re-read them only then (this loop runs at every change of the buffer)
                now = (self.ledger.revision, self.buffer.count_in(GroupState.READY, step))
                if now != seen:
                    seen = now
                    missing = decisions.step_missing(
                        ordinals,
                        ready=self.buffer.ordinals_in(GroupState.READY, step),
                        given_up=self.ledger.shortfall,
                    )
                    if not missing:
                        return
                    issued = decisions.step_issued(
                        ordinals, cursor=self.ledger.cursor, reissue=self.ledger.reissue
                    )
                if self.stop_requested:
                    return
                for stage in self.stages:
                    stage.demand(step, issued=issued)
                await self.buffer.changed.wait()
        finally:
            for stage in self.stages:
                stage.demand(None)


def _ordinals(ordinals: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ordinals[:most]))
    return shown + (f" and {len(ordinals) - most} more" if len(ordinals) > most else "")
