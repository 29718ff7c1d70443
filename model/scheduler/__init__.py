"""An abstract model of the whole scheduler: many groups, permits, batches, timers, teachers,
checkpoints, crashes and shutdown, small enough to explore exhaustively.

The lifecycle table says what may happen to one group; the hard bugs live in how many groups
interleave. A `SchedState` is the scheduler at one instant; `enabled` lists what may happen next
and `apply` makes it happen. Every group change goes through `groupflow.model.fire`, and every
scheduling decision (admission, dispatch, the batch, demand, what a checkpoint re-issues) is a
function of `groupflow.model.decisions` that the pipeline calls too.

Time is abstract: a flush timer firing is an action that may happen whenever a batch waits. A
state is final when the run has exited (`Phase.DONE`).

One module per job: `actions` (what may happen, one vocabulary with the running pipeline),
`bounds` (the parameters of one exploration), `state` (the state and the queries over it),
`guards` (when each action may happen: `enabled`), `transitions` (what it does: `transition`,
`apply`, `restart`), `checks` (what must hold in every state), `words` (actions and states in
words); the exhaustive explorer (`explorer`) with its canonical states (`canonical`) and
partial-order reduction (`reduction`). Every name users of the state machine need is exported
here.
"""

from groupflow.model.policy import (
    CheckpointPolicy,
    Design,
    Dispatch,
    DispatchReason,
    FailurePolicy,
    Sampler,
)
from groupflow.model.scheduler.actions import (
    EXTERNAL_KINDS,
    NOT_PROGRESS_KINDS,
    PERMANENT_FAILURE,
    Action,
    ActionKind,
)
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.guards import dispatch_reasons, enabled, is_enabled
from groupflow.model.scheduler.state import (
    BUDGET_FIELDS,
    Cut,
    Group,
    NotEnabled,
    Phase,
    Saved,
    SchedState,
    group_of,
    initial_state,
    next_prompt,
    producer_ended,
)
from groupflow.model.scheduler.transitions import apply, restart, transition
from groupflow.model.scheduler.words import describe, summarize

__all__ = [
    "EXTERNAL_KINDS",
    "NOT_PROGRESS_KINDS",
    "PERMANENT_FAILURE",
    "Action",
    "ActionKind",
    "BUDGET_FIELDS",
    "Bounds",
    "CheckpointPolicy",
    "Cut",
    "Design",
    "Dispatch",
    "DispatchReason",
    "FailurePolicy",
    "Group",
    "NotEnabled",
    "Phase",
    "Sampler",
    "SchedState",
    "Saved",
    "apply",
    "describe",
    "dispatch_reasons",
    "enabled",
    "group_of",
    "initial_state",
    "is_enabled",
    "next_prompt",
    "producer_ended",
    "summarize",
    "restart",
    "transition",
]
