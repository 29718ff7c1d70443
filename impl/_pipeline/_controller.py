"""The controller: a built run (`Pipeline`, made by `build_pipeline`), which resumes from a
checkpoint, runs its pumps under `supervise`, stops on request, and says what it did
(`RunResult`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import threading
import typing
from collections.abc import Callable
from typing import Any

import attrs
import trio

from groupflow.impl._core import PromptLedger, ReplayBuffer
from groupflow.impl._pipeline._checkpoint import Checkpoint, Checkpointer
from groupflow.impl._pipeline._checkpoint_disk import set_aside_newer
from groupflow.impl._pipeline._config import PipelineConfig
from groupflow.impl._pipeline._fingerprint import check_fingerprint
from groupflow.impl._pipeline._inline_baseline import InlineScoring
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._part_name import part_name
from groupflow.impl._pipeline._pump import Pump, leaves, single_error
from groupflow.impl._pipeline._rollout import RolloutPump, TrainPosition
from groupflow.impl._pipeline._scoring_stage import (
    ScoringStage,
)
from groupflow.impl._pipeline._supervisor import supervise
from groupflow.impl._pipeline._trace import TraceWriter
from groupflow.impl._pipeline._train import StepRecord, TrainPump
from groupflow.impl._pipeline._watchdog import StallWatchdog
from groupflow.impl.contract import Learner
from groupflow.model import Actor, GroupState, GroupView
from groupflow.model.errors import CheckpointExists, ConfigError, PumpFailed, WrongLoop
from groupflow.model.scheduler import Phase

log = logging.getLogger("groupflow.pipeline")


@attrs.frozen
class RunResult:
    """What a run did: its newest `keep_steps` step records, and what became of each prompt.
    A failed run's is on its error (`PumpFailed.result`), or `Pipeline.result()`."""

    steps: tuple[StepRecord, ...]
    trained: frozenset[int]
    shortfall: frozenset[int]
    """The prompts given up (their rollouts or teacher calls failed for good)."""
    rollout_failures: int
    unfinished: frozenset[int] = frozenset()
    """Prompts issued and neither trained nor given up: in flight when the run ended, or
    dropped on its way out. A resume issues them again (unless its checkpoint saved their
    groups); after a run that finished, none."""


@attrs.define
class Pipeline:
    """The wired parts of one run, exposed so tests and the simulator can look inside."""

    config: PipelineConfig
    buffer: ReplayBuffer
    ledger: PromptLedger
    position: TrainPosition
    rollout: RolloutPump
    train: TrainPump
    watchdog: StallWatchdog
    fingerprint: dict[str, Any]
    status: RunStatus
    stage: ScoringStage | None = None
    inline: InlineScoring | None = None
    checkpointer: Checkpointer | None = None
    resumed: Checkpoint | None = None
    """The checkpoint this pipeline resumed from, if any."""
    rows_removed: int = 0
    """Rows no group owned that the end of the run found in the store, and removed."""
    trace: TraceWriter | None = None
    """Writes the run's actions for `groupflow replay` (`build_pipeline(trace=...)`)."""
    later_stages: tuple[ScoringStage, ...] = ()
    """The stages after the teacher's (`build_pipeline(extra_stages=...)`), in order."""
    _token: trio.lowlevel.TrioToken | None = None
    """The trio run this pipeline runs in, once it began: `request_stop` reaches it from
    asyncio code or another thread."""

    @property
    def stages(self) -> tuple[ScoringStage, ...]:
        """Every scoring stage, the teacher's first; a group is READY once the last marked it."""
        return () if self.stage is None else (self.stage, *self.later_stages)

    @property
    def pumps(self) -> list[Pump]:
        # a stage hears that its upstream ended once every pump before it here has returned
        return [self.watchdog, self.rollout, *self.stages, self.train]

    async def resume_from(self, checkpoint: Checkpoint) -> None:
        """Restore a checkpoint into this freshly built pipeline, before `run`.

        Resuming from an older checkpoint than the newest in the checkpoints folder is a rollback:
        the newer checkpoints are moved aside into a `rolled-back-...` folder there (kept, not
        deleted, and logged), so this run's saves never collide with them."""
        if self.resumed is not None:
            raise ConfigError(
                f"this pipeline already resumed from {self.resumed.path}; build a new one",
                field="checkpoint",
                config="Pipeline.resume_from",
            )
        # everything that may refuse the checkpoint comes first, in memory: a refused resume
        # leaves the checkpoint folder (and the trace) as they were
        self._check_host("resume_from")
        check_fingerprint(checkpoint.fingerprint, self.fingerprint, checkpoint.path)
        await self.buffer.load_state_dict(checkpoint.buffer)
        self.ledger.load_state_dict(checkpoint.ledger)
        self.position.step = checkpoint.step
        self.position.weight_version = checkpoint.weight_version
        if self.fingerprint["learner_state"] == "saved":
            learner = typing.cast(Learner, self.train.learner)  # checked by build_pipeline
            loaded = learner.load_state_dict(checkpoint.learner)
            if inspect.isawaitable(loaded):  # an asyncio learner's (`groupflow.impl.aio.part`)
                await loaded
        if self.checkpointer is not None:
            self.checkpointer.lock()  # held until the run ends
            set_aside_newer(self.checkpointer.directory, checkpoint.step, keep=checkpoint.path)
            self.checkpointer.last = {"step": checkpoint.step, "ledger": checkpoint.ledger}
        self.resumed = checkpoint
        if self.trace is not None:
            self.trace.resumed(checkpoint)

    def request_stop(self) -> None:
        """Stop the run before its last step, cleanly: the step training now finishes, a
        checkpoint is saved (with checkpoints on), and the run shuts down; `run` then returns
        with fewer steps. For a Ctrl-C a user wants to resume from. Safe to call at any time,
        more than once, from trio code, from asyncio code on the loop hosting the run
        (`groupflow.impl.aio.run`), from another thread, and before the run begins."""
        if self._token is None or trio.lowlevel.in_trio_task():
            self.train.request_stop()
            return
        try:
            self._token.run_sync_soon(self.train.request_stop)
        except trio.RunFinishedError:
            pass  # the run is over: there is nothing left to stop

    def _check_host(self, method: str) -> None:
        """This call runs in a trio task, and every asyncio part has its asyncio loop: refused
        otherwise in one line, before anything starts, never as failing rollouts."""
        if not trio.lowlevel.in_trio_task():
            raise WrongLoop(
                f"Pipeline.{method}() was awaited outside trio (from asyncio code?): the pipeline "
                f"runs under trio; from asyncio, await groupflow.impl.aio.run(pipeline)"
            )
        self._token = trio.lowlevel.current_trio_token()
        parts = {
            "generator": self.rollout.generator,
            "learner": self.train.learner,
            **{f"stage {s.name!r} scorer": s.scorer for s in self.stages},
            **({"inline scorer": self.inline.scorer} if self.inline is not None else {}),
        }
        on_asyncio = [
            f"{role} {part_name(part)}"
            for role, part in parts.items()
            if getattr(type(part), "groupflow_host", None) == "asyncio"
        ]
        if on_asyncio:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                raise WrongLoop(
                    f"the {on_asyncio[0]} is an asyncio part, and this trio run has no asyncio "
                    f"loop to run it on: run the pipeline with "
                    f"asyncio.run(groupflow.impl.aio.run(pipeline))"
                ) from None

    async def run(self) -> RunResult:
        """Run to the end: `num_steps` trained, or a failure (raised as `PumpFailed`). With
        checkpoints on, the folder is locked against other runs meanwhile. With a trace, a run
        that ends by itself (either way) writes its end line; one cancelled from outside or
        interrupted writes none (to the model that is a crash: see `TraceWriter`)."""
        self._check_host("run")
        try:
            result = await self._run()
        except Exception as exc:
            self._end_trace("failed", error=repr(exc))
            if isinstance(exc, PumpFailed):
                exc.result = self.result()
            raise
        self._end_trace("stopped" if self.status.interrupted else "ok")
        return result

    def _end_trace(self, outcome: str, *, error: str | None = None) -> None:
        if self.trace is not None:
            self.trace.end(
                outcome,
                trained=len(self.ledger.trained),
                given_up=len(self.ledger.shortfall),
                error=error,
            )

    async def _exit(self) -> None:
        """The pumps are done: every group still live is dropped and its rows cleared, so no
        row outlives the run in the store; then the run exits. An unready one (a rollout that
        committed as a failing run stopped its stage) is dropped as the stage drops its
        leftovers, each reported; the READY ones no step trained (a step ahead, or a failed
        run's) go with the exit. Their prompts are issued again on resume (a checkpoint that
        saved them restores them from its own copy). Shielded, and bounded by
        `shutdown_timeout_s`: it runs on the way out of a cancel too."""
        if self.status.phase is Phase.DONE:
            return
        bound = self.config.shutdown_timeout_s
        left: list[GroupView] = []
        with trio.CancelScope(shield=True), trio.move_on_after(bound) as scope:
            try:
                for stage in self.stages:
                    await stage.drop_leftovers()
                left = sorted(
                    (g for g in self.buffer.groups(GroupState.READY) if g.ordinal is not None),
                    key=lambda g: g.ordinal or 0,
                )
                # every group changes state at once; then the store clears their rows
                await self.buffer.discard_many((g.group_id for g in left), actor=Actor.SUPERVISOR)
            except Exception as exc:  # the run's own outcome stands; the store is the news
                log.warning(
                    "the store failed clearing the run's last groups as the run exited (some "
                    "rows may remain in it): %r",
                    exc,
                )
        if scope.cancelled_caught:
            log.warning(
                "the store did not clear the rows of the run's last groups within "
                "shutdown_timeout_s=%g s as the run exited: some may remain in it",
                bound,
            )
        for group in left:
            assert group.ordinal is not None
            self.ledger.mark_dropped(group.ordinal)
        self.status.exit()

    async def _run(self) -> RunResult:
        checkpointer = self.checkpointer
        if checkpointer is not None:
            checkpointer.lock()
        try:
            if checkpointer is not None and self.resumed is None:
                existing = checkpointer.existing()
                if existing:
                    raise CheckpointExists(
                        f"the checkpoints folder {checkpointer.directory} already holds checkpoints "
                        f"(newest {existing[-1].name}): resume from them with "
                        f"pipeline.resume_from(load_checkpoint(dir)), or give an empty folder"
                    )
            try:
                await supervise(
                    self.pumps,
                    shutdown_timeout_s=self.config.shutdown_timeout_s,
                    on_failure=self.status.fail,
                )
            except BaseExceptionGroup as group:
                await self._exit()
                if any(isinstance(e, KeyboardInterrupt) for e in leaves(group)):
                    # Ctrl-C, after every pump's cleanup ran: what `except KeyboardInterrupt`
                    # around the run expects, not a group it would miss
                    raise KeyboardInterrupt from group
                raise
            except BaseException:
                await self._exit()
                raise
            await self._exit()
            leaked = await self.buffer.stray_rows(padding=True)
            if leaked:
                await self.buffer.remove_rows(leaked)
                log.warning(
                    "removed %d rows no group owned at the end of the run (a scorer or a "
                    "store wrote them): %s",
                    len(leaked),
                    leaked[:8],
                )
            self.rows_removed = len(leaked)
        finally:
            if checkpointer is not None:
                checkpointer.unlock()
        return self.result()

    async def run_until_interrupted(
        self, say: Callable[[str], None] = lambda text: None
    ) -> RunResult:
        """`run`, with Ctrl-C as `groupflow train` has it (in the main thread): the first asks
        the run to stop after the step in progress and save a checkpoint (`request_stop`,
        telling `say`), a second quits at once (`KeyboardInterrupt`, after every pump's cleanup
        ran). Elsewhere, `run`."""
        with single_error():  # the run's failure, named, not a group of one
            async with trio.open_nursery() as nursery:
                if threading.current_thread() is threading.main_thread():
                    nursery.start_soon(self._stop_on_sigint, say)
                result = await self.run()
                nursery.cancel_scope.cancel()
        return result

    async def _stop_on_sigint(self, say: Callable[[str], None]) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async for _ in signals:
                if self.train.stop_requested:
                    raise KeyboardInterrupt
                if self.train.done:
                    say(
                        "the last step is trained; the run is ending (Ctrl-C again to quit at once)"
                    )
                else:
                    say(
                        f"stopping: finishing step {self.position.step} and saving a checkpoint "
                        f"(Ctrl-C again to quit at once)"
                    )
                self.request_stop()

    def result(self) -> RunResult:
        """What the run did so far (after it ended: what it did), whether or not it failed."""
        return RunResult(
            steps=tuple(self.train.history),
            trained=frozenset(self.ledger.trained),
            shortfall=frozenset(self.ledger.shortfall),
            rollout_failures=self.rollout.failures,
            unfinished=frozenset(self.ledger.in_flight) | frozenset(self.ledger.reissue),
        )
