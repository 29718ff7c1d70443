"""Breadth-first exploration of every reachable state of the abstract scheduler.

Safety: every state is checked with `check_state`, and a non-final state where nothing but the
world's own events (a crash, a user interrupt) can happen is a deadlock. Liveness: from every
reachable state the run must be able to finish on its own, so after the search a backward pass
over the internal transitions finds the states that cannot reach a final one. Because the search
is breadth-first, the first trace found to each violation is a shortest one.

Pure: no I/O. Progress is reported through a callback the caller owns.
"""

from __future__ import annotations

import contextlib
import gc
import random
import struct
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Final, NamedTuple

import attrs

from groupflow.model.invariants import Violation
from groupflow.model.lifecycle import IllegalTransition
from groupflow.model.policy import DispatchReason
from groupflow.model.scheduler.actions import (
    EXTERNAL_KINDS,
    NOT_PROGRESS_KINDS,
    Action,
    ActionKind,
)
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.canonical import (
    CANONICAL_FIELDS,
    canonical_groups,
    canonical_without_groups,
)
from groupflow.model.scheduler.checks import BY_FIELDS, Check, check_rest, check_state
from groupflow.model.scheduler.guards import BUDGET_OF, enabled
from groupflow.model.scheduler.reduction import ample, independent_in
from groupflow.model.scheduler.state import (
    BUDGET_FIELDS,
    CORE_AT,
    OUTER_FIELDS,
    OUTER_WRITING,
    NotEnabled,
    Phase,
    SchedState,
    core_of,
    initial_state,
    join,
    outer_mask,
    outer_of,
)
from groupflow.model.scheduler.transitions import (
    SNAPSHOT_READS,
    SPENDS,
    TOUCHES,
    Footprint,
    apply,
    footprint,
    ready_groups,
    transition,
)
from groupflow.model.scheduler.words import describe, summarize

Progress = Callable[[int, int, int, float], None]
"""Called now and then with (states, transitions, frontier size, seconds so far)."""


@attrs.frozen
class Finding:
    """One violated property, with a shortest trace from the initial state to a witness."""

    kind: str
    """The invariant's name, or "deadlock" or "stuck"."""
    message: str
    trace: tuple[Action, ...]
    refused: Action | None = None
    """For an illegal transition: the action, enabled after the trace, that broke the table."""

    def replay(self, bounds: Bounds) -> list[SchedState]:
        """The states along the trace, recomputed through the model (`apply` checks each step)."""
        states = [initial_state(bounds)]
        for action in self.trace:
            states.append(apply(states[-1], bounds, action))
        return states

    def confirm(self, bounds: Bounds) -> str | None:
        """None when the trace is a real run of the model (each step enabled, replayed
        through `apply`) whose last state shows the violation; else what is wrong with it."""
        try:
            last = self.replay(bounds)[-1]
        except NotEnabled as exc:
            return f"the trace does not replay: {exc}"
        if self.kind == "illegal_transition":
            if self.refused is None:
                return "an illegal transition without the refused action"
            try:
                transition(last, bounds, self.refused)
            except IllegalTransition:
                return None
            return f"{describe(self.refused, bounds)} is not refused after the trace"
        if self.kind == "deadlock":
            return None if is_deadlocked(last, bounds) else "the last state is not deadlocked"
        if self.kind == "stuck":
            return None if not is_deadlocked(last, bounds) else "the last state is a deadlock"
        if self.kind == "reduction":
            return None
        if self.kind in {v.invariant for v in check_state(last, bounds)}:
            return None
        return f"the last state does not break {self.kind}"

    def to_json(self, bounds: Bounds) -> dict[str, object]:
        states = self.replay(bounds)
        return {
            "kind": self.kind,
            "message": self.message,
            "trace": [
                {**a.to_json(), "says": describe(a, bounds), "state": summarize(s, bounds)}
                for a, s in zip(self.trace, states[1:], strict=True)
            ],
            "refused": None if self.refused is None else self.refused.to_json(),
        }

    def explain(self, bounds: Bounds) -> str:
        """The trace step by step, in words."""
        states = self.replay(bounds)
        lines = [
            f"{self.kind}: {self.message}",
            "   (pN:STATE is prompt N's group; * it holds a generation permit; r it was retried)",
            f"   0. start: {summarize(states[0], bounds)}",
        ]
        for i, (action, state) in enumerate(zip(self.trace, states[1:], strict=True), 1):
            lines.append(f"  {i:>2}. {describe(action, bounds)}")
            lines.append(f"      -> {summarize(state, bounds)}")
        if self.refused is not None:
            lines.append(f"  {len(self.trace) + 1:>2}. {describe(self.refused, bounds)}: refused")
        return "\n".join(lines)


@attrs.frozen
class Report:
    bounds: Bounds
    states: int
    transitions: int
    final_states: int
    seconds: float
    findings: tuple[Finding, ...]
    complete: bool
    """False when the search stopped at `max_states` before visiting everything."""
    reduced: int = 0
    """States expanded through a persistent subset of their actions (0: no reduction)."""
    dispatched: frozenset[DispatchReason] = frozenset()
    """Every reason a batch was sent for in the transitions taken: coverage, so that a model
    that never takes a path (the flush timer under demand dispatch) shows, although taking it
    would break nothing."""

    @property
    def ok(self) -> bool:
        return self.complete and not self.findings

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float("inf")


def _internal(action: Action) -> bool:
    return action.kind not in EXTERNAL_KINDS


_SHIFT = 32
"""A state's key: the number of its core, shifted by this, then the number of its outer part."""
_LOW = (1 << _SHIFT) - 1
_BUDGET_AT = {name: OUTER_FIELDS.index(name) for name in BUDGET_FIELDS}
_WRITING_AT = OUTER_FIELDS.index("writing")
_CORE_FIELDS = tuple(SchedState._fields[i] for i in CORE_AT)
_CORE_WIDTH = len(_CORE_FIELDS)


_WIDTH = 32
"""Bits per field in a packed core: a field's number `j` sits at bit `j * _WIDTH`."""
_FIELD = (1 << _WIDTH) - 1
_BEYOND = _CORE_WIDTH * _WIDTH
"""The first bit above a packed core's fields, where a memo key may add a number of its own."""
_BYTES = _BEYOND // 8
_unpack = struct.Struct(f"<{_CORE_WIDTH}I").unpack
"""A packed core's bytes (little-endian) -> the numbers of its fields."""


class _Parts:
    """The cores and outer parts of the states met so far (`state.OUTER_FIELDS`), each
    numbered once, so that a state is an int key and a core's facts are computed once. A core
    is stored packed: the numbers of its fields' values in one int, `_WIDTH` bits each, so that
    it hashes as one int however many groups and queues it holds, and a handler's effect on it
    is a mask and an or."""

    def __init__(self) -> None:
        self.values: list[list[object]] = [[] for _ in range(_CORE_WIDTH + 1)]
        """Per core field: each value met, by its number; last (`_SNAPSHOTS`), each snapshot a
        `SNAPSHOT` action wrote."""
        self.value_ids: list[dict[object, int]] = [{} for _ in range(_CORE_WIDTH + 1)]
        self.cores: list[int] = []
        """Per core: the numbers of its fields' values, in `core_of` order, packed."""
        self.core_values: list[tuple[object, ...] | None] = []
        """Per core: its fields' values (`core_of`), looked up once when first read
        (`values_of`): many cores are met only on the way to their canonical one."""
        self.core_ids: dict[int, int] = {}
        self.outers: list[tuple[object, ...]] = []
        self.outer_ids: dict[tuple[object, ...], int] = {}
        self.masks: list[int] = []
        """Per outer part: `outer_mask`, what the guards read of it."""

    def value_id(self, field: int, value: object) -> int:
        """The number of `value` in core field `field` (`core_of` order)."""
        ids = self.value_ids[field]
        vid = ids.get(value)
        if vid is None:
            vid = ids[value] = len(ids)
            if vid > _FIELD:
                raise OverflowError(f"more than {_FIELD} values of core field {field}")
            self.values[field].append(value)
        return vid

    def core_id(self, fields: int) -> int:
        """The number of the core packed as `fields`."""
        cid = self.core_ids.get(fields)
        if cid is None:
            cid = self.core_ids[fields] = len(self.cores)
            self.cores.append(fields)
            self.core_values.append(None)
        return cid

    def values_of(self, cid: int) -> tuple[object, ...]:
        """The values of the fields of core `cid` (`core_of`)."""
        values = self.core_values[cid]
        if values is None:
            ids = _unpack(self.cores[cid].to_bytes(_BYTES, "little"))
            values = self.core_values[cid] = tuple(map(list.__getitem__, self.values, ids))
        return values

    def outer_id(self, outer: tuple[object, ...]) -> int:
        oid = self.outer_ids.get(outer)
        if oid is None:
            oid = self.outer_ids[outer] = len(self.outers)
            self.outers.append(outer)
            self.masks.append(outer_mask(outer))
        return oid

    def field_ids(self, at: Sequence[int], core: tuple[object, ...]) -> int:
        """The numbers of the values of `core` (`core_of`) in the core fields `at`, packed."""
        packed = 0
        for j in at:
            packed |= self.value_id(j, core[j]) << j * _WIDTH
        return packed

    def key(self, s: SchedState) -> int:
        core_id = self.core_id(self.field_ids(_ALL_CORE, core_of(s)))
        return core_id << _SHIFT | self.outer_id(outer_of(s))

    def state(self, key: int) -> SchedState:
        return join(self.values_of(key >> _SHIFT), self.outers[key & _LOW])


_ALL_CORE = range(_CORE_WIDTH)
_SNAPSHOTS = _CORE_WIDTH
"""Where `_Parts` numbers the snapshots `SNAPSHOT` actions write, after the core fields."""


# The search's own records are plain tuples, unpacked where they are read: building an instance
# of a tuple subclass (a NamedTuple) costs several times a plain tuple, and the search builds
# one per action of every core and one per state.

_Move = tuple[Action, int, Footprint, int, str | None, int, int, bool, bool]
"""One action enabled in the states of a core, with what is known of its result there:
(action, its number in this search, its footprint, core, refusal, change, gate, internal,
progresses). `core`: the successor's core shifted into a key for a `LOCAL`, `SPEND` or
`SNAPSHOT` action, -1 otherwise or when refused. `refusal`: the `IllegalTransition` message,
for an action refused in every such state. `change`: what it changes of the outer part
(`SPEND`, where it spends in `OUTER_FIELDS`; `SNAPSHOT`, the number of the snapshot it
writes; -1 otherwise). `gate`: the bit of `outer_mask` it needs (its budget, `BUDGET_OF`), 0
for none."""
_ACTION: Final = 0
_REFUSAL: Final = 4
_GATE: Final = 6
"""Where `_Move` holds what `_Expander.expansion` reads of it."""

_Core = tuple[
    tuple[Violation, ...], bool, tuple[_Move, ...], int, bool, list[Action], SchedState | None, int
]
"""What the states with one core (and whether a checkpoint is being written) share: (their
violations, done, every move enabled with every budget left, gates, dispatches, actions,
state, mask). `gates`: every move's gate, so that a mask holding them all keeps every move.
`dispatches`: a dispatch is among the moves (`Report.dispatched`). `actions`: the moves'
actions. `state` and `mask`: the state they were computed in and its `outer_mask`: `ample`
reads no more of the outer part than the mask, so it may read this state wherever the mask is
the same."""

_Expansion = tuple[
    tuple[Violation, ...], bool, bool, tuple[_Move, ...], list[Action], list[Action] | None
]
"""What the states with one core and one outer mask share: (violations, done, reduced, the
moves the search takes, the actions enabled, the persistent subset `ample` chose or None).
`reduced`: `ample` found a persistent subset."""


_GATES = {kind: 2 << BUDGET_FIELDS.index(name) for kind, name in BUDGET_OF.items()}
_KIND_FACTS = {
    kind: (
        footprint(Action(kind)),
        _GATES.get(kind, 0),
        _BUDGET_AT[SPENDS[kind]] if kind in SPENDS else -1,
        kind not in EXTERNAL_KINDS,
        kind not in NOT_PROGRESS_KINDS,
    )
    for kind in ActionKind
}
"""What `_Move` records of each kind of action, whatever its ordinal, lane or detail."""
_DISPATCH = ActionKind.DISPATCH
_DONE = Phase.DONE  # bound once: a global reads faster than an enum member on Python 3.11


def _core_fields(names: Collection[str]) -> tuple[int, ...]:
    """Where the core fields among `names` sit in a core (`core_of` order)."""
    return tuple(j for j, name in enumerate(_CORE_FIELDS) if name in names)


class _Rewrite(NamedTuple):
    """How a function that reads and writes some core fields (and maybe the outer part)
    acts on a packed core (`_Parts.cores`): a core's `& mask` is what it reads, and its
    `& keep` or'd with the fields after is the new core."""

    at: tuple[int, ...]
    """The core fields it reads or writes."""
    mask: int
    """The bits of the fields `at`."""
    keep: int
    """The bits of the other fields."""


def _rewrite(names: Collection[str]) -> _Rewrite:
    at = _core_fields(names)
    mask = 0
    for j in at:
        mask |= _FIELD << j * _WIDTH
    return _Rewrite(at, mask, ~mask)


_TOUCHED = {kind: _rewrite(names) for kind, names in TOUCHES.items()}
"""Per kind: how its handler acts on a core, by the fields `TOUCHES` names."""
_CANONICAL = _rewrite(CANONICAL_FIELDS)
"""How `canonical` acts on a core, besides the groups (`CANONICAL_FIELDS`)."""
_NO_REWRITE = _rewrite(())
"""For an action whose handler the explorer calls on whole states."""
_SNAPSHOT_READ = _rewrite(SNAPSHOT_READS)
"""How a `SNAPSHOT` handler reads a core, besides `ready_groups` (`SNAPSHOT_READS`)."""
_GROUPS = _CORE_FIELDS.index("groups")
_GROUPS_BIT = _GROUPS * _WIDTH
_NOT_GROUPS = ~(_FIELD << _GROUPS_BIT)
_CUT = _CORE_FIELDS.index("cut")
_CUT_BIT = _CUT * _WIDTH
_NOT_CUT = ~(_FIELD << _CUT_BIT)
_SAME: tuple[()] = ()
"""A memo's value for a state `canonical` leaves as it is."""


class _Kind(NamedTuple):
    """What the explorer knows of one action whatever the state: its number, how its handler
    reads the state, what it spends and gates, and the memo of its results."""

    action: Action
    aid: int
    how: Footprint
    budget: int
    gate: int
    internal: bool
    progresses: bool
    local: bool
    """`LOCAL` or `SPEND`: its result in a core is computed once per value of `rewrite.mask`."""
    dispatch: bool
    rewrite: _Rewrite
    """How its handler acts on a core (`LOCAL`, `SPEND`, `SNAPSHOT`, `WHOLE`; no fields
    otherwise)."""
    memo: dict[Any, Any]
    """`LOCAL`, `SPEND`: the numbers of the core fields it touches before -> after, or the
    refusal (with the budgets of `every_budget`). `SNAPSHOT`: the numbers of the fields it
    reads (`SNAPSHOT_READS`, then `ready_groups`) -> those of the cut after and of the snapshot
    written, or the refusal. `WHOLE`: (those numbers, the outer part) before -> (after, the
    outer part after), or the refusal."""


class _Expander:
    """The facts of a state computed once and reused in every state that shares what they
    read: `check_state` reads of the outer part only whether a checkpoint is being written,
    `enabled` also which budgets are left, each for the kinds it gates (`BUDGET_OF`), `ample`
    no more than `outer_mask`, each action's handler what `TOUCHES` and its `Footprint` say,
    and `canonical` what `CANONICAL_FIELDS` says. The memos are keyed by field numbers
    (`_Parts`), so a lookup hashes a few small ints."""

    def __init__(self, bounds: Bounds, parts: _Parts, *, reduce: bool) -> None:
        self.bounds = bounds
        self.parts = parts
        self.reduce = reduce
        self.cores: dict[int, _Core] = {}
        initial = outer_of(initial_state(bounds))
        self.every_budget = tuple(min(left, 1) for left in initial[2:])
        """One unit of each budget the bounds give: every action a budget gates is listed."""
        self.every_mask = outer_mask((None, None, *self.every_budget))
        """`outer_mask` of `every_budget`, no checkpoint being written."""
        self.kinds: dict[Action, _Kind] = {}
        self.canonical: dict[int, tuple[int, int] | tuple[()]] = {}
        """The numbers of `CANONICAL_FIELDS` in the core, with the outer part's above them
        (`_BEYOND`) -> after, or `_SAME`."""
        self.groups: dict[int, int] = {}
        """The number of a groups value -> that of its `canonical_groups`."""
        self.ready: dict[int, int] = {}
        """The number of a groups value -> that of its `ready_groups` (`ready_ids`)."""
        self.ready_ids: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        self.checks: list[tuple[int, dict[int, tuple[Violation, ...]], Check]] = [
            (_rewrite(names).mask, {}, check) for names, check in BY_FIELDS
        ]
        """Per check of `BY_FIELDS`: the bits of its fields, and its memo."""
        self.spent: dict[int, int] = {}
        self.written: dict[int, int] = {}
        """(An outer part, a snapshot) -> the outer part with that snapshot being written."""
        self.by_outer: dict[int, tuple[int, str | None]] = {}
        self.dispatched: set[str] = set()

    def expansion(self, cid: int, oid: int) -> _Expansion:
        """The moves from the states with core `cid` and the mask of outer part `oid`."""
        parts = self.parts
        mask = parts.masks[oid]
        core_key = cid << 1 | mask & OUTER_WRITING
        core = self.cores.get(core_key)
        if core is None:
            values = parts.values_of(cid)
            core = self.cores[core_key] = self._core(cid, values, parts.outers[oid])
        violations, done, moves, gates, dispatches, actions, state, state_mask = core
        if done:
            return violations, True, False, (), [], None
        if gates & mask != gates:
            moves = tuple([m for m in moves if m[_GATE] & mask == m[_GATE]])
            actions = [m[_ACTION] for m in moves]
        chosen = None
        if self.reduce and len(actions) > 1:
            if mask != state_mask or state is None:
                state = join(parts.values_of(cid), parts.outers[oid])
            chosen = ample(state, self.bounds, actions)
        if chosen is not None and any(a.kind not in NOT_PROGRESS_KINDS for a in chosen):
            moves = tuple([m for m in moves if m[_ACTION] in chosen])
        if dispatches:
            for m in moves:
                if m[_ACTION].kind is _DISPATCH and m[_REFUSAL] is None:
                    self.dispatched.add(m[_ACTION].detail)
        return violations, False, chosen is not None, moves, actions, chosen

    def _core(self, cid: int, values: tuple[object, ...], outer: tuple[object, ...]) -> _Core:
        """Every action enabled in the states with this core and whether a checkpoint is being
        written, computed in one with every budget left (`BUDGET_OF`); for a `LOCAL`, `SPEND`
        or `SNAPSHOT` one, the successor's core (and the snapshot `SNAPSHOT` writes)."""
        b = self.bounds
        state = join(values, outer[:2] + self.every_budget)
        fields = self.parts.cores[cid]
        violations: tuple[Violation, ...] = ()
        for bits, found_in, check in self.checks:
            found = found_in.get(fields & bits)
            if found is None:
                found = found_in[fields & bits] = check(state, b)
            violations += found
        violations += check_rest(state, b)
        if state.phase is _DONE:
            return violations, True, (), 0, False, [], None, 0
        core_id = self.parts.core_id
        kinds = self.kinds
        moves: list[_Move] = []
        actions = enabled(state, b)
        gates = 0
        dispatches = False
        for a in actions:
            kind = kinds.get(a)
            if kind is None:
                kind = self._kind(a)
            _, aid, how, change, gate, internal, progresses, local, dispatch, rewrite, memo = kind
            gates |= gate
            if dispatch:
                dispatches = True
            after = -1
            refusal: str | None = None
            if local:
                at, mask, keep = rewrite
                before = fields & mask
                known: int | str | None = memo.get(before)
                if known is None:
                    known = memo[before] = self._touched_after(state, a, at)
                if isinstance(known, str):
                    refusal = known
                else:
                    after = fields & keep | known
            elif how is _SNAPSHOT:
                groups = fields >> _GROUPS_BIT & _FIELD
                ready = self.ready.get(groups)
                if ready is None:
                    ready = self._ready(groups)
                seen = fields & rewrite.mask | ready << _BEYOND
                taken: tuple[int, int] | str | None = memo.get(seen)
                if taken is None:
                    taken = memo[seen] = self._snapshot(state, a)
                if isinstance(taken, str):
                    refusal = taken
                else:
                    cut, change = taken
                    after = fields & _NOT_CUT | cut
            core = -1 if after < 0 else core_id(after) << _SHIFT  # a packed core is never < 0
            moves.append((a, aid, how, core, refusal, change, gate, internal, progresses))
        state_mask = self.every_mask | OUTER_WRITING if outer[1] is not None else self.every_mask
        return violations, False, tuple(moves), gates, dispatches, actions, state, state_mask

    def _kind(self, a: Action) -> _Kind:
        how, gate, budget, internal, progresses = _KIND_FACTS[a.kind]
        if how is Footprint.OUTER or how is Footprint.WHOLE:
            how = footprint(a)  # the detail may matter
        rewrite = (
            _SNAPSHOT_READ
            if how is _SNAPSHOT
            else _TOUCHED[a.kind]
            if how in _REWRITTEN
            else _NO_REWRITE
        )
        local = how is _LOCAL or how is _SPEND
        aid = len(self.kinds)
        dispatch = a.kind is _DISPATCH
        kind = _Kind(a, aid, how, budget, gate, internal, progresses, local, dispatch, rewrite, {})
        self.kinds[a] = kind
        return kind

    def _touched_after(self, state: SchedState, a: Action, at: tuple[int, ...]) -> int | str:
        """The numbers of the core fields `at` after `a` in `state`, packed, or the message
        of the `IllegalTransition` it raises."""
        try:
            after = transition(state, self.bounds, a)
        except IllegalTransition as exc:
            return str(exc)
        return self.parts.field_ids(at, core_of(after))

    def _snapshot(self, state: SchedState, a: Action) -> tuple[int, int] | str:
        """For a `SNAPSHOT` action: the number of the cut after it in `state` (packed) and of
        the snapshot it writes, or the message of the `IllegalTransition` it raises."""
        try:
            after = transition(state, self.bounds, a)
        except IllegalTransition as exc:
            return str(exc)
        parts = self.parts
        cut = parts.value_id(_CUT, after.cut) << _CUT_BIT
        return cut, parts.value_id(_SNAPSHOTS, after.writing)

    def _ready(self, groups: int) -> int:
        """The number of `ready_groups` of the groups value numbered `groups`."""
        view = ready_groups(self.parts.values[_GROUPS][groups], self.bounds)  # type: ignore[arg-type]
        ready = self.ready[groups] = self.ready_ids.setdefault(view, len(self.ready_ids))
        return ready

    def spend(self, oid: int, budget: int) -> int:
        """The outer part `oid` with one unit of its budget at `budget` spent."""
        key = oid << 3 | budget
        spent = self.spent.get(key)
        if spent is None:
            outer = list(self.parts.outers[oid])
            outer[budget] -= 1  # type: ignore[operator]
            spent = self.spent[key] = self.parts.outer_id(tuple(outer))
        return spent

    def write(self, oid: int, snapshot: int) -> int:
        """The outer part `oid` with the snapshot numbered `snapshot` being written."""
        key = oid << _SHIFT | snapshot
        written = self.written.get(key)
        if written is None:
            outer = list(self.parts.outers[oid])
            outer[_WRITING_AT] = self.parts.values[_SNAPSHOTS][snapshot]
            written = self.written[key] = self.parts.outer_id(tuple(outer))
        return written

    def after(self, key: int, a: Action, aid: int, how: Footprint) -> tuple[int, str | None]:
        """The key of the state after `a` (numbered `aid`) in the state `key`, for an
        `OUTER`, `RESTART` or `WHOLE` action; or -1 and the message of the
        `IllegalTransition` it raises."""
        if how is Footprint.WHOLE:
            return self._whole_after(key, self.kinds[a])
        memo = aid << _SHIFT | key & _LOW
        known = self.by_outer.get(memo)
        if known is None:
            after, refusal = known = self._key_after(key, a)
            if how is Footprint.OUTER and refusal is None:
                known = after & _LOW, None  # the core is kept: remember the outer part
            self.by_outer[memo] = known
        result, refusal = known
        if how is Footprint.OUTER and refusal is None:
            return key & ~_LOW | result, None
        return known

    def _key_after(self, key: int, a: Action) -> tuple[int, str | None]:
        try:
            after = transition(self.parts.state(key), self.bounds, a)
        except IllegalTransition as exc:
            return -1, str(exc)
        return self.parts.key(after), None

    def _whole_after(self, key: int, kind: _Kind) -> tuple[int, str | None]:
        """As `after`, for a `WHOLE` action: computed once per value of the core fields it
        touches (`TOUCHES`) and of the outer part."""
        fields = self.parts.cores[key >> _SHIFT]
        memo = fields & kind.rewrite.mask, key & _LOW
        known = kind.memo.get(memo)
        if known is None:
            try:
                after = transition(self.parts.state(key), self.bounds, kind.action)
            except IllegalTransition as exc:
                known = str(exc)
            else:
                at = self.parts.field_ids(kind.rewrite.at, core_of(after))
                known = at, self.parts.outer_id(outer_of(after))
            kind.memo[memo] = known
        if isinstance(known, str):
            return -1, known
        core = self.parts.core_id(fields & kind.rewrite.keep | known[0])
        return core << _SHIFT | known[1], None

    def canonical_key(self, key: int) -> int:
        """The key of `canonical` of the state `key`: computed once per value of the fields
        it reads (`CANONICAL_FIELDS`), and of the groups (`canonical_groups`)."""
        parts = self.parts
        at, mask, keep = _CANONICAL
        fields = parts.cores[key >> _SHIFT]
        oid = key & _LOW
        memo = fields & mask | oid << _BEYOND
        known = self.canonical.get(memo)
        if known is None:
            state = parts.state(key)
            canon = canonical_without_groups(state)
            known = (
                _SAME
                if canon is state
                else (parts.field_ids(at, core_of(canon)), parts.outer_id(outer_of(canon)))
            )
            self.canonical[memo] = known
        after = fields
        if known:
            after = fields & keep | known[0]
            oid = known[1]
        if self.bounds.batch_failures:
            groups = after >> _GROUPS_BIT & _FIELD
            erased = self.groups.get(groups)
            if erased is None:
                value: Any = parts.values[_GROUPS][groups]
                erased = parts.value_id(_GROUPS, canonical_groups(value, self.bounds))
                self.groups[groups] = erased
            if erased != groups:
                after = after & _NOT_GROUPS | erased << _GROUPS_BIT
        if after == fields and oid == key & _LOW:
            return key
        return parts.core_id(after) << _SHIFT | oid


_LOCAL, _SPEND, _SNAPSHOT = Footprint.LOCAL, Footprint.SPEND, Footprint.SNAPSHOT
_REWRITTEN = (Footprint.LOCAL, Footprint.SPEND, Footprint.SNAPSHOT, Footprint.WHOLE)
"""The footprints whose handler the explorer computes once per value of `TOUCHES`."""


def explore(
    bounds: Bounds,
    *,
    max_states: int | None = None,
    progress: Progress | None = None,
    progress_every: int = 20_000,
    reduce: bool = True,
    check_reduction: bool = False,
) -> Report:
    """Visit every state reachable from the initial one and check every property on each.

    With `reduce` (the default), the search stores one state per class of states with the
    same future (`groupflow.model.scheduler.canonical`), and a state whose actions include a persistent
    subset (`groupflow.model.scheduler.reduction`) is expanded through that subset only: fewer states,
    the same verdicts. `check_reduction` also tests, in every reduced state, that the chosen
    actions commute with each of the others (slow; for tests).

    A state is stored as the numbers of its core and its outer part (`_Parts`), and what
    depends on the core alone is computed once per core (`_Expander`)."""
    with _collector_paused():
        return _explore(bounds, max_states, progress, progress_every, reduce, check_reduction)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The search allocates millions of tuples and keeps them until it ends, without
    reference cycles: the cycle collector's passes over them cost a sixth of its time and
    free nothing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _explore(
    bounds: Bounds,
    max_states: int | None,
    progress: Progress | None,
    progress_every: int,
    reduce: bool,
    check_reduction: bool,
) -> Report:
    start = time.perf_counter()
    parts = _Parts()
    expander = _Expander(bounds, parts, reduce=reduce)
    root = parts.key(initial_state(bounds))
    if reduce:
        root = expander.canonical_key(root)
    number: dict[int, int] = {root: 0}
    """The key of a state, canonical or not, -> the number of its canonical state; the
    canonical states are numbered in the order found (breadth-first)."""
    keys: list[int] = [root]
    parent: list[int] = [-1]
    via: list[Action | None] = [None]
    preds: list[list[int]] = [[]]  # internal predecessors, for the liveness pass
    final: list[int] = []
    first: dict[str, tuple[int, str, Action | None]] = {}  # kind -> (state id, message, refused)
    expansions: dict[int, _Expansion] = {}
    masks = parts.masks
    canonical_key = expander.canonical_key
    spent = expander.spent
    local, spend, snapshot = Footprint.LOCAL, Footprint.SPEND, Footprint.SNAPSHOT
    written = expander.written
    transitions = 0
    reduced = 0
    complete = True

    def note(kind: str, sid: int, message: str, refused: Action | None = None) -> None:
        if kind not in first:
            first[kind] = (sid, message, refused)

    for sid, key in enumerate(keys):  # breadth-first: each state found is appended to `keys`
        oid = key & _LOW
        ex_key = key >> _SHIFT << 8 | masks[oid]
        ex = expansions.get(ex_key)
        if ex is None:
            ex = expansions[ex_key] = expander.expansion(key >> _SHIFT, oid)
        violations, done, persistent, moves, actions, chosen = ex
        for violation in violations:
            note(violation.invariant, sid, violation.message)
        if done:
            final.append(sid)
            continue
        if persistent:
            reduced += 1
            if check_reduction:
                assert chosen is not None
                others = [a for a in actions if a not in chosen]
                for problem in independent_in(parts.state(key), bounds, chosen, others):
                    note("reduction", sid, problem)
        refused = moved = False
        for action, aid, how, core, refusal, change, _, internal, progresses in moves:
            if refusal is not None:
                note("illegal_transition", sid, refusal, action)
                refused = True
                continue
            if how is local:
                raw = core | oid
            elif how is spend:
                after = spent.get(oid << 3 | change)
                if after is None:
                    after = expander.spend(oid, change)
                raw = core | after
            elif how is snapshot:
                after = written.get(oid << _SHIFT | change)
                if after is None:
                    after = expander.write(oid, change)
                raw = core | after
            else:
                raw, refusal = expander.after(key, action, aid, how)
                if refusal is not None:
                    note("illegal_transition", sid, refusal, action)
                    refused = True
                    continue
                if action.kind is ActionKind.DISPATCH:
                    expander.dispatched.add(action.detail)
            transitions += 1
            if progresses:
                moved = True
            nid = number.get(raw, -1)
            if nid < 0:  # the number of the canonical state of `raw`, numbered if it is new
                settled = canonical_key(raw) if reduce else raw
                if settled != raw:
                    nid = number.get(settled, -1)
                if nid < 0:
                    nid = len(keys)
                    if max_states is not None and nid >= max_states:
                        complete = False
                        continue
                    number[settled] = nid
                    keys.append(settled)
                    parent.append(sid)
                    via.append(action)
                    preds.append([])
                number[raw] = nid
            if internal:
                preds[nid].append(sid)
        if not refused and not moved:
            note(
                "deadlock",
                sid,
                "no group can move: only a crash, an interrupt or a checkpoint can happen",
            )
        if progress is not None and sid % progress_every == 0 and sid:
            progress(len(keys), transitions, len(keys) - sid - 1, time.perf_counter() - start)

    if complete:
        stuck = _cannot_finish(len(parent), final, preds)
        if stuck is not None and "deadlock" not in first:
            note("stuck", stuck, "from here the run can never finish on its own (a livelock)")

    def trace_to(sid: int) -> tuple[Action, ...]:
        actions: list[Action] = []
        while parent[sid] >= 0:
            action = via[sid]
            assert action is not None
            actions.append(action)
            sid = parent[sid]
        return tuple(reversed(actions))

    findings = tuple(
        Finding(kind, message, trace_to(sid), refused)
        for kind, (sid, message, refused) in sorted(first.items(), key=lambda kv: kv[1][0])
    )
    return Report(
        bounds=bounds,
        states=len(parent),
        transitions=transitions,
        final_states=len(final),
        seconds=time.perf_counter() - start,
        findings=findings,
        complete=complete,
        reduced=reduced,
        dispatched=frozenset(DispatchReason(r) for r in expander.dispatched),
    )


def _cannot_finish(count: int, final: Sequence[int], preds: Sequence[list[int]]) -> int | None:
    """The lowest-numbered (so nearest the start) state with no internal path to a final one."""
    can = bytearray(count)
    todo = list(final)  # in any order: what matters is which states are reached
    for sid in final:
        can[sid] = 1
    while todo:
        for p in preds[todo.pop()]:
            if not can[p]:
                can[p] = 1
                todo.append(p)
    stuck = can.find(0)
    return None if stuck < 0 else stuck


def is_deadlocked(state: SchedState, bounds: Bounds) -> bool:
    """A non-final state where no group can move."""
    return state.phase is not Phase.DONE and all(
        a.kind in NOT_PROGRESS_KINDS for a in enabled(state, bounds)
    )


@attrs.frozen
class WalkReport:
    """What `random_walks` saw: beyond exhaustive reach, a sample of runs, not a proof."""

    bounds: Bounds
    walks: int
    transitions: int
    finished: int
    """Walks that reached a final state within the depth."""
    seconds: float
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def transitions_per_second(self) -> float:
        return self.transitions / self.seconds if self.seconds > 0 else float("inf")


def random_walks(
    bounds: Bounds,
    *,
    walks: int,
    depth: int = 10_000,
    seed: int = 0,
    external_rate: float = 0.02,
    progress: Progress | None = None,
) -> WalkReport:
    """`walks` seeded random runs of the model, each up to `depth` actions, checking every
    invariant and deadlock freedom on every state on the way. For bounds the exhaustive
    search cannot finish (many prompts, teachers, faults): it finds violations, it cannot
    prove their absence, and it does not check liveness beyond "this walk finished". The
    world's events (crash, interrupt, abort, a failed step) are picked at `external_rate` per
    step, so that walks also reach the end of a run."""
    if walks < 1 or depth < 1:
        raise ValueError(f"walks and depth must be >= 1, got walks={walks}, depth={depth}")
    start = time.perf_counter()
    rng = random.Random(seed)
    first: dict[str, Finding] = {}
    transitions = finished = 0
    for walk in range(walks):
        state = initial_state(bounds)
        trace: list[Action] = []
        for _ in range(depth):
            for violation in check_state(state, bounds):
                first.setdefault(
                    violation.invariant,
                    Finding(violation.invariant, violation.message, tuple(trace)),
                )
            if state.phase is Phase.DONE:
                finished += 1
                break
            actions = enabled(state, bounds)
            if all(a.kind in NOT_PROGRESS_KINDS for a in actions):
                first.setdefault(
                    "deadlock",
                    Finding(
                        "deadlock",
                        "no group can move: only a crash, an interrupt or a checkpoint can happen",
                        tuple(trace),
                    ),
                )
                break
            internal = [a for a in actions if _internal(a)]
            if internal and rng.random() >= external_rate:
                action = rng.choice(internal)
            else:
                action = rng.choice(actions)
            try:
                state = transition(state, bounds, action)
            except IllegalTransition as exc:
                first.setdefault(
                    "illegal_transition",
                    Finding("illegal_transition", str(exc), tuple(trace), action),
                )
                break
            trace.append(action)
            transitions += 1
        if progress is not None and walk % 100 == 0 and walk:
            progress(walk, transitions, walks - walk, time.perf_counter() - start)
    shortest = sorted(first.values(), key=lambda f: len(f.trace))
    return WalkReport(
        bounds=bounds,
        walks=walks,
        transitions=transitions,
        finished=finished,
        seconds=time.perf_counter() - start,
        findings=tuple(shortest),
    )


@attrs.frozen
class Comparison:
    """The full search and the reduced one on the same bounds, and how they differ."""

    full: Report
    reduced: Report
    """Run with `check_reduction`, so its seconds are not its speed."""
    problems: tuple[str, ...]
    """Empty when they agree."""


def compare_reduction(bounds: Bounds) -> Comparison:
    """How the reduced search (the default) differs from the full one on `bounds`: a verdict
    one finds and the other does not, a trace of the reduced search that is not a real run
    ending in its violation, or a reduced state whose chosen actions do not commute with the
    others. No problem over a sweep is the evidence that the reduction is sound."""
    full = explore(bounds, reduce=False)
    reduced = explore(bounds, check_reduction=True)
    out = []
    kinds = {f.kind for f in full.findings}
    found = {f.kind for f in reduced.findings if f.kind != "reduction"}
    if kinds != found:
        out.append(f"full search finds {sorted(kinds)}, reduced finds {sorted(found)}")
    for finding in reduced.findings:
        if finding.kind == "reduction":
            out.append(f"{finding.message} (after {len(finding.trace)} steps)")
        elif (problem := finding.confirm(bounds)) is not None:
            out.append(f"{finding.kind}: {problem}")
    if reduced.states > full.states:
        out.append(f"reduced search visits more ({reduced.states}) than the full ({full.states})")
    return Comparison(full, reduced, tuple(out))
