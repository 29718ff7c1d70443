"""A Hypothesis state machine that owns one live pipeline and chooses the order of events.

The pipeline is the real one (`build_pipeline`: controller, supervisor, buffer, pumps, stage,
checkpoints), over fakes that do nothing until a rule says so (`pipeline_doubles`): a rollout
waits until a rule finishes or fails it, a teacher call until a rule returns or fails it, and
virtual time moves only when a rule advances it (firing flush timers, call timeouts and the
stall watchdog). What an example runs is drawn by `pipeline_setups.setups`.

Trio runs in guest mode under a host loop of our own (`guest_host.GuestHost`): every rule
hands its decision to the trio side and runs trio until every task is blocked. In the asyncio
variant (`host="asyncio"`) the host is a real asyncio loop, trio is started on it as
`groupflow.impl.aio` starts it, and the generator, scorer and learner are asyncio parts
(`aio.part`) whose calls are asyncio tasks there: a rule also runs the loop until every such
call is held by the machine or handed back. So after each
rule the pipeline has done everything it can without a new event from outside, and the
invariants are checked there: the buffer's (`assert_invariants`), the permits, one call per
teacher, and conformance with the model (`groupflow.sim.verify.conformance`), action by action. A
crash cancels everything; a fresh pipeline resumes from the newest checkpoint on disk. At the
end, a fair drain releases everything and advances time until the run ends, then checks that
nothing is left behind and that each prompt was trained exactly once (across every crash) or
given up.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import trio
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

from groupflow.impl import aio
from groupflow.impl._core import PAD_PREFIX
from groupflow.impl._pipeline import ExtraStage, build_pipeline, lanes_for, load_checkpoint
from groupflow.impl._teachers import teacher_by_agent
from groupflow.impl.errors import PumpFailed
from groupflow.model import GroupState, assert_invariants
from groupflow.model.errors import ShutdownTimeout
from groupflow.model.scheduler import Phase
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.properties.budget import budget, quiet, seeded
from groupflow.properties.guest_host import AsyncioGuestHost, GuestHost
from groupflow.properties.pipeline_doubles import (
    REWARD_FIELD,
    VERIFIER,
    AsyncioCheckingLearner,
    CheckingLearner,
    HeldGenerator,
    HeldScorer,
    Served,
    teacher_bank,
)
from groupflow.properties.pipeline_setups import (
    Incarnation,
    Setup,
    interrupted,
    setups,
    trained_exactly_once,
)
from groupflow.sim.verify.conformance import Conformance, bounds_for

__all__ = [
    "HOSTS",
    "MARKS",
    "SCORERS",
    "PipelineMachine",
    "Served",
    "Setup",
    "drain_alone",
    "last_example",
    "last_setup",
    "marks",
    "run_pipeline_machine",
    "stats",
]

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
"""How a teacher call the machine answers ends: scored, or failed (`pipeline_doubles.FAILURES`)."""

last_example: list[str] = []
"""The rules of the example run last: after a failure, Hypothesis's shrunk example (it runs
that one last, to report it)."""
last_setup: list[Setup] = []
"""The setup of the example run last (one item)."""


def _mark(name: str) -> None:
    marks[name] += 1
    if currently_in_test_context():
        note_event(name)


class _RolloutFailures(logging.Handler):
    """Every rollout failure the run reports (its `groupflow.rollout` warnings): each must be
    one the machine caused, with the machine's own error; not the bridge's, nor another part
    of the pipeline's in its place."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.foreign: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "rollout of prompt" in text and "(by the machine)" not in text:
            self.foreign.append(text)


@attrs.define
class _Tee:
    """The run's observer: the conformance checker, and the machine's coverage marks."""

    checker: Conformance
    machine: PipelineMachine

    def on_action(self, action: Action) -> None:
        self.checker.on_action(action)
        self.machine.saw(action)


class PipelineMachine(RuleBasedStateMachine):
    """One live pipeline per example; rules are the outside world's events.

    `run_pipeline_machine` runs a subclass that sets the variant: `SCORER` ("fake":
    `ArithmeticTeacher`s, "torch": `TorchTeacher`s) on `DEVICE`, `UNSAFE` (the escape hatch
    of `without_safety`), and `HOST` ("trio"; "asyncio": asyncio parts on an asyncio loop;
    "uvloop": the same on uvloop's loop)."""

    SCORER: ClassVar[str] = "fake"
    HOST: ClassVar[str] = "trio"
    DEVICE: ClassVar[str] = "cpu"
    UNSAFE: ClassVar[bool] = False
    SERVED: ClassVar[Served | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.host: GuestHost | AsyncioGuestHost | None = None
        self.rollout_failures = _RolloutFailures()
        logging.getLogger("groupflow.rollout").addHandler(self.rollout_failures)
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
        prompts = setup.steps * config.shape.prompts_per_step
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
        self.incarnations: list[Incarnation] = []
        self.early_crashes = 0
        self.latest: tuple[Incarnation, Path] | None = None
        """The newest checkpoint on disk, and who wrote it."""
        self.stop = trio.Event()
        self.nursery: trio.Nursery | None = None

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await self.stop.wait()
                nursery.cancel_scope.cancel()

        if self.HOST != "trio":
            self.host = AsyncioGuestHost(main, held=self._held_calls, uvloop=self.HOST == "uvloop")
        else:
            self.host = GuestHost(main)
        self._launch(None)

    def _held_calls(self) -> int:
        """The asyncio parts' calls the machine holds now (the rest must be handed back)."""
        if not self.incarnations:
            return 0
        inc = self.current
        return len(inc.generator.pending) + len(inc.scorer.pending)

    def _build(self) -> Incarnation:
        assert self.tmp is not None
        setup = self.setup
        teacher_of = self.teacher_of_agent
        if self.HOST != "trio":
            assert self.host is not None
            generator = HeldGenerator(event=asyncio.Event)
            scorer = HeldScorer(
                self.bank,
                verifier=setup.verifier,
                event=asyncio.Event,
                now=self.host.clock.current_time,
            )
            learner: CheckingLearner = AsyncioCheckingLearner(
                self.bank,
                lambda ordinal: teacher_of[setup.agents[ordinal]],
                verifier=setup.verifier,
            )
            declare: Callable[[Any], Any] = aio.part
        else:
            generator = HeldGenerator()
            scorer = HeldScorer(self.bank, verifier=setup.verifier)
            learner = CheckingLearner(
                self.bank,
                lambda ordinal: teacher_of[setup.agents[ordinal]],
                verifier=setup.verifier,
            )
            declare = _as_it_is
        directory = self.tmp / f"run-{len(self.incarnations)}"
        directory.mkdir()
        config = setup.config
        assert config.checkpoints is not None
        config = attrs.evolve(
            config, checkpoints=attrs.evolve(config.checkpoints, folder=directory)
        )
        part = declare(scorer)
        pipeline = build_pipeline(
            config,
            prompts=list(range(self.num_prompts)),
            generator=declare(generator),
            learner=declare(learner),
            scorer=part,
            route=teacher_by_agent(self.teacher_of_agent),
            agent_of=lambda ordinal: setup.agents[ordinal],
            train_fields=["input_ids", "prompt_length"],
            lanes=self.lanes,
            keep_steps=None,
            extra_stages=[ExtraStage(VERIFIER, part, REWARD_FIELD)] if setup.verifier else [],
        )
        return Incarnation(pipeline, generator, scorer, learner, directory)

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
    def current(self) -> Incarnation:
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

    def _settle(self, inc: Incarnation) -> None:
        """With served teachers: wait until the released calls' HTTP requests have ended."""
        assert self.host is not None
        if self.bank.served is not None:
            assert isinstance(self.host, GuestHost)  # served teachers are trio code
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

    @precondition(lambda self: bool(self.incarnations) and interrupted(self.current))
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

    @precondition(lambda self: not self.live and not interrupted(self.current))
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
        assert 0 <= free <= config.shape.max_inflight_prompts, f"{free} permits free"
        held = config.shape.max_inflight_prompts - free
        assert len(inc.generator.pending) <= held, (
            f"{len(inc.generator.pending)} rollouts generating on {held} permits"
        )
        assert not inc.scorer.overlaps, f"two calls at once on {inc.scorer.overlaps}"
        assert not inc.learner.wrong, f"teacher log-probs written wrong: {inc.learner.wrong[:3]}"
        foreign = self.rollout_failures.foreign
        assert not foreign, (
            f"a rollout failed with an error the machine did not cause: {foreign[0]}"
        )
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

    def _check_end(self, inc: Incarnation) -> None:
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
        if interrupted(inc):
            # READY groups stay with their rows: the checkpoint saved them, or they go again
            if not inc.checked:
                inc.checked = True
                stats["interrupted"] += 1
            return
        store = inc.pipeline.buffer.store
        assert not store.list_ids(), f"rows left in the store: {list(store.list_ids())[:8]}"
        trained_exactly_once(
            inc, prompts=self.num_prompts, per_step=self.setup.config.shape.prompts_per_step
        )
        if not inc.checked:
            inc.checked = True
            stats["completed"] += 1

    # -- the end ------------------------------------------------------------------------

    def _fair_drain(self) -> None:
        host = self.host
        assert host is not None
        for _ in range(DRAIN_ROUNDS):
            if not self.live and interrupted(self.current):
                self._resume_after_interrupt()
            if not self.live:
                break
            inc = self.current
            if inc.generator.pending or inc.scorer.pending:

                def release(inc: Incarnation = inc) -> None:
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
        logging.getLogger("groupflow.rollout").removeHandler(self.rollout_failures)
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
HOSTS = ("trio", "asyncio", "uvloop")


def _as_it_is(part: object) -> object:
    return part


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
    host: str = "trio",
) -> collections.Counter[str]:
    """Run `PipelineMachine` with a budget (CI small, `groupflow fuzz` large) over the `scorer`
    ("fake" or "torch", on `device`; "served": the server `served`), under the `host` ("trio",
    "asyncio": asyncio parts on an asyncio loop, or "uvloop": on uvloop's); returns how often each coverage mark
    (`MARKS`) was reached. `unsafe` turns on the escape hatch (`without_safety`); `seed` fixes
    the examples Hypothesis generates, so a run can be replayed."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer={scorer!r}: use one of {list(SCORERS)}")
    if host not in HOSTS:
        raise ValueError(f"host={host!r}: use one of {list(HOSTS)}")
    if host != "trio" and scorer == "served":
        raise ValueError("host='asyncio' runs asyncio parts: use scorer='fake' or 'torch'")
    machine = type(
        "PipelineMachine",
        (PipelineMachine,),
        {"SCORER": scorer, "DEVICE": device, "UNSAFE": unsafe, "SERVED": served, "HOST": host},
    )
    marks.clear()
    stats.clear()
    with quiet():
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
    return collections.Counter(marks)
