"""One `groupflow train` run: teachers, student, generator and learner wired through
`build_pipeline` (the controller the property machines verify: there is no second code path),
with metrics, a progress bar, checkpoints, a clean stop on Ctrl-C, and the report at the end.

The run folder holds `config.toml` (what ran), `metrics.jsonl` (one line per step),
`tensorboard/` (the same per-step scalars as TensorBoard events, when the package is there),
`trace.jsonl` (every action, for `groupflow replay`), `checkpoints/`, and at the end
`curves.png` and `summary.txt`. A run on served engines also holds `teacher-probe.json`: each
teacher's calls of one group up to a full batch, timed before the run (`probe_teachers`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from groupflow.impl._core import SampleStore
from groupflow.impl._pipeline import StepRecord, ThreadedScorer, build_pipeline
from groupflow.impl._teachers import RoutingConfig, TeacherScorer, router, write_probe
from groupflow.impl._teachers._served_lm import ServedLM
from groupflow.impl._teachers._torch import resolve_device
from groupflow.impl._trainer._config import Engine
from groupflow.impl._trainer._engines import RunEngines
from groupflow.impl._trainer._generator import StudentGenerator
from groupflow.impl._trainer._greedy import greedy_accuracy_by_domain
from groupflow.impl._trainer._learner import TRAIN_FIELDS, DistillLearner
from groupflow.impl._trainer._metrics import MetricsLog
from groupflow.impl._trainer._provision import DomainTeacher, local_teacher, routes_for
from groupflow.impl._trainer._run_folder import RunFolder
from groupflow.impl._trainer._student import run_student
from groupflow.impl._trainer._summary import (
    ProgressFactory,
    TrainSummary,
    format_summary,
    kl_series,
    plot_curves,
    progress_bar,
)
from groupflow.impl._trainer._tasks import Prompt, make_prompts
from groupflow.impl._trainer._tensorboard import open_scalar_log
from groupflow.impl._trainer._verifier import verifier_stage
from groupflow.impl.contract import Scorer
from groupflow.impl.engines import ServedGenerator
from groupflow.model.errors import ConfigError

TRACE_BATCH_S = 0.25
"""The trace's lines are written in batches (`TraceWriter.write_in_batches`): one line at a
time, each `write` releases the GIL to the sampling and scoring threads, and trio's thread
waits to take it back (about 100 us a line, 2% of a run's wall time). A process killed
outright loses at most the last quarter second of lines, never a checkpoint's."""


async def train(
    run: RunFolder,
    *,
    teachers: Mapping[str, DomainTeacher],
    device: str = "auto",
    progress: ProgressFactory | None = progress_bar,
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
    plot: bool = True,
    stop_after: int | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    store: SampleStore | None = None,
    engines: RunEngines | None = None,
) -> TrainSummary:
    """Run `run.config` in its folder (`RunFolder.new`), or go on from its checkpoint
    (`RunFolder.resume`).

    `teachers` maps each domain to its physical teacher (`provide_teachers`). `stop_after`
    asks the run to stop, as Ctrl-C does, once that many steps are trained; `on_step` hears
    each step's record after the metrics do. `store` holds the rows (default: in memory).
    `engines` (a run of `engine = "vllm"`, from `served_engines`): the student samples and
    the teachers score on those servers, and `teachers` only name them."""
    config = run.config
    if (engines is None) != (config.engine is Engine.TORCH):
        raise ConfigError(
            f"train: a run of engine={config.engine.value!r} "
            + ("needs the servers of served_engines" if engines is None else "takes no engines"),
            field="engine",
        )
    where = resolve_device(device)
    run.start()
    checkpoint, metrics_path = run.checkpoint, run.metrics

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
    alias_map = routes_for(config, teachers)
    generator: StudentGenerator | ServedGenerator
    scorer: Scorer
    if engines is None:
        generator = StudentGenerator(
            learner.model, learner.weights, seed=config.seed, temperature=config.temperature
        )
        physical = {t.name: local_teacher(t) for t in teachers.values()}
        scorer = ThreadedScorer(TeacherScorer(physical))
    else:
        assert isinstance(learner.model, ServedLM)
        generator = engines.generator(learner.model, config)
        scorer = engines.scorer()
        if not run.teacher_probe.exists():
            write_probe(run.teacher_probe, await engines.probe(prompts, config))
            say(
                f"timed the teachers' calls of 1 to {config.shape.max_batch_groups} groups: "
                f"{run.teacher_probe}"
            )
    began = time.perf_counter()
    with metrics_path.open("a") as metrics_file:
        metrics = MetricsLog(metrics_file, None, began, 0)
        pipeline = build_pipeline(
            config.pipeline_config(run.checkpoints),
            prompts=prompts,
            generator=generator,
            learner=learner,
            scorer=scorer,
            route=router(alias_map, RoutingConfig()),
            agent_of=lambda ordinal: prompts[ordinal].domain,
            train_fields=TRAIN_FIELDS,
            on_step=metrics.on_step,
            trace=run.trace,
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
            run.tensorboard,
            resume_step=None if checkpoint is None else start_step,
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
    after, curves = _evaluated(learner, run, plot)
    kls = kl_series(metrics_path)
    head = kls[: max(1, min(10, len(kls) // 5))]
    tail = kls[-len(head) :] if kls else []
    summary = TrainSummary(
        out=run.path,
        steps=pipeline.position.step,
        stopped_early=pipeline.position.step < config.steps,
        wall_s=wall,
        steps_per_s=trained_now / wall if wall > 0 else 0.0,
        accuracy_before=before,
        accuracy_after=after,
        kl_first=sum(head) / len(head) if head else float("nan"),
        kl_last=sum(tail) / len(tail) if tail else float("nan"),
        refit_ms=1000 * sum(metrics.syncs) / len(metrics.syncs) if metrics.syncs else 0.0,
        curves=curves,
        metrics=metrics_path,
    )
    run.summary.write_text(format_summary(summary))
    return summary


def _evaluated(
    learner: DistillLearner, run: RunFolder, plot: bool
) -> tuple[Mapping[str, float] | None, Path | None]:
    """The greedy accuracy after the run and the curves; (None, None) when Ctrl-C cuts them
    short, as the run's steps are trained and saved by then and only its report is left.
    Ctrl-C raises here under either host: an asyncio host's own handler would cancel the
    hosting task instead, and the finished run's summary would be lost with it."""
    try:
        with _ctrl_c_raises():
            after = greedy_accuracy_by_domain(learner.model, run.config)
            return after, plot_curves(run.metrics, run.curves) if plot else None
    except KeyboardInterrupt:
        return None, None


@contextlib.contextmanager
def _ctrl_c_raises() -> Iterator[None]:
    """Python's own SIGINT handler (`KeyboardInterrupt` where the code stands) for the block,
    in the main thread; elsewhere signals do not reach the block, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
