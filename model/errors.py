"""Every error groupflow raises on purpose, by who caused it, under one base: `GroupflowError`.

- **Usage** (`UsageError`): the caller broke a rule. An illegal move in the lifecycle
  (`IllegalTransition`), a bad configuration (`ConfigError`, naming the field), bad arguments
  (`ArgumentError`), a group that does not exist (`UnknownGroup`) or has a store call in flight
  (`GroupBusy`), a call at a moment it is not allowed (`CallOrderError`), an agent no teacher
  serves (`RoutingError`), a pump that breaks the pump contract (`MonitorReturned`).
- **Environment** (`ExternalError`): something outside groupflow failed or disagrees. The store
  (`StoreError`), a scoring call (`ScoringError`), a checkpoint on disk (`CheckpointError`:
  mismatched, corrupt, missing, already there), a run that stalls or does not shut down in time,
  a served engine (`EngineError`: busy, timed out, refused, or answering nonsense), a package
  or device that is not there (`Unavailable`), and a failure that may go away if the call is
  made again (`TransientError`: a busy engine, or a user's scorer saying so).
- **Backpressure** (`BackpressureError`): wait and try again (`BufferFull`).
- **Internal** (`InternalError`): groupflow broke its own promise (an inconsistent ledger, a
  broken invariant, a run the model does not allow). Its message says that this is a bug in
  groupflow.

Each class also derives from the builtin exception nearest to it (`ValueError`, `LookupError`,
`RuntimeError`, ...), so code that catches builtins keeps working. The same mistake raises the
same class wherever it is made. `PumpFailed` wraps the failure of a pump; its `__cause__` has
the category.

Pure, like the rest of `groupflow.model`: the standard library only. `groupflow.impl`
re-exports every class.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from groupflow.model.invariants import Violation
    from groupflow.model.lifecycle import Actor, Event
    from groupflow.model.states import GroupState


class GroupflowError(Exception):
    """The base of every error groupflow raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Several errors take keyword-only details, so the default (calling the class with
        # `args` alone) cannot rebuild them: rebuild without `__init__`, then restore the details
        # (an error that crosses a process boundary, from a remote store or teacher).
        return (_rebuild, (type(self), self.args), self.__dict__)


def _rebuild(cls: type[GroupflowError], args: tuple[Any, ...]) -> GroupflowError:
    error = cls.__new__(cls, *args)
    error.args = args
    return error


# -- usage: the caller broke a rule ----------------------------------------------------------


class UsageError(GroupflowError):
    """The caller broke a rule: fix the call, the configuration or the data handed over."""


class ConfigError(UsageError, ValueError):
    """A configuration refuses a value; `field` names it (`config` the class, when known)."""

    def __init__(self, message: str, *, field: str, config: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.config = config


class ArgumentError(UsageError, ValueError):
    """A call's arguments are wrong: a negative step, an id listed twice, rows that do not fit
    the group."""


class IllegalTransition(UsageError, ValueError):
    """A call the group lifecycle does not allow in the group's state: an event the transition
    table has no row for (or that `actor` may not fire), or a call on a group that has already
    finished.

    Seeing this means a caller broke the lifecycle: the message names the group, its state, the
    event and who fired it, and the group has not changed. `event` is None for calls that are
    not events of the table (releasing or reading a group); `actor` is None where no actor
    fires one.
    """

    def __init__(
        self,
        message: str,
        *,
        group_id: str,
        state: GroupState | None,
        event: Event | None,
        actor: Actor | None,
    ) -> None:
        super().__init__(message)
        self.group_id = group_id
        self.state = state
        self.event = event
        self.actor = actor


class NotEnabled(UsageError, ValueError):
    """The scheduler model was asked for an action that is not enabled in the state: a trace
    replayed (`groupflow replay`, a finding) that no longer fits the model."""


class UnknownGroup(UsageError, LookupError):
    """A group id that this buffer never reserved."""


class GroupBusy(UsageError, RuntimeError):
    """A group has a store call in flight (a blocking store yields): no other task may change it
    until that call returns."""


class CallOrderError(UsageError, RuntimeError):
    """A call made when its object cannot take it: loading a state into a buffer already used,
    submitting to a stage whose upstream has ended."""


class Exhausted(UsageError, LookupError):
    """The data source has no prompt left to issue (ask `peek` first)."""


class RoutingError(UsageError, LookupError, ValueError):
    """A group's agent maps to no teacher (and no default was configured), or a call names a
    physical teacher there is none of: the run fails."""


class MonitorReturned(UsageError, RuntimeError):
    """A monitor's `run()` returned: monitors loop until cancelled, so this is a bug in it."""


class WrongLoop(UsageError, RuntimeError):
    """A run, or a part of it, was awaited on an event loop that cannot run it: the pipeline
    from asyncio code (host it with `groupflow.impl.aio.run`), or an asyncio part under a plain
    `trio.run`. The message names the part and the call to make instead."""


# -- environment: something outside groupflow failed --------------------------------------------


class ExternalError(GroupflowError):
    """Environment errors: the store, a teacher, the disk or the machine failed or disagrees."""


class StoreError(ExternalError):
    """The sample store refused a read or a write."""


class StoreTimeout(StoreError, TimeoutError):
    """A call to a remote store did not return within its time limit (a `TimeoutError`, so
    a teacher call that meets it counts as transient)."""


class MissingDataError(StoreError, LookupError):
    """Rows or fields that were asked for are not in the store."""

    def __init__(
        self,
        message: str,
        *,
        rows: Sequence[str] = (),
        fields: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.rows = tuple(rows)
        self.fields = dict(fields or {})


class DuplicateDataError(StoreError, ValueError):
    """A write would overwrite rows or fields that already exist."""


class ScoringError(ExternalError):
    """A scoring call failed: a teacher's, a verifier's, any scoring stage's."""


class TeacherOutputError(ScoringError, ValueError):
    """The teacher returned something other than one finite log-prob per response token."""


class ScoringTimeout(ScoringError, TimeoutError):
    """A scoring call ran past `call_timeout_s`: a failed call under the failure policy (a
    `TimeoutError`, so transient by default)."""


class ScorerLost(ScoringError, RuntimeError):
    """A scorer (a teacher, a verifier) is gone for good and the run fails: its blocking call
    ignored cancellation (its worker thread had not returned `abandon_after_s` after it was
    cancelled, so it was abandoned; the message names the rows it may still touch), or a remote
    worker group lost an actor it may not, or may no longer, restart (`RayTeacherGroup`)."""


class PartLost(ExternalError, RuntimeError):
    """An asyncio part's call is gone: its task ignored the cancel groupflow sent it (and was
    abandoned `abandon_after_s` later, still running on the host loop), or something other
    than groupflow cancelled it. The message names the part and the method. (A scorer's call
    raises `ScorerLost` instead, as a worker thread's does.)"""


class ScoringCallFailed(ScoringError, RuntimeError):
    """A scoring call (a teacher's, a verifier's) failed and the failure policy says to fail
    the run, or too many calls in a row failed (`max_consecutive_failed_batches`)."""


class GeneratorOutputError(ExternalError, ValueError):
    """The generator returned rows the run cannot use: not one mapping per generation, or
    without a field the learner or a teacher reads."""


class RolloutsFailed(ExternalError, RuntimeError):
    """More rollouts failed in a row than `max_consecutive_failed_rollouts`: the generator is
    down, not unlucky, and giving up prompt after prompt would only hide it."""


class NothingTrained(ExternalError, RuntimeError):
    """The run reached its end having given up every prompt: it failed, whatever each failure
    looked like alone."""


class LearnerDiverged(ExternalError, FloatingPointError):
    """A train step's loss is not a finite number: the learner diverged. The run fails there
    rather than train on, and write a metric that is not a number; the same run would diverge
    again where it did, so the cure is a smaller learning rate."""


class CheckpointError(ExternalError):
    """A checkpoint on disk cannot be used as asked."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint saved under another configuration than the one resuming from it."""


class CheckpointCorrupt(CheckpointError, ValueError):
    """A checkpoint that is not one, or whose contents do not hold together."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for."""


class CheckpointLocked(CheckpointError, RuntimeError):
    """Another run holds the checkpoint folder; the message names it (pid and host)."""


class CheckpointExists(CheckpointError, FileExistsError):
    """A checkpoint is already saved under that name; it is never overwritten."""


class TraceError(ExternalError):
    """A trace file (`groupflow replay`'s input) cannot be read as one."""


class TraceNotFound(TraceError, FileNotFoundError):
    """No trace where one was asked for: the path is missing, or a folder without one."""


class TraceCorrupt(TraceError, ValueError):
    """A trace that is not one: not JSON lines, no header, or a format version this groupflow
    does not read. (A trace that reads but breaks the model is a verdict, not an error.)"""


class Stalled(ExternalError, RuntimeError):
    """Nothing progressed for `stall_timeout_s`; the message says what was last seen."""


class ShutdownTimeout(ExternalError, RuntimeError):
    """Stages had not drained `shutdown_timeout_s` after the run ended; they were cancelled."""


class Unavailable(ExternalError, RuntimeError):
    """Something a call needs is not here: an optional package (transformers, matplotlib) or a
    device (CUDA)."""


class TransientError(ExternalError, RuntimeError):
    """A failure that may go away if the same call is made again: a teacher server that is
    busy or restarting, a worker that was preempted. The served engines raise it (as
    `EngineBusy` and `EngineTimeout`), and so may a user's scorer, to say "try again": under
    `failure_policy="retry"` the call's groups are retried alone once
    (`ScoringConfig.transient_errors` lists it by default)."""


class EngineError(ExternalError):
    """A served engine (a teacher or the student on an OpenAI-compatible server) failed a
    call. The same causes raise the same classes for a teacher call, a rollout and a weight
    sync; the message names the engine, its URL and the call (a sync names its step)."""


class EngineBusy(EngineError, TransientError):
    """The engine could not be reached, closed or cut the connection, or answered HTTP 5xx or
    429: the same call may succeed next time."""


class EngineTimeout(EngineBusy):
    """The engine did not answer a call in full within its total time bound; the message
    names the setting. Transient, as a busy engine is (not a `TimeoutError`: that is an
    `OSError`, which a `TransientError` is not)."""


class EngineRefused(EngineError, RuntimeError):
    """The engine refused the request (HTTP 4xx): a prompt longer than its `max_model_len`, a
    model it does not serve, a route it lacks (a vLLM server started without
    `VLLM_SERVER_DEV_MODE=1` has no weight-sync routes). It would refuse it again."""


class EngineOutputError(EngineError, ValueError):
    """The engine answered something other than what was asked: not JSON, larger than its
    bound, for another model or other tokens, the wrong number of choices, an impossible
    log-prob (above 0, not finite, or an engine's clamp of minus infinity), a reload that
    reached no worker."""


# -- backpressure: wait, then try again ------------------------------------------------------


class BackpressureError(GroupflowError):
    """Not now: something downstream is full; wait until it drains."""


class BufferFull(BackpressureError, RuntimeError):
    """`reserve` found every slot taken; wait until the train pump consumes or evicts groups."""


# -- internal: a bug in groupflow ----------------------------------------------------------


_BUG_NOTICE = "(this is a bug in groupflow; please report it)"


class InternalError(GroupflowError):
    """groupflow broke a promise of its own. No call of the user's can cause this: the message
    ends by saying that it is a bug in groupflow."""

    def __str__(self) -> str:
        return f"{super().__str__()} {_BUG_NOTICE}"


class LedgerInconsistent(InternalError, RuntimeError):
    """The prompt ledger disagrees with itself: a prompt trained twice, settled while not in
    flight, or saved and in flight at once."""


class TeacherUntrained(InternalError, RuntimeError):
    """A domain teacher's recipe did not reach its accuracy bar within its step limit: the
    recipe is seeded and fixed, so this is the recipe's fault, not the caller's."""


class InvariantViolation(InternalError, AssertionError):
    """A buffer snapshot broke the model's invariants; the message lists every violation."""

    def __init__(self, violations: list[Violation]) -> None:
        super().__init__("\n".join(str(v) for v in violations))
        self.violations = violations


class ConformanceError(InternalError, AssertionError):
    """The pipeline did something the model does not allow, or reached a state the model did
    not: a disagreement between the code that runs and the code that was checked
    (`groupflow.sim.verify.conformance`)."""


# -- a pump failed ---------------------------------------------------------------------------


class PumpFailed(GroupflowError, RuntimeError):
    """A pump failed (or a monitor returned); `pump` and `kind` say which, `__cause__` why (and
    so to whom the failure is due). Other failures of the same run are attached as notes."""

    def __init__(self, message: str, *, pump: str, kind: enum.Enum) -> None:
        super().__init__(message)
        self.pump = pump
        self.kind = kind
        """The pump's `PumpKind` (`groupflow.impl._pipeline`)."""
        self.result: Any = None
        """What the failed run did, as `Pipeline.run` would have returned it (a `RunResult`:
        trained, given up, unfinished), set as the run's error leaves it."""


__all__ = [
    "ArgumentError",
    "BackpressureError",
    "BufferFull",
    "CallOrderError",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointLocked",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "ConfigError",
    "ConformanceError",
    "DuplicateDataError",
    "EngineBusy",
    "EngineError",
    "EngineOutputError",
    "EngineRefused",
    "EngineTimeout",
    "Exhausted",
    "ExternalError",
    "GroupBusy",
    "GeneratorOutputError",
    "GroupflowError",
    "IllegalTransition",
    "InternalError",
    "InvariantViolation",
    "LearnerDiverged",
    "LedgerInconsistent",
    "MissingDataError",
    "MonitorReturned",
    "NotEnabled",
    "PartLost",
    "NothingTrained",
    "PumpFailed",
    "RolloutsFailed",
    "RoutingError",
    "ShutdownTimeout",
    "Stalled",
    "StoreError",
    "StoreTimeout",
    "ScoringCallFailed",
    "ScoringError",
    "ScorerLost",
    "TeacherOutputError",
    "ScoringTimeout",
    "TeacherUntrained",
    "TraceCorrupt",
    "TraceError",
    "TraceNotFound",
    "TransientError",
    "Unavailable",
    "UnknownGroup",
    "UsageError",
    "WrongLoop",
]
