"""`groupflow train`'s configuration: every field has a default, every value is checked when the
config is built (before any model is), and a TOML file may set any of them under `[train]`."""

from __future__ import annotations

import enum
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl._core import (
    check_run_size,
    choice,
    non_negative_int,
    positive_int,
    positive_number,
    positive_seconds,
)
from groupflow.impl._pipeline import CheckpointConfig, PipelineConfig, ScoringConfig
from groupflow.impl._trainer._tasks import DOMAINS
from groupflow.impl._trainer._tensorboard import (
    MODES,
    TensorBoardMode,
    refuse_on,
    tensorboard_missing,
)
from groupflow.model.errors import ConfigError
from groupflow.model.policy import CheckpointPolicy, Design, Dispatch, FailurePolicy
from groupflow.model.shape import SHAPE_FIELDS, Shape, shape_dict, split_shape


class Engine(enum.StrEnum):
    """What samples the student and scores with the teachers."""

    TORCH = "torch"
    """The models in this process, in torch."""
    VLLM = "vllm"
    """vLLM servers: the student and the teachers as Hugging Face checkpoints (the student a
    `GPT2LM`, the teachers `LlamaLM`s)."""


SERVED_HEAD_DIM = 32
"""The served student's heads are this wide: the narrowest vLLM's CPU attention takes (a
64-wide student has two)."""


def _refuse(field: str, message: str) -> ConfigError:
    return ConfigError(f"TrainConfig.{field} {message}", field=field, config="TrainConfig")


def _non_negative_float(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise _refuse(attribute.name, f"must be a finite number >= 0, got {value!r}")


def _domains(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise _refuse("domains", f"must be a non-empty list of domain names, got {value!r}")
    unknown = [d for d in value if d not in DOMAINS]
    if unknown or len(set(value)) != len(value):
        raise _refuse(
            "domains", f"must name each of {sorted(DOMAINS)} at most once, got {list(value)!r}"
        )
    return tuple(value)


TRAIN_SHAPE = Shape(
    prompts_per_step=8,
    num_generations_per_prompt=4,
    max_inflight_prompts=16,
    max_buffered_groups=32,
    gate_window=1,
    max_batch_groups=8,
)
"""The embedded run's shape: 16 rollouts at once, 8 groups per teacher call."""

CHECKPOINT_FOLDER = Path("checkpoints")
"""Where a run keeps its checkpoints, inside its run folder."""

_CHECKPOINT_KEYS = ("every_steps", "keep", "policy", "flush_timeout_s")
"""The `[train.checkpoints]` keys: `CheckpointConfig`'s fields a run's TOML may set."""


def _checkpoints(value: object) -> CheckpointConfig:
    """A `[train.checkpoints]` table (or a `CheckpointConfig` in the run folder)."""
    if isinstance(value, CheckpointConfig):
        if value.folder != CHECKPOINT_FOLDER:
            raise _refuse(
                "checkpoints",
                f"folder={str(value.folder)!r}: a run keeps its checkpoints in "
                f"RUN_DIR/{CHECKPOINT_FOLDER}",
            )
        return value
    if not isinstance(value, Mapping):
        raise _refuse("checkpoints", f"must be a table of {list(_CHECKPOINT_KEYS)}, got {value!r}")
    unknown = sorted(set(value) - set(_CHECKPOINT_KEYS))
    if unknown:
        raise _refuse(
            "checkpoints",
            f"has unknown keys {unknown}; known: {list(_CHECKPOINT_KEYS)} (a run keeps its "
            f"checkpoints in RUN_DIR/{CHECKPOINT_FOLDER})",
        )
    return CheckpointConfig(CHECKPOINT_FOLDER, **{"every_steps": 100, "keep": 3, **value})


def _design(value: Design | str) -> Design:
    design = choice(Design, value, config="TrainConfig", field="design")
    if design is Design.COALESCE:
        raise _refuse("design", "'coalesce' is a checker baseline; use 'pump' or 'inline'")
    return design


def _engine(value: Engine | str) -> Engine:
    return choice(Engine, value, config="TrainConfig", field="engine")


def _tensorboard(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in MODES:
        raise _refuse(
            attribute.name, f"must be one of {', '.join(map(repr, MODES))}, got {value!r}"
        )
    if value == "on":
        why = tensorboard_missing()
        if why is not None:
            raise refuse_on(why)


@attrs.frozen
class TrainConfig:
    """What one `groupflow train` run does. The defaults are the embedded run: two domains
    distilled into one student on the CPU in a few minutes."""

    steps: int = attrs.field(default=500, validator=positive_int)
    """Train steps; the run samples `steps * prompts_per_step` prompts."""
    shape: Shape = attrs.field(factory=lambda: TRAIN_SHAPE)
    """Prompts per step, responses per prompt, rollouts at once, buffer size, gate and groups
    per teacher call; in TOML, flat under `[train]` by their own names (`prompts_per_step =
    8`)."""
    domains: tuple[str, ...] = attrs.field(default=tuple(DOMAINS), converter=_domains)
    lr: float = attrs.field(default=3e-3, validator=positive_number)
    clip_low: float = attrs.field(default=0.5, validator=_non_negative_float)
    """The importance weights are truncated to `[clip_low, clip_high]`."""
    clip_high: float = attrs.field(default=2.0, validator=positive_number)
    temperature: float = attrs.field(default=1.0, validator=positive_number)
    """The student samples at this temperature."""
    d_model: int = attrs.field(default=64, validator=positive_int)
    n_layers: int = attrs.field(default=2, validator=positive_int)
    n_heads: int = attrs.field(default=4, validator=positive_int)
    seed: int = attrs.field(default=0, validator=non_negative_int)
    flush_after_s: float = attrs.field(default=0.05, validator=positive_seconds)
    checkpoints: CheckpointConfig = attrs.field(
        factory=lambda: _checkpoints({}), converter=_checkpoints
    )
    """`[train.checkpoints]`: a save after every `every_steps` steps and after the last (the
    run stopped, or its steps trained), the newest `keep` kept, groups still being scored
    waited for (`policy = "flush"`, at most `flush_timeout_s`) or left out to be sampled again
    on resume (`"uncommitted"`). In RUN_DIR/checkpoints."""
    eval_prompts: int = attrs.field(default=64, validator=positive_int)
    """Held-out prompts per domain for the greedy accuracy before and after."""
    reward_weight: float = attrs.field(default=0.0, validator=_non_negative_float)
    """Above 0, a verifier stage after the teacher's checks every response and writes its
    reward (1 right, 0 wrong), added to every token's advantage times this weight; a group
    then trains only once both stages scored it. 0: the teacher's stage alone."""
    design: Design = attrs.field(default=Design.PUMP, converter=_design)
    """How the teacher scores: `pump`, the stage that batches groups across rollouts once
    their rows are written (the permit is free at commit); `inline`, the upstream baseline,
    each group scored inside its rollout, one call per group, holding its permit meanwhile."""
    engine: Engine = attrs.field(default=Engine.TORCH, converter=_engine)
    """`torch`: the student samples and the teachers score in this process; `vllm`: on vLLM
    servers, the student's weights reloaded by its server after each step."""
    tensorboard: TensorBoardMode = attrs.field(default="auto", validator=_tensorboard)
    """TensorBoard events in `RUN_DIR/tensorboard/` (every numeric field of each step's
    `metrics.jsonl` record): `auto` writes them when the tensorboard package is installed, `on`
    always (a config with `on` is refused without the package), `off` never."""
    _pipeline: PipelineConfig = attrs.field(init=False, eq=False, repr=False)
    """The pipeline config built (and checked) from these settings."""

    def __attrs_post_init__(self) -> None:
        check_run_size(self.steps, self.shape.prompts_per_step, config="TrainConfig")
        if self.clip_low > self.clip_high:
            raise _refuse("clip_low", f"={self.clip_low} must be <= clip_high={self.clip_high}")
        if self.d_model % self.n_heads:
            raise _refuse(
                "d_model", f"={self.d_model} must be a multiple of n_heads={self.n_heads}"
            )
        if self.engine is Engine.VLLM and self.d_model % SERVED_HEAD_DIM:
            raise _refuse(
                "d_model",
                f"={self.d_model} must be a multiple of {SERVED_HEAD_DIM} with engine='vllm' "
                f"(the served student's heads are {SERVED_HEAD_DIM} wide)",
            )
        if self.design is Design.INLINE and self.reward_weight > 0:
            raise _refuse(
                "design",
                f"is 'inline', which scores inside the rollout with the teacher alone; the "
                f"verifier stage of reward_weight={self.reward_weight} needs design='pump'",
            )
        # the pipeline's own checks (a buffer smaller than a step, ...) fail here, once
        object.__setattr__(self, "_pipeline", self._build_pipeline_config())

    def pipeline_config(self, checkpoints: Path | None = None) -> PipelineConfig:
        """The pipeline this run drives, its checkpoints written to the folder `checkpoints`
        (a run folder's `RunFolder.checkpoints`)."""
        if checkpoints is None:
            return self._pipeline
        folder = attrs.evolve(self.checkpoints, folder=Path(checkpoints))
        return attrs.evolve(self._pipeline, checkpoints=folder)

    def _build_pipeline_config(self) -> PipelineConfig:
        return PipelineConfig(
            shape=self.shape,
            scoring=ScoringConfig(
                flush_after_s=self.flush_after_s,
                dispatch=Dispatch.DEMAND,
                design=self.design,
                failure_policy=FailurePolicy.RETRY,
                call_timeout_s=120.0,
            ),
            checkpoints=self.checkpoints,
            stall_timeout_s=120.0,
        )

    def evolve(self, **changes: Any) -> TrainConfig:
        """This config with some fields changed (checked again); the shape's sizes go by their
        own names, as in TOML (`evolve(prompts_per_step=4)`)."""
        shape, rest = split_shape(changes, self.shape)
        return attrs.evolve(self, shape=shape, **rest)

    @property
    def num_prompts(self) -> int:
        return self.steps * self.shape.prompts_per_step

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, where: str = "config") -> TrainConfig:
        """A config from `values` (a TOML `[train]` table): an unknown key is refused, naming it
        and the known ones."""
        known = {a.name for a in attrs.fields(cls) if a.init} - {"shape"} | set(SHAPE_FIELDS)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown [train] keys {unknown}; known: {sorted(known)}",
                field=unknown[0],
                config="TrainConfig",
            )
        shape, rest = split_shape(values, TRAIN_SHAPE)
        return cls(shape=shape, **rest)

    @classmethod
    def from_toml(cls, path: Path, *, where: str | None = None) -> TrainConfig:
        """Read `[train]` from a TOML file (the only table it may have). `where` names the
        file in messages (default `--config PATH`)."""
        where = f"--config {path}" if where is None else where
        try:
            data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read it ({exc.strerror})", field="config") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{where}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                f"{exc.start}); TOML files are UTF-8",
                field="config",
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: not valid TOML ({exc})", field="config") from None
        extra = sorted(set(data) - {"train"})
        if extra:
            raise ConfigError(
                f"{where}: unknown tables or keys {extra}; put settings under [train]",
                field=extra[0],
            )
        table = data.get("train", {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [train] must be a table", field="train")
        try:
            return cls.from_mapping(table, where=where)
        except ConfigError as exc:
            if str(exc).startswith(where):
                raise
            raise ConfigError(f"{where}: {exc}", field=exc.field, config=exc.config) from None

    def to_toml(self) -> str:
        """The config as a `[train]` table `from_toml` reads back."""
        lines = ["[train]"]
        for a in attrs.fields(type(self)):
            if not a.init:
                continue
            value = getattr(self, a.name)
            if isinstance(value, CheckpointConfig):
                continue  # a table of its own, after the keys
            if isinstance(value, Shape):
                lines += [f"{name} = {size!r}" for name, size in shape_dict(value).items()]
                continue
            if isinstance(value, str):
                lines.append(f'{a.name} = "{value}"')
            elif isinstance(value, tuple):
                lines.append(
                    f"{a.name} = [{', '.join(repr(v).replace(chr(39), chr(34)) for v in value)}]"
                )
            else:
                lines.append(f"{a.name} = {value!r}")
        lines += ["", "[train.checkpoints]"]
        for key in _CHECKPOINT_KEYS:
            value = getattr(self.checkpoints, key)
            if isinstance(value, CheckpointPolicy):
                lines.append(f'{key} = "{value.value}"')
            elif value is not None:
                lines.append(f"{key} = {value!r}")
        return "\n".join(lines) + "\n"
