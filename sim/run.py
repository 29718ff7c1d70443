"""Run a scenario through the real pipeline under virtual time, for one design variant.

Only the generator, the teacher and the learner are simulated (`groupflow.impl.testing`, with the
scenario's latency models); the controller, supervisor, buffer and pumps are the real ones. A
run is deterministic: the latency draws are keyed by the seed, and trio's scheduler runs each
batch of runnable tasks in an order drawn from the seed (`_scheduled_by`), so the same scenario
and seed give the same trace, and the same trace hash, in any process.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import trio
import trio.testing

from groupflow.impl._core import check_run_size
from groupflow.impl._pipeline import (
    ExtraStage,
    Pipeline,
    PipelineConfig,
    build_pipeline,
    lanes_for,
    load_checkpoint,
    single_error,
)
from groupflow.impl._teachers import teacher_by_agent
from groupflow.impl.contract import ScoreRequest
from groupflow.impl.errors import PumpFailed
from groupflow.impl.testing import FakeLearner, FakeScorer, Span, Trace
from groupflow.model.policy import Design, Dispatch
from groupflow.model.scheduler.actions import Action
from groupflow.sim.engines import EngineGenerator
from groupflow.sim.scenario import Scenario, TeacherModel
from groupflow.sim.spread import rng
from groupflow.sim.verify.conformance import Conformance, bounds_for

HUNG_CALL_S = 1e12
"""A call that never returns, in virtual seconds."""
VERIFIER = "verifier"
"""The name of a scenario's second stage (`[verifier]`), its queue and its timeline lane."""
VERIFIER_FIELD = "verifier_reward"
"""The field the simulated verifier writes for every row."""


@attrs.frozen
class Variant:
    """One way to run a scenario."""

    label: str
    design: Design
    dispatch: Dispatch
    free_scoring: bool = False
    """The pipeline bound: scoring costs nothing, so no design can do better."""


INLINE = Variant("inline", Design.INLINE, Dispatch.DEMAND)
PUMP_TIMER = Variant("pump (timer)", Design.PUMP, Dispatch.TIMER)
PUMP_DEMAND = Variant("pump (demand)", Design.PUMP, Dispatch.DEMAND)
BOUND = Variant("bound", Design.PUMP, Dispatch.DEMAND, free_scoring=True)


def variants(design: str, dispatch: str) -> list[Variant]:
    """The variants `groupflow sim --design ... --dispatch ...` asks for."""
    pump = PUMP_TIMER if dispatch == "timer" else PUMP_DEMAND
    if design == "pump":
        return [pump]
    if design == "inline":
        return [INLINE]
    if design == "both":
        return [INLINE, pump]
    if design == "all":
        return [INLINE, PUMP_TIMER, PUMP_DEMAND, BOUND]
    raise ValueError(f"design must be pump, inline, both or all, got {design!r}")


@attrs.frozen
class ConformanceSummary:
    actions: int
    """Abstract actions the run reported, each checked against the model."""
    seconds: float
    """Wall time spent checking them."""
    failure: str | None
    """The first disagreement with the model (None: the run conforms)."""
    trace: tuple[Action, ...] = attrs.field(repr=False, eq=False, default=())
    """The actions checked, in order."""

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def actions_per_s(self) -> float:
        return self.actions / self.seconds if self.seconds > 0 else float("inf")


@attrs.frozen
class SimResult:
    scenario: str
    variant: str
    seed: int
    steps: int
    outcome: str
    """"ok", or what ended the run early."""
    virtual_s: float
    teacher_calls: int
    rows_scored: int
    teacher_busy_s: float
    wait_s: float
    """Summed over scored groups: time from commit to the start of their call."""
    groups_scored: int
    permit_seconds_scoring: float
    generation_concurrency: float
    """Rollouts generating on average over the run."""
    sync_s: float
    """Virtual seconds spent pushing weights to the engines (`[weight_sync]`)."""
    max_inflight: int
    discarded: int
    shortfall: int
    stalls: int
    """Stalls the watchdog saw (no progress for `stall_timeout_s` of virtual time), one per stall."""
    crashed: bool
    resumed_from_checkpoint: bool
    """After a crash: from the last checkpoint, or from scratch when none had been saved."""
    wall_s: float
    trace_hash: str
    spans: tuple[Span, ...] = attrs.field(repr=False, eq=False)
    conformance: ConformanceSummary | None = None
    """With `conform=True`: how the run's actions compared with the model."""
    engine_load: tuple[tuple[float, int, int], ...] = attrs.field(repr=False, eq=False, default=())
    """(time, engine, sequences on it) at every change of an engine's load."""
    skipped_steps: int = 0
    """Of `steps`, those whose every prompt was given up: the learner was not called, yet
    the step counts in the figures per step."""

    @property
    def steps_per_wall_s(self) -> float:
        """Simulated train steps per second of wall time: how fast the simulator runs."""
        return self.steps / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def sync_s_per_step(self) -> float:
        return self.sync_s / self.steps if self.steps else float("nan")

    @property
    def s_per_step(self) -> float:
        return self.virtual_s / self.steps if self.steps else float("nan")

    @property
    def calls_per_step(self) -> float:
        return self.teacher_calls / self.steps if self.steps else float("nan")

    @property
    def rows_per_call(self) -> float:
        return self.rows_scored / self.teacher_calls if self.teacher_calls else 0.0

    @property
    def teacher_s_per_step(self) -> float:
        return self.teacher_busy_s / self.steps if self.steps else float("nan")

    @property
    def wait_per_group_s(self) -> float:
        return self.wait_s / self.groups_scored if self.groups_scored else 0.0

    @property
    def permit_s_per_step(self) -> float:
        return self.permit_seconds_scoring / self.steps if self.steps else float("nan")


def _skipped(pipelines: Sequence[Pipeline]) -> int:
    """The steps skipped (`StepRecord.skipped`) in the run's final history: a step that a
    crashed pipeline took and the resumed one took again counts as the latter took it."""
    skipped: dict[int, bool] = {}
    for pipeline in pipelines:
        skipped.update((s.step, s.skipped) for s in pipeline.train.history)
    return sum(skipped.values())


def trace_hash(spans: list[Span] | tuple[Span, ...]) -> str:
    """A digest of what happened and when. Spans ending at the same virtual instant are
    appended in an order trio does not fix, so they are sorted first."""
    digest = hashlib.sha256()
    for s in sorted(spans, key=lambda s: (s.start, s.end, s.kind, s.lane, s.detail, s.ok)):
        digest.update(f"{s.kind}|{s.lane}|{s.start:.9f}|{s.end:.9f}|{s.detail}|{s.ok}\n".encode())
    return digest.hexdigest()[:16]


@attrs.define
class _Fakes:
    generator: EngineGenerator
    scorer: FakeScorer
    learner: FakeLearner
    verifier: FakeScorer | None = None


def _fakes(scenario: Scenario, variant: Variant, seed: int, trace: Trace) -> _Fakes:
    faults = scenario.faults
    per_teacher: dict[str, int] = {}

    def cost(request: ScoreRequest, index: int) -> float:
        if faults.scorer_hang_call is not None and index == faults.scorer_hang_call:
            return HUNG_CALL_S
        if variant.free_scoring:
            return 0.0
        call = per_teacher.get(request.teacher, 0)
        per_teacher[request.teacher] = call + 1
        model = scenario.teachers[request.teacher]
        return model.duration(
            len(request.sample_ids), seed, request.teacher, call, tokens_in(request)
        )

    def fails(index: int, request: ScoreRequest) -> bool:
        if index in faults.scorer_error_calls or index in faults.scorer_permanent_error_calls:
            return True
        rate = faults.scorer_error_rate
        return rate > 0 and rng(seed, "score-fail", index).random() < rate

    def error(index: int, request: ScoreRequest) -> Exception:
        message = f"teacher {request.teacher!r} call {index} failed"
        if index in faults.scorer_permanent_error_calls:
            return IndexError(f"{message}: token id out of range (permanent)")
        return OSError(message)

    def rollout_fails(ordinal: int, attempt: int) -> bool:
        """Drawn afresh for every attempt: a prompt issued again may go through."""
        rate = faults.rollout_failure_rate
        key = (ordinal,) if attempt == 0 else (ordinal, "attempt", attempt)
        return rate > 0 and rng(seed, "rollout-fail", *key).random() < rate

    def tokens_in(request: ScoreRequest) -> int:
        held = generator.group_tokens
        return sum([held.get(g.ordinal, 0) for g in request.groups if g.ordinal is not None])

    generation = scenario.generation
    generator = EngineGenerator(
        latency=lambda o, a: generation.seconds(seed, o, a, generation.tokens_of(seed, o, a)),
        fails=rollout_fails,
        tokens=(lambda o, a: generation.tokens_of(seed, o, a)) if generation.tokens else None,
        model=scenario.engines,
        sync=scenario.weight_sync,
        trace=trace,
        seed=seed,
    )
    return _Fakes(
        generator,
        FakeScorer(cost=cost, fail=fails, error=error, trace=trace),
        FakeLearner(
            latency=scenario.train_step_s,
            trace=trace,
            fail_steps=faults.train_error_steps,
            blocking=scenario.train_blocks_loop,
        ),
        None
        if scenario.verifier is None
        else _fake_verifier(scenario.verifier, variant, seed, trace, tokens_in),
    )


def _fake_verifier(
    model: TeacherModel,
    variant: Variant,
    seed: int,
    trace: Trace,
    tokens_in: Callable[[ScoreRequest], int],
) -> FakeScorer:
    """The `[verifier]` stage: its calls cost what its model says (free for the bound)."""
    count = [0]

    def cost(request: ScoreRequest, index: int) -> float:
        count[0] += 1
        if variant.free_scoring:
            return 0.0
        return model.duration(
            len(request.sample_ids), seed, VERIFIER, count[0] - 1, tokens_in(request)
        )

    return FakeScorer(cost=cost, trace=trace)


CONFORM_PROMPTS = 600
"""The most prompts a conformance check of a shipped scenario covers: the model's check of each
action grows with the prompts (a cluster-size run's 25,600 would take hours), and a few steps
of a big scenario exercise everything its full length does."""


def conform_steps(scenario: Scenario) -> int:
    """The steps of `scenario` a conformance check runs: all, or as many as `CONFORM_PROMPTS`
    prompts make (at least one)."""
    per_step = scenario.pipeline.shape.prompts_per_step
    return max(1, min(scenario.steps, CONFORM_PROMPTS // per_step))


def runs(scenario: Scenario, variant: Variant) -> bool:
    """Whether `variant` can run `scenario`: the inline baseline has no second stage."""
    return scenario.verifier is None or variant.design is not Design.INLINE


def _check_variant(scenario: Scenario, variant: Variant) -> None:
    if not runs(scenario, variant):
        raise ValueError(
            f"scenario {scenario.name!r} has a [verifier] stage, which the inline baseline "
            f"does not run (it scores once, inside the rollout); simulate it with the pump "
            f"design (--design pump)"
        )


def _config(
    scenario: Scenario, variant: Variant, checkpoints: Path | None = None
) -> PipelineConfig:
    """The scenario's config for `variant`. Its checkpoints are written in the event loop,
    whatever the scenario says (a fitted one says what the run did: in a thread): a write in a
    thread takes real time the virtual clock does not wait for, so the clock would jump past
    the flush and stall timeouts while the file is written, and no two simulations would agree."""
    config = scenario.pipeline
    if config.checkpoints is not None:
        config = attrs.evolve(
            config,
            checkpoints=attrs.evolve(
                config.checkpoints,
                folder=config.checkpoints.folder if checkpoints is None else checkpoints,
                write_in_thread=False,
            ),
        )
    if config.scoring is not None:
        config = attrs.evolve(
            config,
            scoring=attrs.evolve(config.scoring, design=variant.design, dispatch=variant.dispatch),
        )
    return config


def _conformance(scenario: Scenario, variant: Variant, steps: int) -> Conformance:
    """The model this scenario's runs are checked against, with teacher lanes numbered by name."""
    config = _config(scenario, variant)
    lanes = _lanes(scenario)
    prompts = steps * config.shape.prompts_per_step
    routing = [lanes[scenario.agents[scenario.agent_of(o)]] for o in range(prompts)]
    bounds = bounds_for(
        config,
        prompts=prompts,
        routing=routing,
        teachers=max(1, len(scenario.teachers)),
        stages=None if scenario.verifier is None else 2,
    )
    return Conformance(bounds)


def _lanes(scenario: Scenario) -> dict[str, int]:
    """Teachers by name, then the verifier: the model's lane numbering."""
    return lanes_for(scenario.teachers, later=[VERIFIER] if scenario.verifier else [])


def _build(
    scenario: Scenario,
    variant: Variant,
    steps: int,
    fakes: _Fakes,
    checkpoints: Path | None,
    trace: Path | None = None,
) -> Pipeline:
    config = _config(scenario, variant, checkpoints)
    return build_pipeline(
        config,
        prompts=range(steps * config.shape.prompts_per_step),
        generator=fakes.generator,
        learner=fakes.learner,
        scorer=fakes.scorer if config.scoring is not None else None,
        route=teacher_by_agent(dict(scenario.agents)),
        agent_of=scenario.agent_of,
        train_fields=["input_ids", "generation_logprobs"],
        lanes=_lanes(scenario),
        keep_steps=None,  # the report reads every step
        trace=trace,
        extra_stages=()
        if fakes.verifier is None
        else (ExtraStage(VERIFIER, fakes.verifier, VERIFIER_FIELD),),
    )


async def _crash_at(
    deadline: float, run: trio.CancelScope, checker: Conformance | None, pipeline: Pipeline
) -> None:
    """The process dies at `deadline`: the checker and the trace hear it first (what the
    cancelled run reports on its way out is not the model's), then the run is cut."""
    await trio.sleep_until(deadline)
    if checker is not None:
        checker.crash()
    if pipeline.trace is not None:
        pipeline.trace.crash()
    run.cancel()


async def _run_until_crash(
    pipeline: Pipeline, deadline: float, checker: Conformance | None
) -> bool:
    """Run `pipeline`, killed at `deadline` if it is still running then; True if it was."""
    with trio.CancelScope() as run_scope:
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_crash_at, deadline, run_scope, checker, pipeline)
                await pipeline.run()
                nursery.cancel_scope.cancel()
    return run_scope.cancelled_caught


VIRTUAL_S_PER_STEP = 86_400
"""A simulated run is stopped once it has taken a virtual day per step: no scenario worth
simulating is that slow, and a hang (or a latency typed in the wrong unit) then ends, reported
as a failed run, instead of advancing the virtual clock forever."""


async def _simulate(
    scenario: Scenario,
    variant: Variant,
    steps: int,
    seed: int,
    conform: bool,
    trace_file: Path | None = None,
) -> SimResult:
    wall = time.perf_counter()
    trace = Trace()
    fakes = _fakes(scenario, variant, seed, trace)
    outcome = "ok"
    crashed = resumed = False
    checker = _conformance(scenario, variant, steps) if conform else None
    start = trio.current_time()
    horizon = trio.CancelScope(deadline=start + steps * VIRTUAL_S_PER_STEP)
    with tempfile.TemporaryDirectory(prefix="groupflow-sim-") as tmp, horizon:
        pipeline = _build(scenario, variant, steps, fakes, Path(tmp), trace_file)
        pipelines = [pipeline]
        if checker is not None:
            checker.attach(pipeline)
            checker.compare()
        try:
            crash_at = scenario.faults.crash_at_s
            if crash_at is None:
                await pipeline.run()
            else:
                crashed = await _run_until_crash(pipeline, start + crash_at, checker)
                if crashed:
                    pipeline = _build(
                        scenario, variant, steps, fakes, Path(tmp) / "resumed", trace_file
                    )
                    pipelines.append(pipeline)
                    if checker is not None:
                        checker.attach(pipeline)
                    if any(Path(tmp).glob("step-*")):
                        await pipeline.resume_from(load_checkpoint(Path(tmp)))
                        resumed = True
                    if checker is not None:
                        checker.compare()
                    await pipeline.run()
        except PumpFailed as failure:
            outcome = f"failed: {failure.kind} {failure.pump!r}: {failure.__cause__!r}"
    if horizon.cancelled_caught:
        outcome = (
            f"failed: still running after {steps * VIRTUAL_S_PER_STEP:,.0f} s of virtual time "
            f"({VIRTUAL_S_PER_STEP:,} s a step): a hang, or latencies far too large"
        )
    virtual = trio.current_time() - start
    calls = fakes.scorer.calls
    scoring = [s.scoring for p in pipelines for s in p.train.history if s.scoring is not None]
    # what each pipeline scored after its last train step (a crashed one, above all)
    scoring += [p.train.scoring.drain_metrics() for p in pipelines if p.train.scoring is not None]
    last = pipelines[-1]
    return SimResult(
        scenario=scenario.name,
        variant=variant.label,
        seed=seed,
        steps=last.position.step,
        outcome=outcome,
        virtual_s=virtual,
        teacher_calls=len(calls),
        rows_scored=sum(c.rows for c in calls),
        teacher_busy_s=sum(c.end - c.start for c in calls),
        wait_s=sum(m.queue_wait_s for m in scoring),
        groups_scored=sum(m.groups for m in scoring),
        permit_seconds_scoring=sum(p.rollout.permit_seconds_scoring for p in pipelines),
        generation_concurrency=fakes.generator.busy_seconds / virtual if virtual else 0.0,
        sync_s=fakes.generator.sync_seconds,
        max_inflight=scenario.pipeline.shape.max_inflight_prompts,
        discarded=sum(m.discards for m in scoring),
        shortfall=len(last.ledger.shortfall),
        stalls=sum(p.watchdog.warnings for p in pipelines),
        crashed=crashed,
        resumed_from_checkpoint=resumed,
        wall_s=time.perf_counter() - wall,
        trace_hash=trace_hash(trace.spans),
        spans=tuple(trace.spans),
        engine_load=tuple(fakes.generator.load),
        skipped_steps=_skipped(pipelines),
        conformance=None
        if checker is None
        else ConformanceSummary(
            checker.actions, checker.seconds, checker.failure, tuple(checker.trace)
        ),
    )


def simulate(
    scenario: Scenario,
    variant: Variant,
    *,
    steps: int | None = None,
    seed: int = 0,
    conform: bool = False,
    trace: Path | None = None,
) -> SimResult:
    """Run one variant of `scenario` for `steps` train steps (the scenario's by default).
    With `conform`, every action the pipeline takes is checked against the model
    (`groupflow.sim.verify.conformance`); the result says whether the run conformed. With `trace`
    (a file), the run's actions are appended there for `groupflow replay`."""
    _check_variant(scenario, variant)
    clock = trio.testing.MockClock(autojump_threshold=0)
    steps = scenario.steps if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_run_size(
        steps,
        scenario.pipeline.shape.prompts_per_step,
        config="simulate",
        name=f"steps of {scenario.name!r}",
    )
    with _scheduled_by(seed):
        return trio.run(_simulate, scenario, variant, steps, seed, conform, trace, clock=clock)


@contextlib.contextmanager
def _scheduled_by(seed: int) -> Iterator[None]:
    """trio runs each batch of runnable tasks in a random order, and tasks whose deadlines
    fall at one virtual instant join the batch in the order of their cancel scopes' memory
    addresses. Its deterministic mode (the one Hypothesis turns on) sorts each batch by the
    tasks' creation before shuffling it with its generator, seeded here: without it two
    simulations of one scenario and seed part ways at the first such tie."""
    module = trio._core._run
    was = module._ALLOW_DETERMINISTIC_SCHEDULING
    setattr(module, "_ALLOW_DETERMINISTIC_SCHEDULING", True)  # noqa: B010 - a Final flag
    module._r.seed(seed)
    try:
        yield
    finally:
        setattr(module, "_ALLOW_DETERMINISTIC_SCHEDULING", was)  # noqa: B010
