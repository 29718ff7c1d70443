"""The compact encoding the explorer stores: each state with what no future step can read
erased, and what is only ever read as a set put in one order.

Two states that differ only in such data have the same future: the same actions are enabled
in both, each leads to states that again differ only in such data, and every invariant gives
the same verdict on both. Visiting one of them is visiting both (a bisimulation), so the
search stores and expands one representative per class. Traces stay real: a finding is
replayed from the initial state through `apply`, which never sees a canonical state.

What is erased, and why no one reads it again:

- the checkpoint on disk (`saved`) once no crash is left in the budget: only a crash (the
  restore) reads it; and so the content of one being written (`writing`), not that it is;
- the checkpoint budget once the run is shutting down and cannot crash: a checkpoint starts
  only while running, and only a restore runs again;
- the retry count of a READY or CONSUMED group: only a failing call reads it (a permanent
  failure not even that: it never retries), and such a group is never in a call again;
- every fault budget and the checkpoint of a final state: nothing happens after exit.

What is sorted: the prompts to issue again, once the run is shutting down. Only admission
reads their order, and nothing is admitted after shutdown; the exit's ledger recomputes
them from the cursor.
"""

from __future__ import annotations

from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.state import OUTER_FIELDS, Group, Phase, Saved, SchedState
from groupflow.model.states import GroupState

__all__ = ["CANONICAL_FIELDS", "canonical", "canonical_groups", "canonical_without_groups"]

CANONICAL_FIELDS = frozenset({"phase", "reissue", *OUTER_FIELDS})
"""The fields `canonical` reads or changes besides the groups: the rest of a state it keeps,
and what it makes of these depends on these alone, so the explorer computes it once per value
of these fields (`tests/model/test_explorer.py` checks this on reachable states)."""

_DEAD_RETRIES = (GroupState.READY, GroupState.CONSUMED)
_WRITING = Saved(-1, 0, 0, 0, (), ())
"""What a snapshot being written is erased to: it becomes `saved`, which is dead as well."""


def canonical(s: SchedState, b: Bounds) -> SchedState:
    """The representative of `s`'s class: `s` itself when nothing in it is dead. Two erasures
    that read apart (`CANONICAL_FIELDS`, and the groups alone: `canonical_groups`), so that
    the explorer computes each once per value of what it reads."""
    groups = canonical_groups(s.groups, b)
    out = canonical_without_groups(s)
    return out if groups is s.groups else out._replace(groups=groups)


def canonical_groups(groups: tuple[Group, ...], b: Bounds) -> tuple[Group, ...]:
    """The groups without the retry counts no one reads again (`groups` itself when none)."""
    return _without_dead_retries(groups) if b.batch_failures else groups


def canonical_without_groups(s: SchedState) -> SchedState:
    """`canonical` of the fields `CANONICAL_FIELDS` names (`s` itself when nothing changes)."""
    if _is_canonical(s):
        return s
    if s.phase is Phase.DONE:
        return s._replace(
            saved=None,
            reissue=tuple(sorted(s.reissue)),
            crashes_left=0,
            checkpoints_left=0,
            rollout_failures_left=0,
            batch_failures_left=0,
            train_failures_left=0,
            aborts_left=0,
        )
    changes: dict[str, object] = {}
    if s.crashes_left == 0:
        if s.saved is not None:
            changes["saved"] = None
        if s.writing is not None and s.writing is not _WRITING:
            changes["writing"] = _WRITING  # that one is written matters, not what
        if s.phase is not Phase.RUNNING and s.checkpoints_left:
            changes["checkpoints_left"] = 0
    if s.phase is not Phase.RUNNING and len(s.reissue) > 1:
        ordered = tuple(sorted(s.reissue))
        if ordered != s.reissue:
            changes["reissue"] = ordered
    return s._replace(**changes) if changes else s  # type: ignore[arg-type]


def _is_canonical(s: SchedState) -> bool:
    """Nothing in the fields `CANONICAL_FIELDS` names to erase or sort: the explorer asks for
    most states it meets, and most are (the same conditions as `canonical_without_groups`', without
    building a change)."""
    running = s.phase is Phase.RUNNING
    if not running:
        if s.phase is Phase.DONE or (len(s.reissue) > 1 and list(s.reissue) != sorted(s.reissue)):
            return False
    if s.crashes_left == 0:
        if s.saved is not None or (s.writing is not None and s.writing is not _WRITING):
            return False
        if not running and s.checkpoints_left:
            return False
    return True


def _has_dead_retries(groups: tuple[Group, ...]) -> bool:
    for g in groups:
        if g.retries and g.state in _DEAD_RETRIES:
            return True
    return False


def _without_dead_retries(groups: tuple[Group, ...]) -> tuple[Group, ...]:
    if not _has_dead_retries(groups):
        return groups
    return tuple(g._replace(retries=0) if g.state in _DEAD_RETRIES else g for g in groups)
