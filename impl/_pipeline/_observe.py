"""The run's phase as the pipeline knows it, and where its abstract actions are reported.

Every part of the pipeline reports each abstract action it takes (admit, commit, dispatch with
its reason, scored, a failed call, train, checkpoint, stop, exit...) to one `ActionObserver`,
in the model's own vocabulary (`groupflow.model.scheduler.actions`). The report protocol is "act, then
report, without yielding in between": an action's changes to the buffer, the ledger, the queues
and the permits happen in one synchronous block that ends with its report, so an observer that
looks at the pipeline when it hears of an action sees the state the action produced, and never
half of another. With an in-process store (every store call synchronous) this holds for every
action; `groupflow.sim.verify.conformance` relies on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from groupflow.model.scheduler import Phase
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.states import GroupState


class ActionObserver(Protocol):
    """Told of every abstract action the pipeline takes, right after it took it."""

    def on_action(self, action: Action) -> None: ...


class ActionRecorder(Protocol):
    """Told of every action with what the model's vocabulary leaves out: the group it moved
    (`group`), where the action alone does not say, the state it moved it from (`was`), and
    for a commit the group's tokens where its rows say (`tokens`). A recorder sits beside
    the observer, so a trace and a conformance check run together."""

    def record(
        self,
        action: Action,
        *,
        group: str | None = None,
        was: GroupState | None = None,
        tokens: int | None = None,
    ) -> None: ...


@attrs.define
class RunStatus:
    """The phase of one run (running, shutting down, done; failed or not) and its reporter.

    Lanes number the physical teachers in the order the stage first meets them, unless the
    caller names them up front (`lanes`), as a conformance check does to match its model.
    """

    observer: ActionObserver | None = None
    recorder: ActionRecorder | None = None
    """Writes the trace (`TraceWriter`), whatever observer is attached."""
    phase: Phase = Phase.RUNNING
    failed: bool = False
    failing: bool = False
    """Some failure has been chosen to fail the run, reported or about to be (`claim_failure`)."""
    stopped: bool = False
    """Shut down because training was done."""
    interrupted: bool = False
    """Shut down early because the user asked (`Pipeline.request_stop`)."""
    lanes: dict[str, int] = attrs.field(factory=dict)

    def lane(self, teacher: str) -> int:
        if teacher not in self.lanes:
            self.lanes[teacher] = len(self.lanes)
        return self.lanes[teacher]

    def report(
        self,
        kind: ActionKind,
        *,
        ordinal: int = -1,
        teacher: str | None = None,
        detail: str = "",
        group: str | None = None,
        was: GroupState | None = None,
        tokens: int | None = None,
    ) -> None:
        if self.observer is None and self.recorder is None:
            return
        lane = -1 if teacher is None else self.lane(teacher)
        action = Action(kind, ordinal, lane, str(detail))
        if self.observer is not None:
            self.observer.on_action(action)
        if self.recorder is not None:
            self.recorder.record(action, group=group, was=was, tokens=tokens)

    def stop(self) -> None:
        """Training has run its steps: the run shuts down."""
        if self.phase is Phase.RUNNING:
            self.phase = Phase.SHUTDOWN
            self.stopped = True
            self.report(ActionKind.STOP)

    def interrupt(self) -> None:
        """The user stopped the run before its last step (`Pipeline.request_stop`): it shuts
        down as after the last step, and a resume continues where it stopped."""
        if self.phase is Phase.RUNNING:
            self.phase = Phase.SHUTDOWN
            self.interrupted = True
            self.report(ActionKind.INTERRUPT)

    def fail(self) -> None:
        """A pump raised (or shutdown overran its deadline): the run aborts. Reported once;
        a failure that an action already reported (a failed call under the `fail` policy, a
        failed train step) does not report again."""
        if not self.failed:
            self.mark_failed()
            self.report(ActionKind.ABORT)

    def claim_failure(self) -> bool:
        """Take the run's one failure decision: True the first time (the caller fails the run,
        and reports it before its next await or right after its cleanup), False once another
        failure has (the caller's failure then raises nothing: the run has its error)."""
        if self.failing:
            return False
        self.failing = True
        return True

    def mark_failed(self) -> None:
        """The action about to be reported fails the run."""
        self.failed = True
        self.failing = True
        self.phase = Phase.SHUTDOWN

    def exit(self) -> None:
        """The run returns (or raises): nothing is unready any more."""
        if self.phase is not Phase.DONE:
            self.phase = Phase.DONE
            self.report(ActionKind.EXIT)


def lanes_for(
    teachers: Mapping[str, object] | Sequence[str], *, later: Sequence[str] = ()
) -> dict[str, int]:
    """Lanes numbered by sorted teacher name, then the stages after the teacher's (`later`,
    by name, in order): the model's numbering (`groupflow.model.scheduler.bounds.Bounds.lane`), stable
    enough to build a model on."""
    lanes = {name: i for i, name in enumerate(sorted(teachers))}
    for name in later:
        lanes[name] = len(lanes)
    return lanes
