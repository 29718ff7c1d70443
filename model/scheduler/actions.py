"""The abstract actions: what may happen to the scheduler, as the checker explores it and as the
running pipeline reports it (`groupflow.impl._pipeline.ActionObserver`), one vocabulary for both."""

from __future__ import annotations

import enum
from typing import NamedTuple


class ActionKind(enum.StrEnum):
    """One kind of thing that happens. A str enum: `ActionKind.ADMIT == "admit"`."""

    ADMIT = "admit"
    """A prompt takes a generation permit and a buffer slot; its rollout starts."""
    COMMIT = "commit"
    ROLLOUT_FAIL = "rollout_fail"
    """A rollout fails: its group is discarded, its prompt given up (shortfall)."""
    CANCEL = "cancel"
    """A rollout is cancelled by shutdown: its prompt is issued again on resume."""
    DISPATCH = "dispatch"
    SCORED = "scored"
    SCORE_FAIL = "score_fail"
    """A teacher call fails; its groups are retried, dropped or fail the run, by policy. With
    detail `PERMANENT_FAILURE` the error cannot go away by itself (see there)."""
    DROP = "drop"
    """Shutdown drops a WRITTEN or SCORING group; its prompt is issued again on resume."""
    TRAIN = "train"
    """The train pump selects the step's groups (CONSUMED) and starts the step."""
    TRAINED = "trained"
    """The step is done: its prompts are trained, the rows cleared, training moves on."""
    EVICT = "evict"
    """The windowed sampler drops READY groups too stale to train; their prompts are given up."""
    TRAIN_FAIL = "train_fail"
    """A train step raised: its groups are consumed untrained, the run fails; their prompts
    are issued again on resume."""
    TRAIN_CANCELLED = "train_cancelled"
    """A failing run cancels the train step: as a failed step, without being the fault."""
    CHECKPOINT = "checkpoint"
    """A checkpoint starts (detail: its policy); a `flush` one cuts the groups to wait for."""
    CHECKPOINT_SAVED = "checkpoint_saved"
    """The checkpoint's snapshot is taken (the ledger, the READY groups): its write starts.
    Not on disk yet: a crash before `CHECKPOINT_WRITTEN` restarts from the one before."""
    FLUSH_TIMEOUT = "flush_timeout"
    """As `CHECKPOINT_SAVED`, after a `flush` cut that timed out waiting for its groups."""
    CHECKPOINT_WRITTEN = "checkpoint_written"
    """The snapshot's write has ended: on disk, the checkpoint a crash restarts from. With
    detail `WRITE_FAILED` the write failed instead, and the run fails."""
    STOP = "stop"
    """Training has run its steps: the run shuts down (producers stop, stages drain)."""
    EXIT = "exit"
    INTERRUPT = "interrupt"
    ABORT = "abort"
    """The run fails for a reason outside the scheduler (a pump raised): everything stops."""
    CRASH = "crash"
    """The process dies; the run restarts from its last checkpoint."""


class Action(NamedTuple):
    """One thing that happens. `kind` names it; the other fields say to what. `lane` is a
    stage's queue: a teacher's index for the teacher stage."""

    kind: ActionKind
    ordinal: int = -1
    lane: int = -1
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": str(self.kind)}
        if self.ordinal >= 0:
            out["ordinal"] = self.ordinal
        if self.lane >= 0:
            out["lane"] = self.lane
        if self.detail:
            out["detail"] = self.detail
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Action:
        """The action a trace line records; `ValueError` naming the field that is missing or
        not what it must be."""
        if "kind" not in data:
            raise ValueError('no "kind"')
        named = data["kind"]
        if not isinstance(named, str) or named not in _KINDS:
            raise ValueError(f'"kind" {named!r} is none of the model\'s')
        detail = data.get("detail", "")
        if not isinstance(detail, str):
            raise ValueError(f'"detail" must be a string, got {detail!r}')
        ordinal = _whole("ordinal", data.get("ordinal", -1))
        lane = _whole("lane", data.get("lane", data.get("teacher", -1)))
        return cls(ActionKind(named), ordinal, lane, detail)


_KINDS = frozenset(kind.value for kind in ActionKind)
"""The kinds a trace line may name."""


def _whole(name: str, value: object) -> int:
    """A trace line's field that must be a whole number (a bool is none)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'"{name}" must be a whole number, got {value!r}')
    return value


PERMANENT_FAILURE = "permanent"
"""The detail of a `SCORE_FAIL` whose error cannot go away by itself (a bug in the scorer, a
vocabulary too small): calling again would fail again, so under the `retry` policy its groups
are given up at once instead of retried. The pipeline reports it only where it changes the
outcome (`decisions.permanence_matters`), and the model offers it only there."""

WRITE_FAILED = "failed"
"""The detail of a `CHECKPOINT_WRITTEN` whose write failed (a full disk): nothing new is on
disk, and the run fails. The explorer does not branch on it (an `ABORT` with the snapshot
dropped covers what follows); the pipeline reports it and the model accepts it."""

EXTERNAL_KINDS = frozenset(
    {ActionKind.CRASH, ActionKind.INTERRUPT, ActionKind.ABORT, ActionKind.TRAIN_FAIL}
)
"""Actions the world does to the run. Liveness must hold without them: the run finishes on its own."""

NOT_PROGRESS_KINDS = EXTERNAL_KINDS | {ActionKind.CHECKPOINT}
"""A state where nothing but these can happen is a deadlock: starting a checkpoint moves no group."""
