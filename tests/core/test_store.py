"""The `SampleStore` contract, one suite over every store: `MemoryStore` (the embedded default
and the reference) and `TransferQueueStore` (rows in TransferQueue, on a local Ray; skipped,
saying why, without the `tq` extra). Then what only `MemoryStore` has."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from groupflow.impl import MemoryStore, SampleStore
from groupflow.impl._core import keep_ray_local
from groupflow.impl.errors import DuplicateDataError, MissingDataError

NewStore = Callable[[], Any]
"""Makes an empty store of the kind under test (each call a separate one)."""


@pytest.fixture(scope="module")
def tq_owner() -> Iterator[Any]:
    """One local Ray and one TransferQueue for the module's TransferQueue cases (owned, so
    shut down at the end); each case gets a partition of its own."""
    keep_ray_local()
    pytest.importorskip(
        "ray", reason="the TransferQueue store needs the tq extra: pip install -e '.[tq]'"
    )
    pytest.importorskip(
        "transfer_queue",
        reason="the TransferQueue store needs the tq extra: pip install -e '.[tq]'",
    )
    from groupflow.impl import RaySettings, ray_session
    from groupflow.impl._core._tq_store import TransferQueueStore

    with ray_session(RaySettings(num_cpus=2)), TransferQueueStore.open(timeout_s=30) as owner:
        yield owner


@pytest.fixture(params=["memory", pytest.param("tq", marks=pytest.mark.tq)])
def new_store(request: pytest.FixtureRequest) -> Iterator[NewStore]:
    if request.param == "memory":
        yield MemoryStore
        return
    owner = request.getfixturevalue("tq_owner")
    from groupflow.impl._core._tq_store import TransferQueueStore

    made: list[Any] = []

    def make() -> Any:
        made.append(
            TransferQueueStore.open(partition=f"contract-{uuid.uuid4().hex[:8]}", timeout_s=30)
        )
        return made[-1]

    yield make
    for store in made:  # nothing left behind in the shared TransferQueue
        store.clear(store.list_ids())
        store.close()
    assert owner.list_ids() == frozenset()


@pytest.fixture
def store(new_store: NewStore) -> Any:
    """Two rows, `a` and `b`, each with `input_ids`."""
    s = new_store()
    s.put({"a": {"input_ids": [1, 2]}, "b": {"input_ids": [3]}})
    return s


def contents(store: Any) -> dict[str, dict[str, object]]:
    """Everything the store holds, to compare before and after a call."""
    return {sid: store.get([sid], sorted(store.fields_of(sid)))[sid] for sid in store.list_ids()}


# -- the happy paths ---------------------------------------------------------------------


def test_put_then_get_returns_the_fields(store: Any) -> None:
    assert store.get(["a", "b"], ["input_ids"]) == {
        "a": {"input_ids": [1, 2]},
        "b": {"input_ids": [3]},
    }


def test_get_returns_rows_in_the_order_asked_for(store: Any) -> None:
    store.add_fields({"b": {"logprobs": [0.25, -1.5]}, "a": {"logprobs": [0.5]}})
    got = store.get(["b", "a"], ["logprobs", "input_ids"])
    assert list(got) == ["b", "a"]
    assert got == {
        "b": {"logprobs": [0.25, -1.5], "input_ids": [3]},
        "a": {"logprobs": [0.5], "input_ids": [1, 2]},
    }


def test_values_come_back_as_they_were_written(new_store: NewStore) -> None:
    """Lists of ints and floats of any length (jagged across rows), numbers, strings, None,
    nested structures: each comes back equal, floats to the last bit."""
    s = new_store()
    rows: dict[str, dict[str, Any]] = {
        "x": {
            "ids": [5, 6, 7],
            "lp": [0.1, -2.5e-300],
            "n": 3,
            "w": 0.7,
            "tag": "math",
            "none": None,
        },
        "y": {"ids": [], "lp": [1.0], "n": -(2**40), "w": -0.0, "tag": "", "none": None},
        "z": {"ids": [9], "lp": [], "n": 0, "w": 1e308, "tag": "code", "none": None},
        "q": {"meta": {"agent": "math", "turns": [1, 2]}, "flags": [True, False]},
    }
    s.put(rows)
    for sid, fields in rows.items():
        got = s.get([sid], sorted(fields))[sid]
        assert got == fields, sid
        assert [type(v) for v in got.values()] == [type(fields[f]) for f in got], sid


def test_get_returns_only_the_fields_asked_for(store: Any) -> None:
    store.add_fields({"a": {"logprobs": [0.5]}})
    assert store.get(["a"], ["logprobs"]) == {"a": {"logprobs": [0.5]}}


def test_get_of_no_fields_returns_empty_rows(store: Any) -> None:
    assert store.get(["a"], []) == {"a": {}}


def test_put_copies_the_field_mapping(new_store: NewStore) -> None:
    s = new_store()
    fields: dict[str, Any] = {"input_ids": [1]}
    s.put({"x": fields})
    fields["extra"] = 2
    assert s.fields_of("x") == {"input_ids"}


def test_list_ids_and_len_follow_puts_and_clears(store: Any) -> None:
    assert store.list_ids() == {"a", "b"}
    assert len(store) == 2
    store.put({"c": {}})
    assert store.list_ids() == {"a", "b", "c"}
    store.clear(["a", "c"])
    assert store.list_ids() == {"b"}
    assert len(store) == 1


def test_empty_store_lists_nothing(new_store: NewStore) -> None:
    s = new_store()
    assert s.list_ids() == frozenset()
    assert len(s) == 0


def test_add_fields_adds_to_existing_rows(store: Any) -> None:
    store.add_fields({"a": {"logprobs": [0.1]}, "b": {"logprobs": [0.2], "reward": 1.0}})
    assert store.fields_of("a") == {"input_ids", "logprobs"}
    assert store.fields_of("b") == {"input_ids", "logprobs", "reward"}
    assert store.get(["b"], ["reward"]) == {"b": {"reward": 1.0}}


def test_fields_of_names_the_fields_of_one_row(store: Any) -> None:
    assert store.fields_of("a") == frozenset({"input_ids"})


def test_clear_removes_the_rows(store: Any) -> None:
    store.clear(["a"])
    assert store.list_ids() == {"b"}
    with pytest.raises(MissingDataError):
        store.get(["a"], [])


def test_clear_accepts_any_iterable(store: Any) -> None:
    store.clear(iter(["a", "b"]))
    assert store.list_ids() == frozenset()


def test_cleared_id_can_be_put_again(store: Any) -> None:
    store.clear(["a"])
    store.put({"a": {"other": 1}})
    assert store.fields_of("a") == {"other"}


# -- errors write nothing ----------------------------------------------------------------


def test_put_of_an_existing_id_raises_and_writes_nothing(store: Any) -> None:
    before = contents(store)
    with pytest.raises(DuplicateDataError) as info:
        store.put({"new": {"input_ids": [9]}, "a": {"input_ids": [0]}})
    assert "'a'" in str(info.value)
    assert "new" not in str(info.value)
    assert contents(store) == before
    assert "new" not in store.list_ids()


def test_duplicate_data_error_is_a_value_error() -> None:
    assert issubclass(DuplicateDataError, ValueError)


def test_add_fields_to_a_missing_row_raises_naming_it_and_writes_nothing(
    store: Any,
) -> None:
    before = contents(store)
    with pytest.raises(MissingDataError) as info:
        store.add_fields({"a": {"logprobs": [0.1]}, "ghost": {"logprobs": [0.2]}})
    assert info.value.rows == ("ghost",)
    assert "'ghost'" in str(info.value)
    assert contents(store) == before
    assert store.list_ids() == {"a", "b"}


def test_add_fields_of_a_present_field_raises_and_writes_nothing(store: Any) -> None:
    before = contents(store)
    with pytest.raises(DuplicateDataError) as info:
        store.add_fields({"a": {"logprobs": [0.1]}, "b": {"input_ids": [7], "reward": 1.0}})
    message = str(info.value)
    assert "'b'" in message
    assert "input_ids" in message
    assert "reward" not in message
    assert contents(store) == before


def test_get_of_a_missing_row_raises_naming_it(store: Any) -> None:
    with pytest.raises(MissingDataError) as info:
        store.get(["a", "ghost", "phantom"], ["input_ids"])
    assert info.value.rows == ("ghost", "phantom")
    assert info.value.fields == {}
    assert "'ghost'" in str(info.value)
    assert "'phantom'" in str(info.value)
    assert "'a'" not in str(info.value)


def test_get_of_a_missing_field_raises_naming_row_and_field(store: Any) -> None:
    store.add_fields({"a": {"logprobs": [0.1]}})
    with pytest.raises(MissingDataError) as info:
        store.get(["a", "b"], ["input_ids", "logprobs"])
    assert info.value.fields == {"b": ["logprobs"]}
    assert info.value.rows == ()
    message = str(info.value)
    assert "'b'" in message
    assert "logprobs" in message
    assert "'a'" not in message


def test_missing_data_error_is_a_lookup_error_with_a_plain_message() -> None:
    err = MissingDataError("the store has no rows ['x']", rows=["x"])
    assert isinstance(err, LookupError)
    assert str(err) == "the store has no rows ['x']"


def test_clear_of_a_missing_id_raises_and_clears_nothing(store: Any) -> None:
    with pytest.raises(MissingDataError) as info:
        store.clear(["a", "ghost"])
    assert info.value.rows == ("ghost",)
    assert "'ghost'" in str(info.value)
    assert store.list_ids() == {"a", "b"}


def test_clear_with_missing_ok_ignores_missing_ids(store: Any) -> None:
    store.clear(["a", "ghost"], missing_ok=True)
    assert store.list_ids() == {"b"}


def test_fields_of_a_missing_row_raises_naming_it(store: Any) -> None:
    with pytest.raises(MissingDataError) as info:
        store.fields_of("ghost")
    assert info.value.rows == ("ghost",)
    assert "'ghost'" in str(info.value)


# -- the protocol ------------------------------------------------------------------------


def test_every_store_satisfies_the_sample_store_protocol(new_store: NewStore) -> None:
    s = new_store()
    assert isinstance(s, SampleStore)
    assert isinstance(s.blocking, bool)


@pytest.mark.parametrize("blocking", [False, True])
def test_memory_store_satisfies_the_sample_store_protocol(blocking: bool) -> None:
    s = MemoryStore(blocking=blocking)
    assert isinstance(s, SampleStore)
    assert s.blocking is blocking


def test_memory_store_is_not_blocking_by_default() -> None:
    assert MemoryStore().blocking is False


def test_object_missing_store_methods_is_not_a_sample_store() -> None:
    class PutOnly:
        blocking = False

        def put(self, rows: object) -> None:  # pragma: no cover - never called
            pass

    assert not isinstance(PutOnly(), SampleStore)


def test_a_store_names_the_fields_rows_lack(new_store: NewStore) -> None:
    store = new_store()
    store.put({"a": {"x": 1}, "b": {"x": 1, "y": 2}})
    assert store.missing_fields(["a", "b", "c"], ["x", "y"]) == {"a": ["y"], "c": ["x", "y"]}
    assert store.missing_fields(["b"], ["x", "y"]) == {}
