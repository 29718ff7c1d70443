"""The replay buffer: group metadata whose every state change goes through the lifecycle model.

Rows live in a `SampleStore`; the buffer holds one slot of metadata per group and moves it only
with `groupflow.model.fire`, so there is no second place that decides a transition.
"""

from __future__ import annotations

import functools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import trio

from groupflow.impl._core._buffer_config import BufferConfig, Sampler
from groupflow.impl._core._buffer_state import checked_state, restored_slots, saved_state
from groupflow.impl._core._pulse import Pulse
from groupflow.impl._core._slot import Selection, Slot, check_index, check_rows
from groupflow.impl._core._store import PAD_PREFIX, Row, SampleStore
from groupflow.model import (
    LIVE_STATES,
    Actor,
    BufferSnapshot,
    Event,
    GroupState,
    GroupView,
    Guard,
    decisions,
    fire,
    missing_fields,
    readiness,
)
from groupflow.model.errors import (
    ArgumentError,
    BufferFull,
    CallOrderError,
    DuplicateDataError,
    GroupBusy,
    IllegalTransition,
    MissingDataError,
    UnknownGroup,
)

_T = TypeVar("_T")

FINISHED_MEMORY = 4096
"""Finished groups whose terminal state the buffer remembers (at least; 8 x capacity if more)."""


class ReplayBuffer:
    """Prompt groups between generation and training, with deferred readiness.

    Unready groups (RESERVED, WRITTEN, SCORING) hold capacity and count for their target step
    but are never selected or evicted. Methods that touch the store are async; the others are
    synchronous and never yield, so a caller sees each change whole.
    """

    def __init__(self, config: BufferConfig, store: SampleStore) -> None:
        self.config = config
        self.store = store
        self._slots: dict[str, Slot] = {}
        self._finished: OrderedDict[str, GroupState] = OrderedDict()
        """The terminal state of the groups finished most recently (`FINISHED_MEMORY`), so a
        late call on one is refused as illegal rather than unknown; older ones are forgotten,
        which keeps a long run's memory flat."""
        self._owner: dict[str, str] = {}
        self._busy: dict[str, str] = {}
        """Groups with a store call in flight (a blocking store yields), and what the call is."""
        self._counts: Counter[GroupState] = Counter()
        self._live_per_step: Counter[int] = Counter()
        self._per_step: dict[int, dict[str, Slot]] = {}
        """Held groups by the step they were admitted for (lookups by step scan only those)."""
        self._state_per_step: Counter[tuple[GroupState, int]] = Counter()
        self._next_id = 0
        self.changed = Pulse()
        """Notified on every change of a group's state or of the groups held."""

    # -- lookups ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Groups held now (every state but the finished ones)."""
        return len(self._slots)

    @property
    def free_capacity(self) -> int:
        return self.config.capacity - len(self._slots)

    def state_of(self, group_id: str) -> GroupState:
        """The group's state, also after it finished (CONSUMED or DISCARDED and let go)."""
        slot = self._slots.get(group_id)
        if slot is not None:
            return slot.state
        if group_id in self._finished:
            return self._finished[group_id]
        raise UnknownGroup(f"group {group_id!r} was never reserved in this buffer")

    def group(self, group_id: str) -> GroupView:
        """The metadata of a group the buffer holds."""
        return self._held(group_id, changing=False).view()

    def groups(
        self, state: GroupState | None = None, *, step: int | None = None
    ) -> tuple[GroupView, ...]:
        """Held groups in reservation order, optionally only those in `state`, or admitted for
        `step` (those are looked up by step, not found by a scan of every group)."""
        slots = self._slots.values() if step is None else self._per_step.get(step, {}).values()
        return tuple(s.view() for s in slots if state is None or s.state is state)

    def ordinals_in(self, state: GroupState, step: int) -> set[int]:
        """The prompt ordinals of the held groups in `state` admitted for `step` (no views
        built: the train pump asks at every change while it waits)."""
        return {
            slot.ordinal
            for slot in self._per_step.get(step, {}).values()
            if slot.state is state and slot.ordinal is not None
        }

    def count_in(self, state: GroupState, step: int) -> int:
        """Held groups in `state` admitted for `step` (a counter kept as groups move)."""
        return self._state_per_step[state, step]

    def counts(self) -> dict[GroupState, int]:
        """Held groups per state (zeros included)."""
        return {state: self._counts[state] for state in GroupState}

    def count_for_target_step(self, step: int) -> int:
        """Groups admitted for `step` that may still be trained: RESERVED, WRITTEN, SCORING, READY."""
        return self._live_per_step[step]

    def retries_of(self, group_id: str) -> int:
        """How many times a stage handed this group back for another try."""
        return self._held(group_id, changing=False).retries

    async def stray_rows(self, *, padding: bool = False) -> list[str]:
        """Rows in the store that no group owns: what a scorer wrote outside its batch.
        Padding rows (a teacher call's temporaries, cleared by the call) count only with
        `padding`, once no call can be in flight."""
        ids = await self._store_call(self.store.list_ids)
        return sorted(
            sid
            for sid in ids
            if sid not in self._owner and (padding or not sid.startswith(PAD_PREFIX))
        )

    async def remove_rows(self, sample_ids: Sequence[str]) -> None:
        """Clear rows no group owns (refused for one a group owns: that would orphan it)."""
        owned = sorted(sid for sid in sample_ids if sid in self._owner)
        if owned:
            raise ArgumentError(f"rows {owned} belong to groups; release or discard those")
        with trio.CancelScope(shield=True):
            await self._store_call(self.store.clear, list(sample_ids), missing_ok=True)

    async def rows_with(self, sample_ids: Sequence[str], field: str) -> list[str]:
        """Those of the rows that already have `field`."""
        lacking = await self._store_call(self.store.missing_fields, list(sample_ids), [field])
        return [sid for sid in sample_ids if sid not in lacking]

    def snapshot(self) -> BufferSnapshot:
        """Everything the model's invariants look at, taken at one instant."""
        return BufferSnapshot(
            groups=self.groups(),
            store_ids=self.store.list_ids(),
            counts=self.counts(),
            capacity=self.config.capacity,
            group_size=self.config.group_size,
            required_fields=self.config.required_fields,
        )

    # -- the lifecycle ---------------------------------------------------------------------

    def reserve(
        self,
        *,
        target_step: int,
        ordinal: int | None = None,
        agent: str | None = None,
        group_id: str | None = None,
        actor: Actor = Actor.ROLLOUT,
    ) -> str:
        """Take a slot for a rollout that is about to start; returns the group id.

        Raises `BufferFull` when every slot is taken, so capacity can never be over-drawn.
        """
        check_index("target_step", target_step)
        if ordinal is not None:
            check_index("ordinal", ordinal)
        if group_id is not None and (group_id in self._slots or group_id in self._finished):
            raise ArgumentError(
                f"group id {group_id!r} is already used in this buffer "
                f"(it is {self.state_of(group_id)}); group ids are never reused"
            )
        state = fire(group_id or "(new)", None, Event.RESERVE, actor=actor)
        if len(self._slots) >= self.config.capacity:
            held = ", ".join(f"{s} {n}" for s, n in self.counts().items() if n)
            what = repr(group_id) if group_id else "a new group"
            raise BufferFull(
                f"cannot reserve {what}: all {self.config.capacity} slots are held ({held}); "
                f"wait for the train pump to consume or evict groups"
            )
        if group_id is None:
            group_id = self._fresh_id()
        slot = self._slots[group_id] = Slot(group_id, target_step, ordinal, agent, state)
        self._per_step.setdefault(target_step, {})[group_id] = slot
        self.changed.notify()
        self._counts[state] += 1
        self._state_per_step[state, target_step] += 1
        self._live_per_step[target_step] += 1
        return group_id

    async def commit(
        self,
        group_id: str,
        rows: Sequence[Row],
        *,
        start_weight_version: int,
        end_weight_version: int,
        defer_ready: bool = False,
        actor: Actor = Actor.ROLLOUT,
    ) -> GroupView:
        """Write a finished rollout's rows and make the group READY, or WRITTEN if `defer_ready`.

        With `defer_ready`, a stage must take the group and `mark_ready` it. Bad input raises
        before anything is written; a failed write clears what it wrote and leaves the group
        RESERVED for the caller to discard.
        """
        await trio.lowlevel.checkpoint()
        slot = self._slot_for(group_id, Event.COMMIT, actor)
        check_index("start_weight_version", start_weight_version)
        check_index("end_weight_version", end_weight_version)
        if end_weight_version < start_weight_version:
            raise ArgumentError(
                f"commit({group_id!r}): end_weight_version={end_weight_version} is before "
                f"start_weight_version={start_weight_version}"
            )
        fields = self._check_rows(group_id, rows)
        guard = readiness(fields, self.config.required_fields, awaiting_stage=defer_ready)
        if not defer_ready and guard is Guard.PENDING:
            lacking = sorted(missing_fields(fields, self.config.required_fields))
            raise ArgumentError(
                f"commit({group_id!r}): rows lack required fields {lacking}; pass "
                f"defer_ready=True if a stage adds them"
            )
        target = fire(group_id, slot.state, Event.COMMIT, actor=actor, guard=guard)
        sample_ids = tuple(r.sample_id for r in rows)
        self._busy[group_id] = "commit"
        self._owner.update(dict.fromkeys(sample_ids, group_id))  # claimed while the write runs
        try:
            await self._store_call(self.store.put, {r.sample_id: r.fields for r in rows})
        except BaseException as exc:
            for sid in sample_ids:
                del self._owner[sid]
            if not isinstance(exc, DuplicateDataError):  # that one wrote nothing, and the
                await self._clear_after_failed_write(group_id, sample_ids, exc)  # rows are not ours
            raise
        finally:
            del self._busy[group_id]
        slot.sample_ids = sample_ids
        slot.fields = fields
        slot.awaiting_stage = defer_ready
        slot.start_weight_version = start_weight_version
        slot.end_weight_version = end_weight_version
        self._enter(slot, target)
        return slot.view()

    def take_for_scoring(
        self, group_ids: Iterable[str], *, actor: Actor = Actor.STAGE
    ) -> tuple[GroupView, ...]:
        """Move WRITTEN groups into a stage's in-flight batch (SCORING); all or none move."""
        ids = list(group_ids)
        if len(set(ids)) != len(ids):
            dupes = sorted(gid for gid, n in Counter(ids).items() if n > 1)
            raise ArgumentError(f"take_for_scoring: group ids listed twice: {dupes}")
        slots = [self._held_or_finished(gid) for gid in ids]
        self._fire_all(slots, Event.TAKE_BATCH, actor)
        return tuple(slot.view() for slot in slots)

    async def mark_ready(
        self, group_id: str, fields: Iterable[str] = (), *, actor: Actor = Actor.STAGE
    ) -> GroupState:
        """Record the fields a stage added (already in the store) and end its scoring.

        The group becomes READY if it now has every required field, else WRITTEN for the next
        stage. Returns the new state. See `mark_ready_many`.
        """
        (state,) = await self.mark_ready_many([group_id], fields, actor=actor)
        return state

    async def mark_ready_many(
        self, group_ids: Iterable[str], fields: Iterable[str] = (), *, actor: Actor = Actor.STAGE
    ) -> tuple[GroupState, ...]:
        """`mark_ready` for the groups of one call, all or none.

        The field names are not taken on trust: one batched store call checks that every row
        of every group has them, and a group whose rows lack one is refused with
        `MissingDataError` naming the group and the field, before any group changes.

        With an in-process store this never yields: a stage whose call returned as it was being
        cancelled still records the teacher's work, and the stage reports the groups scored
        in the same step as they change (`groupflow.impl._pipeline.ActionObserver`).
        """
        if isinstance(fields, str):
            raise TypeError(
                f"mark_ready: fields must be a collection of names, got the string {fields!r}"
            )
        names = frozenset(fields)
        ids = list(group_ids)
        dupes = sorted(gid for gid, n in Counter(ids).items() if n > 1)
        if dupes:
            raise ArgumentError(f"mark_ready: group ids listed twice: {dupes}")
        slots = [self._slot_for(gid, Event.SCORED, actor) for gid in ids]
        if names and slots:
            await self._check_fields_stored(slots, sorted(names))
        targets = []
        for slot in slots:
            new_fields = slot.fields | names
            guard = readiness(new_fields, self.config.required_fields, awaiting_stage=False)
            targets.append(fire(slot.group_id, slot.state, Event.SCORED, actor=actor, guard=guard))
        for slot, target in zip(slots, targets, strict=True):
            slot.fields = slot.fields | names
            slot.awaiting_stage = False
            self._enter(slot, target)
        return tuple(targets)

    async def _check_fields_stored(self, slots: Sequence[Slot], names: list[str]) -> None:
        """Ask the store, in one call, whether every row of `slots` has the fields `names`."""
        sample_ids = [sid for slot in slots for sid in slot.sample_ids]
        self._busy.update(dict.fromkeys((s.group_id for s in slots), "mark_ready check"))
        try:
            lacking = await self._store_call(self.store.missing_fields, sample_ids, names)
        finally:
            for slot in slots:
                del self._busy[slot.group_id]
        if lacking:
            owner = {sid: slot.group_id for slot in slots for sid in slot.sample_ids}
            per_group: dict[str, set[str]] = {}
            for sid, missing in lacking.items():
                per_group.setdefault(owner.get(sid, "?"), set()).update(missing)
            what = "; ".join(
                f"group {gid!r} lacks {sorted(f)}" for gid, f in sorted(per_group.items())
            )
            raise MissingDataError(
                f"mark_ready: the store does not hold the fields named for every row ({what}); "
                f"a stage must write its fields before it marks the groups scored",
                rows=sorted(lacking),
                fields=lacking,
            )

    def retry(self, group_id: str, *, actor: Actor = Actor.STAGE) -> int:
        """Hand a SCORING group back to WRITTEN after a failed call; returns its retry count."""
        slot = self._slot_for(group_id, Event.RETRY, actor)
        target = fire(group_id, slot.state, Event.RETRY, actor=actor)
        slot.retries += 1
        self._enter(slot, target)
        return slot.retries

    async def discard(
        self,
        group_id: str,
        *,
        actor: Actor = Actor.ROLLOUT,
        then: Callable[[], object] | None = None,
    ) -> None:
        """Drop a group and clear its rows.

        A RESERVED group's rollout failed; a WRITTEN or SCORING group failed scoring for good or
        is dropped at shutdown or restore; a READY group is evicted (by the train pump) or
        dropped as the run exits (by the supervisor).
        """
        await self.discard_many([group_id], actor=actor, then=then)

    async def discard_many(
        self,
        group_ids: Iterable[str],
        *,
        actor: Actor = Actor.ROLLOUT,
        then: Callable[[], object] | None = None,
    ) -> None:
        """`discard` for several groups at once: all move to DISCARDED in one step (all or
        none), then their rows are cleared. `then`, if given, runs right after the groups
        change state and before their rows are cleared (a store call, which may let other
        tasks run): where the caller records the change, so that no other task sees the
        groups gone before it is recorded."""
        await trio.lowlevel.checkpoint()
        ids = list(group_ids)
        dupes = sorted(gid for gid, n in Counter(ids).items() if n > 1)
        if dupes:
            raise ArgumentError(f"discard_many: group ids listed twice: {dupes}")
        slots = [self._held_or_finished(gid) for gid in ids]
        ready = Event.EVICT if actor is Actor.TRAIN else Event.DROP
        events = [
            {GroupState.RESERVED: Event.ROLLOUT_FAILED, GroupState.READY: ready}.get(
                slot.state, Event.DROP
            )
            for slot in slots
        ]
        targets = [
            fire(slot.group_id, slot.state, event, actor=actor)
            for slot, event in zip(slots, events, strict=True)
        ]
        for slot, target in zip(slots, targets, strict=True):
            self._enter(slot, target)
        try:
            if then is not None:
                then()
        finally:
            await self._let_go(slots)

    def select(
        self,
        *,
        step: int,
        weight_version: int,
        max_groups: int | None = None,
        actor: Actor = Actor.TRAIN,
    ) -> Selection:
        """Pick READY groups for train step `step` and mark them CONSUMED.

        In-order: groups admitted for `step`, oldest reservation first. Windowed: groups at most
        `max_staleness_versions` behind `weight_version`, oldest weight version first.
        """
        check_index("step", step)
        check_index("weight_version", weight_version)
        if max_groups is not None:
            check_index("max_groups", max_groups)
        picked = [
            s
            for s in self._slots.values()
            if s.state is GroupState.READY and self._selectable(s, step, weight_version)
        ]
        for slot in picked:
            self._check_not_busy(slot.group_id)
        if self.config.sampler is Sampler.WINDOWED:
            picked.sort(key=lambda s: s.start_weight_version or 0)
        picked = picked[:max_groups]
        self._fire_all(picked, Event.SELECT, actor)
        return Selection(step, weight_version, tuple(s.view() for s in picked))

    async def release(self, group_ids: Iterable[str]) -> None:
        """Clear the rows of CONSUMED groups once their train step is done, and let them go."""
        await trio.lowlevel.checkpoint()
        ids = list(group_ids)
        dupes = sorted(gid for gid, n in Counter(ids).items() if n > 1)
        if dupes:
            raise ArgumentError(f"release: group ids listed twice: {dupes}")
        slots = [self._held(gid) for gid in ids]
        wrong = [s for s in slots if s.state is not GroupState.CONSUMED]
        if wrong:
            listed = ", ".join(f"{s.group_id!r} is {s.state}" for s in wrong)
            raise IllegalTransition(
                f"release: only CONSUMED groups are released after a step; {listed}",
                group_id=wrong[0].group_id,
                state=wrong[0].state,
                event=None,
                actor=None,
            )
        await self._let_go(slots)

    async def read(
        self, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        """The named fields of the named rows, read as the buffer calls its store (in a worker
        thread for a blocking store)."""
        await trio.lowlevel.checkpoint()
        if not sample_ids:
            return {}
        return await self._store_call(self.store.get, sample_ids, fields)

    async def evict_stale(
        self, *, step: int, weight_version: int, actor: Actor = Actor.TRAIN
    ) -> tuple[str, ...]:
        """Discard READY groups the sampler can never pick again; returns their ids."""
        await trio.lowlevel.checkpoint()
        check_index("step", step)
        check_index("weight_version", weight_version)
        stale = [
            s
            for s in self._slots.values()
            if s.state is GroupState.READY and self._stale(s, step, weight_version)
        ]
        for slot in stale:
            self._check_not_busy(slot.group_id)
        self._fire_all(stale, Event.EVICT, actor)
        await self._let_go(stale)
        return tuple(s.group_id for s in stale)

    # -- checkpoint ------------------------------------------------------------------------

    async def state_dict(self) -> dict[str, Any]:
        """READY groups with their rows, enough to rebuild them in a fresh buffer.

        Groups that are not READY are left out here: what happens to them at a checkpoint is
        the pumps' policy (flush them first, or re-issue their prompts on resume).
        """
        await trio.lowlevel.checkpoint()
        ready = [s for s in self._slots.values() if s.state is GroupState.READY]
        for slot in ready:  # a second read at once is refused: its end would free the first's
            self._check_not_busy(slot.group_id)
        self._busy.update(dict.fromkeys((s.group_id for s in ready), "checkpoint read"))
        try:
            reads = [
                await self._store_call(self.store.get, slot.sample_ids, sorted(slot.fields))
                for slot in ready
            ]
        finally:
            for slot in ready:
                del self._busy[slot.group_id]
        return saved_state(self.config, list(zip(ready, reads, strict=True)), self._next_id)

    async def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rebuild the READY groups of `state_dict()` into this empty buffer and its store.

        Everything is checked before anything is written: a state saved under another group
        size or other required fields, or one that does not fit the capacity, raises
        `CheckpointMismatch`; one that does not hold together raises `CheckpointCorrupt`.
        """
        await trio.lowlevel.checkpoint()
        if self._slots or self._finished:
            raise CallOrderError(
                f"load_state_dict needs a fresh buffer; this one already holds {len(self._slots)} "
                f"groups and has finished {len(self._finished)}"
            )
        next_id, groups = checked_state(self.config, state)
        slots, rows = restored_slots(groups, self.config, check_rows=self._check_rows)
        await self._store_call(self.store.put, rows)
        for slot in slots:
            self._slots[slot.group_id] = slot
            self._per_step.setdefault(slot.target_step, {})[slot.group_id] = slot
            self._counts[slot.state] += 1
            self._state_per_step[slot.state, slot.target_step] += 1
            self._live_per_step[slot.target_step] += 1
            self._owner.update(dict.fromkeys(slot.sample_ids, slot.group_id))
        self.changed.notify()
        self._next_id = next_id

    # -- internals -------------------------------------------------------------------------

    def _fresh_id(self) -> str:
        while True:
            gid = f"g{self._next_id:06d}"
            self._next_id += 1
            if gid not in self._slots and gid not in self._finished:
                return gid

    def _held(self, group_id: str, *, changing: bool = True) -> Slot:
        """The held group's slot; a group with a store call in flight may be read, not
        changed (`changing`)."""
        if changing:
            self._check_not_busy(group_id)
        slot = self._slots.get(group_id)
        if slot is None:
            if group_id in self._finished:
                state = self._finished[group_id]
                raise IllegalTransition(
                    f"group {group_id!r} is {state} and no longer held",
                    group_id=group_id,
                    state=state,
                    event=None,
                    actor=None,
                )
            raise UnknownGroup(f"group {group_id!r} was never reserved in this buffer")
        return slot

    def _held_or_finished(self, group_id: str) -> Slot:
        """The held slot, or a stand-in carrying a finished group's terminal state so that
        `fire` names it in the IllegalTransition it raises."""
        self._check_not_busy(group_id)
        slot = self._slots.get(group_id)
        if slot is not None:
            return slot
        if group_id in self._finished:
            return Slot(group_id, 0, None, None, self._finished[group_id])
        raise UnknownGroup(f"group {group_id!r} was never reserved in this buffer")

    def _check_not_busy(self, group_id: str) -> None:
        if group_id in self._busy:
            raise GroupBusy(
                f"group {group_id!r} has a store call in flight ({self._busy[group_id]}); "
                f"another task must not change it until that call returns"
            )

    def _slot_for(self, group_id: str, event: Event, actor: Actor) -> Slot:
        """The group's slot, once the model has said `event` is legal for it: the lifecycle is
        checked before the arguments, so a wrong-state call is reported as such."""
        slot = self._held_or_finished(group_id)
        fire(group_id, slot.state, event, actor=actor, guard=Guard.COMPLETE)
        return slot

    def _check_rows(self, group_id: str, rows: Sequence[Row]) -> frozenset[str]:
        return check_rows(group_id, rows, group_size=self.config.group_size, owner=self._owner)

    def _fire_all(self, slots: Sequence[Slot], event: Event, actor: Actor) -> None:
        """Fire `event` on every slot, all or none: the model is asked about each first."""
        targets = [fire(s.group_id, s.state, event, actor=actor) for s in slots]
        for slot, target in zip(slots, targets, strict=True):
            self._enter(slot, target)

    def _enter(self, slot: Slot, target: GroupState) -> None:
        """Apply a state `fire` returned, keeping the counters in step."""
        self._counts[slot.state] -= 1
        self._counts[target] += 1
        key = (slot.state, slot.target_step)
        self._state_per_step[key] -= 1
        if not self._state_per_step[key]:
            del self._state_per_step[key]
        self._state_per_step[target, slot.target_step] += 1
        if slot.state in LIVE_STATES and target not in LIVE_STATES:
            self._live_per_step[slot.target_step] -= 1
            if not self._live_per_step[slot.target_step]:
                del self._live_per_step[slot.target_step]
        slot.state = target
        self.changed.notify()

    async def _let_go(self, slots: Sequence[Slot]) -> None:
        """Clear finished groups' rows in one store call, then forget their slots at once
        (their terminal states are kept): no other task sees some of them gone and others
        still held, so the capacity they free is free all at once (as the model frees it).

        Shielded: once a group has reached its terminal state its rows must go, or they would be
        orphaned; the wait is one store call."""
        sample_ids = [sid for slot in slots for sid in slot.sample_ids]
        if sample_ids:
            for slot in slots:
                self._busy[slot.group_id] = "clearing rows"
            try:
                with trio.CancelScope(shield=True):
                    await self._store_call(self.store.clear, sample_ids)
            finally:
                for slot in slots:
                    del self._busy[slot.group_id]
        for slot in slots:
            self._forget(slot)
        self.changed.notify()

    def _forget(self, slot: Slot) -> None:
        for sid in slot.sample_ids:
            del self._owner[sid]
        del self._slots[slot.group_id]
        same_step = self._per_step[slot.target_step]
        del same_step[slot.group_id]
        if not same_step:
            del self._per_step[slot.target_step]
        self._counts[slot.state] -= 1
        self._state_per_step[slot.state, slot.target_step] -= 1
        if not self._state_per_step[slot.state, slot.target_step]:
            del self._state_per_step[slot.state, slot.target_step]
        self._finished[slot.group_id] = slot.state
        if len(self._finished) > max(FINISHED_MEMORY, 8 * self.config.capacity):
            self._finished.popitem(last=False)

    def _selectable(self, slot: Slot, step: int, weight_version: int) -> bool:
        if self._stale(slot, step, weight_version):
            return False
        return self.config.sampler is Sampler.WINDOWED or slot.target_step == step

    def _stale(self, slot: Slot, step: int, weight_version: int) -> bool:
        """True when no later `select` can pick this group (steps and versions only grow)."""
        limit = self.config.max_staleness_versions
        too_old = (
            limit is not None
            and slot.start_weight_version is not None
            and decisions.too_stale(
                weight_version=weight_version,
                start_version=slot.start_weight_version,
                max_staleness=limit,
            )
        )
        if self.config.sampler is Sampler.IN_ORDER:
            return too_old or slot.target_step < step
        return too_old

    async def _store_call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Call the store: inline when it is in-process, else in a worker thread that is never
        abandoned, so a cancelled caller still waits for the store to finish."""
        if self.store.blocking:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        return fn(*args, **kwargs)

    async def _clear_after_failed_write(
        self, group_id: str, sample_ids: Sequence[str], error: BaseException
    ) -> None:
        try:
            with trio.CancelScope(shield=True):
                await self._store_call(self.store.clear, sample_ids, missing_ok=True)
        except Exception as cleanup_error:
            error.add_note(
                f"clearing the partial rows of group {group_id!r} also failed: {cleanup_error!r}"
            )
