"""Trace validation: a run's trace (`build_pipeline(trace=...)`) judged against the model.

The live conformance check (`groupflow.sim.verify.conformance`) needs the pipeline beside it; a trace
is what a run leaves behind, crashes included. `replay` walks it line by line with the model's
own step (`model_step`, the function the live check uses): every action must be allowed from
the model state the trace has reached, the model's invariants must hold after it, and what the
trace says the action did (the group's new state, the prompts it trained or gave up) must be
what the model did. A crash is an incarnation's header with no end line before it: the model
takes its crash transition, and the resume line must name the checkpoint the model restarts
from, ledger and all.

Beside the model, the replay keeps its own ledger of every prompt, per lineage (the weights one
incarnation hands to the next through a checkpoint): a prompt trained twice, or trained and
given up, is refused where it happens, and at the end every prompt must be trained once or
given up. A run that did not end (no end line) or that failed is reported as such, with the
prompts still open: not a pass.

Finding the file, parsing its lines and rebuilding the model from the header is
`groupflow.sim.verify.trace_reader`'s job; `bounds_of_header` is exported here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl._pipeline import TRACE_FORMAT
from groupflow.model.errors import TraceCorrupt
from groupflow.model.scheduler import (
    Phase,
    SchedState,
    describe,
    group_of,
    initial_state,
    restart,
    summarize,
)
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.scheduler.bounds import Bounds
from groupflow.sim.verify.conformance import model_step, saved_from
from groupflow.sim.verify.trace_reader import (
    RUN_FIELDS,
    LineRejected,
    bounds_of_header,
    line_ordinals,
    parse_line,
    trace_file,
    trace_lines,
)

__all__ = [
    "FAILED",
    "INCOMPLETE",
    "REJECTED",
    "VALID",
    "Incarnation",
    "OnAction",
    "ReplayResult",
    "bounds_of_header",
    "replay",
]

VALID = "valid"
REJECTED = "rejected"
INCOMPLETE = "incomplete"
"""The trace conforms so far, but the run has no end line: it crashed, or is still running."""
FAILED = "failed"
"""The trace conforms and ended, but the run failed: some prompts are still open."""


@attrs.frozen
class Incarnation:
    """One process's part of the trace."""

    number: int
    line: int
    """The line of its header."""
    resumed_from: int | None
    """The checkpoint step it resumed from (None: a fresh start)."""
    actions: int
    outcome: str | None
    """Its end line's outcome ("ok", "stopped", "failed"), or None: it crashed (or is still
    running)."""


@attrs.frozen
class ReplayResult:
    """What `replay` found: the verdict, where the trace broke, and the counts."""

    path: Path
    verdict: str
    problem: str | None
    """Why the verdict is not `valid`, in words."""
    line: int | None
    """The line where it broke (`rejected`), or the last line read."""
    lines: int
    actions: int
    incarnations: tuple[Incarnation, ...]
    prompts: int
    trained: frozenset[int]
    given_up: frozenset[int]
    notes: tuple[str, ...] = ()
    """What is worth saying without changing the verdict (a line cut short by a crash)."""
    model: str = ""
    """The model's state where the replay stopped, in words."""

    @property
    def ok(self) -> bool:
        return self.verdict == VALID

    @property
    def open(self) -> tuple[int, ...]:
        """Prompts neither trained nor given up (in the lineage the trace ends with)."""
        return tuple(o for o in range(self.prompts) if o not in self.trained | self.given_up)

    def verdict_line(self) -> str:
        if self.verdict == VALID:
            return (
                f"VALID: {self.path} conforms to the model; every prompt was trained once or "
                f"given up"
            )
        where = f" at line {self.line}" if self.verdict == REJECTED else ""
        return f"{self.verdict.upper()}{where}: {self.problem}"

    def summary(self) -> str:
        crashes = sum(1 for i in self.incarnations[:-1] if i.outcome is None)
        resumed = [i.resumed_from for i in self.incarnations if i.resumed_from is not None]
        restarts = f", {crashes} crash{'es' if crashes != 1 else ''}"
        if resumed:
            restarts += f", resumed from step {', '.join(map(str, resumed))}"
        opened = self.open
        shown = ", ".join(map(str, opened[:12])) + (", ..." if len(opened) > 12 else "")
        return (
            f"{self.lines} lines, {self.actions} actions, {len(self.incarnations)} "
            f"incarnation{'s' if len(self.incarnations) != 1 else ''}{restarts}; "
            f"{self.prompts} prompts: {len(self.trained)} trained, {len(self.given_up)} given "
            f"up, {len(opened)} open" + (f" ({shown})" if opened else "")
        )


def _bits_of(bits: int) -> list[int]:
    return [o for o in range(bits.bit_length()) if bits >> o & 1]


@attrs.define
class _Current:
    """The incarnation being read: what its lines have said so far. A new header makes a new
    one, so nothing of the last incarnation's carries over by mistake."""

    number: int
    line: int
    """The line of its header."""
    actions: int = 0
    resumed_from: int | None = None
    expect_resume: bool = True
    """Just after a header: a resume line may come; anything else means a fresh start."""
    ended: str | None = None
    """Its end line's outcome."""
    end_line: int | None = None
    crash_line: int | None = None
    """Its `crash` line (cancelled from outside while running)."""

    @property
    def record(self) -> Incarnation:
        return Incarnation(self.number, self.line, self.resumed_from, self.actions, self.ended)


@attrs.define
class _Replay:
    """The walk over one trace: the model's state and the replay's own ledger."""

    path: Path
    on_action: OnAction | None = None
    bounds: Bounds | None = None
    header: dict[str, Any] | None = None
    state: SchedState | None = None
    closed: list[Incarnation] = attrs.field(factory=list)
    """The incarnations before the current one."""
    now: _Current | None = None
    actions: int = 0
    trained: dict[int, int] = attrs.field(factory=dict)
    """Prompt ordinal -> the line that trained it, in the current lineage."""
    given_up: dict[int, int] = attrs.field(factory=dict)
    saved_at: int | None = None
    """The line where the model's last checkpoint save began."""
    writing_at: int | None = None
    """The line where the snapshot being written was taken, while one is."""
    landed: SchedState | None = None
    """After a crash during a checkpoint's write: the model restarted from that checkpoint
    instead, for a write that reached the disk before its `checkpoint_written` line did."""
    notes: list[str] = attrs.field(factory=list)
    lines: int = 0
    error: str | None = None
    """The failed run's error, from its end line."""
    torn_last: int | None = None
    """The last line, cut short by the process dying while it wrote it."""

    # -- the lines --------------------------------------------------------------------------

    def line(self, number: int, data: dict[str, Any]) -> None:
        kind = data["type"]
        if self.header is None:
            if kind != "header":
                raise TraceCorrupt(
                    f"{self.path}: line 1 is a {kind!r} line, not a header: not a groupflow "
                    f"trace, or its beginning is missing"
                )
            self.first_header(number, data)
            return
        if kind == "header":
            self.next_header(number, data)
            return
        now = self.current_incarnation
        if now.crash_line is not None:
            raise LineRejected(
                f"a {kind!r} line after incarnation {now.number}'s crash line (line "
                f"{now.crash_line}): only a new incarnation's header may follow it"
            )
        if now.ended is not None:
            raise LineRejected(
                f"a {kind!r} line after incarnation {now.number}'s end line (line "
                f"{now.end_line}): only a new incarnation's header may follow it"
            )
        incarnation = data.get("incarnation")
        if incarnation != self.current:
            raise LineRejected(
                f"the line says incarnation {incarnation!r}, the header before it began "
                f"incarnation {self.current}"
            )
        if kind == "resume":
            self.resume(number, data)
            return
        self.start_if_not_resumed()
        if kind == "action":
            self.action(number, data)
        elif kind == "crash":
            now.crash_line = number
            self.notes.append(f"line {number}: incarnation {self.current} was {data.get('reason')}")
        elif kind == "end":
            self.end(number, data)
        else:
            raise LineRejected(
                f"unknown line type {kind!r} (a trace has header, resume, action, crash, end)"
            )

    @property
    def current_incarnation(self) -> _Current:
        assert self.now is not None
        return self.now

    @property
    def current(self) -> int:
        return self.current_incarnation.number

    @property
    def incarnations(self) -> tuple[Incarnation, ...]:
        """Every incarnation so far, the current one as its lines have left it."""
        return tuple(self.closed) + (() if self.now is None else (self.now.record,))

    def first_header(self, number: int, data: dict[str, Any]) -> None:
        self.bounds = bounds_of_header(data)
        if data.get("incarnation") != 0:
            raise LineRejected(
                f"the first header is incarnation {data.get('incarnation')!r}, not 0: the "
                f"trace's beginning is missing"
            )
        self.header = data
        self.state = initial_state(self.bounds)
        self.open_incarnation(number)

    def next_header(self, number: int, data: dict[str, Any]) -> None:
        assert self.header is not None and self.state is not None and self.bounds is not None
        if data.get("format") != TRACE_FORMAT:
            raise LineRejected(f"trace format {data.get('format')!r}, not {TRACE_FORMAT}")
        differ = [f for f in RUN_FIELDS if data.get(f) != self.header.get(f)]
        if differ:
            raise LineRejected(
                f"incarnation {data.get('incarnation')!r}'s header describes another run than "
                f"line 1's ({', '.join(differ)} differ): a trace holds one run"
            )
        if data.get("incarnation") != self.current + 1:
            raise LineRejected(
                f"the header says incarnation {data.get('incarnation')!r}, the next is "
                f"{self.current + 1}"
            )
        self.bare_header()  # its note; a header not bare has had its first line already
        self.closed.append(self.current_incarnation.record)
        if self.state.phase is Phase.DONE:
            # the process ended (stopped, or exited and died before its end line) and was
            # started again: from its checkpoint, as after a crash
            self.state = restart(self.state, self.bounds)
        else:
            before = self.state
            step = model_step(before, self.bounds, Action(ActionKind.CRASH))
            if not step.ok:
                raise LineRejected(f"the model does not allow a crash here: {self.model()}")
            self.state = step.state
            if before.writing is not None:
                done = model_step(before, self.bounds, Action(ActionKind.CHECKPOINT_WRITTEN))
                crashed = model_step(done.state, self.bounds, Action(ActionKind.CRASH))
                if done.ok and crashed.ok:
                    self.landed = crashed.state
        self.open_incarnation(number)

    def open_incarnation(self, number: int) -> None:
        self.now = _Current(len(self.closed), number)

    def resume(self, number: int, data: dict[str, Any]) -> None:
        assert self.state is not None and self.bounds is not None
        now = self.current_incarnation
        if not now.expect_resume:
            raise LineRejected("a resume line after the incarnation's first action")
        now.expect_resume = False
        step, ledger = data.get("step"), data.get("ledger")
        if not isinstance(step, int) or not isinstance(ledger, dict):
            raise LineRejected(f"the resume line needs a step and a ledger, got {data!r}")
        try:
            on_disk = saved_from(step, ledger)
        except (KeyError, TypeError) as exc:
            raise LineRejected(f"the resume line's ledger lacks {exc}") from exc
        landed, self.landed = self.landed, None
        if landed is not None and landed.saved is not None and on_disk == landed.saved:
            self.state = landed
            self.saved_at = self.writing_at
            self.notes.append(
                f"incarnation {self.current} resumes from the checkpoint whose write began at "
                f"line {self.writing_at}: it reached the disk before its checkpoint_written "
                f"line did"
            )
        model = self.state.saved
        if model is None:
            raise LineRejected(
                f"incarnation {self.current} resumes from the checkpoint of step {step}, but "
                f"the model has saved none: a checkpoint from another run?"
            )
        if on_disk != model:
            differ = [
                f"{f}: resumed {getattr(on_disk, f)!r} | model {getattr(model, f)!r}"
                for f in model._fields
                if getattr(on_disk, f) != getattr(model, f)
            ]
            raise LineRejected(
                f"incarnation {self.current} resumes from a checkpoint other than the model's "
                f"last save (line {self.saved_at}): " + "; ".join(differ)
            )
        now.resumed_from = step
        self.trained = {o: number for o in line_ordinals("trained", ledger["trained"], self.size)}
        self.given_up = {
            o: number for o in line_ordinals("shortfall", ledger["shortfall"], self.size)
        }

    def bare_header(self) -> bool:
        """Whether the current incarnation wrote nothing after its header (a process that
        stopped before its first action: a start refused by an older groupflow, or a crash as
        it started). It did nothing the model could check: noted, not judged. A header is the
        only line that leaves a resume to be expected, and every action comes after one."""
        now = self.current_incarnation
        if not now.expect_resume:
            return False
        self.notes.append(
            f"incarnation {now.number} (header at line {now.line}) wrote nothing after its "
            f"header: it stopped before its first action"
        )
        return True

    def start_if_not_resumed(self) -> None:
        """The first line after a header that is not a resume: the run started fresh."""
        now = self.current_incarnation
        if not now.expect_resume:
            return
        assert self.state is not None
        now.expect_resume = False
        self.landed = None
        if self.state.saved is not None:
            raise LineRejected(
                f"incarnation {now.number} (header at line {now.line}) "
                f"started from scratch, but the model restarts from the checkpoint of step "
                f"{self.state.saved.step} (saved at line {self.saved_at}): resume from it"
            )
        self.trained, self.given_up = {}, {}

    @property
    def size(self) -> int:
        assert self.bounds is not None
        return self.bounds.prompts

    def action(self, number: int, data: dict[str, Any]) -> None:
        assert self.state is not None and self.bounds is not None
        try:
            action = Action.from_json(data)
        except ValueError as exc:
            raise LineRejected(f"not an action the model knows: {exc}") from exc
        self.actions += 1
        self.current_incarnation.actions += 1
        trained = line_ordinals("trained", data.get("trained", []), self.size)
        given_up = line_ordinals("given_up", data.get("given_up", []), self.size)
        self.account(number, trained, given_up)
        before = self.state
        step = model_step(before, self.bounds, action)
        what = describe(action, self.bounds)
        if not step.allowed:
            raise LineRejected(f"the model does not allow {what} ({action.to_json()}) from here")
        self.state = step.state
        if step.violations:
            raise LineRejected(
                f"after {what}, the model's invariants fail: " + "; ".join(step.violations)
            )
        self.agree(what, action, data, before, trained, given_up)
        if action.kind in (ActionKind.CHECKPOINT_SAVED, ActionKind.FLUSH_TIMEOUT):
            self.writing_at = number
        elif action.kind is ActionKind.CHECKPOINT_WRITTEN and self.state.saved is not None:
            self.saved_at = self.writing_at
        if self.on_action is not None:
            self.on_action(data, before, self.state)

    def account(self, number: int, trained: list[int], given_up: list[int]) -> None:
        """The replay's own ledger: a prompt settles once per lineage."""
        for o in trained:  # every check before any change: a refused line settles nothing
            if o in self.trained:
                raise LineRejected(
                    f"prompt {o} trained a second time (first at line {self.trained[o]})"
                )
            if o in self.given_up:
                raise LineRejected(
                    f"prompt {o} trained after it was given up (line {self.given_up[o]})"
                )
        for o in given_up:
            if o in self.given_up or o in self.trained or o in trained:
                first = self.given_up.get(o, self.trained.get(o, number))
                raise LineRejected(f"prompt {o} given up after it was settled at line {first}")
        self.trained.update(dict.fromkeys(trained, number))
        self.given_up.update(dict.fromkeys(given_up, number))

    def agree(
        self,
        what: str,
        action: Action,
        data: dict[str, Any],
        before: SchedState,
        trained: list[int],
        given_up: list[int],
    ) -> None:
        """What the line says the action did is what the model did."""
        assert self.state is not None
        after = self.state
        model_trained = _bits_of(after.trained & ~before.trained)
        if sorted(trained) != model_trained:
            raise LineRejected(
                f"{what}: the trace says it trained prompts {sorted(trained)}, the model "
                f"trained {model_trained}" + self.lost(set(model_trained) - set(trained), "trained")
            )
        model_given_up = _bits_of(after.shortfall & ~before.shortfall)
        if sorted(given_up) != model_given_up:
            raise LineRejected(
                f"{what}: the trace says it gave up prompts {sorted(given_up)}, the model gave "
                f"up {model_given_up}" + self.lost(set(model_given_up) - set(given_up), "given up")
            )
        to = data.get("to")
        if to is not None and action.ordinal >= 0:
            group = group_of(after, action.ordinal)
            model_to = "DISCARDED" if group is None else group.state.value
            if to != model_to:
                raise LineRejected(
                    f"{what}: the trace moves the group to {to}, the model to {model_to}"
                )

    @staticmethod
    def lost(ordinals: set[int], how: str) -> str:
        return f" (prompts {sorted(ordinals)} {how} but lost from the trace)" if ordinals else ""

    def end(self, number: int, data: dict[str, Any]) -> None:
        assert self.state is not None
        outcome = data.get("outcome")
        if outcome not in ("ok", "stopped", "failed"):
            raise LineRejected(
                f"the end line's outcome {outcome!r} is not 'ok', 'stopped' or 'failed'"
            )
        now = self.current_incarnation
        if now.actions and self.state.phase is not Phase.DONE:
            raise LineRejected(
                f"the run says it ended ({outcome}) but it never exited: {self.model()}"
            )
        if outcome == "ok" and (self.state.failed or not self.state.stopped):
            raise LineRejected(
                f"the run says it ended ok, but it failed or stopped early in the model: "
                f"{self.model()}"
            )
        if outcome == "stopped" and (self.state.failed or self.state.stopped):
            raise LineRejected(
                f"the run says it was stopped early, but in the model it "
                f"{'failed' if self.state.failed else 'trained every step'}: {self.model()}"
            )
        counts = (data.get("trained"), data.get("given_up"))
        if counts != (len(self.trained), len(self.given_up)):
            raise LineRejected(
                f"the end line counts {counts[0]} prompts trained and {counts[1]} given up, the "
                f"trace {len(self.trained)} and {len(self.given_up)}"
            )
        now.ended = outcome
        now.end_line = number
        error = data.get("error")
        self.error = None if error is None else str(error)

    def model(self) -> str:
        assert self.state is not None and self.bounds is not None
        return summarize(self.state, self.bounds)

    # -- the end of the file ----------------------------------------------------------------

    def finish(self, last: int) -> ReplayResult:
        now = self.current_incarnation
        if self.bare_header():
            return self.result(
                INCOMPLETE,
                f"the trace ends in incarnation {now.number}'s header (line {now.line}): that "
                f"process stopped before its first action; what came before conforms to the "
                f"model",
                last,
            )
        # not bare: the incarnation's first line after its header (a resume, an action, a crash
        # or an end line) has already decided whether it resumed
        if now.ended is None:
            torn = (
                ""
                if self.torn_last is None
                else f"; its last line ({self.torn_last}) is cut short: the process died writing it"
            )
            if now.crash_line is not None:
                torn += f"; it was cancelled from outside (line {now.crash_line})"
            return self.result(
                INCOMPLETE,
                f"the run did not end: incarnation {self.current} has no end line (it crashed, "
                f"or is still running){torn}; what it traced conforms to the model",
                last,
            )
        if now.ended == "stopped":
            return self.result(
                INCOMPLETE,
                f"the run was stopped at step {self.state.step if self.state else '?'} of "
                f"{self.bounds.steps if self.bounds else '?'} (a user's stop, not a failure): "
                f"resume it to finish; what it traced conforms to the model",
                last,
            )
        if now.ended == "failed":
            return self.result(
                FAILED,
                f"the run failed ({self.error or 'no error recorded'}); what "
                f"it traced conforms to the model",
                last,
            )
        open_ = self.unaccounted()
        if open_:
            return self.result(
                REJECTED,
                f"the run says it ended ok, but prompts {open_} were neither trained nor given "
                f"up: lost",
                now.end_line,
            )
        return self.result(VALID, None, last)

    def unaccounted(self) -> list[int]:
        """Every prompt trained once or given up (the end-of-run accounting)."""
        return [o for o in range(self.size) if o not in self.trained and o not in self.given_up]

    def result(self, verdict: str, problem: str | None, line: int | None) -> ReplayResult:
        return ReplayResult(
            path=self.path,
            verdict=verdict,
            problem=problem,
            line=line,
            lines=self.lines,
            actions=self.actions,
            incarnations=self.incarnations,
            prompts=self.size,
            trained=frozenset(self.trained),
            given_up=frozenset(self.given_up),
            notes=tuple(self.notes),
            model="" if self.state is None else self.model(),
        )


OnAction = Callable[[Mapping[str, Any], SchedState, SchedState], None]
"""Told of every action line the model allowed: the line, the model's state before, after."""


def replay(path: Path, *, on_action: OnAction | None = None) -> ReplayResult:
    """Judge the trace at `path` (a run folder or a trace file) against the model.

    Raises `TraceNotFound` for a missing path and `TraceCorrupt` for a file that is not a
    trace (not JSON lines, no header, a format this groupflow does not read); a trace that
    reads but breaks the model is a `rejected` verdict, naming the line. `on_action` hears
    each action the model allowed, with the model's states around it (what a calibration
    reads a run's batches from: `groupflow.sim.calibrate`)."""
    file = trace_file(path)
    walk = _Replay(file, on_action)
    last = 0
    torn: tuple[int, str] | None = None
    """A line that did not parse, waiting to see what follows it."""
    for number, text, complete in trace_lines(file):
        walk.lines = number
        last = number
        data = parse_line(text)
        if torn is not None:
            if data is None or data["type"] != "header":
                return walk.result(
                    REJECTED,
                    f"line {torn[0]} is not a JSON object with a type: {torn[1][:80]!r}",
                    torn[0],
                )
            walk.notes.append(
                f"line {torn[0]} was cut short by the crash of incarnation {walk.current}; "
                f"the restart's header follows it"
            )
            torn = None
        if data is None:
            if number == 1:
                raise TraceCorrupt(
                    f"{file}: line 1 is not a JSON object with a type: not a groupflow trace "
                    f"(JSON lines): {text[:80]!r}"
                )
            if not text.strip() and complete:
                continue
            torn = (number, text)
            continue
        try:
            walk.line(number, data)
        except LineRejected as exc:
            return walk.result(REJECTED, str(exc), number)
    if last == 0:
        raise TraceCorrupt(f"{file} is empty: not a groupflow trace")
    if torn is not None:
        walk.torn_last = torn[0]
        walk.notes.append(
            f"line {torn[0]}, the last, is cut short (the process died writing it); the "
            f"{torn[0] - 1} lines before it are checked"
        )
    return walk.finish(last)
