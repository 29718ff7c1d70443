"""Scenarios: a pipeline config, latency models for generation, teachers and training, and
faults, read from small TOML files. The shipped ones live in `groupflow/sim/scenarios/`.

Every random draw is keyed by the seed and by what it is for (a prompt's ordinal, a teacher's
call number), never by the order of events, so two designs run on the same seed see the same
generation times for the same prompts.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import attrs

from groupflow.impl._core import check_run_size, positive_int
from groupflow.impl._pipeline import (
    CheckpointConfig,
    PipelineConfig,
    ScoringConfig,
    StallAction,
)
from groupflow.model.shape import SHAPE_FIELDS, Shape, shape_dict, split_shape
from groupflow.sim.engines import EngineModel, WeightSyncModel
from groupflow.sim.spread import as_spread, draw, rng

_STATED_SIZES = (
    "prompts_per_step",
    "num_generations_per_prompt",
    "max_inflight_prompts",
    "max_buffered_groups",
)
"""The `[pipeline]` sizes a scenario must state (and `[scoring]`'s `max_batch_groups` when it
scores): the shape's defaults are the checker's, not a run's."""


_Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]
"""An attrs validator."""


def _at_least(low: float, *, strict: bool = False) -> _Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"{attribute.name} must be a number, got {value!r}")
        if value < low or (strict and value == low):
            raise ValueError(
                f"{attribute.name} must be {'>' if strict else '>='} {low}, got {value!r}"
            )

    return check


def _probability(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _at_least(0.0)(instance, attribute, value)
    if value > 1:
        raise ValueError(f"{attribute.name} is a probability, at most 1, got {value!r}")


@attrs.frozen
class GenerationModel:
    """Seconds to generate one group: lognormal around `median_s` (a long right tail).

    With `tokens`, each group also draws its tokens (its rows' `input_ids`, added up: what a
    teacher reads), lognormal around `tokens` with spread `tokens_sigma`, and `token_share` of
    its time grows with them: a group of `t` tokens takes `1 - token_share + token_share * t /
    mean` times its drawn seconds, `mean` the tokens' mean, so the mean time stays `median_s`'s.
    """

    median_s: float = attrs.field(validator=_at_least(0.0, strict=True))
    sigma: float = attrs.field(default=0.0, validator=_at_least(0.0))
    min_s: float = attrs.field(default=0.0, validator=_at_least(0.0))
    tokens: float = attrs.field(default=0.0, validator=_at_least(0.0))
    """The median tokens of a group; 0: the rows carry two tokens each, and time none."""
    tokens_sigma: float = attrs.field(default=0.0, validator=_at_least(0.0))
    token_share: float = attrs.field(default=0.0, validator=_probability)

    def __attrs_post_init__(self) -> None:
        if 0 < self.tokens < 1:
            raise ValueError(f"tokens is a group's median tokens, 0 or >= 1, got {self.tokens!r}")
        named = [
            f"{n} = {getattr(self, n)!r}"
            for n in ("tokens_sigma", "token_share")
            if getattr(self, n)
        ]
        if self.tokens == 0 and named:
            raise ValueError(
                f"[generation] {' and '.join(named)} need tokens, a group's median tokens (>= 1)"
            )

    def tokens_of(self, seed: int, ordinal: int, attempt: int = 0) -> int:
        """The tokens of attempt `attempt` at prompt `ordinal` (0 without `tokens`)."""
        if not self.tokens:
            return 0
        if not self.tokens_sigma:
            return max(1, round(self.tokens))
        key = (ordinal,) if attempt == 0 else (ordinal, "attempt", attempt)
        draw = rng(seed, "tokens", *key).lognormvariate(math.log(self.tokens), self.tokens_sigma)
        return max(1, round(draw))

    def seconds(self, seed: int, ordinal: int, attempt: int, tokens: int) -> float:
        """The time of a group of `tokens` tokens: its draw (`sample`) scaled by its tokens
        against their mean, by `token_share`."""
        drawn = self.sample(seed, ordinal, attempt)
        if not self.token_share:
            return drawn
        mean = self.tokens * math.exp(self.tokens_sigma**2 / 2)
        return drawn * (1 - self.token_share + self.token_share * tokens / mean)

    def sample(self, seed: int, ordinal: int, attempt: int = 0) -> float:
        """The time of attempt `attempt` at prompt `ordinal` (a prompt issued again draws
        afresh; the first attempt's draw is keyed as it always was)."""
        if self.sigma == 0:
            return max(self.min_s, self.median_s)
        key = (ordinal,) if attempt == 0 else (ordinal, "attempt", attempt)
        draw = rng(seed, "generate", *key).lognormvariate(math.log(self.median_s), self.sigma)
        return max(self.min_s, draw)


@attrs.frozen
class TeacherModel:
    """Seconds per call: `(fixed_s + per_row_s * rows + per_token_s * tokens, both per DP
    rank) * (1 + U(0, jitter))`, times one of `spread`'s multipliers where it has some.

    A large `fixed_s` is a latency-bound teacher (batching pays); a large `per_row_s` or
    `per_token_s` a compute-bound one (a batch costs about what separate calls would).
    """

    dp: int = attrs.field(default=1, validator=positive_int)
    fixed_s: float = attrs.field(default=1.0, validator=_at_least(0.0))
    per_row_s: float = attrs.field(default=0.0, validator=_at_least(0.0))
    per_token_s: float = attrs.field(default=0.0, validator=_at_least(0.0))
    """Seconds per token the call's rows carry (`GenerationModel.tokens`)."""
    jitter: float = attrs.field(default=0.0, validator=_at_least(0.0))
    spread: tuple[float, ...] = attrs.field(default=(), converter=as_spread)
    """Multipliers of a call's time, one drawn per call with equal shares (`groupflow.sim.spread`):
    a fit keeps the run's own calls' spread around its line here."""

    def duration(self, rows: int, seed: int, teacher: str, call: int, tokens: int = 0) -> float:
        per_rank = math.ceil(rows / self.dp)
        base = self.fixed_s + self.per_row_s * per_rank
        if self.per_token_s:
            base += self.per_token_s * math.ceil(tokens / self.dp)
        base *= draw(self.spread, rng(seed, "teacher-spread", teacher, call))
        return base * (1 + self.jitter * rng(seed, "teacher", teacher, call).random())


def _numbers(what: str, value: Any) -> frozenset[int]:
    if isinstance(value, str) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} must be a list of numbers >= 0, got {value!r}")
    return frozenset(value)


def _call_numbers(value: Any) -> frozenset[int]:
    return _numbers("scorer_error_calls", value)


def _permanent_call_numbers(value: Any) -> frozenset[int]:
    return _numbers("scorer_permanent_error_calls", value)


def _step_numbers(value: Any) -> frozenset[int]:
    return _numbers("train_error_steps", value)


def _optional(check: _Validator) -> _Validator:
    def run(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check(instance, attribute, value)

    return run


@attrs.frozen
class Faults:
    scorer_error_rate: float = attrs.field(default=0.0, validator=_probability)
    """Probability that a teacher call fails."""
    scorer_error_calls: frozenset[int] = attrs.field(factory=frozenset, converter=_call_numbers)
    """Teacher calls (counted from 0 across teachers, in the order they start) that fail."""
    scorer_permanent_error_calls: frozenset[int] = attrs.field(
        factory=frozenset, converter=_permanent_call_numbers
    )
    """Teacher calls (counted as above) that fail with an error retrying cannot fix (an
    `IndexError`, as from a vocabulary too small): under `retry` their groups are given up."""
    scorer_hang_call: int | None = attrs.field(default=None, validator=_optional(_at_least(0)))
    """The call (counted as above) that never returns: the watchdog's case."""
    rollout_failure_rate: float = attrs.field(default=0.0, validator=_probability)
    train_error_steps: frozenset[int] = attrs.field(factory=frozenset, converter=_step_numbers)
    """Train steps whose learner call raises: the run fails there."""
    crash_at_s: float | None = attrs.field(
        default=None, validator=_optional(_at_least(0.0, strict=True))
    )
    """Virtual time of a crash; the run resumes from its last checkpoint (or from scratch)."""


@attrs.frozen
class Scenario:
    name: str
    description: str
    steps: int
    pipeline: PipelineConfig
    generation: GenerationModel
    teachers: Mapping[str, TeacherModel]
    agents: Mapping[str, str]
    """Agent -> physical teacher. Prompt `o` belongs to agent number `o % len(agents)`."""
    train_step_s: float
    faults: Faults = Faults()
    verifier: TeacherModel | None = None
    """A second scoring stage after the teacher's (`[verifier]`: its cost per call, as a
    teacher's), which writes a reward for every row; None: the teacher's stage alone."""
    engines: EngineModel = EngineModel()
    """The inference engines rollouts share (`[engines]`: how many, and how a sequence slows
    as its engine fills); by default one engine that never slows."""
    weight_sync: WeightSyncModel | None = None
    """The push of new weights after each train step (`[weight_sync]`); None: free."""
    train_blocks_loop: bool = False
    """`[train] blocks_loop`: the learner keeps the event loop to itself for its step (it
    computes in the loop's thread, or in a worker thread while the loop has nothing else to
    do): once the tasks ready at its start have run, nothing else in the pipeline moves until
    it ends (`FakeLearner.blocking`)."""

    def __attrs_post_init__(self) -> None:
        check_run_size(
            self.steps,
            self.pipeline.shape.prompts_per_step,
            config=f"scenario {self.name!r}",
            name="steps",
        )
        costs = {f"teachers.{name}": t for name, t in self.teachers.items()}
        if self.verifier is not None:
            costs["verifier"] = self.verifier
        sync = self.weight_sync
        if sync is not None and sync.drain != 1 and not self.engines.batching:
            raise ValueError(
                f"[weight_sync] drain = {sync.drain!r} slows the rollouts on a batching engine, "
                f"and [engines] batching = false serves one at a time: drop one of them"
            )
        priced = [("engines", "per_token", self.engines.per_token)]
        priced += [(name, "per_token_s", t.per_token_s) for name, t in costs.items()]
        if not self.generation.tokens:
            for section, key, cost in priced:
                if cost:
                    raise ValueError(
                        f"[{section}] {key} = {cost!r} needs [generation] tokens (a group's "
                        f"median tokens): without them no group carries any to price"
                    )

    def agent_of(self, ordinal: int) -> str:
        names = sorted(self.agents)
        return names[ordinal % len(names)]


def _section(data: Mapping[str, Any], name: str, source: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"{source}: [{name}] must be a table")
    return dict(value)


SIM_FOLDER = Path("checkpoints")
"""The folder a scenario's `CheckpointConfig` names until a run is given its own."""

_TOP_LEVEL = {
    "name",
    "description",
    "steps",
    "pipeline",
    "scoring",
    "checkpoints",
    "generation",
    "teachers",
    "agents",
    "train",
    "faults",
    "verifier",
    "engines",
    "weight_sync",
}


def parse_scenario(text: str, *, source: str = "<scenario>") -> Scenario:
    """A scenario from TOML text; errors name the file and the offending key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source} is not valid TOML: {exc}") from exc
    try:
        unknown = sorted(set(data) - _TOP_LEVEL)
        if unknown:
            raise ValueError(f"unknown keys or tables {unknown}; known: {sorted(_TOP_LEVEL)}")
        train = _section(data, "train", source)
        if set(train) - {"step_s", "blocks_loop"}:
            raise ValueError(f"[train] knows only step_s and blocks_loop, got {sorted(train)}")
        blocks = train.get("blocks_loop", False)
        if not isinstance(blocks, bool):
            raise ValueError(f"[train] blocks_loop must be true or false, got {blocks!r}")
        steps = data.get("steps", 10)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        scoring = _section(data, "scoring", source)
        settings = _section(data, "pipeline", source)
        needed = [name for name in _STATED_SIZES if name not in settings]
        if needed:
            raise ValueError(f"[pipeline] needs {', '.join(needed)}")
        known = {a.name for a in attrs.fields(PipelineConfig)} - {
            "scoring",
            "checkpoints",
            "shape",
        } | set(SHAPE_FIELDS)
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"[pipeline] has unknown keys {unknown}; known: {sorted(known)}")
        checkpoints = _section(data, "checkpoints", source)
        if "folder" in checkpoints:
            raise ValueError("[checkpoints] has no folder: the simulator gives each run its own")
        scoring = dict(scoring)
        if "max_batch_groups" in settings:
            raise ValueError("[pipeline] max_batch_groups belongs in [scoring]")
        if scoring and "max_batch_groups" not in scoring:
            raise ValueError("[scoring] needs max_batch_groups")
        batch = {"max_batch_groups": scoring.pop("max_batch_groups")} if scoring else {}
        shape, rest = split_shape({**settings, **batch}, Shape())
        pipeline = PipelineConfig(
            shape=shape,
            **rest,
            scoring=ScoringConfig(**scoring) if scoring else None,
            # the simulator gives each run its own folder, and writes inline (virtual time)
            checkpoints=CheckpointConfig(SIM_FOLDER, **checkpoints) if checkpoints else None,
        )
        teachers = {
            name: _built(TeacherModel, f"teachers.{name}", spec)
            for name, spec in _section(data, "teachers", source).items()
        }
        agents = _section(data, "agents", source) or {"default": next(iter(teachers), "teacher")}
        unknown = sorted({t for t in agents.values() if t not in teachers})
        if scoring and unknown:
            raise ValueError(f"agents name teachers with no [teachers.NAME] table: {unknown}")
        return Scenario(
            name=data.get("name", Path(source).stem),
            description=data.get("description", ""),
            steps=steps,
            pipeline=pipeline,
            generation=_built(GenerationModel, "generation", _section(data, "generation", source)),
            teachers=teachers,
            agents=agents,
            train_step_s=_train_seconds(train.get("step_s", 1.0)),
            train_blocks_loop=blocks,
            faults=_faults(_section(data, "faults", source), pipeline),
            verifier=_verifier(data, pipeline, source),
            engines=_built(EngineModel, "engines", _section(data, "engines", source)),
            weight_sync=_built(
                WeightSyncModel, "weight_sync", _section(data, "weight_sync", source)
            )
            if "weight_sync" in data
            else None,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc


def _verifier(
    data: Mapping[str, Any], pipeline: PipelineConfig, source: str
) -> TeacherModel | None:
    if "verifier" not in data:
        return None
    if pipeline.scoring is None:
        raise ValueError("[verifier] scores after the teacher: it needs a [scoring] table")
    return _built(TeacherModel, "verifier", _section(data, "verifier", source))


_Model = TypeVar("_Model", bound=attrs.AttrsInstance)


def _built(cls: type[_Model], table: str, spec: Any) -> _Model:
    """`cls` from the keys of the table `[table]`, a key it does not know refused by name with
    the ones it knows (rather than as a Python keyword error)."""
    if not isinstance(spec, dict):
        raise ValueError(f"[{table}] must be a table, got {spec!r}")
    known = {field.name for field in attrs.fields(cls) if field.init}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"[{table}] has unknown keys {unknown}; known: {sorted(known)}")
    return cls(**spec)


def _train_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"[train] step_s must be seconds >= 0, got {value!r}")
    return float(value)


def _faults(spec: dict[str, Any], pipeline: PipelineConfig) -> Faults:
    faults = Faults(**spec)
    if faults.scorer_hang_call is not None and pipeline.stall_action is not StallAction.ABORT:
        raise ValueError(
            "scorer_hang_call needs [pipeline] stall_action = 'abort': otherwise the watchdog "
            "only warns and the simulated run waits for the hung call forever"
        )
    return faults


def shipped_scenarios() -> list[str]:
    """Names of the scenarios shipped with groupflow."""
    folder = resources.files("groupflow.sim") / "scenarios"
    return sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read scenario {str(path)!r}: {exc}") from exc
        return parse_scenario(text, source=str(path))
    resource = resources.files("groupflow.sim") / "scenarios" / f"{name_or_path}.toml"
    if not resource.is_file():
        raise ValueError(
            f"no scenario {name_or_path!r}: shipped ones are {shipped_scenarios()}, or pass a "
            f"path to a .toml file"
        )
    return parse_scenario(resource.read_text(encoding="utf-8"), source=f"{name_or_path}.toml")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a scenario holds no infinite or NaN numbers, got {value!r}")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple | frozenset):
        items = sorted(value) if isinstance(value, frozenset) else value
        return "[" + ", ".join(_toml_value(v) for v in items) + "]"
    raise ValueError(f"cannot write {value!r} ({type(value).__name__}) to a scenario")


def _toml_table(name: str, values: Mapping[str, Any]) -> str:
    lines = [f"[{name}]"]
    for key, value in values.items():
        if value is None or (isinstance(value, frozenset) and not value):
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _fields(obj: Any, *, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    out = {}
    for field in attrs.fields(type(obj)):
        if field.name in skip:
            continue
        value = getattr(obj, field.name)
        out[field.name] = value.value if hasattr(value, "value") else value
    return out


def scenario_toml(scenario: Scenario) -> str:
    """`scenario` as the TOML text `parse_scenario` reads back (`groupflow sim --from-run`
    writes a fitted one with it)."""
    sizes = shape_dict(scenario.pipeline.shape)
    batch = sizes.pop("max_batch_groups")
    pipeline = {
        **sizes,
        **_fields(scenario.pipeline, skip=frozenset({"scoring", "checkpoints", "shape"})),
    }
    head = {
        "name": scenario.name,
        "description": scenario.description,
        "steps": scenario.steps,
    }
    parts = ["\n".join(f"{k} = {_toml_value(v)}" for k, v in head.items()) + "\n"]
    parts.append(_toml_table("pipeline", pipeline))
    if scenario.pipeline.scoring is not None:
        parts.append(
            _toml_table(
                "scoring",
                {
                    "max_batch_groups": batch,
                    **_fields(scenario.pipeline.scoring, skip=frozenset({"transient_errors"})),
                },
            )
        )
    if scenario.pipeline.checkpoints is not None:
        skip = frozenset({"folder", "write_in_thread"})
        parts.append(_toml_table("checkpoints", _fields(scenario.pipeline.checkpoints, skip=skip)))
    parts.append(_toml_table("generation", _fields(scenario.generation)))
    for name, teacher in scenario.teachers.items():
        parts.append(_toml_table(f'teachers."{name}"', _fields(teacher)))
    if scenario.verifier is not None:
        parts.append(_toml_table("verifier", _fields(scenario.verifier)))
    parts.append(_toml_table("agents", dict(scenario.agents)))
    engines = _fields(scenario.engines)
    engines["slowdown"] = [list(point) for point in scenario.engines.slowdown]
    parts.append(_toml_table("engines", engines))
    if scenario.weight_sync is not None:
        parts.append(_toml_table("weight_sync", _fields(scenario.weight_sync)))
    train: dict[str, Any] = {"step_s": scenario.train_step_s}
    if scenario.train_blocks_loop:
        train["blocks_loop"] = True
    parts.append(_toml_table("train", train))
    faults = _fields(scenario.faults)
    if any(v not in (None, 0.0, frozenset()) for v in faults.values()):
        parts.append(_toml_table("faults", faults))
    return "\n".join(parts)
