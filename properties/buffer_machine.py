"""A Hypothesis state machine that drives `ReplayBuffer` over `MemoryStore` and checks it against
the lifecycle model.

Each rule performs one buffer operation, good or deliberately bad, predicts its outcome from a
small shadow of the buffer plus `groupflow.model.fire`, and compares. After every step the model's
invariants are checked on a fresh snapshot. Async operations run under one `trio.run` each: the
buffer holds no trio objects between calls, so nothing is lost between rules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import trio
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from groupflow.impl import BufferConfig, MemoryStore, ReplayBuffer, Row, Sampler
from groupflow.impl.errors import BufferFull, MissingDataError, UnknownGroup
from groupflow.model import (
    LIVE_STATES,
    TRANSITIONS,
    Actor,
    Event,
    GroupState,
    GroupView,
    Guard,
    IllegalTransition,
    assert_invariants,
    fire,
    readiness,
)
from groupflow.properties.budget import budget, seeded

_T = TypeVar("_T")

FIELD_UNIVERSE = ("input_ids", "generation_logprobs", "teacher_reference_logprobs", "reward")
_EXPECTED_ERRORS = (ValueError, TypeError, LookupError, RuntimeError)


OP_BOUND_S = 30.0
"""Real seconds one buffer operation may take before the machine calls it hung: an in-memory
operation takes microseconds, but a machine shared with servers and other suites has stalled a
process for over 5 s."""


def _run(fn: Callable[[], Awaitable[_T]]) -> _T:
    async def guarded() -> _T:
        with trio.fail_after(OP_BOUND_S):
            return await fn()

    return trio.run(guarded)


@attrs.define
class _Shadow:
    """What the machine believes about one group."""

    state: GroupState
    target_step: int
    seq: int
    sample_ids: tuple[str, ...] = ()
    fields: frozenset[str] = frozenset()
    awaiting_stage: bool = False
    start_version: int | None = None
    retries: int = 0


def _discard_event(state: GroupState | None, actor: Actor) -> Event:
    """The event a discard fires: a failed rollout for a RESERVED group, an eviction of a
    READY one by the train pump (dropped by anyone else: the run's exit), a drop otherwise."""
    if state is GroupState.RESERVED:
        return Event.ROLLOUT_FAILED
    if state is GroupState.READY and actor is Actor.TRAIN:
        return Event.EVICT
    return Event.DROP


class BufferMachine(RuleBasedStateMachine):
    """Random reserve / commit / take / mark / retry / discard / select / release / evict /
    checkpoint operations on one buffer, each checked against the model's prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.version = 0
        self.seq = 0
        self.row_counter = 0
        self.shadow: dict[str, _Shadow] = {}
        self.finished: dict[str, GroupState] = {}

    # -- set-up ----------------------------------------------------------------------------

    @initialize(
        group_size=st.integers(1, 3),
        capacity=st.integers(1, 6),
        required=st.sets(st.sampled_from(FIELD_UNIVERSE), max_size=3),
        sampler=st.sampled_from(Sampler),
        staleness=st.one_of(st.none(), st.integers(0, 2)),
        blocking=st.booleans(),
        data=st.data(),
    )
    def setup(
        self,
        group_size: int,
        capacity: int,
        required: set[str],
        sampler: Sampler,
        staleness: int | None,
        blocking: bool,
        data: st.DataObject,
    ) -> None:
        if sampler is Sampler.WINDOWED and staleness is None:
            staleness = 1
        self.config = BufferConfig(
            group_size=group_size,
            capacity=capacity,
            required_fields=frozenset(required),
            sampler=sampler,
            max_staleness_versions=staleness,
        )
        self.blocking = blocking
        self.store = MemoryStore(blocking=blocking)
        self.buffer = ReplayBuffer(self.config, self.store)
        self._populate(data)

    def _populate(self, data: st.DataObject) -> None:
        """Start from a buffer with groups in several states, so every example has work to do
        even when swarm testing has switched off the rules that would create it."""
        for _ in range(data.draw(st.integers(0, self.config.capacity))):
            self._reserve(data)
            depth = data.draw(st.sampled_from(["reserved", "committed", "taken"]))
            gid = max(self.shadow, key=lambda g: self.shadow[g].seq, default=None)
            if (
                gid is None
                or depth == "reserved"
                or self.shadow[gid].state is not GroupState.RESERVED
            ):
                continue
            self._commit(data, gid=gid)
            if depth == "taken" and self.shadow[gid].state is GroupState.WRITTEN:
                self.buffer.take_for_scoring([gid])
                self.shadow[gid].state = GroupState.SCORING

    # -- helpers ---------------------------------------------------------------------------

    def _ids(self, data: st.DataObject, *, prefer: set[GroupState] | None = None) -> str:
        """A group id: usually a held one (in a preferred state), sometimes finished or unknown."""
        held = sorted(self.shadow)
        preferred = sorted(g for g, s in self.shadow.items() if prefer and s.state in prefer)
        pools = [(preferred, 12), (held, 4), (sorted(self.finished), 1), (["never-reserved"], 1)]
        weighted = [st.sampled_from(ids) for ids, weight in pools if ids for _ in range(weight)]
        gid: str = data.draw(data.draw(st.sampled_from(weighted)))
        return gid

    def _expect_unchanged(
        self,
        action: Callable[[], object],
        errors: type[BaseException] | tuple[type[BaseException], ...],
    ) -> None:
        before = self.buffer.snapshot()
        before_rows = self._rows()
        try:
            action()
        except errors as exc:
            note_event(f"refused: {type(exc).__name__}")
        else:
            raise AssertionError(f"expected {errors} but the call succeeded")
        assert self.buffer.snapshot() == before, "a refused call changed the buffer"
        assert self._rows() == before_rows, "a refused call changed the store"

    def _rows(self) -> dict[str, frozenset[str]]:
        return {sid: self.store.fields_of(sid) for sid in self.store.list_ids()}

    def _expected_error(self, gid: str, event: Event, actor: Actor) -> type[Exception] | None:
        """The error the model predicts for `event` on `gid`, or None if it is allowed."""
        if gid in self.shadow:
            state: GroupState | None = self.shadow[gid].state
        elif gid in self.finished:
            state = self.finished[gid]
        else:
            return UnknownGroup
        try:
            fire(
                gid, state, event, actor=actor, guard=Guard.COMPLETE
            )  # legal for one guard iff for all
        except IllegalTransition:
            return IllegalTransition
        return None

    def _new_rows(self, n: int, fields: frozenset[str]) -> list[Row]:
        rows = []
        for _ in range(n):
            self.row_counter += 1
            rows.append(Row(f"s{self.row_counter}", {f: self.row_counter for f in fields}))
        return rows

    def _finish(self, gid: str, state: GroupState) -> None:
        del self.shadow[gid]
        self.finished[gid] = state

    def _selectable(self, s: _Shadow) -> bool:
        if s.state is not GroupState.READY or self._stale(s):
            return False
        return self.config.sampler is Sampler.WINDOWED or s.target_step == self.step

    def _stale(self, s: _Shadow) -> bool:
        limit = self.config.max_staleness_versions
        assert s.start_version is not None
        too_old = limit is not None and self.version - s.start_version > limit
        if self.config.sampler is Sampler.IN_ORDER:
            return too_old or s.target_step < self.step
        return too_old

    # -- rules: one per actor, so swarm testing (which disables whole rules per example) still
    # leaves a working pipeline in most examples ------------------------------------------

    @rule(data=st.data(), action=st.sampled_from(["reserve"] * 3 + ["commit"] * 3 + ["fail"]))
    def rollout(self, data: st.DataObject, action: str) -> None:
        """The rollout pump: reserves a slot, commits a finished group, or fails a rollout."""
        if action == "reserve":
            self._reserve(data)
        elif action == "commit":
            self._commit(data)
        else:
            self._discard(data, GroupState.RESERVED)

    @rule(
        data=st.data(),
        action=st.sampled_from(["take"] * 2 + ["mark"] * 2 + ["retry", "drop"]),
    )
    def stage(self, data: st.DataObject, action: str) -> None:
        """A scoring stage: takes a batch, marks a scored group, hands one back, or drops one."""
        if action == "take":
            self._take(data)
        elif action == "mark":
            complete = data.draw(st.sampled_from([True, True, True, False]))
            extra = data.draw(st.sets(st.sampled_from(FIELD_UNIVERSE)))
            gid = self._ids(data, prefer={GroupState.SCORING})
            written = data.draw(st.sampled_from([True, True, True, False]), label="written")
            added = extra | self.config.required_fields if complete else extra
            if not written and gid in self.shadow:
                # a stage that claims what it never wrote names at least one field the group
                # lacks: else there is nothing for the buffer to refuse
                lacking = [f for f in FIELD_UNIVERSE if f not in self.shadow[gid].fields]
                added = added | set(lacking[:1])
            self._mark(gid, added, written)
        elif action == "retry":
            self._retry(self._ids(data, prefer={GroupState.SCORING}))
        else:
            self._discard(data, GroupState.SCORING, GroupState.WRITTEN)

    @rule(
        data=st.data(),
        action=st.sampled_from(["select"] * 2 + ["release"] * 2 + ["advance", "evict"]),
    )
    def train(self, data: st.DataObject, action: str) -> None:
        """The train pump: selects a step's groups, releases them, moves on, evicts stale ones."""
        if action == "select":
            self._select(data.draw(st.one_of(st.none(), st.integers(0, 3))))
        elif action == "release":
            self._release(data)
        elif action == "advance":
            self.step += data.draw(st.integers(0, 1))
            self.version += data.draw(st.integers(0, 2))
            note_event("advance")
        else:
            self._evict()

    @rule(
        mode=st.sampled_from(
            ["copy"] * 6 + ["resume", "wrong_group_size", "wrong_fields", "not_fresh"]
        )
    )
    def checkpoint(self, mode: str) -> None:
        """Save, then restore into a fresh buffer: a side copy to compare, the buffer the run
        resumes with (a crash: unready groups are gone, their prompts re-issued elsewhere), or a
        buffer that must refuse the state."""
        state = _run(self.buffer.state_dict)
        ready = [g for g, s in self.shadow.items() if s.state is GroupState.READY]
        assert [g["group_id"] for g in state["groups"]] == ready
        if mode not in ("copy", "resume"):
            self._check_refused_restore(state, mode)
            return
        store = MemoryStore(blocking=self.blocking)
        buffer = ReplayBuffer(self.config, store)

        async def load() -> None:
            await buffer.load_state_dict(state)

        _run(load)
        assert buffer.groups() == tuple(self.buffer.group(g) for g in ready)
        for gid in ready:
            ids = self.shadow[gid].sample_ids
            fields = sorted(self.shadow[gid].fields)
            assert store.get(ids, fields) == self.store.get(ids, fields), "restored rows differ"
        assert store.list_ids() == {sid for g in ready for sid in self.shadow[g].sample_ids}
        note_event(f"checkpoint {mode}: {len(ready)} groups")
        if mode == "resume":
            self.store, self.buffer = store, buffer
            self.shadow = {g: s for g, s in self.shadow.items() if s.state is GroupState.READY}
            self.finished = {}

    # -- operations, each with its prediction ----------------------------------------------

    def _reserve(self, data: st.DataObject) -> None:
        target = self.step + data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        known = sorted(self.shadow.keys() | self.finished.keys())
        if known and data.draw(st.sampled_from([False] * 5 + [True])):
            gid = data.draw(st.sampled_from(known))
            self._expect_unchanged(
                lambda: self.buffer.reserve(target_step=target, group_id=gid), ValueError
            )
            return
        gid_in = f"named{self.seq}" if data.draw(st.booleans()) else None
        if len(self.shadow) >= self.config.capacity:
            self._expect_unchanged(
                lambda: self.buffer.reserve(target_step=target, group_id=gid_in), BufferFull
            )
            return
        gid = self.buffer.reserve(target_step=target, ordinal=self.seq, group_id=gid_in)
        assert gid not in self.shadow and gid not in self.finished, f"id {gid!r} reused"
        assert gid_in is None or gid == gid_in
        self.shadow[gid] = _Shadow(GroupState.RESERVED, target, self.seq)
        note_event("reserve")
        self.seq += 1

    def _commit(self, data: st.DataObject, gid: str | None = None) -> None:
        if gid is None:
            gid = self._ids(data, prefer={GroupState.RESERVED})
        extra = data.draw(st.sets(st.sampled_from(FIELD_UNIVERSE)))
        complete = data.draw(st.sampled_from([True, True, True, False]))
        fields = extra | self.config.required_fields if complete else extra
        defer = data.draw(st.booleans())
        flaw = data.draw(
            st.sampled_from(
                ["none"] * 15 + ["size", "dup_within", "dup_store", "mixed_fields", "versions"]
            )
        )
        start = data.draw(st.integers(max(0, self.version - 2), self.version))
        end = self.version
        rows = self._new_rows(self.config.group_size, frozenset(fields))
        expected = self._expected_error(gid, Event.COMMIT, Actor.ROLLOUT)
        if expected is None and flaw != "none":
            expected = ValueError
            if flaw == "size":
                rows = rows + self._new_rows(1, frozenset(fields))
            elif flaw == "dup_within":
                if len(rows) < 2:
                    rows = rows + [rows[0]]  # wrong size and a duplicate: still a ValueError
                else:
                    rows[-1] = Row(rows[0].sample_id, rows[-1].fields)
            elif flaw == "dup_store":
                owned = [sid for s in self.shadow.values() for sid in s.sample_ids]
                if not owned:
                    expected = None
                else:
                    rows[0] = Row(data.draw(st.sampled_from(owned)), rows[0].fields)
            elif flaw == "mixed_fields":
                if len(rows) < 2:
                    expected = None
                else:
                    rows[-1] = Row(rows[-1].sample_id, {**rows[-1].fields, "extra": 0})
            elif flaw == "versions":
                start, end = end + 1, end
        if expected is None and not defer and self.config.required_fields - fields:
            expected = ValueError

        async def go() -> GroupView:
            return await self.buffer.commit(
                gid, rows, start_weight_version=start, end_weight_version=end, defer_ready=defer
            )

        if expected is not None:
            self._expect_unchanged(lambda: _run(go), expected)
            return
        guard = readiness(fields, self.config.required_fields, awaiting_stage=defer)
        predicted = fire(gid, GroupState.RESERVED, Event.COMMIT, actor=Actor.ROLLOUT, guard=guard)
        view = _run(go)
        assert view.state is predicted, (view.state, predicted)
        note_event(f"commit -> {predicted}")
        s = self.shadow[gid]
        s.state, s.sample_ids, s.fields = (
            predicted,
            tuple(r.sample_id for r in rows),
            frozenset(fields),
        )
        s.awaiting_stage, s.start_version = defer, start

    def _take(self, data: st.DataObject) -> None:
        written = sorted(g for g, s in self.shadow.items() if s.state is GroupState.WRITTEN)
        ids = (
            data.draw(st.lists(st.sampled_from(written), min_size=1, unique=True))
            if written
            else []
        )
        if not ids or data.draw(st.sampled_from([False] * 4 + [True])):
            ids = list(dict.fromkeys([*ids, self._ids(data)]))
        if any(self._expected_error(g, Event.TAKE_BATCH, Actor.STAGE) for g in ids):
            self._expect_unchanged(lambda: self.buffer.take_for_scoring(ids), _EXPECTED_ERRORS)
            return
        views = self.buffer.take_for_scoring(ids)
        assert [v.group_id for v in views] == ids
        assert all(v.state is GroupState.SCORING for v in views)
        note_event(f"take_for_scoring {len(ids)} groups")
        for gid in ids:
            self.shadow[gid].state = GroupState.SCORING

    def _mark(self, gid: str, added: set[str], written: bool = True) -> None:
        """A stage marks a group scored with the fields it says it added; unless `written`, it
        names a field it never wrote, which the buffer must refuse."""
        expected = self._expected_error(gid, Event.SCORED, Actor.STAGE)
        if expected is not None:
            self._expect_unchanged(
                lambda: _run(lambda: self.buffer.mark_ready(gid, added)), expected
            )
            return
        s = self.shadow[gid]
        new = frozenset(added) - s.fields
        if new and not written:
            self._expect_unchanged(
                lambda: _run(lambda: self.buffer.mark_ready(gid, added)), MissingDataError
            )
            return
        if new:  # the stage writes its fields before it marks the group
            self.store.add_fields({sid: {f: 0 for f in new} for sid in s.sample_ids})
        fields = s.fields | new
        guard = readiness(fields, self.config.required_fields, awaiting_stage=False)
        predicted = fire(gid, s.state, Event.SCORED, actor=Actor.STAGE, guard=guard)
        assert _run(lambda: self.buffer.mark_ready(gid, added)) is predicted
        note_event(f"mark_ready -> {predicted}")
        s.state, s.fields, s.awaiting_stage = predicted, fields, False

    def _retry(self, gid: str) -> None:
        expected = self._expected_error(gid, Event.RETRY, Actor.STAGE)
        if expected is not None:
            self._expect_unchanged(lambda: self.buffer.retry(gid), expected)
            return
        s = self.shadow[gid]
        s.retries += 1
        assert self.buffer.retry(gid) == s.retries
        note_event("retry")
        s.state = GroupState.WRITTEN

    def _discard(self, data: st.DataObject, *prefer: GroupState) -> None:
        gid = self._ids(data, prefer=set(prefer))
        state = self.shadow[gid].state if gid in self.shadow else self.finished.get(gid)
        allowed = sorted(
            {
                a
                for r in TRANSITIONS
                for a in r.actors
                if r.source is state and r.event is _discard_event(state, a)
            },
            key=str,
        )
        any_actor = data.draw(st.sampled_from([False] * 3 + [True]))
        actor = data.draw(st.sampled_from(list(Actor) if any_actor or not allowed else allowed))
        event = _discard_event(state, actor)
        expected = self._expected_error(gid, event, actor)

        async def go() -> None:
            await self.buffer.discard(gid, actor=actor)

        if expected is not None:
            self._expect_unchanged(lambda: _run(go), expected)
            return
        _run(go)
        note_event(f"discard {state}")
        self._finish(gid, GroupState.DISCARDED)

    def _select(self, limit: int | None) -> None:
        candidates = [g for g, s in self.shadow.items() if self._selectable(s)]
        if self.config.sampler is Sampler.WINDOWED:
            candidates.sort(key=lambda g: self.shadow[g].start_version or 0)
        predicted = candidates[:limit]
        selection = self.buffer.select(
            step=self.step, weight_version=self.version, max_groups=limit
        )
        assert list(selection.group_ids) == predicted, (selection.group_ids, predicted)
        assert len(selection.sample_ids) == len(predicted) * self.config.group_size
        note_event(f"select {len(predicted)} groups")
        for gid in predicted:
            self.shadow[gid].state = GroupState.CONSUMED

    def _release(self, data: st.DataObject) -> None:
        consumed = sorted(g for g, s in self.shadow.items() if s.state is GroupState.CONSUMED)
        ids = data.draw(st.lists(st.sampled_from(consumed), unique=True)) if consumed else []
        other = self._ids(data) if data.draw(st.sampled_from([False] * 3 + [True])) else None

        async def go() -> None:
            await self.buffer.release(ids)

        if other is not None and other not in consumed:
            ids.append(other)
            self._expect_unchanged(lambda: _run(go), _EXPECTED_ERRORS)
            return
        _run(go)
        note_event(f"release {len(ids)} groups")
        for gid in ids:
            self._finish(gid, GroupState.CONSUMED)

    def _evict(self) -> None:
        predicted = [
            g for g, s in self.shadow.items() if s.state is GroupState.READY and self._stale(s)
        ]

        async def go() -> tuple[str, ...]:
            return await self.buffer.evict_stale(step=self.step, weight_version=self.version)

        assert list(_run(go)) == predicted
        note_event(f"evict {len(predicted)} groups")
        for gid in predicted:
            self._finish(gid, GroupState.DISCARDED)

    def _check_refused_restore(self, state: dict[str, Any], mismatch: str) -> None:
        if mismatch == "not_fresh":
            if not self.shadow and not self.finished:
                return
            target, store = self.buffer, self.store
            expected: type[Exception] = RuntimeError
        else:
            config = attrs.evolve(
                self.config,
                **(
                    {"group_size": self.config.group_size + 1}
                    if mismatch == "wrong_group_size"
                    else {"required_fields": self.config.required_fields ^ {"reward"}}
                ),
            )
            store = MemoryStore()
            target = ReplayBuffer(config, store)
            expected = ValueError
        before = (target.snapshot(), store.list_ids())

        async def load() -> None:
            await target.load_state_dict(state)

        try:
            _run(load)
        except expected:
            pass
        else:
            raise AssertionError(f"restore with mismatch {mismatch!r} was accepted")
        assert (target.snapshot(), store.list_ids()) == before

    # -- after every step ------------------------------------------------------------------

    @invariant()
    def model_invariants_hold(self) -> None:
        if not hasattr(self, "buffer"):
            return
        assert_invariants(self.buffer.snapshot())

    @invariant()
    def buffer_agrees_with_shadow(self) -> None:
        if not hasattr(self, "buffer"):
            return
        assert len(self.buffer) == len(self.shadow)
        for gid, s in self.shadow.items():
            view = self.buffer.group(gid)
            assert (view.state, view.sample_ids, view.fields, view.target_step) == (
                s.state,
                s.sample_ids,
                s.fields,
                s.target_step,
            ), (gid, view, s)
            if s.sample_ids:
                assert all(s.fields <= self.store.fields_of(sid) for sid in s.sample_ids)
        for gid, state in self.finished.items():
            assert self.buffer.state_of(gid) is state
        for step in range(self.step, self.step + 3):
            live = sum(
                1 for s in self.shadow.values() if s.target_step == step and s.state in LIVE_STATES
            )
            assert self.buffer.count_for_target_step(step) == live


def run_buffer_machine(
    *,
    max_examples: int = 100,
    steps: int = 50,
    derandomize: bool = False,
    shrink: bool = True,
    seed: int | None = None,
) -> None:
    """Run `BufferMachine` with a budget: CI uses a small one, `groupflow fuzz` a large one
    (`seed` fixes the examples, so a run can be replayed)."""
    run_state_machine_as_test(
        seeded(BufferMachine, seed),
        settings=budget(
            max_examples=max_examples,
            steps=steps,
            derandomize=derandomize,
            shrink=shrink,
            seed=seed,
        ),
    )
