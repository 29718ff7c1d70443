"""The controller: builds the pumps a config asks for and runs them under `supervise`.

The stage exists only when scoring is on; the inline baseline replaces it when the config asks
for that design. Everything is wired here and nowhere else.
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl.core import BufferConfig, MemoryStore, PromptLedger, ReplayBuffer, SampleStore
from groupflow.impl.pipeline._checkpoint import Checkpoint, Checkpointer
from groupflow.impl.pipeline._checkpoint_disk import set_aside_newer
from groupflow.impl.pipeline._config import PipelineConfig
from groupflow.impl.pipeline._contract import (
    check_fields_written,
    check_generator,
    check_learner,
    needs_of,
    routes_for,
    train_fields_for,
)
from groupflow.impl.pipeline._fingerprint import check_fingerprint, digest_data, fingerprint
from groupflow.impl.pipeline._inline_baseline import InlineScoring
from groupflow.impl.pipeline._observe import ActionObserver, RunStatus, lanes_for
from groupflow.impl.pipeline._pump import Pump, leaves
from groupflow.impl.pipeline._rollout import Generator, RolloutPump, TrainPosition
from groupflow.impl.pipeline._scorer import Scorer, teachers_of
from groupflow.impl.pipeline._supervisor import supervise
from groupflow.impl.pipeline._teacher_stage import (
    TEACHER_FIELD,
    ExtraStage,
    TeacherStage,
    chain,
)
from groupflow.impl.pipeline._trace import TraceWriter, pipeline_header
from groupflow.impl.pipeline._train import Learner, StatelessLearner, StepRecord, TrainPump
from groupflow.impl.pipeline._watchdog import StallWatchdog
from groupflow.model import GroupView
from groupflow.model.errors import CheckpointExists, ConfigError, RoutingError
from groupflow.model.policy import Design
from groupflow.model.scheduler.bounds import MAX_STAGES

log = logging.getLogger("groupflow.pipeline")


@attrs.frozen
class RunResult:
    """What a run did: its newest `keep_steps` step records, and what became of each prompt."""

    steps: tuple[StepRecord, ...]
    trained: frozenset[int]
    shortfall: frozenset[int]
    rollout_failures: int


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
    stage: TeacherStage | None = None
    inline: InlineScoring | None = None
    checkpointer: Checkpointer | None = None
    resumed: Checkpoint | None = None
    """The checkpoint this pipeline resumed from, if any."""
    rows_removed: int = 0
    """Rows no group owned that the end of the run found in the store, and removed."""
    trace: TraceWriter | None = None
    """Writes the run's actions for `groupflow replay` (`build_pipeline(trace=...)`)."""
    later_stages: tuple[TeacherStage, ...] = ()
    """The stages after the teacher's (`build_pipeline(extra_stages=...)`), in order."""

    @property
    def stages(self) -> tuple[TeacherStage, ...]:
        """Every scoring stage, the teacher's first; a group is READY once the last marked it."""
        return () if self.stage is None else (self.stage, *self.later_stages)

    @property
    def pumps(self) -> list[Pump]:
        # a stage hears that its upstream ended once every pump before it here has returned
        return [self.watchdog, self.rollout, *self.stages, self.train]

    async def resume_from(self, checkpoint: Checkpoint) -> None:
        """Restore a checkpoint into this freshly built pipeline, before `run`.

        Resuming from an older checkpoint than the newest in `checkpoint_dir` is a rollback:
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
        check_fingerprint(checkpoint.fingerprint, self.fingerprint, checkpoint.path)
        await self.buffer.load_state_dict(checkpoint.buffer)
        self.ledger.load_state_dict(checkpoint.ledger)
        self.position.step = checkpoint.step
        self.position.weight_version = checkpoint.weight_version
        if self.fingerprint["learner_state"] == "saved":
            learner = typing.cast(Learner, self.train.learner)  # checked by build_pipeline
            learner.load_state_dict(checkpoint.learner)
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
        with fewer steps. For a Ctrl-C a user wants to resume from. Safe to call from trio
        code at any time, more than once."""
        self.train.request_stop()

    async def run(self) -> RunResult:
        """Run to the end: `num_steps` trained, or a failure (raised as `PumpFailed`). With
        checkpoints on, the folder is locked against other runs meanwhile. With a trace, a run
        that ends by itself (either way) writes its end line; one cancelled from outside or
        interrupted writes none (to the model that is a crash: see `TraceWriter`)."""
        try:
            result = await self._run()
        except Exception as exc:
            self._end_trace("failed", error=repr(exc))
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

    async def _run(self) -> RunResult:
        checkpointer = self.checkpointer
        if checkpointer is not None:
            checkpointer.lock()
        try:
            if checkpointer is not None and self.resumed is None:
                existing = checkpointer.existing()
                if existing:
                    raise CheckpointExists(
                        f"checkpoint_dir {checkpointer.directory} already holds checkpoints "
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
                self.status.exit()
                if any(isinstance(e, KeyboardInterrupt) for e in leaves(group)):
                    # Ctrl-C, after every pump's cleanup ran: what `except KeyboardInterrupt`
                    # around the run expects, not a group it would miss
                    raise KeyboardInterrupt from group
                raise
            except BaseException:
                self.status.exit()
                raise
            self.status.exit()
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
        return RunResult(
            steps=tuple(self.train.history),
            trained=frozenset(self.ledger.trained),
            shortfall=frozenset(self.ledger.shortfall),
            rollout_failures=self.rollout.failures,
        )


def build_pipeline(
    config: PipelineConfig,
    *,
    prompts: Sequence[Any],
    generator: Generator,
    learner: Learner | StatelessLearner,
    scorer: Scorer | None = None,
    store: SampleStore | None = None,
    route: Callable[[GroupView], str] = lambda group: "teacher",
    agent_of: Callable[[int], str | None] = lambda ordinal: None,
    train_fields: Sequence[str] | None = None,
    num_steps: int | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_in_thread: bool = True,
    observer: ActionObserver | None = None,
    lanes: dict[str, int] | None = None,
    stateless_learner: bool = False,
    data_digest: str | None = None,
    keep_steps: int | None = 1000,
    on_step: Callable[[StepRecord], None] | None = None,
    trace: Path | None = None,
    extra_stages: Sequence[ExtraStage] = (),
) -> Pipeline:
    """Wire buffer, ledger and pumps for `config`, after checking the parts fit together.

    `train_fields` are the generator's fields the learner reads (default: every field the
    generator declares in `fields`; the teacher's field is added when scoring is on). `route`
    gives a group's physical teacher from its agent (`agent_of(ordinal)`); it is asked once per
    agent here and checked against the scorer's `teachers`. A learner must have `state_dict`
    and `load_state_dict`, saved with every checkpoint, unless `stateless_learner=True`. The
    checkpoint fingerprint digests the prompts and their agents; pass `data_digest` for data
    too large or too opaque to read here. The run keeps the records of its newest `keep_steps`
    train steps (None: all); `on_step` is called with each as it is made. `observer` hears every abstract action the run takes
    (`groupflow.impl.pipeline.ActionObserver`); `lanes` numbers the teachers for it.
    `trace` (a file, or a folder to hold `trace.jsonl`) appends every action to a JSON-lines
    trace that `groupflow replay` checks against the model; it is written beside any
    observer, and a restart appends to the same file (`TraceWriter`).
    `extra_stages` are scoring stages after the teacher's (a verifier, a reward model), in
    order: each takes the groups the one before it scored and writes its own field, which the
    learner then reads too; a group is READY once the last has marked it."""
    scoring = config.scoring
    if (scoring is None) != (scorer is None):
        raise ConfigError(
            "config.scoring and scorer go together: pass both to score groups, or neither",
            field="scoring",
            config="PipelineConfig",
        )
    extra = _check_extra_stages(config, extra_stages)
    check_learner(learner, stateless=stateless_learner)
    check_generator(generator)
    stage_specs = (
        [("teacher", scorer, TEACHER_FIELD), *((e.name, e.scorer, e.field) for e in extra)]
        if scorer is not None
        else []
    )
    stage_fields = [field for _, _, field in stage_specs]
    learner_fields = train_fields_for(train_fields, generator, stage_fields=stage_fields)
    needs = needs_of(stage_specs, learner_fields)
    check_fields_written(generator, needs)
    agents = [agent_of(ordinal) for ordinal in range(len(prompts))]
    routes = (
        routes_for(route, agents, per_step=config.prompts_per_step, scorer=scorer)
        if scoring is not None
        else {}
    )
    _check_stage_names(extra, routes)
    if keep_steps is not None and (isinstance(keep_steps, bool) or keep_steps < 1):
        raise ConfigError(
            f"keep_steps={keep_steps!r} must be a positive number of steps, or None for all",
            field="keep_steps",
            config="build_pipeline",
        )
    if data_digest is not None and (not isinstance(data_digest, str) or not data_digest):
        raise ConfigError(
            f"data_digest={data_digest!r} must be a non-empty string",
            field="data_digest",
            config="build_pipeline",
        )
    fields = learner_fields + stage_fields
    buffer = ReplayBuffer(
        BufferConfig(
            group_size=config.num_generations_per_prompt,
            capacity=config.max_buffered_groups,
            required_fields=frozenset(fields),
        ),
        store if store is not None else MemoryStore(),
    )
    ledger = PromptLedger(num_prompts=len(prompts), changed=buffer.changed)
    position = TrainPosition(changed=buffer.changed)
    status = RunStatus(observer, lanes=dict(lanes or {}))

    def account(group: GroupView, why: str) -> None:
        assert group.ordinal is not None
        if why == "failed":
            ledger.mark_shortfall(group.ordinal)
        else:
            ledger.mark_dropped(group.ordinal)

    stage = inline = None
    later: tuple[TeacherStage, ...] = ()
    if scoring is not None and scorer is not None:
        wiring: dict[str, Any] = {
            "route": route,
            "on_discard": account,
            "status": status,
            "abandon_after_s": config.shutdown_timeout_s,
        }
        if scoring.design is Design.INLINE:
            inline = InlineScoring(buffer, scorer, scoring, **wiring)
        else:
            stage = TeacherStage(buffer, scorer, scoring, **wiring)
            later = tuple(
                TeacherStage(
                    buffer,
                    spec.scorer,
                    scoring,
                    **(wiring | {"route": _to(spec.name)}),
                    field=spec.field,
                    name=spec.name,
                )
                for spec in extra
            )
    stages = (stage, *later) if stage is not None else ()
    chain(stages)
    rollout = RolloutPump(
        buffer,
        ledger,
        generator,
        config=config,
        position=position,
        prompts=prompts,
        status=status,
        agent_of=agent_of,
        stage=stage,
        inline=inline,
        row_fields=frozenset().union(*needs.values()),
    )
    most = math.ceil(len(prompts) / config.prompts_per_step)
    if num_steps is not None and not 1 <= num_steps <= most:
        raise ConfigError(
            f"num_steps={num_steps} must be between 1 and {most}: {len(prompts)} prompts at "
            f"prompts_per_step={config.prompts_per_step} make {most} steps",
            field="num_steps",
            config="build_pipeline",
        )
    steps = num_steps if num_steps is not None else most
    train = TrainPump(
        buffer,
        ledger,
        learner,
        config=config,
        position=position,
        num_steps=steps,
        fields=fields,
        status=status,
        stages=stages,
        scoring=stage if stage is not None else inline,
        sync_weights=generator.sync_weights,
        keep_steps=keep_steps,
        on_step=on_step,
    )

    def progress() -> tuple[int, int, int]:
        """(commits, groups scored, train steps): what the watchdog watches."""
        return rollout.commits, sum(s.scored for s in stages), position.step

    def waiting(now: float) -> str:
        """What the run is stuck on, in words: its groups by state, each teacher's call and
        queue, and what training waits for."""
        counts = buffer.counts()
        held = ", ".join(f"{n} {state.value}" for state, n in counts.items() if n)
        parts = [f"groups {held or 'none'}"]
        parts += [line for s in stages for line in s.waiting(now)]
        if inline is not None:
            parts += inline.waiting(now)
        parts.append(train.waiting())
        return "; ".join(parts)

    watchdog = StallWatchdog(
        progress, timeout_s=config.stall_timeout_s, action=config.stall_action, waiting=waiting
    )
    prints = fingerprint(
        prompts_per_step=config.prompts_per_step,
        num_generations_per_prompt=config.num_generations_per_prompt,
        num_prompts=len(prompts),
        fields=fields,
        data=data_digest if data_digest is not None else digest_data(prompts, agents),
        routes=routes,
        learner_state=not stateless_learner,
    )
    if checkpoint_dir is not None and config.checkpoint_every_steps is None:
        raise ConfigError(
            f"checkpoint_dir={str(checkpoint_dir)!r} is set but checkpoint_every_steps is not: "
            f"no checkpoint would be saved; set checkpoint_every_steps",
            field="checkpoint_every_steps",
            config="PipelineConfig",
        )
    checkpointer = None
    if config.checkpoint_every_steps is not None:
        if checkpoint_dir is None:
            raise ConfigError(
                f"checkpoint_every_steps={config.checkpoint_every_steps} needs a checkpoint_dir",
                field="checkpoint_every_steps",
                config="PipelineConfig",
            )
        checkpointer = Checkpointer(
            Path(checkpoint_dir),
            config.checkpoint_every_steps,
            config,
            buffer,
            ledger,
            position,
            None if stateless_learner else typing.cast(Learner, learner),
            prints,
            stages=stages,
            status=status,
            write_in_thread=checkpoint_in_thread,
        )
        train.checkpointer = checkpointer
    built = Pipeline(
        config,
        buffer,
        ledger,
        position,
        rollout,
        train,
        watchdog,
        prints,
        status,
        stage,
        inline,
        checkpointer,
        later_stages=later,
    )
    if trace is not None:
        _attach_trace(built, Path(trace), agents=agents, routes=routes, steps=steps)
    return built


def _to(name: str) -> Callable[[GroupView], str]:
    """A later stage's route: every group to its one queue."""
    return lambda group: name


def _check_extra_stages(
    config: PipelineConfig, extra_stages: Sequence[ExtraStage]
) -> tuple[ExtraStage, ...]:
    """Later stages come after the teacher's, in the pump design, as many as the model knows."""
    if isinstance(extra_stages, ExtraStage) or not isinstance(extra_stages, Sequence):
        raise ConfigError(
            f"extra_stages={extra_stages!r} must be a list of ExtraStage",
            field="extra_stages",
            config="build_pipeline",
        )
    extra = tuple(extra_stages)
    if not extra:
        return extra
    bad = [e for e in extra if not isinstance(e, ExtraStage)]
    if bad:
        raise ConfigError(
            f"extra_stages holds {bad[0]!r}, not an ExtraStage(name, scorer, field)",
            field="extra_stages",
            config="build_pipeline",
        )
    if config.scoring is None:
        raise ConfigError(
            f"extra_stages={[e.name for e in extra]} need the teacher stage first: set "
            f"config.scoring and pass a scorer",
            field="extra_stages",
            config="build_pipeline",
        )
    if config.scoring.design is not Design.PUMP:
        raise ConfigError(
            f"extra_stages={[e.name for e in extra]} need design='pump' (the inline baseline "
            f"scores in the rollout, one teacher call and no later stage); it is "
            f"{config.scoring.design.value!r}",
            field="extra_stages",
            config="build_pipeline",
        )
    if 1 + len(extra) > MAX_STAGES:
        raise ConfigError(
            f"extra_stages={[e.name for e in extra]}: the model checks runs of at most "
            f"{MAX_STAGES} scoring stages, the teacher's included, so at most {MAX_STAGES - 1} "
            f"extra stage",
            field="extra_stages",
            config="build_pipeline",
        )
    fields = [TEACHER_FIELD, *(e.field for e in extra)]
    names = [e.name for e in extra]
    for what, values in (("field", fields), ("name", names)):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ConfigError(
                f"extra_stages: two stages share the {what} {twice[0]!r}; each stage needs its own",
                field="extra_stages",
                config="build_pipeline",
            )
    return extra


def _check_stage_names(extra: Sequence[ExtraStage], routes: Mapping[str | None, str]) -> None:
    """A later stage's queue is named after it, beside the teachers': names must not clash,
    and a scorer that says whom it serves must serve the stage."""
    teachers = set(routes.values())
    for spec in extra:
        if spec.name in teachers:
            raise ConfigError(
                f"extra stage {spec.name!r} has the name of a teacher; name it otherwise",
                field="extra_stages",
                config="build_pipeline",
            )
        served = teachers_of(spec.scorer)
        if served is not None and spec.name not in served:
            raise RoutingError(
                f"extra stage {spec.name!r}: its scorer {type(spec.scorer).__name__} serves "
                f"{sorted(served)}, not {spec.name!r}"
            )


def _attach_trace(
    pipeline: Pipeline,
    path: Path,
    *,
    agents: Sequence[str | None],
    routes: dict[str | None, str],
    steps: int,
) -> None:
    """Open the trace (last, once everything else is checked) and let it hear the run. The
    teachers' lanes are fixed now, by name, unless the caller numbered them: the header must
    say which lane each prompt goes to before the stage meets any teacher."""
    status = pipeline.status
    later = [stage.name for stage in pipeline.later_stages]
    if routes and not status.lanes:
        status.lanes.update(lanes_for(sorted(set(routes.values())), later=later))
    routing = [status.lanes[routes[agent]] for agent in agents] if routes else []
    header = pipeline_header(
        pipeline.config,
        prompts=len(agents),
        num_steps=steps,
        routing=routing,
        lanes=status.lanes,
        # the inline baseline scores inside the rollout: one scoring stage with no pump
        stages=len(pipeline.stages) if pipeline.inline is None else 1,
    )
    writer = TraceWriter.open(path, header=header)
    writer.bind(pipeline.buffer, pipeline.position, status)
    status.recorder = writer
    pipeline.ledger.on_settled = writer.settled
    pipeline.trace = writer
