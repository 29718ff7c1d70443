"""Which failures of a teacher call may go away by themselves (`is_transient`), and the warning
the stage logs for each failed call.

Under `failure_policy="retry"` only a transient failure's groups are retried (alone, once;
`groupflow.model.decisions.retry_after_failure` decides): an error that stays would fail the
retry too, costing a call and delaying the step for nothing. `ScoringConfig.transient_errors`
lists what counts; by default (`DEFAULT_TRANSIENT_ERRORS`):

- `OSError`: the network, a connection refused or reset, a timeout (`ConnectionError` and
  `TimeoutError` are `OSError`s). It also covers a file not found; at worst that is one
  call retried in vain.
- `trio.TooSlowError`: a call past a time limit the scorer set itself (`trio.fail_after`).
- `TransientError`: what a scorer raises to say "try again".

Of groupflow's other environment errors (`ExternalError`), none is transient by default:

- `StoreError` (`MissingDataError`, `DuplicateDataError`): the store says the rows are not
  as the call expects (a scorer that did not write its field, a field written twice); calling
  again finds the same rows. A store whose connection fails raises an `OSError`.
- `TeacherOutputError`: the teacher returned NaN or the wrong number of log-probs. The same
  rows through the same weights give the same output; a retried group goes alone, which
  changes its padding and nothing else. A teacher whose kernels overflow on some batch shapes
  only can be given a retry by adding `TeacherOutputError` to `transient_errors`.
- `ScoringError` itself says that a call failed, not why; `ScoringCallFailed` is a failure
  policy's verdict, not a cause. `Unavailable`: a package or a device that is not there does
  not appear between two calls.
- Checkpoint errors, `Stalled` and `ShutdownTimeout` are not a scorer's to raise (two
  checkpoint errors are `OSError`s, `CheckpointNotFound` and `CheckpointExists`, and would
  count as transient if one did).

torch's CUDA out-of-memory error (`torch.cuda.OutOfMemoryError`, defined as
`torch.OutOfMemoryError`) is transient whatever `transient_errors` says: a retried group goes
alone, in a smaller batch than the one that ran out of memory. The pipeline does not import
torch, so the class is recognised by its name and its module (`torch` or below).

Everything else is permanent: a `ConfigError`, an `IndexError` from a vocabulary too small,
a `TypeError` in the scorer are bugs, and a bug fails every call made again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from groupflow.model import decisions
from groupflow.model.errors import TransientError
from groupflow.model.policy import FailurePolicy
from groupflow.model.scheduler.actions import PERMANENT_FAILURE

__all__ = ["DEFAULT_TRANSIENT_ERRORS", "is_transient"]

log = logging.getLogger("groupflow.teacher")

DEFAULT_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    trio.TooSlowError,
    TransientError,
)
"""The failures `ScoringConfig.transient_errors` retries by default (see the module)."""

_OUT_OF_MEMORY = "OutOfMemoryError"


def is_transient(exc: BaseException, transient_errors: tuple[type[BaseException], ...]) -> bool:
    """Whether calling again may succeed where `exc` failed: an instance of one of
    `transient_errors`, or torch's CUDA out-of-memory error. An exception group (scoring
    failed and cleaning up failed too) is transient only if everything in it is: one error
    that stays makes the retry fail as well."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transient(e, transient_errors) for e in exc.exceptions)
    return isinstance(exc, transient_errors) or _cuda_out_of_memory(exc)


def _cuda_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory error or a subclass, told by name: importing torch here would
    make every install need it."""
    return any(
        cls.__name__ == _OUT_OF_MEMORY
        and (cls.__module__ == "torch" or cls.__module__.startswith("torch."))
        for cls in type(exc).__mro__
    )


def failure_detail(policy: FailurePolicy, *, transient: bool) -> str:
    """The detail a failed call is reported to the model with: `PERMANENT_FAILURE` where
    that changes what happens to its groups (`decisions.permanence_matters`), none otherwise."""
    if transient or not decisions.permanence_matters(policy):
        return ""
    return PERMANENT_FAILURE


def log_failure(
    who: str,
    group_ids: Sequence[str],
    error: BaseException,
    *,
    policy: FailurePolicy,
    transient: bool,
    retried: Sequence[str],
) -> None:
    """One warning per failed call: who was called (`teacher 't0'`, `stage 'verifier'`), its
    groups, the error, and what happens to the groups (retried alone, given up and why, or the
    run fails)."""
    notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))
    log.warning(
        "%s failed scoring groups %s: %r%s; %s",
        who,
        list(group_ids),
        error,
        notes,
        _outcome(group_ids, policy=policy, transient=transient, retried=retried),
    )


def _outcome(
    group_ids: Sequence[str], *, policy: FailurePolicy, transient: bool, retried: Sequence[str]
) -> str:
    if policy is FailurePolicy.FAIL:
        return "the run fails (failure_policy='fail')"
    given_up = [g for g in group_ids if g not in retried]
    out = []
    if retried:
        out.append(f"a transient error: retrying {list(retried)} alone")
    if given_up:
        if policy is FailurePolicy.DISCARD:
            why = "failure_policy='discard'"
        elif not transient:
            why = "not a transient error: calling again would fail again"
        else:
            why = "retried once already"
        out.append(f"giving up {given_up}, not retried ({why})")
    return "; ".join(out)
