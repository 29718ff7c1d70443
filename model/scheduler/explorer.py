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
import operator
import random
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, NamedTuple

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
    SPENDS,
    TOUCHES,
    Footprint,
    apply,
    footprint,
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


class _Parts:
    """The cores and outer parts of the states met so far (`state.OUTER_FIELDS`), each
    numbered once, so that a state is an int key and a core's facts are computed once. A core
    is stored as the numbers of its fields' values, so that it hashes as a few small ints
    however many groups and queues it holds."""

    def __init__(self) -> None:
        self.values: list[list[object]] = [[] for _ in range(_CORE_WIDTH + 1)]
        """Per core field: each value met, by its number; last (`_SNAPSHOTS`), each snapshot a
        `SNAPSHOT` action wrote."""
        self.value_ids: list[dict[object, int]] = [{} for _ in range(_CORE_WIDTH + 1)]
        self.cores: list[tuple[int, ...]] = []
        """Per core: the numbers of its fields' values, in `core_of` order."""
        self.core_values: list[tuple[object, ...]] = []
        """Per core: its fields' values (`core_of`), kept so as not to look them up again."""
        self.core_ids: dict[tuple[int, ...], int] = {}
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
            self.values[field].append(value)
        return vid

    def core_id(self, fields: tuple[int, ...]) -> int:
        cid = self.core_ids.get(fields)
        if cid is None:
            cid = self.core_ids[fields] = len(self.cores)
            self.cores.append(fields)
            self.core_values.append(tuple(map(list.__getitem__, self.values, fields)))
        return cid

    def outer_id(self, outer: tuple[object, ...]) -> int:
        oid = self.outer_ids.get(outer)
        if oid is None:
            oid = self.outer_ids[outer] = len(self.outers)
            self.outers.append(outer)
            self.masks.append(outer_mask(outer))
        return oid

    def field_ids(self, at: Sequence[int], core: tuple[object, ...]) -> tuple[int, ...]:
        """The numbers of the values of `core` (`core_of`) in the core fields `at`."""
        return tuple([self.value_id(j, core[j]) for j in at])

    def key(self, s: SchedState) -> int:
        core_id = self.core_id(self.field_ids(_ALL_CORE, core_of(s)))
        return core_id << _SHIFT | self.outer_id(outer_of(s))

    def state(self, key: int) -> SchedState:
        return join(self.core_values[key >> _SHIFT], self.outers[key & _LOW])


_ALL_CORE = range(_CORE_WIDTH)
_SNAPSHOTS = _CORE_WIDTH
"""Where `_Parts` numbers the snapshots `SNAPSHOT` actions write, after the core fields."""


class _Move(NamedTuple):
    """One action enabled in the states of a core, with what is known of its result there:
    for a `LOCAL`, `SPEND` or `SNAPSHOT` action the successor's core, or the refusal."""

    action: Action
    aid: int
    """The action's number in this search."""
    footprint: Footprint
    core: int
    """The successor's core, shifted into a key (`LOCAL`, `SPEND`, `SNAPSHOT`); -1 otherwise,
    or when refused."""
    refusal: str | None
    """The `IllegalTransition` message, for an action refused in every such state."""
    change: int
    """What it changes of the outer part: `SPEND`, where it spends (`OUTER_FIELDS`);
    `SNAPSHOT`, the number of the snapshot it writes; -1 otherwise."""
    gate: int
    """The bit of `outer_mask` this action needs (its budget, `BUDGET_OF`); 0 for none."""
    internal: bool
    progresses: bool


class _Core(NamedTuple):
    """What the states with one core (and whether a checkpoint is being written) share:
    their violations and every action enabled with every budget left."""

    violations: tuple[Violation, ...]
    done: bool
    moves: tuple[_Move, ...]
    gates: int
    """Every `_Move.gate` of `moves`: a mask holding them all keeps every move."""
    dispatches: bool
    """A dispatch is among `moves` (`Report.dispatched`)."""


class _Expansion(NamedTuple):
    """What the states with one core and one outer mask share: the moves the search takes."""

    violations: tuple[Violation, ...]
    done: bool
    reduced: bool
    """`ample` found a persistent subset."""
    moves: tuple[_Move, ...]
    actions: list[Action]
    chosen: list[Action] | None


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
_new_move = tuple.__new__
_DISPATCH = ActionKind.DISPATCH


def _core_fields(names: Collection[str]) -> tuple[int, ...]:
    """Where the core fields among `names` sit in a core (`core_of` order)."""
    return tuple(j for j, name in enumerate(_CORE_FIELDS) if name in names)


class _Rewrite(NamedTuple):
    """How a function that reads and writes some core fields (and maybe the outer part)
    acts on a core stored as field numbers (`_Parts.cores`)."""

    at: tuple[int, ...]
    """The core fields it reads or writes."""
    read: Callable[[tuple[int, ...]], tuple[int, ...]]
    """From a core's field numbers, those of the fields `at`."""
    update: Callable[[tuple[int, ...]], tuple[int, ...]]
    """From a core's field numbers followed by new ones for the fields `at`, the new core's."""


def _rewrite(names: Collection[str]) -> _Rewrite:
    at = _core_fields(names)
    assert len(at) > 1  # so that each getter makes a tuple
    update = (_CORE_WIDTH + at.index(j) if j in at else j for j in _ALL_CORE)
    return _Rewrite(at, operator.itemgetter(*at), operator.itemgetter(*update))


_TOUCHED = {kind: _rewrite(names) for kind, names in TOUCHES.items()}
"""Per kind: how its handler acts on a core, by the fields `TOUCHES` names."""
_CANONICAL = _rewrite(CANONICAL_FIELDS)
"""How `canonical` acts on a core, besides the groups (`CANONICAL_FIELDS`)."""
_GROUPS = _CORE_FIELDS.index("groups")
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
    rewrite: _Rewrite | None
    """How its handler acts on a core (`LOCAL`, `SPEND`, `SNAPSHOT`, `WHOLE`); None
    otherwise."""
    memo: dict[Any, Any]
    """`LOCAL`, `SPEND`: the numbers of the core fields it touches before -> after, or the
    refusal (with the budgets of `every_budget`). `SNAPSHOT`: as `LOCAL`, with the number of
    the snapshot written after. `WHOLE`: (those numbers, the outer part) before -> (after, the
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
        self.kinds: dict[Action, _Kind] = {}
        self.canonical: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int] | tuple[()]]
        self.canonical = {}
        """(The numbers of `CANONICAL_FIELDS` in the core, the outer part) -> after, or
        `_SAME`."""
        self.groups: dict[int, int] = {}
        """The number of a groups value -> that of its `canonical_groups`."""
        self.checks: list[tuple[Callable[[tuple[int, ...]], Any], dict[Any, Any], Check]]
        self.checks = [(_rewrite(names).read, {}, check) for names, check in BY_FIELDS]
        """Per check of `BY_FIELDS`: how to read its fields' numbers, and its memo."""
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
        values = None
        if core is None:
            values = parts.core_values[cid]
            core = self.cores[core_key] = self._core(cid, values, parts.outers[oid])
        if core.done:
            return _Expansion(core.violations, True, False, (), [], None)
        moves = core.moves
        if core.gates & mask != core.gates:
            moves = tuple([m for m in moves if m.gate & mask == m.gate])
        actions = [m.action for m in moves]
        chosen = None
        if self.reduce and len(actions) > 1:
            if values is None:
                values = parts.core_values[cid]
            chosen = ample(join(values, parts.outers[oid]), self.bounds, actions)
        if chosen is not None and any(a.kind not in NOT_PROGRESS_KINDS for a in chosen):
            moves = tuple([m for m in moves if m.action in chosen])
        if core.dispatches:
            for m in moves:
                if m.action.kind is _DISPATCH and m.refusal is None:
                    self.dispatched.add(m.action.detail)
        return _Expansion(core.violations, False, chosen is not None, moves, actions, chosen)

    def _core(self, cid: int, values: tuple[object, ...], outer: tuple[object, ...]) -> _Core:
        """Every action enabled in the states with this core and whether a checkpoint is being
        written, computed in one with every budget left (`BUDGET_OF`); for a `LOCAL`, `SPEND`
        or `SNAPSHOT` one, the successor's core (and the snapshot `SNAPSHOT` writes)."""
        b = self.bounds
        state = join(values, outer[:2] + self.every_budget)
        fields = self.parts.cores[cid]
        violations: tuple[Violation, ...] = ()
        for read, memo, check in self.checks:
            found = memo.get(read(fields))
            if found is None:
                found = memo[read(fields)] = check(state, b)
            violations += found
        violations += tuple(check_rest(state, b))
        if state.phase is Phase.DONE:
            return _Core(violations, True, (), 0, False)
        core_ids = self.parts.core_ids
        kinds = self.kinds
        moves = []
        gates = 0
        dispatches = False
        for a in enabled(state, b):
            kind = kinds.get(a)
            if kind is None:
                kind = self._kind(a)
            _, aid, how, change, gate, internal, progresses, rewrite, memo = kind
            core, refusal = -1, None
            if how is _LOCAL or how is _SPEND or how is _SNAPSHOT:
                assert rewrite is not None
                before = rewrite.read(fields)
                known: tuple[int, ...] | str | None = memo.get(before)
                if known is None:
                    known = memo[before] = self._touched_after(state, a, rewrite.at)
                if isinstance(known, str):
                    refusal = known
                else:
                    if how is _SNAPSHOT:
                        change = known[-1]
                        known = known[:-1]
                    after = rewrite.update(fields + known)
                    successor = core_ids.get(after)
                    if successor is None:
                        successor = self.parts.core_id(after)
                    core = successor << _SHIFT
            if a.kind is _DISPATCH:
                dispatches = True
            gates |= gate
            moves.append(
                _new_move(_Move, (a, aid, how, core, refusal, change, gate, internal, progresses))
            )
        return _Core(violations, False, tuple(moves), gates, dispatches)

    def _kind(self, a: Action) -> _Kind:
        how, gate, budget, internal, progresses = _KIND_FACTS[a.kind]
        if how is Footprint.OUTER or how is Footprint.WHOLE:
            how = footprint(a)  # the detail may matter
        rewrite = _TOUCHED[a.kind] if how in _REWRITTEN else None
        kind = _Kind(a, len(self.kinds), how, budget, gate, internal, progresses, rewrite, {})
        self.kinds[a] = kind
        return kind

    def _touched_after(
        self, state: SchedState, a: Action, at: tuple[int, ...]
    ) -> tuple[int, ...] | str:
        """The numbers of the core fields `at` after `a` in `state` (for a `SNAPSHOT` action,
        followed by that of the snapshot written), or the message of the `IllegalTransition`
        it raises."""
        try:
            after = transition(state, self.bounds, a)
        except IllegalTransition as exc:
            return str(exc)
        at_ids = self.parts.field_ids(at, core_of(after))
        if footprint(a) is not Footprint.SNAPSHOT:
            return at_ids
        return (*at_ids, self.parts.value_id(_SNAPSHOTS, after.writing))

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
        rewrite = kind.rewrite
        assert rewrite is not None
        fields = self.parts.cores[key >> _SHIFT]
        memo = rewrite.read(fields), key & _LOW
        known = kind.memo.get(memo)
        if known is None:
            try:
                after = transition(self.parts.state(key), self.bounds, kind.action)
            except IllegalTransition as exc:
                known = str(exc)
            else:
                at = self.parts.field_ids(rewrite.at, core_of(after))
                known = at, self.parts.outer_id(outer_of(after))
            kind.memo[memo] = known
        if isinstance(known, str):
            return -1, known
        core = self.parts.core_id(rewrite.update(fields + known[0]))
        return core << _SHIFT | known[1], None

    def canonical_key(self, key: int) -> int:
        """The key of `canonical` of the state `key`: computed once per value of the fields
        it reads (`CANONICAL_FIELDS`), and of the groups (`canonical_groups`)."""
        parts = self.parts
        at, read, update = _CANONICAL
        fields = parts.cores[key >> _SHIFT]
        oid = key & _LOW
        memo = read(fields), oid
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
            after = update(fields + known[0])
            oid = known[1]
        if self.bounds.batch_failures:
            groups = after[_GROUPS]
            erased = self.groups.get(groups)
            if erased is None:
                value: Any = parts.values[_GROUPS][groups]
                erased = parts.value_id(_GROUPS, canonical_groups(value, self.bounds))
                self.groups[groups] = erased
            if erased != groups:
                after = after[:_GROUPS] + (erased,) + after[_GROUPS + 1 :]
        if after is fields:
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
    index: dict[int, int] = {root: 0}
    """The key of each canonical state -> its number, in the order found (breadth-first)."""
    known: dict[int, int] = {root: 0}
    """The key of a state before `canonical` -> the number of its canonical state."""
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

    def settle(raw: int, sid: int, action: Action) -> int:
        """The number of the canonical state of `raw`, numbering it if it is new; -1 when
        `max_states` refuses it."""
        nonlocal complete
        key = canonical_key(raw) if reduce else raw
        nid = index.get(key)
        if nid is None:
            nid = len(keys)
            if max_states is not None and nid >= max_states:
                complete = False
                return -1
            index[key] = nid
            keys.append(key)
            parent.append(sid)
            via.append(action)
            preds.append([])
        known[raw] = nid
        return nid

    sid = -1
    while sid + 1 < len(keys):  # breadth-first: states are numbered in the order found
        sid += 1
        key = keys[sid]
        oid = key & _LOW
        ex_key = key >> _SHIFT << 8 | masks[oid]
        ex = expansions.get(ex_key)
        if ex is None:
            ex = expansions[ex_key] = expander.expansion(key >> _SHIFT, oid)
        for violation in ex.violations:
            note(violation.invariant, sid, violation.message)
        if ex.done:
            final.append(sid)
            continue
        if ex.reduced:
            reduced += 1
            if check_reduction:
                assert ex.chosen is not None
                others = [a for a in ex.actions if a not in ex.chosen]
                for problem in independent_in(parts.state(key), bounds, ex.chosen, others):
                    note("reduction", sid, problem)
        refused = moved = False
        for action, aid, how, core, refusal, change, _, internal, progresses in ex.moves:
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
            nid = known.get(raw, -1)
            if nid < 0:
                nid = settle(raw, sid, action)
                if nid < 0:
                    continue
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
    queue = deque(final)
    for sid in final:
        can[sid] = 1
    while queue:
        sid = queue.popleft()
        for p in preds[sid]:
            if not can[p]:
                can[p] = 1
                queue.append(p)
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
