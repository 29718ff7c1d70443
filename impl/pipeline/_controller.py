"""The controller: builds the pumps a config asks for and runs them under `supervise`.

The stage exists only when scoring is on; the inline baseline replaces it when the config asks
for that design. Everything is wired here and nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl.core import BufferConfig, MemoryStore, PromptLedger, ReplayBuffer, SampleStore
from groupflow.impl.pipeline._checkpoint import (
    Checkpoint,
    Checkpointer,
    check_fingerprint,
    fingerprint,
)
from groupflow.impl.pipeline._config import PipelineConfig
from groupflow.impl.pipeline._inline_baseline import InlineScoring
from groupflow.impl.pipeline._observe import ActionObserver, RunStatus
from groupflow.impl.pipeline._pump import Pump
from groupflow.impl.pipeline._rollout import Generator, RolloutPump, TrainPosition
from groupflow.impl.pipeline._scorer import Scorer
from groupflow.impl.pipeline._supervisor import supervise
from groupflow.impl.pipeline._teacher_stage import TEACHER_FIELD, TeacherStage
from groupflow.impl.pipeline._train import Learner, StepRecord, TrainPump
from groupflow.impl.pipeline._watchdog import StallWatchdog
from groupflow.model import GroupView
from groupflow.model.errors import ConfigError
from groupflow.model.policy import Design


@attrs.frozen
class RunResult:
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

    @property
    def pumps(self) -> list[Pump]:
        pumps: list[Pump] = [self.watchdog, self.rollout]
        if self.stage is not None:
            pumps.append(self.stage)
        pumps.append(self.train)
        return pumps

    async def resume_from(self, checkpoint: Checkpoint) -> None:
        """Restore a checkpoint into this freshly built pipeline, before `run`."""
        check_fingerprint(checkpoint.fingerprint, self.fingerprint, checkpoint.path)
        await self.buffer.load_state_dict(checkpoint.buffer)
        self.ledger.load_state_dict(checkpoint.ledger)
        self.position.step = checkpoint.step
        self.position.weight_version = checkpoint.weight_version
        learner = self.train.learner
        if checkpoint.learner is not None and hasattr(learner, "load_state_dict"):
            learner.load_state_dict(checkpoint.learner)
        if self.checkpointer is not None:
            self.checkpointer.last = {"step": checkpoint.step, "ledger": checkpoint.ledger}

    async def run(self) -> RunResult:
        try:
            await supervise(
                self.pumps,
                shutdown_timeout_s=self.config.shutdown_timeout_s,
                on_failure=self.status.fail,
            )
        except Exception:
            self.status.exit()
            raise
        self.status.exit()
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
    learner: Learner,
    scorer: Scorer | None = None,
    store: SampleStore | None = None,
    route: Callable[[GroupView], str] = lambda group: "teacher",
    agent_of: Callable[[int], str | None] = lambda ordinal: None,
    train_fields: Sequence[str] = (),
    num_steps: int | None = None,
    checkpoint_dir: Path | None = None,
    checkpoint_in_thread: bool = True,
    observer: ActionObserver | None = None,
    lanes: dict[str, int] | None = None,
) -> Pipeline:
    """Wire buffer, ledger and pumps for `config`. `train_fields` are the generator's fields the
    learner reads (the teacher's field is added when scoring is on). `observer` hears every
    abstract action the run takes (`groupflow.impl.pipeline.ActionObserver`); `lanes` numbers the teachers
    for it."""
    scoring = config.scoring
    if (scoring is None) != (scorer is None):
        raise ConfigError(
            "config.scoring and scorer go together: pass both to score groups, or neither",
            field="scoring",
            config="PipelineConfig",
        )
    fields = list(train_fields) + ([TEACHER_FIELD] if scoring is not None else [])
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
    if scoring is not None and scorer is not None:
        if scoring.design is Design.INLINE:
            inline = InlineScoring(
                buffer, scorer, scoring, route=route, on_discard=account, status=status
            )
        else:
            stage = TeacherStage(
                buffer, scorer, scoring, route=route, on_discard=account, status=status
            )
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
    )
    steps = (
        num_steps if num_steps is not None else math.ceil(len(prompts) / config.prompts_per_step)
    )
    train = TrainPump(
        buffer,
        ledger,
        learner,
        config=config,
        position=position,
        num_steps=steps,
        fields=fields,
        status=status,
        stage=stage,
        scoring=stage if stage is not None else inline,
    )

    def progress() -> tuple[int, int, int]:
        """(commits, groups scored, train steps): what the watchdog watches."""
        return rollout.commits, 0 if stage is None else stage.scored, position.step

    watchdog = StallWatchdog(progress, timeout_s=config.stall_timeout_s, action=config.stall_action)
    prints = fingerprint(config, num_prompts=len(prompts), fields=fields)
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
            learner,
            prints,
            stage=stage,
            status=status,
            write_in_thread=checkpoint_in_thread,
        )
        train.checkpointer = checkpointer
    return Pipeline(
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
    )
