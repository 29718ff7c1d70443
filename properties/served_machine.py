"""The pipeline over served engines, with faults on the wire, chosen by Hypothesis.

Each example runs the real pipeline (`build_pipeline`) with a student sampled by
`ServedGenerator` and a teacher scored by `ServedTeachers`, each on a `VLLMImitation` over real
HTTP, weights synced into the student after every step. Hypothesis draws the configuration and
a plan of events on a real clock: faults met by the next request to a route of either server
(a closed connection, a cut or dripping answer, a hang, HTTP 4xx or 5xx, garbage, a huge
answer, an answer for another model or with an impossible log-prob, a request that reaches the
server late) and outages (a server dies, and comes back or not); and a crash at a chosen
moment. Syncs race the rollouts of the next step by themselves.

A run that did not finish (it failed, or crashed) is resumed once from its newest checkpoint
(from scratch when it has none) on the same servers, without faults, and must finish. Then:

- every prompt was trained exactly once across the lineage, or given up;
- conformance with the model, action by action, across both runs;
- each run ended within `bound_s`, and a failed one failed for a reason groupflow names (an
  engine's error, too many failed rollouts or calls), never a bug's exception;
- no row stayed in either run's store;
- every trained row was sampled by the weights its labels say: the versions the student's
  server recorded for it lie within its group's start and end weight versions, and under
  `sync_mode="wait"` are exactly the row's own `weight_version`; its log-probs are real ones,
  and its teacher log-probs are the teacher's own for those tokens.

`run_served_machine` runs it at a budget; `tests/properties/test_served_machine.py` at the CI budget,
with the seeded bugs of `served_bugs`; `groupflow fuzz --machine served` for longer.
"""

from __future__ import annotations

import collections
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
from hypothesis import example as hypothesis_example
from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from groupflow.impl import MemoryStore
from groupflow.impl._pipeline import (
    CheckpointConfig,
    Pipeline,
    PipelineConfig,
    ScoringConfig,
    build_pipeline,
    lanes_for,
    load_checkpoint,
)
from groupflow.impl.contract import TEACHER_FIELD, TrainBatch
from groupflow.impl.engines import ServedGenerator, ServedTeachers
from groupflow.impl.errors import (
    CheckpointNotFound,
    GroupflowError,
    NothingTrained,
    PumpFailed,
    RolloutsFailed,
    ScoringCallFailed,
)
from groupflow.impl.testing import FakeLearner, Fault, VLLMImitation
from groupflow.model.errors import ConfigError
from groupflow.model.policy import CheckpointPolicy, FailurePolicy, SyncMode
from groupflow.model.shape import Shape
from groupflow.properties.budget import budget
from groupflow.properties.pipeline_setups import trained_exactly_once
from groupflow.sim.verify.conformance import Conformance, bounds_for

__all__ = [
    "MARKS",
    "ServedSetup",
    "WireEvent",
    "last_setup",
    "marks",
    "run_served_machine",
    "served_setups",
    "stats",
]

COMPLETIONS = "/v1/completions"
SYNC_ROUTES = ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")
VOCAB = 32
MAX_TOKENS = 6
TOKEN_S = (0.002, 0.002, 0.01, 0.03)
"""How long the student may take to sample a token (one of these per example)."""
RELOAD_S = 0.06
CALL_S = 1.0
"""Each engine call's total bound (rollout, teacher request, sync step), in real seconds."""
RESUMED_CALL_S = 30.0
"""The same bound in the resumed run, which meets no fault: it must finish, and on a loaded
machine a sync step of the imitation can take more than `CALL_S`."""
HANGS = (7135, 8205)
"""Seeds of examples every run begins with: a rollout that hangs, a teacher call that hangs
(each the plan's one fault, no crash), so a call given up with `EngineTimeout` is reached
whatever the budget draws."""
GRACE_S = 0.3
SHUTDOWN_S = 5.0
BOUND_S = 60.0
"""A run that has not ended by then has hung."""
TEACHER = "teacher"

MARKS = (
    "a call given up: EngineBusy",
    "a call given up: EngineTimeout",
    "a call given up: EngineRefused",
    "a call given up: EngineOutputError",
    "a run failed: rollouts kept failing",
    "a run failed: teacher calls kept failing",
    "a run failed at a weight sync",
    "a crash",
    "resumed from a checkpoint",
    "resumed from scratch",
    "a row that spanned a sync trained",
    "a rollout held through a sync trained",
)
"""Cases the machine must keep reaching (a test asserts each is reached at the CI budget)."""

marks: collections.Counter[str] = collections.Counter()
"""How often each case in `MARKS` was reached since the last `run_served_machine`."""

stats: collections.Counter[str] = collections.Counter()
"""Since the last `run_served_machine`: "examples", runs that "completed" first time, that
"failed" or "crashed" and were "resumed", rows "checked"."""
last_setup: list[ServedSetup] = []


@attrs.frozen
class WireEvent:
    """The `nth` request (from 0) to `route` of the `target` server meets `fault`; or, with no
    route, the server dies `at_s` seconds into the run for `down_s` seconds (None: for good)."""

    target: str
    route: str | None = None
    nth: int = 0
    fault: Fault | None = None
    label: str = ""
    at_s: float = 0.0
    down_s: float | None = None

    def __str__(self) -> str:
        if self.route is None:
            gone = "for good" if self.down_s is None else f"for {self.down_s:g} s"
            return f"{self.at_s:g} s: the {self.target} server dies {gone}"
        return f"request {self.nth} to {self.target} {self.route} meets {self.label}"


@attrs.frozen
class ServedSetup:
    config: PipelineConfig
    steps: int
    sync_mode: SyncMode
    jitter_s: float
    """How late a request to the student may reach it (`VLLMImitation.jitter_s`)."""
    token_s: float
    """How long the student takes to sample a token: slow rollouts overlap the syncs."""
    store_s: float
    """How long the store takes to clear rows (a remote one: the steps end later)."""
    replicas: int
    """How many times the teacher's server is listed (its replicas, here one server)."""
    events: tuple[WireEvent, ...]
    crash_at_s: float | None

    def __str__(self) -> str:
        c = self.config
        assert c.scoring is not None
        lines = [
            f"{self.steps} steps x {c.shape.prompts_per_step} prompts x "
            f"{c.shape.num_generations_per_prompt} rows, {c.shape.max_inflight_prompts} permits, "
            f"gate {c.shape.gate_window}, sync {self.sync_mode.value}, jitter {self.jitter_s:g} s, "
            f"{self.token_s * 1000:g} ms a token, store {self.store_s * 1000:g} ms, "
            f"teacher x{self.replicas}, "
            f"{c.scoring.failure_policy.value}, crash at {self.crash_at_s}"
        ]
        lines += [f"  {event}" for event in self.events]
        return "\n".join(lines)


def _other_model(answer: dict[str, Any]) -> None:
    answer["model"] = "another-model"


def _impossible(value: float) -> Callable[[dict[str, Any]], None]:
    """An answer whose last log-prob is `value` (a teacher's or a rollout's)."""

    def change(answer: dict[str, Any]) -> None:
        choice = answer["choices"][-1]
        if choice.get("prompt_logprobs"):
            entry = choice["prompt_logprobs"][-1]
            (token,) = entry
            entry[token]["logprob"] = value
        else:
            choice["logprobs"]["token_logprobs"][-1] = value

    return change


_ON_ANY_ROUTE: dict[str, list[Fault]] = {
    "close": [Fault.close()],
    "cut": [Fault.cut(60), Fault.cut(300)],
    "hang": [Fault.hang(), Fault.hang()],
    "drip": [Fault.drip(300), Fault.drip(100)],
    "HTTP 5xx": [Fault.with_status(503), Fault.with_status(500)],
    "HTTP 429": [Fault.with_status(429)],
    "HTTP 4xx": [Fault.with_status(400), Fault.with_status(404)],
    "garbage": [Fault.raw(b"<html>upstream error</html>")],
    "a huge answer": [Fault.huge(2_000_000), Fault.huge(2_000_000, chunked=True)],
    "a late arrival": [Fault.delay(0.05), Fault.delay(0.2)],
}
_ON_COMPLETIONS: dict[str, list[Fault]] = {
    "another model": [Fault.edit(_other_model)],
    "an impossible log-prob": [Fault.edit(_impossible(-9999.0)), Fault.edit(_impossible(0.7))],
}
_ON_ROUTE: dict[str, dict[str, list[Fault]]] = {
    "/collective_rpc": {"no worker": [Fault.edit(lambda a: a.update(results=[]))]},
    "/reset_prefix_cache": {"cache kept": [Fault.edit(lambda a: a.update(success=False))]},
}
FAULT_KINDS = (*_ON_ANY_ROUTE, *_ON_COMPLETIONS, "no worker", "cache kept")
PLACES = ("rollouts", "teacher calls", "syncs", "outages")
TIMES = (0.0, 0.0, 0.02, 0.1, 0.3, 0.6, 1.0)


def _faults_for(route: str, kinds: frozenset[str]) -> list[tuple[str, Fault]]:
    table = {**_ON_ANY_ROUTE, **(_ON_COMPLETIONS if route == COMPLETIONS else {})}
    table.update(_ON_ROUTE.get(route, {}))
    return [(kind, fault) for kind, faults in table.items() if kind in kinds for fault in faults]


def _events(rng: random.Random) -> tuple[WireEvent, ...]:
    """Events in the swarm's way: each example enables a few places and kinds of fault and
    draws its events from those alone, so that some examples pile many faults of one kind on
    one place and others run with none."""
    places = [p for p in PLACES if rng.random() < 0.5]
    kinds = frozenset(k for k in FAULT_KINDS if rng.random() < 0.5) or frozenset(
        {rng.choice(FAULT_KINDS)}
    )
    out = []
    for _ in range(rng.randint(0, 5) if places else 0):
        place = rng.choice(places)
        if place == "outages":
            target = rng.choice(["student", "teacher"])
            down = rng.choice([0.05, 0.3, None])
            out.append(WireEvent(target, at_s=rng.choice(TIMES), down_s=down))
            continue
        target = "teacher" if place == "teacher calls" else "student"
        route = rng.choice(SYNC_ROUTES) if place == "syncs" else COMPLETIONS
        faults = _faults_for(route, kinds)
        if faults:
            label, fault = rng.choice(faults)
            out.append(WireEvent(target, route, rng.randint(0, 6), fault, label))
    return tuple(out)


def setup_from(seed: int) -> ServedSetup:
    """The example `seed` stands for: a configuration the pipeline accepts, over served
    engines, and a plan of faults, drawn at random from it. Hypothesis chooses the seed:
    drawing the plan from one number keeps every example of a small budget a new one (its own
    generation would spend much of a CI budget on near-copies, and each example costs a
    second of real time); a failing example is reported by its seed and its plan in full."""
    rng = random.Random(seed)
    while True:
        per_step = rng.randint(1, 3)
        permits = rng.choice([1, 2, 2, 3, 4])
        try:
            config = PipelineConfig(
                shape=Shape(
                    prompts_per_step=per_step,
                    num_generations_per_prompt=rng.choice([1, 2, 2]),
                    max_inflight_prompts=permits,
                    max_buffered_groups=per_step + rng.randint(0, 6),
                    gate_window=rng.choice([0, 1, 2, 2, 3]),
                    max_batch_groups=min(rng.randint(1, 3), permits),
                ),
                scoring=ScoringConfig(
                    flush_after_s=rng.choice([0.01, 0.05]),
                    failure_policy=rng.choice(list(FailurePolicy)),
                    call_timeout_s=3 * CALL_S,
                ),
                shutdown_timeout_s=SHUTDOWN_S,
                stall_timeout_s=120.0,
                stall_action="warn",
                checkpoints=CheckpointConfig(
                    ".",
                    policy=rng.choice([CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED]),
                    flush_timeout_s=2.0,
                    every_steps=1,
                    write_in_thread=False,
                ),
            )
        except ConfigError:
            continue  # a configuration the pipeline refuses: draw another
        return ServedSetup(
            config,
            steps=rng.randint(2, 6),
            sync_mode=rng.choice(list(SyncMode)),
            jitter_s=rng.choice([0.0, 0.01, 0.03]),
            token_s=rng.choice(TOKEN_S),
            store_s=rng.choice([0.0, 0.03]),
            replicas=rng.choice([1, 2, 2]),
            events=_events(rng),
            crash_at_s=rng.choice([None] * 5 + [0.1, 0.3, 0.6]),
        )


def served_setups() -> st.SearchStrategy[ServedSetup]:
    """Examples for the machine, one per seed Hypothesis draws (see `setup_from`)."""
    return st.integers(0, 2**32 - 1).map(setup_from)


@attrs.define
class LabelLearner(FakeLearner):
    """Records every trained row's problems: its versions against what the student's server
    recorded, its log-probs, and its teacher log-probs against the teacher's own."""

    student: VLLMImitation | None = None
    teacher: VLLMImitation | None = None
    exact: bool = True
    problems: list[str] = attrs.field(factory=list)

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        assert self.student is not None and self.teacher is not None
        for group in batch.groups:
            assert group.start_weight_version is not None
            assert group.end_weight_version is not None
            span = range(group.start_weight_version, group.end_weight_version + 1)
            for sid in group.sample_ids:
                self.problems += _row_problems(
                    batch.rows[sid], span, self.student, self.teacher, exact=self.exact
                )
                stats["checked"] += 1
        return await super().train_step(batch)


def _row_problems(
    row: Mapping[str, Any],
    span: range,
    student: VLLMImitation,
    teacher: VLLMImitation,
    *,
    exact: bool,
) -> list[str]:
    ids, sampled = list(row["input_ids"]), list(row["generation_logprobs"])
    where = f"row {ids}"
    values = sampled + list(row[TEACHER_FIELD])
    if any(not -9999.0 < v <= 1e-4 for v in values):
        return [f"{where}: trained on an impossible log-prob: {values}"]
    versions = student.versions_of(ids, sampled)
    if versions is None:
        return [f"{where}: the student's server sampled no such row"]
    # a version no sync loaded (its step was skipped: every prompt given up) holds the weights
    # of the version loaded before it: the same weights, under the number training gave them
    loaded = [0, *student.reloads]

    def weights(version: int) -> int:
        return max(v for v in loaded if v <= version)

    if len(versions) > 1:
        marks["a row that spanned a sync trained"] += 1
    if row["weight_version"] > span.start:
        marks["a rollout held through a sync trained"] += 1
    out = []
    if not versions <= {weights(v) for v in span}:
        out.append(
            f"{where}: sampled by versions {sorted(versions)}, outside its group's "
            f"{span.start}..{span.stop - 1}"
        )
    if exact and versions != {weights(row["weight_version"])}:
        out.append(
            f"{where}: sampled by versions {sorted(versions)}, labelled {row['weight_version']}"
        )
    prompt_length = len(ids) - len(sampled)
    truth = teacher.logprobs_of(ids, prompt_length)
    if any(abs(a - b) > 1e-6 for a, b in zip(truth, row[TEACHER_FIELD], strict=True)):
        out.append(f"{where}: teacher log-probs {row[TEACHER_FIELD]} are not the teacher's")
    return out


@attrs.define
class SlowStore(MemoryStore):
    """A store whose clearing of rows takes `seconds`, in a worker thread, as a remote one's
    does: a step's end (rows released, then training moves on) takes that long."""

    seconds: float = 0.0

    def clear(self, sample_ids: Iterable[str], *, missing_ok: bool = False) -> None:
        time.sleep(self.seconds)
        super().clear(sample_ids, missing_ok=missing_ok)


@attrs.define(eq=False)
class Run:
    """One process's pipeline over the servers, and how it ended."""

    pipeline: Pipeline
    learner: LabelLearner
    generator: ServedGenerator
    directory: Path
    resumed_step: int | None = None
    resumed_writer: Run | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    crashed: bool = False
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.error is None and not self.crashed and self.pipeline.status.stopped


def _prompt(ordinal: int) -> list[int]:
    return [1, 2 + ordinal // 20, 3 + ordinal % 20]


def _build(
    setup: ServedSetup,
    student: VLLMImitation,
    teacher: VLLMImitation,
    directory: Path,
    *,
    call_s: float = CALL_S,
) -> Run:
    directory.mkdir()
    config = setup.config
    assert config.checkpoints is not None
    config = attrs.evolve(config, checkpoints=attrs.evolve(config.checkpoints, folder=directory))

    async def publish(version: int) -> None:
        student.publish(version)

    generator = ServedGenerator(
        student.url,
        list,
        max_tokens=MAX_TOKENS,
        model=student.model,
        publish=publish,
        sync_mode=setup.sync_mode,
        rollout_timeout_s=call_s,
        sync_timeout_s=call_s,
        cancel_grace_s=GRACE_S,
    )
    learner = LabelLearner(
        latency=0.005, student=student, teacher=teacher, exact=setup.sync_mode is SyncMode.WAIT
    )
    pipeline = build_pipeline(
        config,
        prompts=[_prompt(o) for o in range(setup.steps * config.shape.prompts_per_step)],
        generator=generator,
        learner=learner,
        scorer=ServedTeachers(
            {TEACHER: [teacher.url] * setup.replicas},
            models={TEACHER: teacher.model},
            request_timeout_s=call_s,
        ),
        train_fields=["input_ids", "generation_logprobs", "weight_version", TEACHER_FIELD],
        lanes=lanes_for([TEACHER]),
        keep_steps=None,
        store=SlowStore(blocking=setup.store_s > 0, seconds=setup.store_s),
    )
    return Run(pipeline, learner, generator, directory)


async def _run(
    run: Run,
    servers: Mapping[str, VLLMImitation],
    events: tuple[WireEvent, ...],
    crash_at_s: float | None,
    checker: Conformance,
    bound_s: float,
) -> None:
    """Run `run` while the plan's events happen, on the real clock, within `bound_s`."""
    started = trio.current_time()

    _script(servers, events)

    async def happen(event: WireEvent) -> None:
        await trio.sleep_until(started + event.at_s)
        server = servers[event.target]
        if server.alive:
            server.kill()
            if event.down_s is not None:
                await trio.sleep(event.down_s)
                server.revive()

    on_disk: list[Path] = []

    async def crash() -> None:
        assert crash_at_s is not None
        await trio.sleep(crash_at_s)
        checker.crash()
        run.crashed = True
        checkpointer = run.pipeline.checkpointer
        on_disk.extend([] if checkpointer is None else checkpointer.saved)
        run.scope.cancel()

    async with trio.open_nursery() as nursery:
        for event in events:
            if event.route is None:
                nursery.start_soon(happen, event)
        if crash_at_s is not None:
            nursery.start_soon(crash)
        with trio.move_on_after(bound_s) as bounded, run.scope:
            try:
                await run.pipeline.run()
            except Exception as exc:
                run.error = exc
        nursery.cancel_scope.cancel()
    run.seconds = trio.current_time() - started
    assert not bounded.cancelled_caught, f"the run did not end within {bound_s:g} s"
    if run.crashed and run.pipeline.status.stopped:
        run.crashed = False  # it had finished before the crash came
    elif run.crashed and run.pipeline.checkpointer is not None:
        # a cancel reaches a task at its next wait: a write that was under way in a worker
        # thread at the crash may have landed after it, which a dead process never does
        for late in set(run.pipeline.checkpointer.saved) - set(on_disk):
            shutil.rmtree(late)


_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (RolloutsFailed, "a run failed: rollouts kept failing"),
    (ScoringCallFailed, "a run failed: teacher calls kept failing"),
)


class _Warnings(logging.Handler):
    """Marks the rollouts and teacher calls given up, by the error their warning names."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        for kind in ("EngineBusy", "EngineTimeout", "EngineRefused", "EngineOutputError"):
            if f"{kind}(" in text:
                marks[f"a call given up: {kind}"] += 1


def _script(servers: Mapping[str, VLLMImitation], events: tuple[WireEvent, ...]) -> None:
    """Each route's faults in the order of the requests they are for, plain answers between
    (two faults for the same request: the second takes the next one)."""
    queues: dict[tuple[str, str], list[Fault]] = collections.defaultdict(list)
    for event in sorted(events, key=lambda e: e.nth):
        if event.route is None or event.fault is None:
            continue
        queue = queues[event.target, event.route]
        queue.extend([Fault.plain()] * (event.nth - len(queue)))
        queue.append(event.fault)
    for (target, route), faults in queues.items():
        servers[target].script(route, *faults)


def _check_end(run: Run) -> None:
    """What any run must leave, however it ended."""
    error = run.error
    if run.crashed:
        marks["a crash"] += 1
    if error is not None:
        cause = error.__cause__ if isinstance(error, PumpFailed) else error
        assert isinstance(cause, GroupflowError), f"the run failed with a bug: {cause!r}"
        chain: list[BaseException] = []
        while cause is not None and cause not in chain:
            chain.append(cause)
            cause = cause.__cause__
        for kind, mark in _FAILURES:
            if any(isinstance(e, kind) for e in chain):
                marks[mark] += 1
        if any("weight sync" in str(e) for e in chain):
            marks["a run failed at a weight sync"] += 1
    stray = sorted(run.pipeline.buffer.store.list_ids())
    assert not stray, f"rows left in the store after the run: {stray[:8]}"
    problems = run.learner.problems
    assert not problems, "trained rows not as labelled: " + "; ".join(problems[:3])


async def _example(setup: ServedSetup, bound_s: float) -> None:
    stats["examples"] += 1
    last_setup[:] = [setup]
    tmp = Path(tempfile.mkdtemp(prefix="groupflow-served-machine-"))
    config = setup.config
    prompts = setup.steps * config.shape.prompts_per_step
    try:
        with (
            VLLMImitation(
                "student",
                vocab=VOCAB,
                token_s=setup.token_s,
                reload_s=RELOAD_S,
                jitter_s=setup.jitter_s,
            ) as student,
            VLLMImitation("teacher", vocab=VOCAB, seed=7) as teacher,
        ):
            servers = {"student": student, "teacher": teacher}
            checker = Conformance(bounds_for(config, prompts=prompts, teachers=1))
            first = _build(setup, student, teacher, tmp / "run-0")
            checker.attach(first.pipeline)
            await _run(first, servers, setup.events, setup.crash_at_s, checker, bound_s)
            _check_end(first)
            last = first
            if first.finished:
                stats["completed"] += 1
            else:
                stats["crashed" if first.crashed else "failed"] += 1
                last = await _resume(setup, first, servers, checker, tmp, bound_s)
            assert checker.ok, checker.failure
            trained_exactly_once(last, prompts=prompts, per_step=config.shape.prompts_per_step)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _resume(
    setup: ServedSetup,
    first: Run,
    servers: Mapping[str, VLLMImitation],
    checker: Conformance,
    tmp: Path,
    bound_s: float,
) -> Run:
    """The user runs it again: from the newest checkpoint (or from scratch), on the same
    servers (brought back up), without faults. It must finish."""
    stats["resumed"] += 1
    for server in servers.values():
        server.clear_script()
        if not server.alive:
            server.revive()
    second = _build(
        setup, servers["student"], servers["teacher"], tmp / "run-1", call_s=RESUMED_CALL_S
    )
    if not first.crashed:
        checker.restart()
    checker.attach(second.pipeline)
    try:
        loaded = load_checkpoint(first.directory)
    except CheckpointNotFound:
        loaded = None
    marks["resumed from scratch" if loaded is None else "resumed from a checkpoint"] += 1
    if loaded is not None:
        second.resumed_step, second.resumed_writer = loaded.step, first
        await second.pipeline.resume_from(loaded)
    with trio.fail_after(bound_s):  # the student serves the run's weights first, as the
        # trainer has it: a failed sync may have left others on the server
        await second.generator.sync_weights(second.pipeline.position.weight_version)
    checker.compare()
    await _run(second, servers, (), None, checker, bound_s)
    _check_end(second)
    cause = second.error.__cause__ if isinstance(second.error, PumpFailed) else second.error
    if isinstance(cause, NothingTrained):  # the checkpoint had given every prompt up
        assert not second.pipeline.ledger.trained
    else:
        assert second.finished, f"the resumed run did not finish: {second.error!r}"
    return second


def run_served_machine(
    *,
    max_examples: int,
    seed: int | None = None,
    bound_s: float = BOUND_S,
    shrink: bool = True,
    derandomize: bool = False,
) -> collections.Counter[str]:
    """Run the machine for `max_examples` examples; a failing one is shrunk and raised, with
    its setup as a note. Returns how often each case in `MARKS` was reached."""
    stats.clear()
    marks.clear()

    @budget(max_examples=max_examples, steps=1, shrink=shrink, seed=seed, derandomize=derandomize)
    @given(setup=served_setups())
    @hypothesis_example(setup=setup_from(HANGS[0]))
    @hypothesis_example(setup=setup_from(HANGS[1]))
    def example(setup: ServedSetup) -> None:
        try:
            trio.run(_example, setup, bound_s)
        except BaseException as exc:
            exc.add_note(f"served machine setup:\n{setup}")
            raise

    if seed is not None:
        example = hypothesis_seed(seed)(example)
    handler = _Warnings()
    logging.getLogger("groupflow").addHandler(handler)
    try:
        example()
    finally:
        logging.getLogger("groupflow").removeHandler(handler)
    return collections.Counter(marks)
