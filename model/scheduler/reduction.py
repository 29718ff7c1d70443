"""Partial-order reduction for the explorer: where several things may happen next and one of
them commutes with everything else that could ever happen first, expand that one alone.

In a state `s`, a set `T` of enabled actions is *persistent* when every run from `s` that
does not take an action of `T` takes only actions independent of every action in `T`:
actions that, wherever both are enabled, neither disable the other and lead to the same
state in either order. Expanding only `T` then loses no deadlock, no state from which the run
cannot finish, and no final state: each run of the full graph can be reordered, one
independent swap at a time, into a run of the reduced one with the same end. The graph is
acyclic (every action uses up a budget or moves a group, a counter or the phase forward, and
a crash spends one of the crash budget), so no action can be postponed forever (the
"ignoring" problem needs a cycle).

Two families of persistent sets are used, each a handful of actions of one place:

- *a call returns*: the last stage's in-flight batch on lane `L` (`scored`, or
  `score_fail` when a failure may still happen, transient or permanent: every action of
  `_CALL_ENDS` on `L`, whatever its detail). It changes only the batch's groups (to READY,
  back in the queue of `L`, or dropped and given up) and lane `L`'s calls;
- *a train step ends* (`trained`): it lets go of CONSUMED groups and moves the step on.

Everything the world can do that would break that independence is excluded by the
conditions of `_reducible` and `_state_allows`: a checkpoint that could still start or is in
progress (it reads which groups are pending and READY, or is being written), a crash, an abort or a failing run
(they drop groups, batches included), shutdown without draining, two scoring stages (a
returning first-stage call feeds the next stage's queue), the windowed sampler (a step
trains whichever groups are READY), and demand dispatch without a timer on several
teachers (a call returning can end the demand that another teacher's dispatch relies on).

Invariants are checked on every state the reduced search visits. A violation in a skipped
state is found only if the actions that break invariants are not the ones postponed: the
invariants are conjunctions over groups, lanes and counters, and an action of `T` touches
none of what the postponed actions touch, so it cannot repair what they broke. That is an
argument, not a proof; the tests show it on a sweep (`tests/model/test_reduction.py`): every
verdict of the reduced search equals the full one, and every seeded bug of the checker's
tests is still caught with the reduction on. `explore(..., reduce=False)` and
`groupflow check --no-reduction` search everything.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from groupflow.model.policy import FailurePolicy, Sampler
from groupflow.model.scheduler.actions import Action, ActionKind
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.guards import enabled
from groupflow.model.scheduler.state import Phase, SchedState
from groupflow.model.scheduler.transitions import transition

__all__ = ["ample", "independent_in"]

_K = ActionKind
_RUNNING, _FAIL, _TRAINED = Phase.RUNNING, FailurePolicy.FAIL, _K.TRAINED
"""Read in every state the explorer reduces: bound once (a global reads faster than an enum
member on Python 3.11)."""


@functools.lru_cache(maxsize=256)
def _reducible(b: Bounds) -> bool:
    """Bounds under which the families above are persistent whenever the state allows."""
    return (
        b.stages >= 1
        and b.sampler is Sampler.IN_ORDER
        and b.drain_on_shutdown
        and not (b.demand and not b.flush_timer and b.lanes > 1)
    )


def _state_allows(s: SchedState, b: Bounds) -> bool:
    """Nothing that reads or drops every group can still happen from `s`."""
    return (  # the conditions that fail most often first
        s.cut is None
        and s.writing is None
        and not s.failed
        and s.crashes_left == 0
        and s.aborts_left == 0
        and s.train_failures_left == 0
        and (s.batch_failures_left == 0 or b.failure_policy is not _FAIL)
        and (s.checkpoints_left == 0 or s.phase is not _RUNNING)
    )


def ample(s: SchedState, b: Bounds, actions: Sequence[Action]) -> list[Action] | None:
    """A persistent subset of `actions` (all enabled in `s`) smaller than it, or None to
    expand everything."""
    if len(actions) < 2 or not _reducible(b) or not _state_allows(s, b):
        return None
    last = b.stages - 1
    for lane, batches in enumerate(s.inflight):
        if batches and b.stage_of_lane(lane) == last:
            chosen = [a for a in actions if a.lane == lane and a.kind in _CALL_ENDS]
            if chosen and len(chosen) < len(actions):
                return chosen
            break
    if s.training and not (b.interrupts and s.phase is _RUNNING and s.step + 1 >= b.steps):
        # A step that ends the last step disables a user's interrupt: dependent then.
        chosen = [a for a in actions if a.kind is _TRAINED]
        if chosen and len(chosen) < len(actions):
            return chosen
    return None


_CALL_ENDS = frozenset({_K.SCORED, _K.SCORE_FAIL})


def independent_in(
    s: SchedState,
    b: Bounds,
    chosen: Sequence[Action],
    others: Sequence[Action],
) -> list[str]:
    """Where the local half of independence fails in `s`: for each chosen action `a` and
    each other enabled `c`, both orders must be possible and reach the same state. A
    diagnostic for tests (`explore(..., check_reduction=True)`): necessary for persistence,
    not sufficient, so it catches a family that stops commuting after a model change."""
    out = []
    after = {c: transition(s, b, c) for c in others}
    for a in chosen:
        after_a = transition(s, b, a)
        enabled_after_a = enabled(after_a, b)
        for c, after_c in after.items():
            same_c = _same_move(c, enabled_after_a)
            if same_c is None:
                out.append(f"{a} disables {c}")
            elif a not in enabled(after_c, b):
                out.append(f"{c} disables {a}")
            elif transition(after_a, b, same_c) != transition(after_c, b, a):
                out.append(f"{a} and {c} do not commute")
    return out


def _same_move(c: Action, actions: Sequence[Action]) -> Action | None:
    """`c` among `actions`, or a dispatch from the same lane for another reason (the batch
    does not depend on the reason); None when `c` is no longer possible."""
    if c in actions:
        return c
    if c.kind is _K.DISPATCH:
        return next((x for x in actions if x.kind is _K.DISPATCH and x.lane == c.lane), None)
    return None
