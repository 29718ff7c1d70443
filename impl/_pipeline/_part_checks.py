"""What `build_pipeline` checks about the user's parts before anything runs.

Each of these mistakes would otherwise pass silently or fail an hour into a run: a learner
whose weights no checkpoint saves, a generator nobody tells about new weights, a route to a
teacher the scorer does not have, a learner that reads no field, a field no part writes, a
later stage in a design that has none. Each check raises the
error of the nearest kind, naming the part and saying what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence, Sized
from typing import Any

from groupflow.impl._pipeline._config import PipelineConfig
from groupflow.impl._pipeline._part_name import part_name
from groupflow.impl._pipeline._scorer import reads_of, teachers_of
from groupflow.impl._pipeline._scoring_stage import ExtraStage
from groupflow.impl.contract import TEACHER_FIELD
from groupflow.model import GroupState, GroupView
from groupflow.model.errors import ConfigError, GeneratorOutputError, RoutingError
from groupflow.model.policy import Design
from groupflow.model.scheduler.bounds import MAX_STAGES


def check_learner(learner: object, *, stateless: bool) -> None:
    """A learner's state is saved with every checkpoint, or the user says there is none."""
    if not callable(getattr(learner, "train_step", None)):
        raise ConfigError(
            f"learner {part_name(learner)} has no train_step(batch) method",
            field="learner",
            config="build_pipeline",
        )
    has = [m for m in ("state_dict", "load_state_dict") if callable(getattr(learner, m, None))]
    if stateless:
        if has:
            raise ConfigError(
                f"stateless_learner=True, but learner {part_name(learner)} has {' and '.join(has)}: "
                f"its weights would not be checkpointed; drop stateless_learner",
                field="stateless_learner",
                config="build_pipeline",
            )
        return
    if len(has) < 2:
        lacks = [m for m in ("state_dict", "load_state_dict") if m not in has]
        raise ConfigError(
            f"learner {part_name(learner)} has no {' or '.join(lacks)}(): checkpoints could not "
            f"save its weights, and a resume would continue from fresh ones while the ledger "
            f"says the earlier steps were trained; implement both, or pass "
            f"stateless_learner=True if it truly keeps no state",
            field="learner",
            config="build_pipeline",
        )


def check_generator(generator: object) -> None:
    """A generator can generate, and hears of new weights (the weight sync hook)."""
    for method, why in (
        ("generate", "generate(request) returns one group's rows"),
        (
            "sync_weights",
            "sync_weights(version) is awaited after every train step so the generator loads "
            "the new weights (make it a no-op if its weights never change)",
        ),
    ):
        if not callable(getattr(generator, method, None)):
            raise ConfigError(
                f"generator {part_name(generator)} has no {method}(): {why}",
                field="generator",
                config="build_pipeline",
            )


def check_cancel_grace(generator: object, config: PipelineConfig) -> None:
    """A generator that spends time cleaning up after a cancel (`cancel_grace_s`: a served one
    resumes its server) does so within the run's shutdown bound."""
    grace = getattr(generator, "cancel_grace_s", None)
    if isinstance(grace, int | float) and grace >= config.shutdown_timeout_s:
        raise ConfigError(
            f"generator {part_name(generator)}.cancel_grace_s={grace:g} is not below "
            f"shutdown_timeout_s={config.shutdown_timeout_s:g}: a cancelled weight sync could "
            f"outlast the run's shutdown; lower the one or raise the other",
            field="cancel_grace_s",
            config=part_name(generator),
        )


def train_fields_for(
    train_fields: Sequence[str] | None, generator: object, *, stage_fields: Collection[str] = ()
) -> list[str]:
    """The generator's fields the learner reads: those given, or else every field the
    generator declares it writes; never none, so rows do not reach the learner empty. The
    stages' fields (`stage_fields`) are the learner's anyway and are left out here."""
    if isinstance(train_fields, str):
        raise ConfigError(
            f"train_fields={train_fields!r} is one string; pass a list of field names",
            field="train_fields",
            config="build_pipeline",
        )
    if train_fields is None:
        declared = getattr(generator, "fields", None)
        if declared is None:
            raise ConfigError(
                f"train_fields is not given and generator {part_name(generator)} declares no "
                f"`fields`: name the row fields the learner reads, e.g. "
                f"train_fields=['input_ids', 'prompt_length', 'generation_logprobs']",
                field="train_fields",
                config="build_pipeline",
            )
        train_fields = sorted(declared)
    fields = [f for f in dict.fromkeys(train_fields) if f not in stage_fields]
    if not fields:
        raise ConfigError(
            "train_fields is empty: the learner would get rows without any field the generator "
            "wrote (not even input_ids); name the fields it reads",
            field="train_fields",
            config="build_pipeline",
        )
    return fields


def check_fields_written(generator: object, needs: Mapping[str, frozenset[str]]) -> None:
    """Every generator field some part reads (`needs_of`) is written by the generator, when it
    declares its `fields`."""
    declared = getattr(generator, "fields", None)
    if declared is None:
        return  # checked at each commit instead
    written = frozenset(declared)
    for reader, fields in needs.items():
        missing = sorted(fields - written)
        if missing:
            raise ConfigError(
                f"{reader} reads {missing}, which generator {part_name(generator)} does not write "
                f"(its fields: {sorted(declared)})",
                field="train_fields" if reader == "the learner" else "generator",
                config="build_pipeline",
            )


def check_generations(
    ordinal: int, generations: object, *, expected: int, needs: frozenset[str]
) -> list[Mapping[str, Any]]:
    """What a generator returned for one prompt: `expected` mappings, each with every field
    read downstream. Raises `GeneratorOutputError` naming the prompt and the field."""
    if not isinstance(generations, Sequence) or isinstance(generations, (str, bytes)):
        raise GeneratorOutputError(
            f"generator returned a {type(generations).__name__} for prompt {ordinal}; "
            f"expected a sequence of {expected} row mappings"
        )
    if len(generations) != expected:
        raise GeneratorOutputError(
            f"generator returned {len(generations)} rows for prompt {ordinal}; "
            f"num_generations_per_prompt is {expected}"
        )
    for i, row in enumerate(generations):
        if not isinstance(row, Mapping):
            raise GeneratorOutputError(
                f"generator row {i} of prompt {ordinal} is a {type(row).__name__}, not a mapping "
                f"of fields"
            )
        missing = sorted(needs - row.keys())
        if missing:
            raise GeneratorOutputError(
                f"generator row {i} of prompt {ordinal} lacks {missing} (it has "
                f"{sorted(map(str, row))}), which the learner or a teacher reads"
            )
    return list(generations)


TOKENS_FIELD = "input_ids"
"""The row field whose length is a row's tokens (`TokenRow.input_ids`: prompt and response, a
flat sequence of token ids)."""


def tokens_of(generations: Sequence[Mapping[str, Any]]) -> int | None:
    """A group's tokens: the lengths of its rows' `TOKENS_FIELD` added up, or None when a row
    has no such sequence (or one without a length, as a 0-d array). The trace records them
    with the group's commit, so that a fit can read a rollout's and a teacher call's time
    against the tokens they carried."""
    total = 0
    for row in generations:
        ids = row.get(TOKENS_FIELD)
        if not isinstance(ids, Sized) or isinstance(ids, (str, bytes)):
            return None
        try:
            total += len(ids)
        except TypeError:
            return None
    return total


def routes_for(
    route: Callable[[GroupView], str],
    agents: Sequence[str | None],
    *,
    per_step: int,
    scorer: object,
) -> dict[str | None, str]:
    """Each agent's physical teacher, asked of `route` once per agent (with the first prompt
    of that agent) and checked against the teachers the scorer serves."""
    first: dict[str | None, int] = {}
    for ordinal, agent in enumerate(agents):
        first.setdefault(agent, ordinal)
    served = teachers_of(scorer)
    routes: dict[str | None, str] = {}
    for agent, ordinal in first.items():
        probe = GroupView(
            group_id=f"p{ordinal}-route-check",
            state=GroupState.RESERVED,
            target_step=ordinal // per_step,
            ordinal=ordinal,
            agent=agent,
        )
        try:
            teacher = route(probe)
        except (LookupError, ValueError) as exc:
            raise RoutingError(f"no teacher for prompt {ordinal}'s agent {agent!r}: {exc}") from exc
        if served is not None and teacher not in served:
            raise RoutingError(
                f"route sends agent {agent!r} (prompt {ordinal}) to teacher {teacher!r}, which "
                f"scorer {part_name(scorer)} does not serve (it serves {sorted(served)}); pass "
                f"route= (for example teacher_by_agent({{agent: teacher}}))"
            )
        routes[agent] = teacher
    return routes


def needs_of(
    scorers: Sequence[tuple[str, object, str]], train_fields: Sequence[str]
) -> dict[str, frozenset[str]]:
    """Who reads which generator fields: the learner, and each stage's scorer when it says.
    `scorers` lists each stage as (its name, its scorer, the field it writes), in order; a
    stage may read the fields of the stages before it, which the generator need not write,
    and no other stage's (`ConfigError` naming both)."""
    needs = {"the learner": frozenset(train_fields)}
    stage_fields = {field for _, _, field in scorers}
    before: set[str] = set()
    for name, scorer, field in scorers:
        reads = reads_of(scorer)
        later = sorted((reads & stage_fields) - before)
        if later:
            raise ConfigError(
                f"stage {name!r} (scorer {part_name(scorer)}) reads {later}, which only its own or "
                f"a later stage writes; order the stages so each reads what came before",
                field="extra_stages",
                config="build_pipeline",
            )
        if reads - stage_fields:
            needs[f"scorer {part_name(scorer)}"] = frozenset(reads - stage_fields)
        before.add(field)
    return needs


def check_extra_stages(
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


def check_stage_names(extra: Sequence[ExtraStage], routes: Mapping[str | None, str]) -> None:
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
                f"extra stage {spec.name!r}: its scorer {part_name(spec.scorer)} serves "
                f"{sorted(served)}, not {spec.name!r}"
            )
