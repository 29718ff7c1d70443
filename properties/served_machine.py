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

`run_served_machine` runs it at a budget; `tests/test_served_machine.py` at the CI budget,
with the seeded bugs of `served_bugs`; `groupflow fuzz --machine served` for longer.
"""

from __future__ import annotations

import collections
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
from hypothesis import assume, given
from hypothesis import strategies as st

from groupflow.impl.contract import TEACHER_FIELD, TrainBatch
from groupflow.impl.engines import ServedGenerator, ServedTeachers
from groupflow.impl.errors import CheckpointNotFound, GroupflowError, PumpFailed
from groupflow.impl.pipeline import (
    CheckpointConfig,
    Pipeline,
    PipelineConfig,
    ScoringConfig,
    build_pipeline,
    lanes_for,
    load_checkpoint,
)
from groupflow.impl.testing import FakeLearner, Fault, VLLMImitation
from groupflow.model.errors import ConfigError
from groupflow.model.policy import CheckpointPolicy, FailurePolicy, SyncMode
from groupflow.properties.budget import budget
from groupflow.properties.pipeline_setups import trained_exactly_once
from groupflow.sim.conformance import Conformance, bounds_for

__all__ = ["ServedSetup", "WireEvent", "last_setup", "run_served_machine", "served_setups", "stats"]

COMPLETIONS = "/v1/completions"
SYNC_ROUTES = ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume")
VOCAB = 32
MAX_TOKENS = 6
TOKEN_S = 0.0005
CALL_S = 1.0
"""Each engine call's total bound (rollout, teacher request, sync step), in real seconds."""
GRACE_S = 0.3
SHUTDOWN_S = 5.0
BOUND_S = 60.0
"""A run that has not ended by then has hung."""
TEACHER = "t"

stats: collections.Counter[str] = collections.Counter()
"""Since the last `run_served_machine`: "examples", runs that "completed" first time, that
"failed" or "crashed" and were "resumed", rows "checked"."""
last_setup: list[ServedSetup] = []


@attrs.frozen
class WireEvent:
    """At `at_s` into the run: the next request to `route` of the `target` server meets
    `fault`; or, with no route, the server dies for `down_s` seconds (None: for good)."""

    at_s: float
    target: str
    route: str | None = None
    fault: Fault | None = None
    label: str = ""
    down_s: float | None = None

    def __str__(self) -> str:
        if self.route is None:
            gone = "for good" if self.down_s is None else f"for {self.down_s:g} s"
            return f"{self.at_s:g} s: the {self.target} server dies {gone}"
        return f"{self.at_s:g} s: {self.target} {self.route} meets {self.label}"


@attrs.frozen
class ServedSetup:
    config: PipelineConfig
    steps: int
    sync_mode: SyncMode
    replicas: int
    """How many times the teacher's server is listed (its replicas, here one server)."""
    events: tuple[WireEvent, ...]
    crash_at_s: float | None

    def __str__(self) -> str:
        c = self.config
        assert c.scoring is not None
        lines = [
            f"{self.steps} steps x {c.prompts_per_step} prompts x "
            f"{c.num_generations_per_prompt} rows, {c.max_inflight_prompts} permits, "
            f"gate {c.gate_window}, sync {self.sync_mode.value}, teacher x{self.replicas}, "
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


_ANY_ROUTE: list[tuple[str, Fault]] = [
    ("close", Fault.close()),
    ("cut", Fault.cut(60)),
    ("hang", Fault.hang()),
    ("drip", Fault.drip(300)),
    ("HTTP 503", Fault.with_status(503)),
    ("HTTP 500", Fault.with_status(500)),
    ("HTTP 429", Fault.with_status(429)),
    ("HTTP 400", Fault.with_status(400)),
    ("garbage", Fault.raw(b"<html>upstream error</html>")),
    ("a huge answer", Fault.huge(2_000_000)),
    ("a late arrival", Fault.delay(0.2)),
    ("a late arrival", Fault.delay(0.05)),
]
_COMPLETIONS_ONLY: list[tuple[str, Fault]] = [
    ("another model", Fault.edit(_other_model)),
    ("log-prob -9999", Fault.edit(_impossible(-9999.0))),
    ("log-prob 0.7", Fault.edit(_impossible(0.7))),
    ("a late arrival", Fault.delay(0.3)),
]
_ROUTE_ONLY: dict[str, list[tuple[str, Fault]]] = {
    "/collective_rpc": [("no worker", Fault.edit(lambda a: a.update(results=[])))],
    "/reset_prefix_cache": [("cache kept", Fault.edit(lambda a: a.update(success=False)))],
}
TIMES = (0.0, 0.0, 0.02, 0.1, 0.3, 0.6, 1.0)


@st.composite
def _event(draw: st.DrawFn) -> WireEvent:
    at = draw(st.sampled_from(TIMES), label="at_s")
    target = draw(st.sampled_from(["student", "student", "teacher"]), label="target")
    if draw(st.integers(0, 9), label="outage?") == 0:
        down = draw(st.sampled_from([0.05, 0.3, None]), label="down_s")
        return WireEvent(at, target, down_s=down)
    routes = [COMPLETIONS] * 4 + list(SYNC_ROUTES) if target == "student" else [COMPLETIONS]
    route = draw(st.sampled_from(routes), label="route")
    faults = _ANY_ROUTE + (_COMPLETIONS_ONLY if route == COMPLETIONS else _ROUTE_ONLY.get(route, []))
    label, fault = draw(st.sampled_from(faults), label="fault")
    return WireEvent(at, target, route, fault, label)


@st.composite
def served_setups(draw: st.DrawFn) -> ServedSetup:
    """A configuration the pipeline accepts, over served engines, and a plan of faults."""
    per_step = draw(st.integers(1, 2), label="prompts_per_step")
    permits = draw(st.integers(1, 4), label="permits")
    steps = draw(st.integers(2, 4), label="steps")
    try:
        config = PipelineConfig(
            prompts_per_step=per_step,
            num_generations_per_prompt=draw(st.integers(1, 2), label="generations"),
            max_inflight_prompts=permits,
            max_buffered_groups=per_step + draw(st.integers(0, 3), label="capacity over step"),
            gate_window=draw(st.integers(0, 2), label="gate_window"),
            scoring=ScoringConfig(
                max_batch_groups=min(draw(st.integers(1, 3), label="max_batch_groups"), permits),
                flush_after_s=0.05,
                failure_policy=draw(st.sampled_from(list(FailurePolicy)), label="policy"),
                call_timeout_s=3 * CALL_S,
            ),
            shutdown_timeout_s=SHUTDOWN_S,
            stall_timeout_s=120.0,
            stall_action="warn",
            checkpoints=CheckpointConfig(
                ".",
                policy=draw(
                    st.sampled_from([CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED]),
                    label="checkpoint policy",
                ),
                flush_timeout_s=2.0,
                every_steps=1,
                write_in_thread=False,
            ),
        )
    except ConfigError:
        assume(False)
        raise  # unreachable: assume(False) raises
    events = tuple(draw(st.lists(_event(), max_size=6), label="events"))
    crash = draw(st.sampled_from([None, None, None, 0.05, 0.2, 0.5]), label="crash_at_s")
    return ServedSetup(
        config,
        steps,
        draw(st.sampled_from(list(SyncMode)), label="sync_mode"),
        draw(st.integers(1, 2), label="teacher replicas"),
        events,
        crash,
    )


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
    versions = student.versions_of(ids, sampled)
    if versions is None:
        return [f"{where}: the student's server sampled no such row"]
    out = []
    if not versions <= set(span):
        out.append(
            f"{where}: sampled by versions {sorted(versions)}, outside its group's "
            f"{span.start}..{span.stop - 1}"
        )
    if exact and versions != {row["weight_version"]}:
        out.append(
            f"{where}: sampled by versions {sorted(versions)}, labelled {row['weight_version']}"
        )
    values = sampled + list(row[TEACHER_FIELD])
    if any(not -9999.0 < v <= 1e-4 for v in values):
        out.append(f"{where}: trained on an impossible log-prob: {values}")
    prompt_length = len(ids) - len(sampled)
    truth = teacher.logprobs_of(ids, prompt_length)
    if any(abs(a - b) > 1e-6 for a, b in zip(truth, row[TEACHER_FIELD], strict=True)):
        out.append(f"{where}: teacher log-probs {row[TEACHER_FIELD]} are not the teacher's")
    return out


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
    setup: ServedSetup, student: VLLMImitation, teacher: VLLMImitation, directory: Path
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
        rollout_timeout_s=CALL_S,
        sync_timeout_s=CALL_S,
        cancel_grace_s=GRACE_S,
    )
    learner = LabelLearner(
        latency=0.005, student=student, teacher=teacher, exact=setup.sync_mode is SyncMode.WAIT
    )
    pipeline = build_pipeline(
        config,
        prompts=[_prompt(o) for o in range(setup.steps * config.prompts_per_step)],
        generator=generator,
        learner=learner,
        scorer=ServedTeachers(
            {TEACHER: [teacher.url] * setup.replicas},
            models={TEACHER: teacher.model},
            request_timeout_s=CALL_S,
        ),
        train_fields=["input_ids", "generation_logprobs", "weight_version", TEACHER_FIELD],
        lanes=lanes_for([TEACHER]),
        keep_steps=None,
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

    async def plan() -> None:
        for event in sorted(events, key=lambda e: e.at_s):
            await trio.sleep_until(started + event.at_s)
            server = servers[event.target]
            if event.route is not None:
                assert event.fault is not None
                server.script(event.route, event.fault)
            elif server.alive:
                server.kill()
                if event.down_s is not None:
                    await trio.sleep(event.down_s)
                    server.revive()

    async def crash() -> None:
        assert crash_at_s is not None
        await trio.sleep(crash_at_s)
        checker.crash()
        run.crashed = True
        run.scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(plan)
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


def _check_end(run: Run) -> None:
    """What any run must leave, however it ended."""
    error = run.error
    if error is not None:
        cause = error.__cause__ if isinstance(error, PumpFailed) else error
        assert isinstance(cause, GroupflowError), f"the run failed with a bug: {cause!r}"
    stray = sorted(run.pipeline.buffer.store.list_ids())
    assert not stray, f"rows left in the store after the run: {stray[:8]}"
    problems = run.learner.problems
    assert not problems, "trained rows not as labelled: " + "; ".join(problems[:3])


async def _example(setup: ServedSetup, bound_s: float) -> None:
    stats["examples"] += 1
    last_setup[:] = [setup]
    tmp = Path(tempfile.mkdtemp(prefix="groupflow-served-machine-"))
    config = setup.config
    prompts = setup.steps * config.prompts_per_step
    try:
        with (
            VLLMImitation("student", vocab=VOCAB, token_s=TOKEN_S) as student,
            VLLMImitation("teacher", vocab=VOCAB, token_s=TOKEN_S, seed=7) as teacher,
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
            trained_exactly_once(last, prompts=prompts, per_step=config.prompts_per_step)
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
    second = _build(setup, servers["student"], servers["teacher"], tmp / "run-1")
    if not first.crashed:
        checker.restart()
    checker.attach(second.pipeline)
    try:
        loaded = load_checkpoint(first.directory)
    except CheckpointNotFound:
        loaded = None
    if loaded is not None:
        second.resumed_step, second.resumed_writer = loaded.step, first
        await second.pipeline.resume_from(loaded)
        with trio.fail_after(bound_s):  # the student serves the checkpoint's weights first
            await second.generator.sync_weights(loaded.weight_version)
    checker.compare()
    await _run(second, servers, (), None, checker, bound_s)
    _check_end(second)
    assert second.finished, f"the resumed run did not finish: {second.error!r}"
    return second


def run_served_machine(
    *,
    max_examples: int,
    seed: int | None = None,
    bound_s: float = BOUND_S,
    shrink: bool = True,
) -> None:
    """Run the machine for `max_examples` examples; a failing one is shrunk and raised, its
    setup printed first."""
    stats.clear()

    @budget(max_examples=max_examples, steps=1, shrink=shrink, seed=seed)
    @given(setup=served_setups())
    def example(setup: ServedSetup) -> None:
        try:
            trio.run(_example, setup, bound_s)
        except BaseException as exc:
            exc.add_note(f"served machine setup:\n{setup}")
            raise

    if seed is not None:
        from hypothesis import seed as hypothesis_seed

        example = hypothesis_seed(seed)(example)
    example()
