"""The abstract scheduler's state: what one instant of a run holds (`SchedState`, its groups,
the checkpoint on disk), the initial state, and the queries over a state that the transitions,
the checks and the words share. Tuples and ints only: hashable and cheap to compare, since the
explorer stores hundreds of thousands of them."""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterator
from typing import Any, NamedTuple

from groupflow.model.errors import NotEnabled
from groupflow.model.policy import CheckpointPolicy
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.states import GroupState

__all__ = [
    "BUDGET_FIELDS",
    "OUTER_FIELDS",
    "Cut",
    "Group",
    "NotEnabled",
    "Phase",
    "Saved",
    "SchedState",
    "group_of",
    "initial_state",
    "next_prompt",
    "producer_ended",
]

_S = GroupState
UNREADY = (_S.RESERVED, _S.WRITTEN, _S.SCORING)
PENDING = (_S.WRITTEN, _S.SCORING)
_RESERVED = _S.RESERVED  # bound once: a global reads faster than an enum member on 3.11


class Phase(enum.IntEnum):
    RUNNING = 0
    SHUTDOWN = 1
    """No new prompts; rollouts are cancelled or finish; stages drain (or, after a failure,
    everything unready is dropped)."""
    DONE = 2
    """Exited: final."""


class Group(NamedTuple):
    ordinal: int
    state: GroupState
    permit: bool
    """The rollout task still holds its generation permit."""
    retries: int = 0
    stage: int = 0
    """Stages this group has been scored by."""
    again: bool = False
    """Queued again after a failed call: it goes alone, at once."""
    version: int = 0
    """The weight version its rollout started from (tracked for the windowed sampler only)."""


class Saved(NamedTuple):
    """What a checkpoint holds: the train position and the ledger of prompt ordinals."""

    step: int
    cursor: int
    trained: int
    """Bit set of ordinals trained by the saved weights."""
    shortfall: int
    """Bit set of ordinals given up on (failed for good), accounted rather than trained."""
    ready: tuple[int, ...]
    """Ordinals saved as READY groups, with their rows."""
    reissue: tuple[int, ...]
    """Ordinals issued before the save that must be issued again on resume."""
    versions: tuple[int, ...] = ()
    """The weight versions of the `ready` groups (windowed sampler only)."""


class Cut(NamedTuple):
    """A checkpoint in progress: its policy and, for `flush`, the groups it waits for."""

    policy: CheckpointPolicy
    ordinals: tuple[int, ...]


class SchedState(NamedTuple):
    """The scheduler at one instant. Tuples and ints only: hashable and cheap to compare. The
    outer part (`OUTER_FIELDS`) comes last, so that a state is its core then its outer part."""

    phase: Phase
    step: int
    cursor: int
    """The next fresh ordinal the data source hands out."""
    reissue: tuple[int, ...]
    """Ordinals to issue again (after a restore) before fresh ones."""
    groups: tuple[Group, ...]
    """Groups the buffer holds, by ordinal."""
    pending: tuple[tuple[int, ...], ...]
    """Per lane: ordinals queued for a call, in arrival order."""
    inflight: tuple[tuple[tuple[int, ...], ...], ...]
    """Per lane: the batches whose call is in flight."""
    free_permits: int
    rows: int
    """Bit set of ordinals whose rows are in the store."""
    trained: int
    """Bit set of ordinals trained in the weights the run now has."""
    trained_twice: int
    """Ghost: ordinals a train step consumed although already trained. Must stay 0."""
    shortfall: int
    cut: Cut | None
    """While a checkpoint is in progress."""
    failed: bool
    """The run failed and is shutting down: nothing is scored or trained any more."""
    training: bool
    """A train step is running: its groups are CONSUMED, not yet trained."""
    stopped: bool
    """The run shut down because training was done (not interrupted, not failed)."""
    saved: Saved | None
    """The newest checkpoint on disk: what a crash restarts from."""
    writing: Saved | None
    """A checkpoint's snapshot being written (between `checkpoint_saved` and
    `checkpoint_written`): nothing else of the train pump's happens meanwhile."""
    crashes_left: int
    checkpoints_left: int
    rollout_failures_left: int
    batch_failures_left: int
    train_failures_left: int
    aborts_left: int


def _fast_replace(cls: type[tuple[Any, ...]]) -> None:
    """Give a NamedTuple a `_replace` without the generic one's dict and map: the explorer
    replaces fields of states and groups millions of times."""
    fields: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
    index = {name: i for i, name in enumerate(fields)}
    new = tuple.__new__

    def _replace(self: tuple[Any, ...], **changes: Any) -> tuple[Any, ...]:
        values = list(self)
        for name, value in changes.items():
            i = index.get(name)
            if i is None:
                raise ValueError(f"{cls.__name__} has no field {name!r}")
            values[i] = value
        return new(cls, values)

    cls._replace = _replace  # type: ignore[attr-defined]


_fast_replace(Group)
_fast_replace(SchedState)


BUDGET_FIELDS = (
    "crashes_left",
    "checkpoints_left",
    "rollout_failures_left",
    "batch_failures_left",
    "train_failures_left",
    "aborts_left",
)
"""The explorer's fault budgets: bounds of the search, not state of the system."""

OUTER_FIELDS = ("saved", "writing", *BUDGET_FIELDS)
"""The checkpoints (on disk, and being written) and the fault budgets: the *outer* part of a
state, its other fields the *core*. A search meets few outer parts and few cores, each in many
states, so the explorer numbers each once and computes what depends on one part alone (the
actions of a core, their effect on it, its invariants) once for all the states that share it."""

_FIELDS: tuple[str, ...] = SchedState._fields
_OUTER_AT = len(_FIELDS) - len(OUTER_FIELDS)
assert _FIELDS[_OUTER_AT:] == OUTER_FIELDS  # last, so that a state is its core then its outer part
CORE_AT = tuple(range(_OUTER_AT))
"""Where the core's fields sit in a `SchedState`, in field order."""
_core_of = operator.itemgetter(slice(None, _OUTER_AT))
_outer_of = operator.itemgetter(slice(_OUTER_AT, None))
_new_state = tuple.__new__


def core_of(s: SchedState) -> tuple[Any, ...]:
    """Every field of `s` but the outer ones, in field order."""
    return _core_of(s)  # type: ignore[no-any-return]


def outer_of(s: SchedState) -> tuple[Any, ...]:
    """The fields of `OUTER_FIELDS`, in that order."""
    return _outer_of(s)  # type: ignore[no-any-return]


def join(core: tuple[Any, ...], outer: tuple[Any, ...]) -> SchedState:
    """The state with this core and this outer part (`core_of` and `outer_of` undone)."""
    return _new_state(SchedState, core + outer)


OUTER_WRITING = 1
"""The bit of `outer_mask` that says a checkpoint is being written; bit `i + 1` says the budget
`BUDGET_FIELDS[i]` is not spent."""


def outer_mask(outer: tuple[Any, ...]) -> int:
    """What `enabled`, `ample` and `check_state` read of an outer part: whether a checkpoint
    is being written and which budgets are left (never how much, nor what a checkpoint holds)."""
    mask = OUTER_WRITING if outer[1] is not None else 0
    for i, left in enumerate(outer[2:]):
        if left:
            mask |= 2 << i
    return mask


def initial_state(b: Bounds) -> SchedState:
    return SchedState(
        phase=Phase.RUNNING,
        step=0,
        cursor=0,
        reissue=(),
        groups=(),
        pending=((),) * b.lanes,
        inflight=((),) * b.lanes,
        free_permits=b.shape.max_inflight_prompts,
        rows=0,
        trained=0,
        trained_twice=0,
        shortfall=0,
        saved=None,
        cut=None,
        writing=None,
        failed=False,
        training=False,
        stopped=False,
        crashes_left=b.crashes,
        checkpoints_left=b.checkpoints,
        rollout_failures_left=b.rollout_failures,
        batch_failures_left=b.batch_failures,
        train_failures_left=b.train_failures,
        aborts_left=b.aborts,
    )


def _bit(ordinal: int) -> int:
    return 1 << ordinal


def _ordinals(bits: int) -> Iterator[int]:
    o = 0
    while bits:
        if bits & 1:
            yield o
        bits >>= 1
        o += 1


class _Bits:
    """A bit set seen as a container of ordinals (for the shared decision functions)."""

    __slots__ = ("bits",)

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def __contains__(self, ordinal: object) -> bool:
        return isinstance(ordinal, int) and bool(self.bits >> ordinal & 1)


_NAMES = tuple(f"prompt {o}" for o in range(256))


def _name(ordinal: int) -> str:
    return _NAMES[ordinal] if ordinal < len(_NAMES) else f"prompt {ordinal}"


def group_of(s: SchedState, ordinal: int) -> Group | None:
    for g in s.groups:
        if g.ordinal == ordinal:
            return g
    return None


def next_prompt(s: SchedState, b: Bounds) -> int | None:
    """The ordinal the data source hands out next, if any."""
    if s.reissue:
        return s.reissue[0]
    if s.cursor < b.prompts:
        return s.cursor
    return None


def producer_ended(s: SchedState, b: Bounds) -> bool:
    """No prompt left to issue and no rollout in flight: downstream may drain."""
    return next_prompt(s, b) is None and not any(g.state is _RESERVED for g in s.groups)
