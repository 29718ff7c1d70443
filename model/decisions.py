"""Every scheduling decision, written once as a pure function of plain facts.

The pipeline (`groupflow.impl`) and the abstract scheduler (`groupflow.model.scheduler`) both
call these, as both call `fire` for every group change: what `groupflow check` proved about a
rule is a statement about the rule the pipeline runs. Each function takes the facts it needs as
keyword arguments, so a caller cannot pass them in the wrong order, and none of them reads a
clock or a buffer: the caller gathers the facts, the function decides.
"""

from __future__ import annotations

import enum
from collections.abc import Container, Iterable

from groupflow.model.policy import CheckpointPolicy, Design, DispatchReason, FailurePolicy
from groupflow.model.shape import Shape


class Hold(enum.StrEnum):
    """Why a prompt is not admitted yet."""

    SHUTDOWN = "the run is shutting down"
    NO_PERMIT = "no free generation permit"
    BUFFER_FULL = "the buffer is full"
    GATE = "its train step is beyond the gate window"


def admission(
    *,
    running: bool,
    free_permits: int,
    held_groups: int,
    max_buffered_groups: int,
    steps_ahead: int,
    gate_window: int,
) -> Hold | None:
    """None when the next prompt may be admitted now, else what holds it back.

    Nothing is admitted once the run shuts down (training done, or a failure). A prompt takes
    a generation permit and a buffer slot at once, and is admitted at most `gate_window` train
    steps ahead of training (`steps_ahead`: for the in-order sampler, its target step minus
    the train step). A pending `flush` checkpoint does not hold
    admission back: the flush waits for the groups pending at its cut only, so new rollouts
    keep the generators busy without lengthening it (see the README, "Checkpoints").
    """
    if not running:
        return Hold.SHUTDOWN
    if free_permits <= 0:
        return Hold.NO_PERMIT
    if held_groups >= max_buffered_groups:
        return Hold.BUFFER_FULL
    if steps_ahead > gate_window:
        return Hold.GATE
    return None


def step_issued(step_ordinals: Iterable[int], *, cursor: int, reissue: Container[int]) -> bool:
    """Every prompt of a step has been handed out by the data source (none waits to be issued,
    fresh or again)."""
    return all(o < cursor and o not in reissue for o in step_ordinals)


def demand_dispatch(
    *,
    training_waits: bool,
    step_issued: bool,
    step_upstream: bool,
    step_queued_here: bool,
) -> bool:
    """Demand dispatch: training waits on a step whose prompts are all issued, none of the
    step's groups can still join a stage's queue (`step_upstream` is false: no rollout of the
    step is running, none is at an earlier stage), and this queue holds one of them. Waiting
    longer cannot grow the step's batch here, only delay training.

    Judged for the step across every teacher: judging per teacher, a teacher whose queue holds
    the step's only group waits for another teacher's group forever.
    """
    return training_waits and step_issued and not step_upstream and step_queued_here


def dispatch_reasons(
    *,
    design: Design,
    run_failed: bool,
    queued: int,
    head_is_retry: bool,
    call_in_flight: bool,
    max_batch_groups: int,
    draining: bool,
    flush_requested: bool,
    demanded: bool,
    timer_expired: bool,
) -> tuple[DispatchReason, ...]:
    """Every reason that allows sending a batch from this queue now, in the order they are
    tried; empty when the batch must wait. At most one call per physical teacher is in flight,
    and none starts once the run has failed.

    The pipeline sends with the first reason. The model does too, and accepts any of them from
    a trace: the pipeline may learn of a fact (upstream has ended, say) a moment after it holds.
    """
    if run_failed or queued == 0 or call_in_flight:
        return ()
    if design is Design.INLINE:
        return (DispatchReason.INLINE,)
    out: list[DispatchReason] = []
    if head_is_retry:
        out.append(DispatchReason.RETRY)
    if queued >= max_batch_groups:
        out.append(DispatchReason.FULL)
    if draining:
        out.append(DispatchReason.DRAIN)
    if flush_requested:
        out.append(DispatchReason.CHECKPOINT_FLUSH)
    if demanded:
        out.append(DispatchReason.DEMAND)
    if timer_expired:
        out.append(DispatchReason.TIMER)
    return tuple(out)


def batch_size(*, design: Design, queued: int, head_is_retry: bool, max_batch_groups: int) -> int:
    """How many groups from the head of the queue go in the call: one for the inline baseline
    and for a retried group (it goes alone), else up to `max_batch_groups`, stopping before the next
    retried group."""
    if design is Design.INLINE or head_is_retry:
        return 1
    return min(queued, max_batch_groups)


def reissue_on_resume(cursor: int, accounted: Container[int]) -> tuple[int, ...]:
    """The prompts a checkpoint records to be issued again on resume: every issued ordinal
    (below the data cursor) that is neither trained, given up, nor saved as a READY group."""
    return tuple(o for o in range(cursor) if o not in accounted)


def config_problems(
    *,
    shape: Shape,
    design: Design,
    flush_timer: bool,
    demand: bool,
) -> list[str]:
    """What makes a configuration unsafe, one sentence each (empty: safe).

    With a flush timer (always on in the pipeline) these are the exact conditions
    `groupflow check` finds, tested over a sweep of bounds: a configuration breaks none of them
    exactly when the checker finds no violation. The timer removes every deadlock but one, a
    buffer smaller than a step, which can never hold the step whole. Without a timer (a setting
    only the checker explores) these conditions are safe but not exact: demand dispatch saves
    the pump design, nothing saves the coalescing one.
    """
    out: list[str] = []
    prompts_per_step, max_buffered_groups = shape.prompts_per_step, shape.max_buffered_groups
    if max_buffered_groups < prompts_per_step:
        out.append(
            f"max_buffered_groups={max_buffered_groups} is smaller than prompts_per_step="
            f"{prompts_per_step}: a step's READY groups would fill the buffer and its last "
            f"prompt could never be admitted (the run would hang); use max_buffered_groups >= "
            f"{prompts_per_step}"
        )
    if not flush_timer and design is Design.COALESCE:
        out.append(
            "the coalescing design without a flush timer: waiting groups hold their generation "
            "permits, and a partial batch can wait forever for a group no permit is left for"
        )
    elif not flush_timer and not demand and design is Design.PUMP:
        out.append(
            "without a flush timer or demand dispatch a partial batch can wait forever for a "
            "group that admission holds back"
        )
    return out


def step_missing(
    step_ordinals: Iterable[int], *, ready: Container[int], given_up: Container[int]
) -> list[int]:
    """The prompts of a step that training still waits for: neither READY nor given up (a
    prompt not issued yet is missing too). The step trains once this is empty."""
    return [o for o in step_ordinals if o not in ready and o not in given_up]


def flush_cut(policy: CheckpointPolicy, pending: Iterable[int]) -> tuple[int, ...]:
    """The prompts a checkpoint waits for: under `flush`, those WRITTEN or SCORING at the cut
    (`pending`); under the other policies, none."""
    return tuple(sorted(pending)) if policy is CheckpointPolicy.FLUSH else ()


def retry_after_failure(policy: FailurePolicy, retries: int, *, transient: bool) -> bool:
    """Whether a group of a failed call is queued again (alone, first) rather than dropped:
    under `retry`, once, and only when the failure may go away by itself (`transient`). A
    call that failed for a reason that stays (a bug in the scorer, a vocabulary too small)
    would fail again alone: retrying it costs a call and delays the step for nothing."""
    return transient and policy is FailurePolicy.RETRY and retries == 0


def permanence_matters(policy: FailurePolicy) -> bool:
    """Whether it changes anything that a failure is permanent rather than transient: under
    `retry` only, where a transient failure's groups are retried and a permanent one's given up.
    `discard` gives up and `fail` fails the run either way, so there the pipeline does not
    report a failure as permanent and the model does not offer it."""
    return policy is FailurePolicy.RETRY


def failure_is_judged(*, run_failed: bool) -> bool:
    """Whether a rollout's or a teacher call's failure is judged by the failure rules (given
    up, retried, or the run fails): only while the run has not failed. A run fails once, for
    one reason: what fails after that (the rest of a fleet that went down in the same instant)
    ends as cancelled, its prompt issued again on resume, and the run's error stays the first."""
    return not run_failed


def too_stale(*, weight_version: int, start_version: int, max_staleness: int) -> bool:
    """A group generated `weight_version - start_version` versions ago is past the window."""
    return weight_version - start_version > max_staleness
