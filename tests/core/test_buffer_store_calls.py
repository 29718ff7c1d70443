"""ReplayBuffer and its store: a write that fails half-way, a blocking store called from worker
threads, and store calls cancelled mid-way.

Every buffer made through the `make_buffer` fixture (`conftest.py`) has the model's invariants
asserted on its final snapshot when the test ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import trio

from groupflow.impl import MemoryStore, ReplayBuffer
from groupflow.impl._core import PAD_PREFIX
from groupflow.model import Actor, assert_invariants
from tests.helpers import (
    INPUT,
    TEACHER,
    MakeBuffer,
    S,
    committed,
    group_in,
    new_buffer,
    row_ids,
    rows,
    world,
)


class HalfWritingStore(MemoryStore):
    """Writes the first half of the rows it is given, then fails (while `failing`)."""

    def __init__(self, *, blocking: bool = False) -> None:
        super().__init__(blocking=blocking)
        self.ids_at_failure: set[str] | None = None
        self.failing = True

    def put(self, rows: Any) -> None:
        if not self.failing:
            super().put(rows)
            return
        items = list(rows.items())
        super().put(dict(items[: len(items) // 2]))
        self.ids_at_failure = set(self.list_ids())
        raise OSError("store connection lost mid-write")


@pytest.mark.parametrize("blocking", [False, True], ids=["inline", "thread"])
async def test_failed_store_write_clears_partial_rows_and_keeps_the_group_reserved(
    make_buffer: MakeBuffer, blocking: bool
) -> None:
    store = HalfWritingStore(blocking=blocking)
    buffer = make_buffer(store=store, group_size=4)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(60):
        with pytest.raises(OSError, match="mid-write"):
            await buffer.commit(gid, rows(gid, 4), start_weight_version=0, end_weight_version=0)
        assert store.ids_at_failure == {f"{gid}/0", f"{gid}/1"}
        assert store.list_ids() == frozenset()
        assert buffer.state_of(gid) is S.RESERVED
        assert buffer.group(gid).sample_ids == ()
        assert_invariants(buffer.snapshot())
        await buffer.discard(gid)
    assert buffer.state_of(gid) is S.DISCARDED
    assert len(buffer) == 0


async def test_a_group_whose_write_failed_commits_the_same_rows_again(
    make_buffer: MakeBuffer,
) -> None:
    """A failed write gives back the row ids it claimed: the rollout may try its rows again."""
    store = HalfWritingStore()
    buffer = make_buffer(store=store)
    gid = buffer.reserve(target_step=0)
    with pytest.raises(OSError, match="mid-write"):
        await buffer.commit(gid, rows(gid), start_weight_version=0, end_weight_version=0)
    store.failing = False
    await buffer.commit(gid, rows(gid), start_weight_version=0, end_weight_version=0)
    assert buffer.state_of(gid) is S.READY
    assert store.list_ids() == row_ids(gid)


class UnclearableStore(HalfWritingStore):
    """A HalfWritingStore whose clears fail too (while `failing`)."""

    def clear(self, sample_ids: Any, *, missing_ok: bool = False) -> None:
        if self.failing:
            raise OSError("store gone")
        super().clear(sample_ids, missing_ok=missing_ok)


async def test_a_failed_clear_after_a_failed_write_is_noted_on_the_write_error(
    make_buffer: MakeBuffer,
) -> None:
    """The caller sees the write's error, the one that says what went wrong, and a note that
    the partial rows are still in the store (strays, for `remove_rows`)."""
    store = UnclearableStore()
    buffer = make_buffer(store=store, group_size=4)
    gid = buffer.reserve(target_step=0)
    with pytest.raises(OSError, match="mid-write") as info:
        await buffer.commit(gid, rows(gid, 4), start_weight_version=0, end_weight_version=0)
    assert info.value.__notes__ == [
        f"clearing the partial rows of group {gid!r} also failed: OSError('store gone')"
    ]
    assert buffer.state_of(gid) is S.RESERVED
    assert await buffer.stray_rows() == [f"{gid}/0", f"{gid}/1"]
    store.failing = False
    await buffer.remove_rows(await buffer.stray_rows())
    assert store.list_ids() == frozenset()


class CancellingHalfWritingStore(HalfWritingStore):
    """A blocking HalfWritingStore whose write cancels `scope` (its caller's) before it fails:
    a shutdown that lands as the write fails."""

    def __init__(self, scope: trio.CancelScope) -> None:
        super().__init__(blocking=True)
        self.scope = scope

    def put(self, rows: Any) -> None:
        trio.from_thread.run_sync(self.scope.cancel)
        super().put(rows)


async def test_a_write_failing_as_its_caller_is_cancelled_still_clears_its_partial_rows(
    make_buffer: MakeBuffer,
) -> None:
    scope = trio.CancelScope()
    store = CancellingHalfWritingStore(scope)
    buffer = make_buffer(store=store, group_size=4)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(60), pytest.raises(OSError, match="mid-write"), scope:
        await buffer.commit(gid, rows(gid, 4), start_weight_version=0, end_weight_version=0)
    assert store.ids_at_failure == {f"{gid}/0", f"{gid}/1"}
    assert store.list_ids() == frozenset()
    assert buffer.state_of(gid) is S.RESERVED
    await buffer.discard(gid)


# -- rows no group owns ------------------------------------------------------------------


async def test_stray_rows_are_those_no_group_owns_with_padding_only_when_asked(
    buffer: ReplayBuffer,
) -> None:
    gid = await committed(buffer)
    pad = f"{PAD_PREFIX}0"
    buffer.store.put({"stray/0": {INPUT: 1}, pad: {INPUT: 2}})
    assert await buffer.stray_rows() == ["stray/0"]
    assert await buffer.stray_rows(padding=True) == sorted([pad, "stray/0"])
    await buffer.remove_rows(["stray/0", pad])
    assert buffer.store.list_ids() == row_ids(gid)


async def test_remove_rows_refuses_a_group_s_rows_and_takes_rows_already_gone(
    buffer: ReplayBuffer,
) -> None:
    """Refused for a group's row, which would orphan it; a row already gone (a teacher call
    clears its own padding) is no error."""
    gid = await committed(buffer)
    buffer.store.put({"stray/0": {INPUT: 1}})
    before = world(buffer)
    with pytest.raises(ValueError, match=rf"\['{gid}/1'\] belong to groups"):
        await buffer.remove_rows(["stray/0", f"{gid}/1"])
    assert world(buffer) == before
    await buffer.remove_rows(["stray/0", "gone/0"])
    assert buffer.store.list_ids() == row_ids(gid)


async def test_remove_rows_clears_even_when_its_caller_is_cancelled(
    make_buffer: MakeBuffer,
) -> None:
    """Rows found stray are removed whole: a caller cancelled then would leave them behind."""
    buffer = make_buffer(blocking=True)
    buffer.store.put({"stray/0": {INPUT: 1}, "stray/1": {INPUT: 2}})
    with trio.fail_after(60), trio.CancelScope() as scope:
        scope.cancel()
        await buffer.remove_rows(["stray/0", "stray/1"])
    assert buffer.store.list_ids() == frozenset()


# -- store calls made --------------------------------------------------------------------


class CallRecordingStore(MemoryStore):
    """A MemoryStore that records its reads and field checks, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def get(self, sample_ids: Any, fields: Any) -> dict[str, dict[str, Any]]:
        self.calls.append("get")
        return super().get(sample_ids, fields)

    def missing_fields(self, sample_ids: Any, fields: Any) -> dict[str, list[str]]:
        self.calls.append("missing_fields")
        return super().missing_fields(sample_ids, fields)


async def test_read_returns_the_named_fields_and_asks_nothing_for_no_rows(
    make_buffer: MakeBuffer,
) -> None:
    store = CallRecordingStore()
    buffer = make_buffer(store=store)
    gid = await committed(buffer)
    ids = sorted(row_ids(gid))
    assert await buffer.read(ids, [INPUT]) == {r.sample_id: dict(r.fields) for r in rows(gid)}
    assert await buffer.read([], [INPUT]) == {}
    assert store.calls == ["get"]


async def test_mark_ready_checks_the_store_only_for_fields_named(make_buffer: MakeBuffer) -> None:
    """One store call for the fields a stage names, none when it names none (a remote store
    is a round trip)."""
    store = CallRecordingStore()
    buffer = make_buffer(store=store)
    plain, named = await group_in(buffer, S.SCORING), await group_in(buffer, S.SCORING)
    assert await buffer.mark_ready(plain) is S.READY
    assert await buffer.mark_ready_many([], [TEACHER]) == ()
    assert store.calls == []
    assert await buffer.mark_ready(named, [INPUT]) is S.READY
    assert store.calls == ["missing_fields"]


# -- a blocking store --------------------------------------------------------------------


class ThreadRecordingStore(MemoryStore):
    """A blocking MemoryStore that records the thread of every call that writes or clears."""

    def __init__(self) -> None:
        super().__init__(blocking=True)
        self.threads: list[threading.Thread] = []

    def put(self, rows: Any) -> None:
        self.threads.append(threading.current_thread())
        super().put(rows)

    def clear(self, sample_ids: Any, *, missing_ok: bool = False) -> None:
        self.threads.append(threading.current_thread())
        super().clear(sample_ids, missing_ok=missing_ok)


async def test_blocking_store_works_end_to_end_through_worker_threads(
    make_buffer: MakeBuffer,
) -> None:
    store = ThreadRecordingStore()
    buffer = make_buffer(store=store, required_fields=(INPUT, TEACHER), max_staleness_versions=1)
    with trio.fail_after(60):
        scored = await committed(buffer, defer=True, fields=(INPUT,))
        buffer.take_for_scoring([scored])
        store.add_fields({sid: {TEACHER: 1.0} for sid in row_ids(scored)})
        assert await buffer.mark_ready(scored, [TEACHER]) is S.READY
        stale = await committed(buffer, target_step=0, start=0)
        dropped = await committed(buffer, defer=True)
        await buffer.discard(dropped, actor=Actor.STAGE)
        assert await buffer.evict_stale(step=0, weight_version=2) == (scored, stale)
        kept = await committed(buffer, target_step=1, start=2)
        state = await buffer.state_dict()
        selection = buffer.select(step=1, weight_version=2)
        assert selection.group_ids == (kept,)
        await buffer.release(selection.group_ids)
        restored = make_buffer(store=MemoryStore(blocking=True), required_fields=(INPUT, TEACHER))
        await restored.load_state_dict(state)
    assert restored.groups()[0].group_id == kept
    assert store.list_ids() == frozenset()
    assert len(store.threads) == 7  # 4 puts; clears: 1 discard, 1 for both evictions, 1 release
    assert all(t is not threading.main_thread() for t in store.threads)
    assert_invariants(buffer.snapshot())


# -- cancellation ------------------------------------------------------------------------


class SlowStore(MemoryStore):
    """A blocking store whose puts and clears sleep in their worker thread."""

    def __init__(self, delay: float = 0.2) -> None:
        super().__init__(blocking=True)
        self.delay = delay
        self.slow = True
        self.started = threading.Event()
        self.finished = threading.Event()

    def _slowly(self, write: Callable[[], None]) -> None:
        if not self.slow:
            write()
            return
        self.started.set()
        time.sleep(self.delay)
        write()
        self.finished.set()

    def put(self, rows: Any) -> None:
        self._slowly(partial(MemoryStore.put, self, rows))

    def clear(self, sample_ids: Any, *, missing_ok: bool = False) -> None:
        ids = list(sample_ids)
        self._slowly(partial(MemoryStore.clear, self, ids, missing_ok=missing_ok))


async def cancel_mid_call(store: SlowStore, fn: Callable[[], Any]) -> None:
    """Run `fn` and cancel it from outside once the store's thread is inside a slow call."""
    store.started.clear()
    store.finished.clear()
    store.slow = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fn)
        while not store.started.is_set():
            await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    store.slow = False


async def test_cancelled_commit_still_finishes_its_write(make_buffer: MakeBuffer) -> None:
    store = SlowStore()
    buffer = make_buffer(store=store)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(60):
        await cancel_mid_call(
            store,
            partial(buffer.commit, gid, rows(gid), start_weight_version=0, end_weight_version=0),
        )
    assert store.finished.is_set(), "the worker thread was abandoned mid-write"
    assert store.list_ids() == row_ids(gid)
    assert buffer.state_of(gid) is S.READY
    assert_invariants(buffer.snapshot())


async def test_cancelled_evict_stale_leaves_the_buffer_consistent() -> None:
    """Cancelled while clearing the first of two stale groups: every group must end either
    still READY with its rows, or DISCARDED, let go and cleared, so a later call can finish.

    (Built with `new_buffer`: the invariants are asserted here, not again at teardown.)"""
    store = SlowStore()
    buffer = new_buffer(store=store)
    store.slow = False
    first = await committed(buffer, target_step=0)
    second = await committed(buffer, target_step=0)
    with trio.fail_after(60):
        await cancel_mid_call(store, partial(buffer.evict_stale, step=1, weight_version=0))
        assert store.finished.is_set()
        assert_invariants(buffer.snapshot())
        await buffer.evict_stale(step=1, weight_version=0)
    assert [buffer.state_of(g) for g in (first, second)] == [S.DISCARDED, S.DISCARDED]
    assert store.list_ids() == frozenset()
    assert len(buffer) == 0


async def test_cancelled_release_leaves_the_buffer_consistent(make_buffer: MakeBuffer) -> None:
    store = SlowStore()
    buffer = make_buffer(store=store)
    store.slow = False
    first = await committed(buffer)
    second = await committed(buffer)
    selection = buffer.select(step=0, weight_version=0)
    with trio.fail_after(60):
        await cancel_mid_call(store, partial(buffer.release, selection.group_ids))
        assert store.finished.is_set()
        assert_invariants(buffer.snapshot())
        still_held = [g.group_id for g in buffer.groups()]
        await buffer.release(still_held)
    assert [buffer.state_of(g) for g in (first, second)] == [S.CONSUMED, S.CONSUMED]
    assert store.list_ids() == frozenset()
