"""A Hypothesis state machine that owns one live pipeline and chooses the order of events.

The pipeline is the real one (`build_pipeline`: controller, supervisor, buffer, pumps, stage,
checkpoints), over fakes that do nothing until a rule says so: a rollout waits until a rule
finishes or fails it, a teacher call until a rule returns or fails it, and virtual time moves
only when a rule advances it (firing flush timers, call timeouts and the stall watchdog).

Trio runs in guest mode, with a host loop of our own: every rule hands its decision to the
trio side (`TrioToken.run_sync_soon`) and then runs trio's callbacks until a helper task sees
every other task blocked (`trio.testing.wait_all_tasks_blocked`). So after each rule the pipeline
has done everything it can without a new event from outside, and the invariants are checked
there: the buffer's (`assert_invariants`), the permits, one call per teacher, and conformance
with the model (`groupflow.sim.conformance`), action by action. A crash cancels everything; a
fresh pipeline resumes from the newest checkpoint on disk. At the end, a fair drain releases
everything and advances time until the run ends, then checks that nothing is left behind and
that each prompt was trained exactly once (across every crash) or given up.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import trio
import trio.lowlevel
import trio.testing
from hypothesis import assume
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from groupflow.impl import TEACHER_FIELD, PumpFailed
from groupflow.impl.core import PAD_PREFIX
from groupflow.impl.pipeline import (
    ExtraStage,
    GenerateRequest,
    Pipeline,
    PipelineConfig,
    ScoreRequest,
    ScoringConfig,
    TrainBatch,
    build_pipeline,
    lanes_for,
    load_checkpoint,
)
from groupflow.impl.teachers import (
    TEACHER_INPUTS,
    Teacher,
    TokenRow,
    score_request,
    teacher_by_agent,
)
from groupflow.model import GroupState, assert_invariants
from groupflow.model.errors import ConfigError, ShutdownTimeout, TeacherOutputError
from groupflow.model.policy import CheckpointPolicy, Dispatch, FailurePolicy
from groupflow.model.scheduler import Phase
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.properties.budget import budget, seeded
from groupflow.sim.conformance import Conformance, bounds_for

MARKS = (
    "timer flush while another teacher scores",
    "crash with groups SCORING",
    "demand dispatch",
    "retry then success",
    "watchdog fired",
    "resume re-issues prompts",
    "resume after an interrupt",
    "verifier scores a batch",
)
"""Cases the machine must keep reaching (a test asserts each is reached at the CI budget)."""

marks: collections.Counter[str] = collections.Counter()
"""How often each case in `MARKS` was reached since the last `run_pipeline_machine`."""

stats: collections.Counter[str] = collections.Counter()
"""Since the last `run_pipeline_machine`: "examples" started, "checks" (after each rule and
each round of the drain), runs "completed" (checked exactly-once) and "failed" (checked clean)."""

PUMP_LIMIT = 5_000
"""Trio callbacks one rule may run before the machine calls the pipeline busy-looping (a rule
needs a few dozen)."""
DRAIN_ROUNDS = 400
"""Rounds of the fair drain (release all, advance time) before it counts as a failure."""
DRAIN_TICK_S = 5.0
MAX_CRASHES = 2
"""Crashes per example: more would keep most runs from getting anywhere."""
MAX_EARLY_CRASHES = 1
"""Crashes per example before any checkpoint is on disk: a crash is enabled from the first
rule on, so without this limit most examples spend their crashes before a step is trained, and
a resume from a checkpoint is rarely reached."""
TIME_STEPS = (0.01, 0.5, 1.0, 3.0, 10.0, 40.0, 700.0)
CALL_OUTCOMES = (None, None, None, None, None, "raises", "raises", "garbage")
"""How a teacher call the machine answers ends: scored, or failed (`FAILURES`)."""

last_example: list[str] = []
"""The rules of the example run last: after a failure, Hypothesis's shrunk example (it runs
that one last, to report it)."""
last_setup: list[Setup] = []
"""The setup of the example run last (one item)."""


def _mark(name: str) -> None:
    marks[name] += 1
    if currently_in_test_context():
        note_event(name)


# -- controllable fakes --------------------------------------------------------------------


ROW_LENGTHS = (4, 5, 7)
"""Rows of a group differ in length, so a batch pads rows inside the forward pass too."""
PROMPT_LENGTH = 2
VOCAB = 256
"""Token ids below the tiny torch preset's vocabulary."""


def tokens_of(ordinal: int, index: int) -> tuple[int, ...]:
    """The `index`-th generation of prompt `ordinal`: fixed, so any row can be scored again."""
    length = ROW_LENGTHS[(ordinal + index) % len(ROW_LENGTHS)]
    return tuple((ordinal * 37 + index * 11 + j * 5 + 3) % VOCAB for j in range(length))


@attrs.define
class _Held:
    """One call the outside world has not answered yet."""

    done: trio.Event = attrs.field(factory=trio.Event)
    fail: str | None = None
    started: float = 0.0


@attrs.define
class HeldGenerator:
    """Each rollout waits until `finish(ordinal, fail=...)`."""

    fields: frozenset[str] = frozenset({"input_ids", "prompt_length", "generation_logprobs"})
    pending: dict[int, _Held] = attrs.field(factory=dict)

    async def generate(self, request: GenerateRequest) -> Sequence[Mapping[str, Any]]:
        assert request.ordinal not in self.pending, f"prompt {request.ordinal} generated twice"
        held = self.pending[request.ordinal] = _Held()
        try:
            await held.done.wait()
        finally:
            self.pending.pop(request.ordinal, None)
        if held.fail:
            raise RuntimeError(f"rollout of prompt {request.ordinal} failed (by the machine)")
        return [
            {
                "input_ids": list(tokens_of(request.ordinal, i)),
                "prompt_length": PROMPT_LENGTH,
                "generation_logprobs": [-1.0],
            }
            for i in range(request.num_generations)
        ]

    def finish(self, ordinal: int, *, fail: bool) -> None:
        held = self.pending[ordinal]
        held.fail = "failed" if fail else None
        held.done.set()

    async def sync_weights(self, version: int) -> None:
        return None


@attrs.frozen
class ArithmeticTeacher:
    """A `Teacher` without torch: a response token's log-prob is a fixed function of the
    token, its position and the teacher's seed, so what every row should get is known."""

    seed: int
    dp_size: int = 1

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        return [[self.expected(row) for row in shard] for shard in shards]

    def expected(self, row: TokenRow) -> list[float]:
        return [
            -(((token * 31 + position * 7 + self.seed) % 97) + 1) / 100
            for position, token in enumerate(row.input_ids)
            if position >= row.prompt_length
        ]


@attrs.frozen
class _Raising:
    """A teacher whose forward pass fails (after the batch was padded and sharded)."""

    teacher: Teacher

    @property
    def dp_size(self) -> int:
        return self.teacher.dp_size

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        raise OSError("teacher forward pass failed (by the machine)")


@attrs.frozen
class _Garbage:
    """A teacher that returns one log-prob too many for every row (a permanent failure)."""

    teacher: Teacher

    @property
    def dp_size(self) -> int:
        return self.teacher.dp_size

    def score_shards(self, shards: Sequence[Sequence[TokenRow]]) -> list[list[Sequence[float]]]:
        return [[[-1.0] * (row.response_length + 1) for row in shard] for shard in shards]


FAILURES: dict[str, Callable[[Teacher], Teacher]] = {"raises": _Raising, "garbage": _Garbage}
"""How a teacher call the machine fails goes wrong: a transient error, or bad output."""

VERIFIER = "verifier"
"""The second stage some setups draw (`Setup.verifier`): it writes `REWARD_FIELD`."""
REWARD_FIELD = "reward"
VERIFIER_FAILURES: dict[str, type[Exception]] = {"raises": OSError, "garbage": ValueError}
"""How a verifier call the machine fails goes wrong: transient, or permanent."""


def reward_of(input_ids: Sequence[int]) -> float:
    """What the machine's verifier writes for a row: a fixed function of its tokens."""
    return float(sum(input_ids) % 3)


@attrs.frozen
class TeacherBank:
    """The physical teachers of one example, and what each should write for a row. With
    `served`, the teachers are served (`ServedTeachers`: real HTTP calls to a real server) and
    `teachers` only names them, with their replica counts as DP sizes."""

    teachers: Mapping[str, Any]
    reference: Callable[[str, TokenRow], list[float]]
    tolerance: float
    served: Any = None


@attrs.frozen
class Served:
    """A server the machine's teachers are scored on (`scorer="served"`): its URL and the
    Hugging Face folder it serves (what the written log-probs are checked against)."""

    url: str
    model: Path


SERVED_TOLERANCE = 2e-3
"""How far a served float32 log-prob may be from transformers' on the same weights."""

_hf_models: dict[Path, Any] = {}
"""The served folders' models in transformers, loaded once per process."""


def _served_bank(served: Served, dp_sizes: Mapping[str, int]) -> TeacherBank:
    import torch
    import transformers

    from groupflow.impl.engines import ServedTeachers

    if served.model not in _hf_models:
        _hf_models[served.model] = transformers.AutoModelForCausalLM.from_pretrained(
            served.model, local_files_only=True, dtype=torch.float32
        )  # in eval mode, as from_pretrained leaves it
    model = _hf_models[served.model]

    def reference(name: str, row: TokenRow) -> list[float]:
        with torch.inference_mode():
            ids = torch.tensor([row.input_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
        return [
            float(logp[p - 1, row.input_ids[p]])
            for p in range(row.prompt_length, len(row.input_ids))
        ]

    # a teacher of DP size n is n replicas: its calls split their rows over n requests
    scorer = ServedTeachers({n: [served.url] * dp for n, dp in dp_sizes.items()})
    return TeacherBank(dict(dp_sizes), reference, SERVED_TOLERANCE, served=scorer)


_torch_models: dict[tuple[int, str], Any] = {}
"""Torch teachers' models by (seed, device): built once per process, not once per example."""


def teacher_bank(
    scorer: str, device: str, dp_sizes: Mapping[str, int], served: Served | None = None
) -> TeacherBank:
    """`fake`: `ArithmeticTeacher`s; `torch`: `TorchTeacher`s on the tiny preset, each checked
    against a forward pass of its model on the row alone (`reference_logprobs`); `served`: the
    teachers on the server `served`, checked against transformers on the folder it serves."""
    if scorer == "served":
        if served is None:
            raise ValueError("scorer='served' needs the server: served=Served(url, model)")
        return _served_bank(served, dp_sizes)
    seeds = {name: i for i, name in enumerate(sorted(dp_sizes))}
    if scorer == "fake":
        fakes = {n: ArithmeticTeacher(seeds[n], dp) for n, dp in dp_sizes.items()}
        return TeacherBank(fakes, lambda name, row: fakes[name].expected(row), 0.0)
    from groupflow.impl.teachers import (
        PRESETS,
        TorchTeacher,
        batch_tolerance,
        reference_logprobs,
        resolve_device,
    )

    where = str(resolve_device(device))
    models = {}
    for name, seed in seeds.items():
        key = (seed, where)
        if key not in _torch_models:
            _torch_models[key] = TorchTeacher.from_config(
                PRESETS["tiny"], seed=seed, device=where
            ).model
        models[name] = _torch_models[key]
    teachers = {n: TorchTeacher(models[n], dp_size=dp, device=where) for n, dp in dp_sizes.items()}
    tolerance = batch_tolerance(next(iter(teachers.values())).dtype)
    return TeacherBank(teachers, lambda name, row: reference_logprobs(models[name], row), tolerance)


@attrs.define
class HeldScorer:
    """Each teacher call waits until `finish(teacher, fail=...)`, then scores its batch for real
    (`score_teacher_batch`: padding to the teacher's DP size, shards, checked output) on the
    teacher, or on a failing wrapper of it. Two calls at once on one teacher are recorded in
    `overlaps` (and fail)."""

    bank: TeacherBank
    verifier: bool = False
    """It also serves the `VERIFIER` stage, whose calls write `reward_of` each row."""
    reads: ClassVar[frozenset[str]] = TEACHER_INPUTS
    pending: dict[str, tuple[_Held, ScoreRequest]] = attrs.field(factory=dict)
    overlaps: list[str] = attrs.field(factory=list)
    calling: set[str] = attrs.field(factory=set)
    """Served teachers whose released call is still on the wire (the machine waits for them
    to end before its next event)."""

    @property
    def teachers(self) -> frozenset[str]:
        return frozenset(self.bank.teachers) | ({VERIFIER} if self.verifier else set())

    async def score(self, request: ScoreRequest) -> None:
        if request.teacher in self.pending:
            self.overlaps.append(request.teacher)
            raise AssertionError(f"two calls at once on teacher {request.teacher!r}")
        held = _Held(started=trio.current_time())
        self.pending[request.teacher] = (held, request)
        try:
            await held.done.wait()
        finally:
            if self.pending.get(request.teacher, (None,))[0] is held:
                del self.pending[request.teacher]
        if request.teacher == VERIFIER:
            if held.fail is not None:
                raise VERIFIER_FAILURES[held.fail](
                    f"verifier call failed ({held.fail}, by the machine)"
                )
            rows = request.store.get(request.sample_ids, ["input_ids"])
            request.store.add_fields(
                {sid: {request.field: reward_of(row["input_ids"])} for sid, row in rows.items()}
            )
            return
        if self.bank.served is not None:
            if held.fail == "raises":
                raise OSError("served teacher call failed (by the machine)")
            if held.fail is not None:
                raise TeacherOutputError("served teacher answered garbage (by the machine)")
            self.calling.add(request.teacher)
            try:
                await self.bank.served.score(request)
            finally:
                self.calling.discard(request.teacher)
            return
        teacher = self.bank.teachers[request.teacher]
        if held.fail is not None:
            teacher = FAILURES[held.fail](teacher)
        score_request(teacher, request)

    def finish(self, teacher: str, *, fail: str | None) -> ScoreRequest:
        held, request = self.pending[teacher]
        held.fail = fail
        held.done.set()
        return request


@attrs.define
class CheckingLearner:
    """Records each batch, and checks every row's teacher log-probs against what the row's
    teacher gives it alone (`TeacherBank.reference`): `wrong` lists the rows that differ."""

    bank: TeacherBank
    teacher_of: Callable[[int], str]
    verifier: bool = False
    """Rows must carry the verifier's `reward_of` them too."""
    batches: list[TrainBatch] = attrs.field(factory=list)
    wrong: list[str] = attrs.field(factory=list)
    steps: int = 0

    async def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        self.batches.append(batch)
        self.steps += 1
        for group in batch.groups:
            assert group.ordinal is not None
            teacher = self.teacher_of(group.ordinal)
            for sid in group.sample_ids:
                row = batch.rows[sid]
                token_row = TokenRow(tuple(row["input_ids"]), int(row["prompt_length"]))
                want = self.bank.reference(teacher, token_row)
                got = list(row[TEACHER_FIELD])
                if len(got) != len(want) or any(
                    abs(g - w) > self.bank.tolerance for g, w in zip(got, want, strict=True)
                ):
                    self.wrong.append(f"{sid} (teacher {teacher}): wrote {got}, expected {want}")
                if self.verifier and row.get(REWARD_FIELD) != reward_of(row["input_ids"]):
                    self.wrong.append(
                        f"{sid} (verifier): reward {row.get(REWARD_FIELD)!r}, expected "
                        f"{reward_of(row['input_ids'])}"
                    )
        return {"groups": float(len(batch.groups))}

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.steps = state["steps"]


# -- one run of the pipeline ---------------------------------------------------------------


@attrs.define(eq=False)
class _Incarnation:
    """One process's pipeline: the first, or one resumed after a crash."""

    pipeline: Pipeline
    generator: HeldGenerator
    scorer: HeldScorer
    learner: CheckingLearner
    directory: Path
    resumed_step: int | None = None
    """The step of the checkpoint it resumed from (None: it started from scratch)."""
    resumed_writer: _Incarnation | None = None
    """The incarnation that wrote that checkpoint."""
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ended: bool = False
    crashed: bool = False
    stop_requested: bool = False
    """An interrupt rule asked it to stop (`Pipeline.request_stop`)."""
    error: BaseException | None = None
    checked: bool = False


def _interrupted(inc: _Incarnation) -> bool:
    """It stopped early, cleanly, on request (not after its last step, not failed)."""
    return (
        inc.ended
        and inc.stop_requested
        and inc.error is None
        and not inc.crashed
        and not inc.pipeline.status.stopped
    )


@attrs.define
class _Tee:
    """The run's observer: the conformance checker, and the machine's coverage marks."""

    checker: Conformance
    machine: PipelineMachine

    def on_action(self, action: Action) -> None:
        self.checker.on_action(action)
        self.machine.saw(action)


@attrs.frozen
class Setup:
    config: PipelineConfig
    steps: int
    teachers: tuple[str, ...]
    agents: tuple[str, ...]
    """The agent of each prompt."""
    dp_sizes: tuple[int, ...]
    """Each teacher's DP size: a batch is padded to a multiple of it."""
    verifier: bool = False
    """A second scoring stage after the teachers' (`ExtraStage`): the two-stage model."""


def without_safety(config: PipelineConfig) -> PipelineConfig:
    """The test-only escape hatch: `config` with its flush timer off (which the config refuses
    to build), so a partial batch waits for a full one or the drain, whatever admission does.
    Only `PipelineMachine(unsafe=True)` uses it, to show the machine finds the deadlock the
    config's conditions prevent."""
    assert config.scoring is not None
    scoring = config.scoring
    object.__setattr__(scoring, "flush_after_s", math.inf)
    return config


@st.composite
def setups(draw: st.DrawFn, *, unsafe: bool = False) -> Setup:
    """A configuration the pipeline accepts (`unsafe`: one past its deadlock conditions, no
    flush timer and no demand dispatch, which only `without_safety` can build)."""
    # every draw is made whatever the others gave (three DP sizes, an agent for each of the
    # most prompts there can be): so when the shrinker makes one smaller, the draws after it
    # still line up with the same choices
    per_step = draw(st.integers(1, 3), label="prompts_per_step")
    permits = draw(st.integers(1, 4), label="permits")
    teachers = tuple(f"t{i}" for i in range(draw(st.integers(1, 3), label="teachers")))
    dp_sizes = tuple(draw(st.integers(1, 3), label=f"dp_size of t{i}") for i in range(3))
    steps = draw(st.integers(2, 4), label="steps")
    agents = tuple(
        f"a{draw(st.integers(0, 2), label=f'agent of prompt {o}') % len(teachers)}"
        for o in range(4 * 3)
    )[: steps * per_step]
    flush = draw(st.sampled_from([0.5, 2.0, 10.0]), label="flush_after_s")
    scoring = ScoringConfig(
        max_batch_groups=min(
            draw(st.integers(1, 4), label="max_batch_groups"), 4 if unsafe else permits
        ),
        flush_after_s=flush,
        dispatch=Dispatch.TIMER if unsafe else draw(st.sampled_from(Dispatch), label="dispatch"),
        failure_policy=draw(
            st.sampled_from(
                [
                    FailurePolicy.RETRY,
                    FailurePolicy.RETRY,
                    FailurePolicy.DISCARD,
                    FailurePolicy.FAIL,
                ]
            ),
            label="failure_policy",
        ),
        call_timeout_s=draw(st.sampled_from([30.0, 600.0]), label="call_timeout_s"),
        max_consecutive_failed_batches=1_000_000,
    )
    try:
        config = PipelineConfig(
            prompts_per_step=per_step,
            num_generations_per_prompt=draw(st.integers(1, 2), label="generations"),
            max_inflight_prompts=permits,
            max_buffered_groups=per_step + draw(st.integers(-1, 3), label="capacity over step"),
            gate_window=draw(st.integers(0, 2), label="gate_window"),
            scoring=scoring,
            max_consecutive_failed_rollouts=1_000_000,
            stall_timeout_s=draw(st.sampled_from([20.0, 200.0]), label="stall_timeout_s"),
            stall_action="warn",
            checkpoint_policy=draw(
                st.sampled_from([CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED]),
                label="checkpoint_policy",
            ),
            flush_timeout_s=draw(st.sampled_from([5.0, 100.0]), label="flush_timeout_s"),
            checkpoint_every_steps=draw(st.integers(1, 2), label="checkpoint_every_steps"),
        )
    except ConfigError:
        assume(False)
        raise  # unreachable: assume(False) raises
    if unsafe:
        config = without_safety(config)
    verifier = draw(st.booleans(), label="verifier stage")
    return Setup(config, steps, teachers, agents, dp_sizes[: len(teachers)], verifier)


class _Host:
    """A trio run in guest mode, driven by hand: `call(fn)` runs `fn` inside trio, then trio
    runs until every task is blocked."""

    def __init__(self, main: Callable[[], Any]) -> None:
        self.clock = trio.testing.MockClock(autojump_threshold=math.inf)
        self.queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.quiet = False
        self.done: Any = None
        """The guest run's `outcome.Outcome`, once it ended."""
        self.token: trio.lowlevel.TrioToken | None = None
        self._poke = trio.Event()
        self._main = main

        async def guest() -> Any:
            self.token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_quiet)
                result = await self._main()
                nursery.cancel_scope.cancel()
            return result

        trio.lowlevel.start_guest_run(
            guest,
            run_sync_soon_threadsafe=self.queue.put,
            run_sync_soon_not_threadsafe=self.queue.put,
            done_callback=self._finished,
            clock=self.clock,
            host_uses_signal_set_wakeup_fd=True,
        )
        self.pump()

    def _finished(self, result: Any) -> None:
        self.done = result

    async def _watch_quiet(self) -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked()
            self.quiet = True
            await self._poke.wait()
            self._poke = trio.Event()

    def pump(self) -> None:
        """Run trio's callbacks until every task is blocked (or the run is over)."""
        for _ in range(PUMP_LIMIT):
            if self.quiet or self.done is not None:
                return
            self.queue.get(timeout=30)()
        raise AssertionError(
            f"the pipeline did not settle within {PUMP_LIMIT} trio callbacks: a task never "
            f"blocks (a busy loop)"
        )

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` inside trio (synchronously, between its tasks), then let trio settle."""
        assert self.token is not None and self.done is None

        def inside() -> None:
            self.quiet = False
            try:
                fn()
            finally:
                self._poke.set()

        self.quiet = False
        self.token.run_sync_soon(inside)
        self.pump()

    def advance(self, seconds: float) -> None:
        self.call(lambda: self.clock.jump(seconds))

    def settle_until(self, done: Callable[[], bool], *, timeout_s: float = 120.0) -> None:
        """Run trio's callbacks, in real time, until `done()` (real I/O has ended: a served
        teacher's answer came), then let trio settle."""
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self.done is not None:
                raise AssertionError(f"the real I/O did not end within {timeout_s:g} s")
            try:
                self.queue.get(timeout=left)()
            except queue.Empty:
                continue
        self.call(lambda: None)

    def close(self) -> None:
        """End the guest run (its main returns when told), and wait for it."""
        for _ in range(PUMP_LIMIT):
            if self.done is not None:
                return
            self.queue.get(timeout=30)()
        raise AssertionError("the trio guest run did not end")


class PipelineMachine(RuleBasedStateMachine):
    """One live pipeline per example; rules are the outside world's events.

    `run_pipeline_machine` runs a subclass that sets the variant: `SCORER` ("fake":
    `ArithmeticTeacher`s, "torch": `TorchTeacher`s) on `DEVICE`, and `UNSAFE` (the escape hatch
    of `without_safety`)."""

    SCORER: ClassVar[str] = "fake"
    DEVICE: ClassVar[str] = "cpu"
    UNSAFE: ClassVar[bool] = False
    SERVED: ClassVar[Served | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.host: _Host | None = None
        self.tmp: Path | None = None

    # -- set-up ------------------------------------------------------------------------

    @initialize(setup=st.data(), seed=st.integers(0, 2**32 - 1))
    def start(self, setup: st.DataObject, seed: int) -> None:
        self._start(setup.draw(setups(unsafe=self.UNSAFE), label="setup"), seed)

    def _start(self, setup: Setup, seed: int) -> None:
        stats["examples"] += 1
        last_example.clear()
        last_setup[:] = [setup]
        # trio breaks ties between runnable tasks at random: seeded from the example, so an
        # example (and a derandomized run) replays exactly, as the simulator's runs do
        trio._core._run._r.seed(seed)
        self.setup = setup
        config = setup.config
        self.teacher_of_agent = {f"a{i}": t for i, t in enumerate(setup.teachers)}
        self.lanes = lanes_for(list(setup.teachers), later=[VERIFIER] if setup.verifier else [])
        self.lane_names = {lane: name for name, lane in self.lanes.items()}
        prompts = setup.steps * config.prompts_per_step
        self.num_prompts = prompts
        routing = [self.lanes[self.teacher_of_agent[setup.agents[o]]] for o in range(prompts)]
        self.bank = teacher_bank(
            self.SCORER,
            self.DEVICE,
            dict(zip(setup.teachers, setup.dp_sizes, strict=True)),
            served=self.SERVED,
        )
        self.checker = Conformance(
            bounds_for(
                config,
                prompts=prompts,
                routing=routing,
                teachers=len(setup.teachers),
                stages=2 if setup.verifier else None,
            )
        )
        self.tmp = Path(tempfile.mkdtemp(prefix="groupflow-pipeline-machine-"))
        self.incarnations: list[_Incarnation] = []
        self.early_crashes = 0
        self.latest: tuple[_Incarnation, Path] | None = None
        """The newest checkpoint on disk, and who wrote it."""
        self.stop = trio.Event()
        self.nursery: trio.Nursery | None = None

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await self.stop.wait()
                nursery.cancel_scope.cancel()

        self.host = _Host(main)
        self._launch(None)

    def _build(self) -> _Incarnation:
        assert self.tmp is not None
        setup = self.setup
        generator = HeldGenerator()
        scorer = HeldScorer(self.bank, verifier=setup.verifier)
        learner = CheckingLearner(
            self.bank,
            lambda ordinal: self.teacher_of_agent[setup.agents[ordinal]],
            verifier=setup.verifier,
        )
        directory = self.tmp / f"run-{len(self.incarnations)}"
        directory.mkdir()
        pipeline = build_pipeline(
            setup.config,
            prompts=list(range(self.num_prompts)),
            generator=generator,
            learner=learner,
            scorer=scorer,
            route=teacher_by_agent(self.teacher_of_agent),
            agent_of=lambda ordinal: setup.agents[ordinal],
            train_fields=["input_ids", "prompt_length"],
            checkpoint_dir=directory,
            checkpoint_in_thread=False,
            lanes=self.lanes,
            keep_steps=None,
            extra_stages=[ExtraStage(VERIFIER, scorer, REWARD_FIELD)] if setup.verifier else [],
        )
        return _Incarnation(pipeline, generator, scorer, learner, directory)

    def _launch(self, checkpoint: Path | None) -> None:
        """Build the next incarnation and start it (resumed from `checkpoint`, if any)."""
        assert self.host is not None
        inc = self._build()
        if self.latest is not None:
            inc.resumed_writer = self.latest[0]
        self.incarnations.append(inc)
        self.checker.attach(inc.pipeline)
        inc.pipeline.status.observer = _Tee(self.checker, self)

        async def run() -> None:
            with inc.scope:
                try:
                    if checkpoint is not None:
                        loaded = load_checkpoint(checkpoint)
                        if loaded.ledger["reissue"]:
                            _mark("resume re-issues prompts")
                        inc.resumed_step = loaded.step
                        await inc.pipeline.resume_from(loaded)
                    self.checker.compare()
                    await inc.pipeline.run()
                except BaseException as exc:
                    if not inc.scope.cancel_called:
                        inc.error = exc
                    elif not isinstance(exc, trio.Cancelled | BaseExceptionGroup):
                        inc.error = exc
                    else:
                        raise
                finally:
                    inc.ended = True

        def go() -> None:
            assert self.nursery is not None
            self.nursery.start_soon(run)

        self.host.call(go)

    # -- what the rules see -------------------------------------------------------------

    @property
    def current(self) -> _Incarnation:
        return self.incarnations[-1]

    @property
    def live(self) -> bool:
        """The run is going on (not ended, not failed)."""
        return bool(self.incarnations) and not self.current.ended

    def saw(self, action: Action) -> None:
        """Coverage marks, from the actions the run reports."""
        if action.kind is ActionKind.DISPATCH:
            if action.detail == "timer":
                teacher = self.lane_names[action.lane]
                if any(t != teacher for t in self.current.scorer.pending):
                    _mark("timer flush while another teacher scores")
            elif action.detail == "demand":
                _mark("demand dispatch")

    # -- rules --------------------------------------------------------------------------

    @precondition(lambda self: self.live and bool(self.current.generator.pending))
    @rule(data=st.data())
    def finish_rollout(self, data: st.DataObject) -> None:
        assert self.host is not None
        inc = self.current
        ordinal = data.draw(st.sampled_from(sorted(inc.generator.pending)), label="rollout")
        fail = data.draw(st.sampled_from([False, False, False, True]), label="rollout fails")
        last_example.append(f"finish_rollout({ordinal}, fail={fail})")
        self.host.call(lambda: inc.generator.finish(ordinal, fail=fail))

    @precondition(lambda self: self.live and bool(self.current.scorer.pending))
    @rule(data=st.data())
    def teacher_returns(self, data: st.DataObject) -> None:
        assert self.host is not None
        inc = self.current
        teacher = data.draw(st.sampled_from(sorted(inc.scorer.pending)), label="teacher")
        fail = data.draw(st.sampled_from(CALL_OUTCOMES), label="call fails")
        last_example.append(f"teacher_returns({teacher!r}, fail={fail!r})")
        _, request = inc.scorer.pending[teacher]
        ids = [g.group_id for g in request.groups]
        if fail is None and any(inc.pipeline.buffer.retries_of(gid) for gid in ids):
            _mark("retry then success")
        if fail is None and teacher == VERIFIER:
            _mark("verifier scores a batch")
        self.host.call(lambda: inc.scorer.finish(teacher, fail=fail))
        self._settle(inc)

    def _settle(self, inc: _Incarnation) -> None:
        """With served teachers: wait until the released calls' HTTP requests have ended."""
        assert self.host is not None
        if self.bank.served is not None:
            self.host.settle_until(lambda: not inc.scorer.calling)

    @precondition(lambda self: self.live)
    @rule(seconds=st.sampled_from(TIME_STEPS))
    def time_passes(self, seconds: float) -> None:
        assert self.host is not None
        before = self.current.pipeline.watchdog.warnings
        last_example.append(f"time_passes({seconds:g})")
        self.host.advance(seconds)
        if self.incarnations and self.current.pipeline.watchdog.warnings > before:
            _mark("watchdog fired")

    @precondition(lambda self: self.live and self._has_timer())
    @rule()
    def flush_timer_expires(self) -> None:
        """Just past the flush deadline of whatever queued now."""
        assert self.host is not None
        scoring = self.setup.config.scoring
        assert scoring is not None
        last_example.append("flush_timer_expires()")
        self.host.advance(scoring.flush_after_s)

    def _has_timer(self) -> bool:
        scoring = self.setup.config.scoring
        return scoring is not None and math.isfinite(scoring.flush_after_s)

    @precondition(
        lambda self: (
            self._may_restart()
            and (self.latest is not None or self._saved() or self.early_crashes < MAX_EARLY_CRASHES)
        )
    )
    @rule()
    def crash(self) -> None:
        """The process dies: everything is cancelled; only the checkpoints on disk survive,
        and a fresh pipeline resumes from the newest."""
        last_example.append("crash()")
        self._crash()

    @precondition(lambda self: self._may_restart() and self._saved_with_reissue())
    @rule()
    def crash_after_checkpoint(self) -> None:
        """A crash once a checkpoint that has prompts to issue again is on disk (rare by
        chance: a crash usually comes before the first checkpoint)."""
        last_example.append("crash_after_checkpoint()")
        self._crash()

    def _may_restart(self) -> bool:
        """A crash or a stop may come: the run goes on, has restarts left, and is not the
        escape hatch's (whose deadlock is the schedule's alone: restarts would only make its
        examples longer to shrink)."""
        return self.live and len(self.incarnations) <= MAX_CRASHES and not self.UNSAFE

    def _saved(self) -> bool:
        checkpointer = self.current.pipeline.checkpointer
        return checkpointer is not None and bool(checkpointer.saved)

    def _saved_with_reissue(self) -> bool:
        checkpointer = self.current.pipeline.checkpointer
        return (
            checkpointer is not None
            and bool(checkpointer.saved)
            and checkpointer.last is not None
            and bool(checkpointer.last["ledger"]["reissue"])
        )

    def _crash(self) -> None:
        assert self.host is not None
        inc = self.current
        if self.latest is None and not self._saved():
            self.early_crashes += 1
        if inc.pipeline.buffer.snapshot().counts.get(GroupState.SCORING, 0):
            _mark("crash with groups SCORING")
        if inc.pipeline.checkpointer is not None and inc.pipeline.checkpointer.saved:
            self.latest = (inc, inc.pipeline.checkpointer.saved[-1])

        def die() -> None:
            self.checker.crash()
            inc.crashed = True
            inc.scope.cancel()

        self.host.call(die)
        assert inc.ended, "the crashed pipeline did not end when cancelled"
        assert inc.error is None, f"the crashed pipeline raised {inc.error!r}"
        self._launch(None if self.latest is None else self.latest[1])

    @precondition(lambda self: self._may_restart() and not self.current.stop_requested)
    @rule()
    def interrupt(self) -> None:
        """The user presses Ctrl-C: the trainer asks the run to stop after this step."""
        assert self.host is not None
        inc = self.current
        inc.stop_requested = True
        last_example.append("interrupt()")
        self.host.call(inc.pipeline.request_stop)

    @precondition(lambda self: bool(self.incarnations) and _interrupted(self.current))
    @rule()
    def resume_after_interrupt(self) -> None:
        """The user runs the trainer again with `--resume`."""
        last_example.append("resume_after_interrupt()")
        self._resume_after_interrupt()

    def _resume_after_interrupt(self) -> None:
        inc = self.current
        assert inc.pipeline.checkpointer is not None
        saved = inc.pipeline.checkpointer.saved
        if saved:
            self.latest = (inc, saved[-1])
        # else it stopped at the step it had resumed from: that checkpoint is still the newest
        assert self.latest is not None, "an interrupted run with checkpoints on saved none"
        _mark("resume after an interrupt")
        self.checker.restart()
        self._launch(self.latest[1])

    @precondition(lambda self: not self.live and not _interrupted(self.current))
    @rule()
    def run_is_over(self) -> None:
        """Nothing is left to drive once the run ended (or failed): the checks below run."""

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def pipeline_is_sound(self) -> None:
        if self.host is None or not self.incarnations:
            return
        stats["checks"] += 1
        inc = self.current
        pipeline = inc.pipeline
        assert self.checker.ok, self.checker.failure
        assert_invariants(pipeline.buffer.snapshot())
        config = self.setup.config
        free = pipeline.rollout.free_permits
        assert 0 <= free <= config.max_inflight_prompts, f"{free} permits free"
        held = config.max_inflight_prompts - free
        assert len(inc.generator.pending) <= held, (
            f"{len(inc.generator.pending)} rollouts generating on {held} permits"
        )
        assert not inc.scorer.overlaps, f"two calls at once on {inc.scorer.overlaps}"
        assert not inc.learner.wrong, f"teacher log-probs written wrong: {inc.learner.wrong[:3]}"
        store = pipeline.buffer.store
        pads = sorted(sid for sid in store.list_ids() if sid.startswith(PAD_PREFIX))
        assert not pads, f"padding rows left in the store between calls: {pads[:4]}"
        scoring = config.scoring
        assert scoring is not None
        now = self.host.clock.current_time()
        late = {t: now - held.started for t, (held, _) in inc.scorer.pending.items()}
        late = {t: s for t, s in late.items() if s > scoring.call_timeout_s}
        assert not late, (
            f"teacher calls in flight past call_timeout_s={scoring.call_timeout_s:g}: {late}"
        )
        if inc.ended and not inc.crashed:
            self._check_end(inc)

    def _check_end(self, inc: _Incarnation) -> None:
        """A run that ended by itself: cleanly, and (if it did not fail) with every prompt
        trained once or given up."""
        snapshot = inc.pipeline.buffer.snapshot()
        for state in (GroupState.WRITTEN, GroupState.SCORING, GroupState.RESERVED):
            assert not snapshot.counts.get(state, 0), f"{state} groups left: {snapshot}"
        if inc.error is not None:
            if isinstance(inc.error, ShutdownTimeout):
                # a stop with a teacher call the machine held past `shutdown_timeout_s`: the
                # bounded shutdown doing its job (only a stopped run shuts down mid-work)
                assert inc.stop_requested, repr(inc.error)
            else:
                assert isinstance(inc.error, PumpFailed), repr(inc.error)
            assert inc.pipeline.status.failed
            # every prompt is still accounted for: trained, given up, to be issued again,
            # READY in the buffer, or never issued
            ledger = inc.pipeline.ledger
            ready = {g.ordinal for g in snapshot.groups if g.state is GroupState.READY}
            accounted = (
                set(ledger.trained)
                | set(ledger.shortfall)
                | set(ledger.reissue)
                | ready
                | set(range(ledger.cursor, self.num_prompts))
            )
            lost = set(range(self.num_prompts)) - accounted
            assert not lost, f"the failed run lost prompts {sorted(lost)}"
            if not inc.checked:
                inc.checked = True
                stats["failed"] += 1
            return
        assert inc.pipeline.status.phase is Phase.DONE or not inc.pipeline.status.failed
        if _interrupted(inc):
            # READY groups stay with their rows: the checkpoint saved them, or they go again
            if not inc.checked:
                inc.checked = True
                stats["interrupted"] += 1
            return
        store = inc.pipeline.buffer.store
        assert not store.list_ids(), f"rows left in the store: {list(store.list_ids())[:8]}"
        self._check_exactly_once(inc)
        if not inc.checked:
            inc.checked = True
            stats["completed"] += 1

    def _check_exactly_once(self, last: _Incarnation) -> None:
        trained: list[int] = []
        chain: list[tuple[_Incarnation, float]] = [(last, math.inf)]
        inc: _Incarnation | None = last
        while inc is not None and inc.resumed_step is not None:
            writer = inc.resumed_writer
            assert writer is not None
            chain.append((writer, inc.resumed_step))
            inc = writer
        for member, before in chain:
            for batch in member.learner.batches:
                if batch.step < before:
                    ordinals = [g.ordinal for g in batch.groups]
                    per_step = self.setup.config.prompts_per_step
                    assert all(o is not None and o // per_step == batch.step for o in ordinals)
                    trained.extend(o for o in ordinals if o is not None)
        twice = sorted(o for o, n in collections.Counter(trained).items() if n > 1)
        assert not twice, f"prompts {twice} trained twice"
        ledger = last.pipeline.ledger
        shortfall = set(ledger.shortfall)
        assert set(trained) == set(ledger.trained), (sorted(trained), sorted(ledger.trained))
        assert not set(trained) & shortfall
        missing = set(range(self.num_prompts)) - set(trained) - shortfall
        assert not missing, f"prompts {sorted(missing)} neither trained nor given up"

    # -- the end ------------------------------------------------------------------------

    def _fair_drain(self) -> None:
        host = self.host
        assert host is not None
        for _ in range(DRAIN_ROUNDS):
            if not self.live and _interrupted(self.current):
                self._resume_after_interrupt()
            if not self.live:
                break
            inc = self.current
            if inc.generator.pending or inc.scorer.pending:

                def release(inc: _Incarnation = inc) -> None:
                    for ordinal in list(inc.generator.pending):
                        inc.generator.finish(ordinal, fail=False)
                    for teacher in list(inc.scorer.pending):
                        inc.scorer.finish(teacher, fail=None)

                host.call(release)
                self._settle(inc)
            else:
                host.advance(DRAIN_TICK_S)
            self.pipeline_is_sound()
        else:
            raise AssertionError(
                f"fair drain did not complete: {DRAIN_ROUNDS} rounds "
                f"(up to {DRAIN_ROUNDS * DRAIN_TICK_S:g} virtual s), run still going: "
                f"{self.current.pipeline.buffer.snapshot()}"
            )
        self.pipeline_is_sound()
        assert self.current.ended

    def teardown(self) -> None:
        host = self.host
        # called in Hypothesis's `finally`: after a failed check the drain would only take
        # time (shrinking runs many failing examples) and could hide the failure behind its own
        failing = sys.exc_info()[1] is not None
        try:
            if host is not None and host.done is None and self.incarnations and not failing:
                self._fair_drain()
        finally:
            try:
                if host is not None and host.done is None:
                    for inc in self.incarnations:
                        inc.scope.cancel()
                    host.call(self.stop.set)
                    host.close()
            finally:
                if self.tmp is not None:
                    shutil.rmtree(self.tmp, ignore_errors=True)
        if host is not None and host.done is not None and not failing:
            host.done.unwrap()


SCORERS = ("fake", "torch", "served")


def drain_alone(setup: Setup, *, unsafe: bool = False, seed: int = 0) -> str | None:
    """Run `setup` with no event from outside but the fair drain: None when the run ends,
    else the drain's failure. Shows whether a configuration deadlocks by itself, whatever
    order of events an example took to get there."""
    machine = type("PipelineMachine", (PipelineMachine,), {"UNSAFE": unsafe})()
    machine._start(setup, seed)
    try:
        machine.teardown()
    except AssertionError as exc:
        return str(exc)
    return None


def run_pipeline_machine(
    *,
    max_examples: int = 30,
    steps: int = 30,
    derandomize: bool = False,
    shrink: bool = True,
    scorer: str = "fake",
    device: str = "cpu",
    unsafe: bool = False,
    seed: int | None = None,
    served: Served | None = None,
) -> collections.Counter[str]:
    """Run `PipelineMachine` with a budget (CI small, `groupflow fuzz` large) over the `scorer`
    ("fake" or "torch", on `device`; "served": the server `served`); returns how often each coverage mark (`MARKS`) was
    reached. `unsafe` turns on the escape hatch (`without_safety`); `seed` fixes the examples
    Hypothesis generates, so a run can be replayed."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer={scorer!r}: use one of {list(SCORERS)}")
    machine = type(
        "PipelineMachine",
        (PipelineMachine,),
        {"SCORER": scorer, "DEVICE": device, "UNSAFE": unsafe, "SERVED": served},
    )
    marks.clear()
    stats.clear()
    quiet = logging.NullHandler()  # the run's warnings are the machine's doing: not news
    log = logging.getLogger("groupflow")
    log.addHandler(quiet)
    try:
        run_state_machine_as_test(
            seeded(machine, seed),
            settings=budget(
                max_examples=max_examples,
                steps=steps,
                derandomize=derandomize,
                shrink=shrink,
                seed=seed,
            ),
        )
    finally:
        log.removeHandler(quiet)
    return collections.Counter(marks)
