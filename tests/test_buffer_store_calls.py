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

from groupflow.impl import MemoryStore
from groupflow.model import Actor, assert_invariants
from tests.helpers import INPUT, TEACHER, MakeBuffer, S, committed, new_buffer, row_ids, rows


class HalfWritingStore(MemoryStore):
    """Writes the first half of the rows it is given, then fails."""

    def __init__(self, *, blocking: bool = False) -> None:
        super().__init__(blocking=blocking)
        self.ids_at_failure: set[str] | None = None

    def put(self, rows: Any) -> None:
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
    assert len(store.threads) == 8  # 4 puts; clears: 1 discard, 2 evictions, 1 release
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
