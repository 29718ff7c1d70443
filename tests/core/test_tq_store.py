"""The TransferQueue store's traps, each handled and tested: a default config too big for a
small machine (sized, or refused naming the numbers), jagged reads (densified), rows or fields
silently dropped by a read (checked: `MissingDataError`), writes that silently overwrite
(checked: `DuplicateDataError`), a close that would kill the shared controller (only the owner
closes), calls without a time limit (bounded: `StoreTimeout`), and an asyncio API trio cannot
await (the buffer calls the store from worker threads: a pipeline runs on it). Seeded bugs show
each check can fail. The contract every store meets is in `tests/core/test_store.py`.

One local Ray (2 CPUs) and one TransferQueue (1 storage unit) for the module. Skipped without
the `tq` extra.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from groupflow.impl._core import keep_ray_local

keep_ray_local()
ray = pytest.importorskip(
    "ray", reason="the TransferQueue store needs the tq extra: pip install -e '.[tq]'"
)
transfer_queue = pytest.importorskip(
    "transfer_queue", reason="the TransferQueue store needs the tq extra: pip install -e '.[tq]'"
)
torch = pytest.importorskip("torch", reason="the tq extra brings torch")

import trio  # noqa: E402

from groupflow.impl import PipelineConfig, RaySettings, ScoringConfig, ray_session  # noqa: E402
from groupflow.impl._core import PAD_PREFIX, RaySession  # noqa: E402
from groupflow.impl._core import _tq_store as tq_module  # noqa: E402
from groupflow.impl._core._tq_store import TransferQueueStore  # noqa: E402
from groupflow.impl._pipeline import build_pipeline  # noqa: E402
from groupflow.impl.errors import (  # noqa: E402
    CallOrderError,
    ConfigError,
    DuplicateDataError,
    MissingDataError,
    StoreError,
    StoreTimeout,
)
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer  # noqa: E402
from tests import ray_fakes  # noqa: E402
from tests.helpers import STEP_OF_FOUR  # noqa: E402

pytestmark = pytest.mark.tq

CPUS = 2
"""TransferQueue's controller and one storage unit take one CPU each."""


@pytest.fixture(scope="module")
def session() -> Iterator[RaySession]:
    with ray_session(RaySettings(num_cpus=CPUS)) as opened:
        yield opened


@pytest.fixture(scope="module")
def owner(session: RaySession) -> Iterator[TransferQueueStore]:
    with TransferQueueStore.open(timeout_s=30) as store:
        assert store.owner
        yield store


@pytest.fixture
def store(owner: TransferQueueStore) -> Iterator[TransferQueueStore]:
    """A partition of its own, emptied afterwards."""
    s = TransferQueueStore.open(partition=f"t-{uuid.uuid4().hex[:8]}", timeout_s=30)
    assert not s.owner
    yield s
    s.clear(s.list_ids())
    s.close()


# -- sizing (before TransferQueue starts) ------------------------------------------------------


def test_opening_without_ray_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # whatever this process's Ray is doing (a module's session may be up), the check sees none
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(CallOrderError, match="ray_session"):
        TransferQueueStore.open()


def test_too_many_storage_units_for_the_cpus_is_refused_naming_both(session: RaySession) -> None:
    """TransferQueue's default (two storage units) waits forever on a 2-CPU Ray: refused."""
    with pytest.raises(ConfigError) as info:
        TransferQueueStore.open(storage_units=2)
    assert info.value.field == "storage_units"
    assert "storage_units=2" in str(info.value) and "needs 3" in str(info.value)
    assert "has 2" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"), [("storage_units", 0), ("timeout_s", 0), ("start_timeout_s", -1)]
)
def test_open_refuses_bad_settings_naming_them(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        TransferQueueStore.open(**{field: value})
    assert info.value.field == field


# -- jagged reads, densified -------------------------------------------------------------------


def test_tensors_of_different_lengths_come_back_dense_and_equal(store: TransferQueueStore) -> None:
    rows = {
        "a": {"t": torch.tensor([1.5, 2.5, 3.5]), "m": torch.ones(2, 3, dtype=torch.int32)},
        "b": {"t": torch.tensor([4.5]), "m": torch.zeros(2, 3, dtype=torch.int32)},
    }
    store.put(rows)
    got = store.get(["a", "b"], ["t", "m"])
    for sid, fields in rows.items():
        for name, tensor in fields.items():
            value = got[sid][name]
            assert isinstance(value, torch.Tensor) and not value.is_nested, (sid, name)
            assert value.dtype == tensor.dtype and torch.equal(value, tensor), (sid, name)


def test_lists_of_different_lengths_come_back_as_lists(store: TransferQueueStore) -> None:
    store.put({"a": {"ids": [1, 2, 3]}, "b": {"ids": [4]}, "c": {"ids": [5, 6]}})
    assert store.get(["c", "a", "b"], ["ids"]) == {
        "c": {"ids": [5, 6]},
        "a": {"ids": [1, 2, 3]},
        "b": {"ids": [4]},
    }


# -- what a read drops, and what a write overwrites -----------------------------------------


def _stale(store: TransferQueueStore, extra: dict[str, dict[str, str]]) -> None:
    """Make the store's view of the partition claim more than TransferQueue holds: what it
    sees when another process clears rows between its listing and its read."""
    real = TransferQueueStore._catalogue

    def catalogue() -> dict[str, dict[str, str]]:
        listed = real(store)
        for sid, codecs in extra.items():
            listed[sid] = {**listed.get(sid, {}), **codecs}
        return listed

    store._catalogue = catalogue  # type: ignore[method-assign]


def test_a_row_transferqueue_drops_from_a_read_is_named(store: TransferQueueStore) -> None:
    store.put({"a": {"ids": [1]}, "b": {"ids": [2]}})
    _stale(store, {"ghost": {"ids": "ints"}})
    with pytest.raises(MissingDataError) as info:
        store.get(["a", "ghost", "b"], ["ids"])
    assert info.value.rows == ("ghost",)
    assert "'ghost'" in str(info.value)


def test_a_field_transferqueue_drops_from_a_read_is_named(store: TransferQueueStore) -> None:
    store.put({"a": {"ids": [1]}})
    _stale(store, {"a": {"lp": "floats"}})
    with pytest.raises(MissingDataError) as info:
        store.get(["a"], ["ids", "lp"])
    assert info.value.fields == {"a": ["lp"]}


def test_a_write_never_overwrites(store: TransferQueueStore) -> None:
    store.put({"a": {"ids": [1]}})
    with pytest.raises(DuplicateDataError):
        store.put({"a": {"ids": [2]}})
    with pytest.raises(DuplicateDataError):
        store.add_fields({"a": {"ids": [3]}})
    assert store.get(["a"], ["ids"]) == {"a": {"ids": [1]}}


def test_the_id_field_is_the_stores_own(store: TransferQueueStore) -> None:
    with pytest.raises(ValueError, match=tq_module.KEY_FIELD):
        store.put({"a": {tq_module.KEY_FIELD: "b"}})
    assert store.list_ids() == frozenset()


def test_padding_row_ids_with_a_nul_byte_are_kept(store: TransferQueueStore) -> None:
    pad = "\x00groupflow-pad/0123abcd"
    store.put({pad: {"ids": [1]}})
    assert store.list_ids() == {pad}
    assert store.get([pad], ["ids"]) == {pad: {"ids": [1]}}


# -- time limits -------------------------------------------------------------------------------


def _sleeping_call(store: TransferQueueStore, seconds: float) -> tuple[threading.Event, Any]:
    """Run a coroutine of `seconds` through the store's call path, on TransferQueue's loop;
    returns whether it was cancelled there, and the call's result or error."""
    cancelled = threading.Event()

    async def sleep() -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "slept"

    try:
        result: Any = store._call(sleep, "sleeping")
    except Exception as error:
        result = error
    return cancelled, result


def test_a_call_past_timeout_s_is_cancelled_and_raises(store: TransferQueueStore) -> None:
    store.timeout_s = 0.5
    started = time.monotonic()
    cancelled, result = _sleeping_call(store, 8.0)
    assert isinstance(result, StoreTimeout), result
    assert time.monotonic() - started < 3, "the call waited past timeout_s"
    assert "timeout_s=0.5" in str(result) and store.partition in str(result)
    assert isinstance(result, TimeoutError) and isinstance(result, StoreError)
    assert cancelled.wait(5), "the call went on running on TransferQueue's loop"


# -- from trio --------------------------------------------------------------------------------


async def test_a_pipeline_runs_on_the_store_from_trio(store: TransferQueueStore) -> None:
    """The buffer calls a blocking store from worker threads: the whole pipeline (rollout,
    teacher stage, training) runs on TransferQueue under trio, trains every prompt once, and
    leaves no row behind."""
    config = PipelineConfig(
        shape=STEP_OF_FOUR,
        scoring=ScoringConfig(flush_after_s=0.05),
    )
    pipeline = build_pipeline(
        config,
        prompts=list(range(8)),
        generator=FakeGenerator(latency=lambda ordinal: 0.01),
        learner=FakeLearner(latency=0.01),
        scorer=FakeScorer(fixed=0.01),
        store=store,
        train_fields=["input_ids", "generation_logprobs"],
    )
    with trio.fail_after(60):
        result = await pipeline.run()
    assert result.trained == frozenset(range(8)) and not result.shortfall
    assert await trio.to_thread.run_sync(store.list_ids) == frozenset()


# -- ownership ---------------------------------------------------------------------------------


def test_a_store_closed_in_another_process_leaves_transferqueue_running(
    store: TransferQueueStore,
) -> None:
    """A Ray worker (another process) joins, writes a row, and closes its store: the owner's
    TransferQueue goes on, and the row is there."""
    task = ray.remote(num_cpus=0)(ray_fakes.join_write_close)  # TransferQueue holds the CPUs
    opened = ray.get(task.remote(store.partition, "from-worker"), timeout=120)
    assert opened == {"owner": False}
    store.timeout_s = 10
    assert store.get(["from-worker"], ["ids"]) == {"from-worker": {"ids": [7, 8]}}


def _other_store_comes_and_goes(store: TransferQueueStore) -> None:
    """Another store in this process (not the owner) writes a row and closes; the owner's
    TransferQueue must still answer."""
    other = TransferQueueStore.open(partition=f"o-{uuid.uuid4().hex[:8]}", timeout_s=10)
    assert not other.owner
    other.put({"x": {"ids": [1]}})
    other.clear(["x"])
    other.close()
    store.put({"after": {"ids": [2]}})
    assert store.get(["after"], ["ids"]) == {"after": {"ids": [2]}}


def test_a_store_that_does_not_own_transferqueue_leaves_it_running(
    store: TransferQueueStore,
) -> None:
    _other_store_comes_and_goes(store)
    closed = TransferQueueStore.open(partition=store.partition, timeout_s=10)
    closed.close()
    with pytest.raises(CallOrderError, match="closed"):
        closed.list_ids()
    assert store.list_ids() == {"after"}


# -- seeded bugs ------------------------------------------------------------------------------


def _put_trusts_transferqueue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TransferQueueStore, "_existing", lambda self, ids: [])


def _reads_trust_transferqueue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TransferQueueStore, "_check_read", lambda self, ids, fields, data: None)
    original = tq_module._cells
    monkeypatch.setattr(
        tq_module, "_cells", lambda column, rows, field: original(column, len(list(column)), field)
    )


def _reads_not_densified(monkeypatch: pytest.MonkeyPatch) -> None:
    original = tq_module._decode
    monkeypatch.setattr(
        tq_module, "_decode", lambda codec, cell: cell if codec == "ints" else original(codec, cell)
    )


def _no_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TransferQueueStore, "_wait", lambda self, future, what: future.result())


def _any_store_closes_transferqueue(monkeypatch: pytest.MonkeyPatch) -> None:
    def close(self: TransferQueueStore) -> None:
        self._closed = True
        transfer_queue.close()

    monkeypatch.setattr(TransferQueueStore, "close", close)


def _check_owner_survives(store: TransferQueueStore) -> None:
    try:
        _other_store_comes_and_goes(store)
    except AssertionError:
        raise
    except Exception as error:  # TransferQueue is gone: the owner's next call cannot work
        raise AssertionError(f"the owner's TransferQueue stopped answering: {error!r}") from error
    finally:
        _restart_if_shut_down()


def _restart_if_shut_down() -> None:
    """Put back a TransferQueue a seeded bug shut down, once Ray has its CPUs back (its actors
    die a moment after they are killed), so the module's later tests have one."""
    if transfer_queue.interface._TQ_CLIENT is not None:
        return
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    TransferQueueStore.open(timeout_s=30)


def _check_duplicates(store: TransferQueueStore) -> None:
    test_a_write_never_overwrites(store)


def _check_dropped_row(store: TransferQueueStore) -> None:
    test_a_row_transferqueue_drops_from_a_read_is_named(store)


def _check_dense(store: TransferQueueStore) -> None:
    test_lists_of_different_lengths_come_back_as_lists(store)


def _check_time_limit(store: TransferQueueStore) -> None:
    """The time-limit test with a guard: a call still waiting after 3 s fails the check."""
    store.timeout_s = 0.5
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(_sleeping_call(store, 4.0)), daemon=True)
    thread.start()
    thread.join(timeout=3)
    hung = thread.is_alive()
    thread.join(timeout=10)
    assert not hung, "the call ignored timeout_s"


TQ_BUGS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Callable[[Any], None], str]] = {
    # name: (the bug, the check that must fail, what its failure says)
    "put trusts TransferQueue not to overwrite": (
        _put_trusts_transferqueue,
        _check_duplicates,
        "DID NOT RAISE",
    ),
    "reads trust TransferQueue to return every row": (
        _reads_trust_transferqueue,
        _check_dropped_row,
        "DID NOT RAISE|ValueError: zip",
    ),
    "jagged reads are not densified": (_reads_not_densified, _check_dense, r"tensor\("),
    "calls wait without a time limit": (
        _no_time_limit,
        _check_time_limit,
        "the call ignored timeout_s",
    ),
    "a store that does not own TransferQueue shuts it down": (
        _any_store_closes_transferqueue,
        _check_owner_survives,
        "stopped answering|Please initialize the TransferQueue",
    ),
}


@pytest.mark.parametrize("bug", sorted(TQ_BUGS))
def test_seeded_tq_bugs_are_caught(
    bug: str, store: TransferQueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply, check, says = TQ_BUGS[bug]
    apply(monkeypatch)
    # a check fails by an assertion, or by the store raising what it must not
    with pytest.raises((Exception, pytest.fail.Exception)) as caught:
        check(store)
    failure = f"{type(caught.value).__name__}: {caught.value}"
    assert re.search(says, failure), failure[:2000]


# -- the pipeline machine over the store --------------------------------------------------


MACHINE_EXAMPLES = 10
MACHINE_STEPS = 30


def _machine_over_tq(monkeypatch: pytest.MonkeyPatch) -> list[TransferQueueStore]:
    """Every pipeline the machine builds (one per incarnation) gets a fresh partition. The
    machine settles when every trio task is blocked, and a task waiting on a worker thread
    counts as blocked, so its stores are called inline (`blocking=False`): the machine still
    checks its invariants against what TransferQueue holds after every rule."""
    from groupflow.properties import pipeline_machine

    made: list[TransferQueueStore] = []

    def build(*args: Any, **kwargs: Any) -> Any:
        fresh = TransferQueueStore.open(partition=f"m-{uuid.uuid4().hex[:8]}", timeout_s=30)
        fresh.blocking = False
        made.append(fresh)
        return build_pipeline(*args, store=fresh, **kwargs)

    monkeypatch.setattr(pipeline_machine, "build_pipeline", build)
    return made


def _drop(made: list[TransferQueueStore]) -> None:
    for s in made:
        s.clear(s.list_ids())
        s.close()


def test_the_pipeline_machine_runs_over_the_store(
    owner: TransferQueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from groupflow.properties import pipeline_machine
    from groupflow.properties.pipeline_machine import run_pipeline_machine

    made = _machine_over_tq(monkeypatch)
    try:
        run_pipeline_machine(max_examples=MACHINE_EXAMPLES, steps=MACHINE_STEPS, derandomize=True)
        assert pipeline_machine.stats["completed"] > 0, pipeline_machine.stats
        assert len(made) >= MACHINE_EXAMPLES
    finally:
        _drop(made)


def test_the_pipeline_machine_over_the_store_catches_a_clear_that_skips_padding(
    owner: TransferQueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded bug in the store: `clear` leaves padding rows behind. The machine, run over
    the store, finds them."""
    from groupflow.properties.pipeline_machine import run_pipeline_machine

    original = TransferQueueStore.clear

    def clear(self: TransferQueueStore, sample_ids: Any, *, missing_ok: bool = False) -> None:
        kept = [sid for sid in sample_ids if not sid.startswith(PAD_PREFIX)]
        original(self, kept, missing_ok=missing_ok)

    monkeypatch.setattr(TransferQueueStore, "clear", clear)
    made = _machine_over_tq(monkeypatch)
    try:
        with pytest.raises(AssertionError, match=r"padding rows left|no live group owns: \[.*pad/"):
            run_pipeline_machine(
                max_examples=MACHINE_EXAMPLES * 4,
                steps=MACHINE_STEPS,
                derandomize=True,
                shrink=False,
            )
    finally:
        monkeypatch.setattr(TransferQueueStore, "clear", original)
        _drop(made)
