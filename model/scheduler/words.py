"""The abstract scheduler in words: an action and a state as a user reads them in a trace."""

from __future__ import annotations

from groupflow.model.scheduler.actions import PERMANENT_FAILURE, WRITE_FAILED, Action, ActionKind
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.state import PENDING, SchedState, next_prompt

__all__ = ["describe", "summarize"]

_K = ActionKind


def _lane_name(lane: int, b: Bounds) -> str:
    return f"teacher {lane}" if lane < b.teachers else f"stage {b.stage_of_lane(lane) + 1}"


def describe(a: Action, b: Bounds) -> str:
    """One action in words a user can follow."""
    o = a.ordinal
    lane = _lane_name(a.lane, b)
    kind = ActionKind(a.kind)
    if kind is _K.ADMIT:
        return f"admit prompt {o} for step {b.target(o)} (teacher {b.teacher(o)})"
    if kind is _K.COMMIT:
        if b.stages == 0:
            return f"rollout of prompt {o} finishes: commit, READY"
        return f"rollout of prompt {o} finishes: commit, queue at teacher {b.teacher(o)}"
    if kind is _K.ROLLOUT_FAIL:
        return f"rollout of prompt {o} fails: group discarded, prompt given up"
    if kind is _K.CANCEL:
        return f"rollout of prompt {o} cancelled by shutdown"
    if kind is _K.DISPATCH:
        return f"{lane}: send a batch ({a.detail})"
    if kind is _K.SCORED:
        return f"{lane}: call returns, its groups scored"
    if kind is _K.SCORE_FAIL:
        if a.detail == PERMANENT_FAILURE:
            return f"{lane}: call fails with a permanent error (groups given up, not retried)"
        return f"{lane}: call fails ({b.failure_policy} policy)"
    if kind is _K.DROP:
        return f"shutdown drops prompt {o}'s group (issued again on resume)"
    if kind is _K.TRAIN:
        return f"train {a.detail}: select its groups"
    if kind is _K.TRAINED:
        return f"train {a.detail} done"
    if kind is _K.EVICT:
        return f"evict READY groups more than {b.max_staleness} versions old (prompts given up)"
    if kind is _K.TRAIN_CANCELLED:
        return f"train {a.detail} cancelled by the failing run"
    if kind is _K.TRAIN_FAIL:
        return f"train {a.detail} raises: the run fails"
    if kind is _K.CHECKPOINT:
        return f"checkpoint starts ({a.detail})"
    if kind is _K.CHECKPOINT_SAVED:
        return "checkpoint snapshot taken: its write starts"
    if kind is _K.FLUSH_TIMEOUT:
        return "flush timed out: snapshot taken without the pending groups, its write starts"
    if kind is _K.CHECKPOINT_WRITTEN:
        if a.detail == WRITE_FAILED:
            return "checkpoint write fails: the run fails"
        return "checkpoint written: a crash restarts from it"
    if kind is _K.STOP:
        return "training done: shutdown"
    if kind is _K.EXIT:
        return "run exits"
    if kind is _K.INTERRUPT:
        return "user stops the run: shutdown"
    if kind is _K.ABORT:
        return "a pump fails: the run aborts"
    return "crash: restart from the last checkpoint"


def summarize(s: SchedState, b: Bounds) -> str:
    """The state in one line: phase, step, permits, each group, each lane's queue."""
    groups = (
        " ".join(
            f"p{g.ordinal}:{g.state.value}{'*' if g.permit else ''}{'r' if g.retries else ''}"
            + (f"@{g.stage}" if b.stages > 1 and g.state in PENDING else "")
            for g in s.groups
        )
        or "-"
    )
    lanes = " ".join(
        f"{'t' if lane < b.teachers else 's'}{lane}[queued {list(s.pending[lane])} in flight "
        f"{[list(x) for x in s.inflight[lane]]}]"
        for lane in range(b.lanes)
    )
    extra = []
    if s.reissue:
        extra.append(f"reissue {list(s.reissue)}")
    if s.cut is not None:
        extra.append(f"checkpoint ({s.cut.policy}) waits for {list(s.cut.ordinals)}")
    if s.writing is not None:
        extra.append(f"checkpoint of step {s.writing.step} being written")
    if s.training:
        extra.append("training")
    if s.failed:
        extra.append("failed")
    phase = s.phase.name.lower()
    return (
        f"{phase} step {s.step}/{b.steps}, next prompt {next_prompt(s, b)}, permits free "
        f"{s.free_permits}/{b.shape.max_inflight_prompts}, held {len(s.groups)}/{b.shape.max_buffered_groups} | {groups} | {lanes}"
        + ("" if not extra else " | " + ", ".join(extra))
    )
