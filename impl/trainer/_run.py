"""One `groupflow train` run: teachers, student, generator and learner wired through
`build_pipeline` (the controller the property machines verify: there is no second code path),
with metrics, a progress bar, checkpoints, a clean stop on Ctrl-C, and the report at the end.

The run folder holds `config.toml` (what ran), `metrics.jsonl` (one line per step),
`tensorboard/` (the same per-step scalars as TensorBoard events, when the package is there),
`trace.jsonl` (every action, for `groupflow replay`), `checkpoints/`, and at the end
`curves.png` and `summary.txt`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch

from groupflow.impl.core import SampleStore
from groupflow.impl.engines import ServedGenerator, is_url
from groupflow.impl.pipeline import (
    TRACE_FILE,
    Checkpoint,
    Scorer,
    StepRecord,
    Teacher,
    ThreadedScorer,
    build_pipeline,
    load_checkpoint,
)
from groupflow.impl.teachers import (
    AliasMap,
    RoutingConfig,
    ServedLM,
    TeacherScorer,
    resolve_device,
    router,
)
from groupflow.impl.trainer._config import CHECKPOINT_FOLDER, Engine, TrainConfig
from groupflow.impl.trainer._domain_teachers import (
    DEFAULT_RECIPE,
    ENGINE_RECIPE,
    TeacherRecipe,
    domain_teacher,
)
from groupflow.impl.trainer._engines import RunEngines
from groupflow.impl.trainer._generator import StudentGenerator
from groupflow.impl.trainer._greedy import greedy_accuracy
from groupflow.impl.trainer._learner import TRAIN_FIELDS, DistillLearner
from groupflow.impl.trainer._student import run_student
from groupflow.impl.trainer._tasks import Prompt, make_prompts
from groupflow.impl.trainer._teacher_override import (
    parse_domain_value,
    parse_teacher_override,
    teacher_from_path,
)
from groupflow.impl.trainer._tensorboard import TENSORBOARD_DIR, ScalarLog, open_scalar_log
from groupflow.impl.trainer._verifier import verifier_stage
from groupflow.model.errors import ConfigError

log = logging.getLogger("groupflow.trainer")

EVAL_SEED = 1_000
"""The held-out prompts' seed: far from the training prompts' (seed `config.seed`)."""


TRACE_BATCH_S = 0.25
"""The trace's lines are written in batches (`TraceWriter.write_in_batches`): one line at a
time, each `write` releases the GIL to the sampling and scoring threads, and trio's thread
waits to take it back (about 100 us a line, 2% of a run's wall time). A process killed
outright loses at most the last quarter second of lines, never a checkpoint's."""


@attrs.frozen
class DomainTeacher:
    """The physical teacher a domain is routed to, and what to call it (shared when two
    domains name the same checkpoint or URL). `teacher` is None for one served at a URL."""

    name: str
    teacher: Teacher | None


def _local(teacher: DomainTeacher) -> Teacher:
    if teacher.teacher is None:
        raise ConfigError(
            f"teacher {teacher.name!r} is served at a URL: a run of engine='torch' scores with "
            f"teachers in this process; use --engine vllm",
            field="teacher_url",
        )
    return teacher.teacher


@attrs.frozen
class TrainSummary:
    out: Path
    steps: int
    """Steps trained, in total, across resumes."""
    stopped_early: bool
    wall_s: float
    steps_per_s: float
    accuracy_before: Mapping[str, float]
    """Greedy accuracy on held-out prompts, per domain, before this run's first step."""
    accuracy_after: Mapping[str, float]
    kl_first: float
    """Mean teacher-student KL over the first steps logged (of the whole run, resumes
    included), and over the last."""
    kl_last: float
    refit_ms: float
    """Mean time of a weight sync (generator refit), ms."""
    curves: Path | None
    metrics: Path


ProgressFactory = Callable[[int, int], Any]
"""(total steps, steps done) -> a tqdm-like bar with `update`, `set_postfix_str`, `close`."""


def progress_bar(total: int, done: int) -> Any:
    """The terminal's progress bar (tqdm): steps, the step rate, KL and accuracy."""
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True)


def teacher_choices(
    config: TrainConfig, *, overrides: Sequence[str] = (), urls: Sequence[str] = ()
) -> tuple[dict[str, Path], dict[str, str]]:
    """The `--teacher DOMAIN=PATH` and `--teacher-url DOMAIN=URL` flags, checked (nothing is
    loaded): each domain's saved teacher, and each domain's server."""
    chosen: dict[str, Path] = {}
    for text in overrides:
        domain, path = parse_teacher_override(text)
        _check_domain(config, domain, f"--teacher {text}")
        chosen[domain] = path
    served: dict[str, str] = {}
    for text in urls:
        domain, url = parse_domain_value(
            text, flag="--teacher-url", what="URL", example="count=http://127.0.0.1:8000"
        )
        _check_domain(config, domain, f"--teacher-url {text}")
        if config.engine is not Engine.VLLM:
            raise ConfigError(
                f"--teacher-url {text}: a teacher at a URL is scored on an engine; add "
                f"--engine vllm",
                field="teacher_url",
            )
        if not is_url(url):
            raise ConfigError(
                f"--teacher-url {text}: {url!r} is not an http:// or https:// URL",
                field="teacher_url",
            )
        if domain in chosen:
            raise ConfigError(
                f"--teacher-url {text}: domain {domain!r} has a --teacher too; give one",
                field="teacher_url",
            )
        served[domain] = url
    return chosen, served


def provide_teachers(
    config: TrainConfig,
    *,
    overrides: Sequence[str] = (),
    urls: Sequence[str] = (),
    device: str = "auto",
    cache_dir: Path | None = None,
    say: Callable[[str], None] = lambda text: None,
    recipe: TeacherRecipe | None = None,
) -> dict[str, DomainTeacher]:
    """Each domain's teacher: a `--teacher DOMAIN=PATH` override (domains naming one path share
    that teacher), a `--teacher-url DOMAIN=URL` (engine `vllm`: a server the user runs), or
    the domain's own, trained on first use and cached (`domain_teacher`, by `recipe`: by
    default in the Llama architecture for an engine)."""
    chosen, served = teacher_choices(config, overrides=overrides, urls=urls)
    # the user's files first: one that does not load is refused before a teacher is trained
    loaded = {
        path: teacher_from_path(path, device=device) for path in dict.fromkeys(chosen.values())
    }
    if recipe is None:
        recipe = ENGINE_RECIPE if config.engine is Engine.VLLM else DEFAULT_RECIPE
    out = {}
    for domain in config.domains:
        if domain in served:
            out[domain] = DomainTeacher(served[domain], None)
        elif domain in chosen:
            out[domain] = DomainTeacher(str(chosen[domain]), loaded[chosen[domain]])
        else:
            teacher = domain_teacher(
                domain, cache_dir=cache_dir, device=device, on_progress=say, recipe=recipe
            )
            out[domain] = DomainTeacher(f"{domain}-teacher", teacher)
    return out


def _check_domain(config: TrainConfig, domain: str, flag: str) -> None:
    if domain not in config.domains:
        raise ConfigError(f"{flag}: this run's domains are {list(config.domains)}", field="teacher")


def greedy_accuracy_by_domain(model: torch.nn.Module, config: TrainConfig) -> dict[str, float]:
    """The share of held-out prompts of each domain the model answers right, greedily."""
    return {
        name: greedy_accuracy(
            model, name, make_prompts(config.eval_prompts, domains=(name,), seed=EVAL_SEED)
        )
        for name in config.domains
    }


def _numbers(prefix: str, value: object, *, sep: str = "/") -> dict[str, int | float]:
    """The numbers in `value` (an attrs instance, a mapping, a number) by name under
    `prefix` (joined by `sep`, deeper levels by a slash): how a stage's metrics become
    `metrics.jsonl` fields (`teacher_calls`, `teacher_reasons/demand`), whatever their
    shape."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int):
        return {prefix: value}
    if isinstance(value, float):
        return {prefix: round(value, 6)}
    if attrs.has(type(value)):
        value = attrs.asdict(value, recurse=False)  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        out: dict[str, int | float] = {}
        for key, item in value.items():
            out.update(_numbers(f"{prefix}{sep}{key}", item))
        return out
    return {}


@attrs.define
class _Metrics:
    """Appends each step's record to `metrics.jsonl`, writes its scalars to TensorBoard (when
    `scalars` is set) and moves the progress bar."""

    file: TextIO
    bar: Any
    began: float
    done: int
    kls: list[float] = attrs.field(factory=list)
    syncs: list[float] = attrs.field(factory=list)
    scalars: ScalarLog | None = None
    last: float | None = None
    """When the previous step's record came (None before the first)."""

    def on_step(self, record: StepRecord) -> None:
        now = time.perf_counter()
        since = now - (self.began if self.last is None else self.last)
        self.last = now
        line: dict[str, Any] = {
            "step": record.step,
            "wall_s": round(now - self.began, 4),
            "steps_per_s": round(1 / since, 4) if since > 0 else 0.0,
            "groups": record.groups,
            "shortfall": record.shortfall,
            "waited_s": round(record.waited_s, 6),
            "train_s": round(record.train_s, 6),
            "sync_s": round(record.sync_s, 6),
            "skipped": record.skipped,
            **{k: round(v, 6) for k, v in record.stats.items()},
        }
        stages = {"teacher": record.scoring, **record.later_scoring}
        for name, scored in stages.items():
            if scored is not None:  # teacher_calls, teacher_queue_wait_s, verifier_groups, ...
                line.update(_numbers(name, scored, sep="_"))
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        if self.scalars is not None:
            self.scalars.write(record.step, line)
        self.done += 1
        if not record.skipped:
            self.kls.append(record.stats["kl"])
            self.syncs.append(record.sync_s)
        if self.bar is not None:
            accuracy = " ".join(
                f"{k.split('/', 1)[1]}={v:.2f}"
                for k, v in record.stats.items()
                if k.startswith("accuracy/")
            )
            self.bar.set_postfix_str(f"kl={record.stats.get('kl', float('nan')):.3f} {accuracy}")
            self.bar.update(1)


def _routes(config: TrainConfig, teachers: Mapping[str, DomainTeacher]) -> AliasMap:
    missing = [d for d in config.domains if d not in teachers]
    if missing:
        raise ConfigError(f"no teacher for domains {missing}", field="teachers")
    return AliasMap.build(
        {d: d for d in config.domains}, {d: teachers[d].name for d in config.domains}
    )


def resume_checkpoint(out: Path, config: TrainConfig) -> Checkpoint:
    """The checkpoint a `--resume` of the run folder `out` continues from, every check made
    before any work (the run's own config, a checkpoint that verifies): refused, nothing in
    the folder has changed."""
    checkpoints = Path(out) / CHECKPOINT_FOLDER
    if not checkpoints.is_dir():
        raise ConfigError(f"--resume {out}: no checkpoints/ folder there", field="resume")
    saved = TrainConfig.from_toml(Path(out) / "config.toml", where=f"--resume {out}")
    if saved != config:
        changed = [
            a.name
            for a in attrs.fields(TrainConfig)
            if getattr(saved, a.name) != getattr(config, a.name)
        ]
        raise ConfigError(
            f"--resume {out}: the run was started with other settings ({changed}); resume "
            f"with its config.toml",
            field=changed[0],
        )
    return load_checkpoint(checkpoints)


def check_fresh_out(out: Path) -> None:
    """A new run's folder holds no run's checkpoints (refused, naming `--resume`)."""
    checkpoints = Path(out) / CHECKPOINT_FOLDER
    if checkpoints.exists() and any(checkpoints.iterdir()):
        raise ConfigError(
            f"--out {out} already holds a run's checkpoints: continue it with --resume "
            f"{out}, or give another folder",
            field="out",
        )


async def train(
    config: TrainConfig,
    out: Path,
    *,
    teachers: Mapping[str, DomainTeacher],
    resume: bool = False,
    device: str = "auto",
    progress: ProgressFactory | None = progress_bar,
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
    plot: bool = True,
    stop_after: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    store: SampleStore | None = None,
    checkpoint: Checkpoint | None = None,
    engines: RunEngines | None = None,
) -> TrainSummary:
    """Run `config` into the folder `out` (with `resume`: continue the run saved there, from
    `checkpoint` if the caller has loaded it with `resume_checkpoint` already).

    `teachers` maps each domain to its physical teacher (`provide_teachers`). `stop_after`
    asks the run to stop, as Ctrl-C does, once that many steps are trained; `on_step` hears
    each step's record after the metrics do. `store` holds the rows (default: in memory).
    `engines` (a run of `engine = "vllm"`, from `served_engines`): the student samples and
    the teachers score on those servers, and `teachers` only name them."""
    if (engines is None) != (config.engine is Engine.TORCH):
        raise ConfigError(
            f"train: a run of engine={config.engine.value!r} "
            + ("needs the servers of served_engines" if engines is None else "takes no engines"),
            field="engine",
        )
    out = Path(out)
    where = resolve_device(device)
    checkpoints = out / CHECKPOINT_FOLDER
    metrics_path = out / "metrics.jsonl"
    if resume:
        if checkpoint is None:
            checkpoint = resume_checkpoint(out, config)
    else:
        checkpoint = None
        check_fresh_out(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(config.to_toml())
        metrics_path.write_text("")
        (out / TRACE_FILE).unlink(missing_ok=True)  # a run that never saved: start afresh
    checkpoints.mkdir(exist_ok=True)

    prompts: list[Prompt] = make_prompts(
        config.num_prompts, domains=config.domains, seed=config.seed
    )
    student = run_student(config)
    learner = DistillLearner(
        student,
        prompts,
        lr=config.lr,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        reward_weight=config.reward_weight,
        device=where,
    )
    alias_map = _routes(config, teachers)
    generator: StudentGenerator | ServedGenerator
    scorer: Scorer
    if engines is None:
        generator = StudentGenerator(
            learner.model, learner.weights, seed=config.seed, temperature=config.temperature
        )
        physical = {t.name: _local(t) for t in teachers.values()}
        scorer = ThreadedScorer(TeacherScorer(physical))
    else:
        assert isinstance(learner.model, ServedLM)
        generator = engines.generator(learner.model, config)
        scorer = engines.scorer()
    began = time.perf_counter()
    with metrics_path.open("a") as metrics_file:
        metrics = _Metrics(metrics_file, None, began, 0)
        pipeline = build_pipeline(
            config.pipeline_config(out),
            prompts=prompts,
            generator=generator,
            learner=learner,
            scorer=scorer,
            route=router(alias_map, RoutingConfig()),
            agent_of=lambda ordinal: prompts[ordinal].domain,
            train_fields=TRAIN_FIELDS,
            on_step=metrics.on_step,
            trace=out / TRACE_FILE,
            extra_stages=[verifier_stage(prompts)] if config.reward_weight > 0 else [],
            store=store,
        )
        assert pipeline.trace is not None
        pipeline.trace.write_in_batches(TRACE_BATCH_S)
        if checkpoint is not None:
            await pipeline.resume_from(checkpoint)
            await generator.sync_weights(pipeline.position.weight_version)
            say(f"resumed from {checkpoint.path} (step {checkpoint.step})")
        elif engines is not None:  # the server serves the learner's weights, whatever it loaded
            await generator.sync_weights(pipeline.position.weight_version)
        start_step = pipeline.position.step
        before = greedy_accuracy_by_domain(learner.model, config)
        metrics.scalars = open_scalar_log(
            config.tensorboard,
            out / TENSORBOARD_DIR,
            resume_step=start_step if resume else None,
            say=say,
        )
        bar = progress(config.steps, start_step) if progress is not None else None
        metrics.bar = bar
        metrics.done = start_step
        if stop_after is not None or on_step is not None:
            inner = metrics.on_step

            def each_step(record: StepRecord) -> None:
                inner(record)
                if stop_after is not None and record.step + 1 >= stop_after:
                    pipeline.request_stop()
                if on_step is not None:
                    on_step(record)

            pipeline.train.on_step = each_step
        try:
            result = await pipeline.run_until_interrupted(say)
        finally:
            if bar is not None:
                bar.close()
            if metrics.scalars is not None:
                metrics.scalars.close()
    wall = time.perf_counter() - began
    trained_now = len(result.steps)
    after = greedy_accuracy_by_domain(learner.model, config)
    kls = _kl_series(metrics_path)
    head = kls[: max(1, min(10, len(kls) // 5))]
    tail = kls[-len(head) :] if kls else []
    summary = TrainSummary(
        out=out,
        steps=pipeline.position.step,
        stopped_early=pipeline.position.step < config.steps,
        wall_s=wall,
        steps_per_s=trained_now / wall if wall > 0 else 0.0,
        accuracy_before=before,
        accuracy_after=after,
        kl_first=sum(head) / len(head) if head else float("nan"),
        kl_last=sum(tail) / len(tail) if tail else float("nan"),
        refit_ms=1000 * sum(metrics.syncs) / len(metrics.syncs) if metrics.syncs else 0.0,
        curves=_plot(metrics_path, out / "curves.png") if plot else None,
        metrics=metrics_path,
    )
    (out / "summary.txt").write_text(format_summary(summary))
    return summary


def _kl_series(path: Path) -> list[float]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "kl" in record:
            out.append(float(record["kl"]))
    return out


def _plot(metrics: Path, target: Path) -> Path | None:
    """The learning curves (KL, loss, each domain's accuracy on the rollouts) as a PNG; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no matplotlib: no curves.png (pip install 'groupflow[train]')")
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "kl" in r]
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r["kl"] for r in records])
    axes[0].set_title("teacher-student KL (sampled tokens)")
    axes[1].plot(steps, [r["loss"] for r in records])
    axes[1].set_title("loss")
    names = sorted({k for r in records for k in r if k.startswith("accuracy/")})
    for name in names:
        axes[2].plot(steps, [r.get(name, float("nan")) for r in records], label=name.split("/")[1])
    axes[2].set_title("rollouts correct, per domain")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def format_summary(summary: TrainSummary) -> str:
    lines = [
        f"run: {summary.out}",
        f"steps: {summary.steps}{' (stopped early)' if summary.stopped_early else ''}, "
        f"{summary.wall_s:.1f} s, {summary.steps_per_s:.2f} steps/s, refit {summary.refit_ms:.2f} ms",
        f"teacher-student KL: {summary.kl_first:.3f} (first steps) -> {summary.kl_last:.3f} (last)",
        "",
        f"{'domain':<10} {'greedy accuracy before':>23} {'after':>7}",
    ]
    for name in summary.accuracy_after:
        lines.append(
            f"{name:<10} {summary.accuracy_before.get(name, float('nan')):>23.2f} "
            f"{summary.accuracy_after[name]:>7.2f}"
        )
    lines.append("")
    lines.append(f"metrics: {summary.metrics}")
    if summary.curves is not None:
        lines.append(f"curves:  {summary.curves}")
    return "\n".join(lines) + "\n"
