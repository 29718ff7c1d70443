"""Tasks that touch a group while a store call for it is still in flight (a blocking store yields)."""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import pytest
import trio

from groupflow.impl import BufferConfig, MemoryStore, ReplayBuffer, Row
from groupflow.model import GroupState, assert_invariants


class GatedStore(MemoryStore):
    """A blocking store whose calls named in `gated` (writes and clears unless told) wait for
    the test to open a gate."""

    def __init__(self, gated: Collection[str] = ("put", "clear")) -> None:
        super().__init__(blocking=True)
        self.gated = frozenset(gated)
        self.started = threading.Event()
        self.gate = threading.Event()

    def _wait(self, call: str) -> None:
        if call not in self.gated:
            return
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"

    def put(self, rows: Mapping[str, Any]) -> None:
        self._wait("put")
        super().put(rows)

    def clear(self, sample_ids: Iterable[str], *, missing_ok: bool = False) -> None:
        self._wait("clear")
        super().clear(sample_ids, missing_ok=missing_ok)

    def get(self, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, dict[str, Any]]:
        self._wait("get")
        return super().get(sample_ids, fields)


def _rows(gid: str, n: int = 2) -> list[Row]:
    return [Row(f"{gid}-{i}", {"input_ids": i}) for i in range(n)]


async def _wait_started(store: GatedStore) -> None:
    assert await trio.to_thread.run_sync(store.started.wait, 60)


async def test_group_with_a_commit_in_flight_refuses_other_changes() -> None:
    store = GatedStore()
    buffer = ReplayBuffer(BufferConfig(group_size=2, capacity=4), store)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: buffer.commit(gid, _rows(gid), start_weight_version=0, end_weight_version=0)
            )
            await _wait_started(store)
            with pytest.raises(RuntimeError, match=rf"{gid!r}.*commit"):
                await buffer.discard(gid)
            with pytest.raises(RuntimeError, match="in flight"):
                await buffer.commit(
                    gid, _rows("other"), start_weight_version=0, end_weight_version=0
                )
            other = buffer.reserve(target_step=0)
            with pytest.raises(ValueError, match="already in use"):
                await buffer.commit(other, _rows(gid), start_weight_version=0, end_weight_version=0)
            store.gate.set()
    assert buffer.state_of(gid) is GroupState.READY
    assert_invariants(buffer.snapshot())


async def test_cancelled_commit_still_finishes_its_write() -> None:
    """The store thread is never abandoned: the rows land and the group moves on, whole."""
    store = GatedStore()
    buffer = ReplayBuffer(BufferConfig(group_size=2, capacity=4), store)
    gid = buffer.reserve(target_step=0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: buffer.commit(
                    gid, _rows(gid), start_weight_version=0, end_weight_version=0, defer_ready=True
                )
            )
            await _wait_started(store)
            nursery.cancel_scope.cancel()
            store.gate.set()
    assert buffer.state_of(gid) is GroupState.WRITTEN
    assert store.list_ids() == {f"{gid}-0", f"{gid}-1"}
    assert_invariants(buffer.snapshot())


async def test_release_twice_concurrently_is_refused() -> None:
    store = GatedStore()
    store.gate.set()
    buffer = ReplayBuffer(BufferConfig(group_size=2, capacity=4), store)
    gid = buffer.reserve(target_step=0)
    await buffer.commit(gid, _rows(gid), start_weight_version=0, end_weight_version=0)
    selection = buffer.select(step=0, weight_version=0)
    store.gate.clear()
    store.started.clear()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(buffer.release, selection.group_ids)
            await _wait_started(store)
            with pytest.raises(RuntimeError, match="clearing rows"):
                await buffer.release(selection.group_ids)
            store.gate.set()
    assert buffer.state_of(gid) is GroupState.CONSUMED
    assert not store.list_ids()
    assert_invariants(buffer.snapshot())


async def test_a_group_read_for_a_checkpoint_is_left_alone_meanwhile() -> None:
    """Selected or evicted while its rows are read, a group would be saved READY and yet
    trained or dropped too: trained twice, or lost, after a resume. A second read at once
    would free the group when it ended, while the first still reads."""
    store = GatedStore(gated=["get"])
    buffer = ReplayBuffer(BufferConfig(group_size=2, capacity=4), store)
    gid = buffer.reserve(target_step=0)
    await buffer.commit(gid, _rows(gid), start_weight_version=0, end_weight_version=0)
    saved: list[dict[str, Any]] = []

    async def checkpoint() -> None:
        saved.append(await buffer.state_dict())

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(checkpoint)
            await _wait_started(store)
            try:
                with pytest.raises(RuntimeError, match=rf"{gid!r}.*checkpoint read"):
                    buffer.select(step=0, weight_version=0)
                with pytest.raises(RuntimeError, match=rf"{gid!r}.*checkpoint read"):
                    await buffer.evict_stale(step=1, weight_version=0)
                with pytest.raises(RuntimeError, match=rf"{gid!r}.*checkpoint read"):
                    await buffer.state_dict()
            finally:
                store.gate.set()
    assert [g["group_id"] for g in saved[0]["groups"]] == [gid]
    assert buffer.select(step=0, weight_version=0).group_ids == (gid,)
    assert_invariants(buffer.snapshot())
