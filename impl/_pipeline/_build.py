"""`build_pipeline`: check that the user's parts fit together, then wire the buffer, the ledger
and the pumps for them. Two steps, so that every refusal comes before anything is made.

The stage exists only when scoring is on; the inline baseline replaces it when the config asks
for that design. Everything is wired here and nowhere else.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl._core import BufferConfig, MemoryStore, PromptLedger, ReplayBuffer, SampleStore
from groupflow.impl._pipeline._checkpoint import Checkpointer
from groupflow.impl._pipeline._config import PipelineConfig
from groupflow.impl._pipeline._controller import Pipeline
from groupflow.impl._pipeline._fingerprint import digest_data, fingerprint
from groupflow.impl._pipeline._inline_baseline import InlineScoring
from groupflow.impl._pipeline._observe import RunStatus, lanes_for
from groupflow.impl._pipeline._part_checks import (
    check_cancel_grace,
    check_extra_stages,
    check_fields_written,
    check_generator,
    check_learner,
    check_stage_names,
    needs_of,
    routes_for,
    train_fields_for,
)
from groupflow.impl._pipeline._rollout import RolloutPump, TrainPosition
from groupflow.impl._pipeline._scoring_stage import ExtraStage, ScoringStage, chain
from groupflow.impl._pipeline._trace import TraceWriter, pipeline_header
from groupflow.impl._pipeline._train import StepRecord, TrainPump
from groupflow.impl._pipeline._watchdog import StallWatchdog
from groupflow.impl.contract import TEACHER_FIELD, Generator, Learner, Scorer, StatelessLearner
from groupflow.model import GroupView
from groupflow.model.errors import ConfigError
from groupflow.model.policy import Design


@attrs.frozen
class _Parts:
    """What checking the parts found: each follows from the arguments, and all of them fit."""

    extra: tuple[ExtraStage, ...]
    stages: tuple[tuple[str, Scorer, str], ...]
    """(name, scorer, field) of each scoring stage, the teacher's first."""
    learner_fields: tuple[str, ...]
    needs: Mapping[str, frozenset[str]]
    """The row fields each part reads, by part."""
    agents: tuple[str | None, ...]
    routes: dict[str | None, str]
    num_steps: int

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field a group needs before it trains: the learner's, then each stage's."""
        return (*self.learner_fields, *(field for _, _, field in self.stages))


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
    lanes: dict[str, int] | None = None,
    stateless_learner: bool = False,
    data_digest: str | None = None,
    keep_steps: int | None = 1000,
    on_step: Callable[[StepRecord], None] | None = None,
    trace: Path | None = None,
    extra_stages: Sequence[ExtraStage] = (),
) -> Pipeline:
    """Check that the parts fit together, then wire buffer, ledger and pumps for `config`.

    Every mistake is refused here, naming the part, before anything runs.

    - `config`: sizes, timeouts and policies; `config.scoring` and `scorer` go together, and
      `config.checkpoints` turns checkpoints on.
    - `prompts`: the data, one group per prompt, in order.
    - `generator`: writes each prompt's rows (`Generator`).
    - `learner`: trains on each step's groups (`Learner`); its `state_dict` is saved with
      every checkpoint, unless `stateless_learner=True` says it has none.
    - `scorer`: the teacher stage's calls (`Scorer`), with `config.scoring`.
    - `store`: where rows live (default a `MemoryStore`).
    - `route`: a group's physical teacher from its agent; asked once per agent here and
      checked against the scorer's `teachers`. `agent_of(ordinal)` is prompt `ordinal`'s agent.
    - `train_fields`: the generator's fields the learner reads (default: every field the
      generator declares in `fields`); each stage's field is added.
    - `num_steps`: train steps to run (default: as many as the prompts make).
    - `lanes`: numbers the teachers in the trace (default: by name).
    - `data_digest`: the checkpoint fingerprint's digest of the data (default: digests the
      prompts and their agents; pass one for data too large or opaque to read here).
    - `keep_steps`: the newest this many step records are kept (None: all); `on_step` is
      called with each as it is made.
    - `trace`: a file, or a folder to hold `trace.jsonl`: every action appended as JSON lines
      that `groupflow replay` checks against the model; a restart appends to it.
    - `extra_stages`: scoring stages after the teacher's (a verifier, a reward model), in
      order: each takes the groups the one before it scored and writes its own field, which
      the learner reads too; a group is READY once the last has marked it.
    """
    parts = _check_parts(
        config,
        prompts=prompts,
        generator=generator,
        learner=learner,
        scorer=scorer,
        route=route,
        agent_of=agent_of,
        train_fields=train_fields,
        num_steps=num_steps,
        stateless_learner=stateless_learner,
        data_digest=data_digest,
        keep_steps=keep_steps,
        extra_stages=extra_stages,
    )
    built = _wire(
        config,
        parts,
        prompts=prompts,
        generator=generator,
        learner=learner,
        scorer=scorer,
        store=store,
        route=route,
        agent_of=agent_of,
        lanes=lanes,
        stateless_learner=stateless_learner,
        data_digest=data_digest,
        keep_steps=keep_steps,
        on_step=on_step,
    )
    if trace is not None:
        _attach_trace(built, Path(trace), parts)
    return built


def _check_parts(
    config: PipelineConfig,
    *,
    prompts: Sequence[Any],
    generator: Generator,
    learner: Learner | StatelessLearner,
    scorer: Scorer | None,
    route: Callable[[GroupView], str],
    agent_of: Callable[[int], str | None],
    train_fields: Sequence[str] | None,
    num_steps: int | None,
    stateless_learner: bool,
    data_digest: str | None,
    keep_steps: int | None,
    extra_stages: Sequence[ExtraStage],
) -> _Parts:
    """Refuse parts that do not fit, naming them; what they imply, once they do."""
    scoring = config.scoring
    if (scoring is None) != (scorer is None):
        raise ConfigError(
            "config.scoring and scorer go together: pass both to score groups, or neither",
            field="scoring",
            config="PipelineConfig",
        )
    extra = check_extra_stages(config, extra_stages)
    check_learner(learner, stateless=stateless_learner)
    check_generator(generator)
    check_cancel_grace(generator, config)
    stages = (
        (("teacher", scorer, TEACHER_FIELD), *((e.name, e.scorer, e.field) for e in extra))
        if scorer is not None
        else ()
    )
    stage_fields = [field for _, _, field in stages]
    learner_fields = train_fields_for(train_fields, generator, stage_fields=stage_fields)
    needs = needs_of(list(stages), learner_fields)
    check_fields_written(generator, needs)
    agents = tuple(agent_of(ordinal) for ordinal in range(len(prompts)))
    routes = (
        routes_for(route, agents, per_step=config.shape.prompts_per_step, scorer=scorer)
        if scoring is not None
        else {}
    )
    check_stage_names(extra, routes)
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
    most = math.ceil(len(prompts) / config.shape.prompts_per_step)
    if num_steps is not None and not 1 <= num_steps <= most:
        raise ConfigError(
            f"num_steps={num_steps} must be between 1 and {most}: {len(prompts)} prompts at "
            f"prompts_per_step={config.shape.prompts_per_step} make {most} steps",
            field="num_steps",
            config="build_pipeline",
        )
    return _Parts(
        extra=extra,
        stages=stages,
        learner_fields=tuple(learner_fields),
        needs=needs,
        agents=agents,
        routes=routes,
        num_steps=num_steps if num_steps is not None else most,
    )


def _wire(
    config: PipelineConfig,
    parts: _Parts,
    *,
    prompts: Sequence[Any],
    generator: Generator,
    learner: Learner | StatelessLearner,
    scorer: Scorer | None,
    store: SampleStore | None,
    route: Callable[[GroupView], str],
    agent_of: Callable[[int], str | None],
    lanes: dict[str, int] | None,
    stateless_learner: bool,
    data_digest: str | None,
    keep_steps: int | None,
    on_step: Callable[[StepRecord], None] | None,
) -> Pipeline:
    """Make and connect the run's objects for checked parts."""
    scoring = config.scoring
    fields = list(parts.fields)
    buffer = ReplayBuffer(
        BufferConfig(
            group_size=config.shape.num_generations_per_prompt,
            capacity=config.shape.max_buffered_groups,
            required_fields=frozenset(fields),
        ),
        store if store is not None else MemoryStore(),
    )
    ledger = PromptLedger(num_prompts=len(prompts), changed=buffer.changed)
    position = TrainPosition(changed=buffer.changed)
    status = RunStatus(None, lanes=dict(lanes or {}))

    def account(group: GroupView, why: str) -> None:
        assert group.ordinal is not None
        if why == "failed":
            ledger.mark_shortfall(group.ordinal)
        else:
            ledger.mark_dropped(group.ordinal)

    stage = inline = None
    later: tuple[ScoringStage, ...] = ()
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
            batch = config.shape.max_batch_groups
            stage = ScoringStage(buffer, scorer, scoring, max_batch_groups=batch, **wiring)
            later = tuple(
                ScoringStage(
                    buffer,
                    spec.scorer,
                    scoring,
                    max_batch_groups=batch,
                    **(wiring | {"route": _to(spec.name)}),
                    field=spec.field,
                    name=spec.name,
                )
                for spec in parts.extra
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
        row_fields=frozenset().union(*parts.needs.values()),
    )
    train = TrainPump(
        buffer,
        ledger,
        learner,
        config=config,
        position=position,
        num_steps=parts.num_steps,
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
        lines = [f"groups {held or 'none'}"]
        lines += [line for s in stages for line in s.waiting(now)]
        if inline is not None:
            lines += inline.waiting(now)
        lines.append(train.waiting())
        return "; ".join(lines)

    watchdog = StallWatchdog(
        progress, timeout_s=config.stall_timeout_s, action=config.stall_action, waiting=waiting
    )
    prints = fingerprint(
        prompts_per_step=config.shape.prompts_per_step,
        num_generations_per_prompt=config.shape.num_generations_per_prompt,
        num_prompts=len(prompts),
        fields=fields,
        data=data_digest if data_digest is not None else digest_data(prompts, parts.agents),
        routes=parts.routes,
        learner_state=not stateless_learner,
    )
    checkpointer = None
    if config.checkpoints is not None:
        checkpointer = Checkpointer(
            config.checkpoints,
            buffer,
            ledger,
            position,
            None if stateless_learner else typing.cast(Learner, learner),
            prints,
            stages=stages,
            status=status,
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
        later_stages=later,
    )


def _to(name: str) -> Callable[[GroupView], str]:
    """A later stage's route: every group to its one queue."""
    return lambda group: name


def _attach_trace(pipeline: Pipeline, path: Path, parts: _Parts) -> None:
    """Open the trace (last, once everything else is checked) and let it hear the run. The
    teachers' lanes are fixed now, by name, unless the caller numbered them: the header must
    say which lane each prompt goes to before the stage meets any teacher."""
    status, agents, routes = pipeline.status, parts.agents, parts.routes
    later = [stage.name for stage in pipeline.later_stages]
    if routes and not status.lanes:
        status.lanes.update(lanes_for(sorted(set(routes.values())), later=later))
    routing = [status.lanes[routes[agent]] for agent in agents] if routes else []
    header = pipeline_header(
        pipeline.config,
        prompts=len(agents),
        num_steps=parts.num_steps,
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
