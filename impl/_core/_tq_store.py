"""`TransferQueueStore`: a `SampleStore` whose rows live in TransferQueue, on Ray.

TransferQueue keeps rows (its keys) with named fields (its columns) in storage units on the
cluster's nodes, behind one controller actor. This store is a blocking one (the buffer calls
it from worker threads), and it handles what TransferQueue 0.1.x does not promise:

- Its default configuration wants more CPUs than a small machine has (a controller and two
  storage units, one CPU each): `open` sizes the storage units (`storage_units`, one by default)
  and refuses, naming both numbers, when Ray has too few CPUs free, instead of hanging.
- Its reads return jagged (nested) tensors for rows of different lengths: each value is
  densified back into what was written (a list of ints or floats, a number, a tensor, an object),
  by a codec recorded per row and field.
- Its reads silently drop rows or fields that are missing, and its writes silently overwrite:
  the store checks every request against the controller's list of keys first, and every read
  against what came back (each row carries its own id, read back and compared, in order), and
  raises `MissingDataError` or `DuplicateDataError` as the protocol promises.
- Only the process that started it may close it (`close()` from any other process would kill
  the shared controller): `close` shuts TransferQueue down only in the owner.
- Its asyncio API cannot be awaited from trio, and its sync API has no timeout: every call runs
  on TransferQueue's own event loop, and this store waits for it at most `timeout_s`, then
  cancels it and raises `StoreTimeout`.

Install with `pip install 'groupflow[tq]'`; Ray must be running (`ray_session`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

# TransferQueue sizes torch's threads per call from this, read when it is imported; past the
# machine's cores it logs a warning on every call
os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))

from groupflow.impl._core._ray_session import import_ray  # noqa: E402
from groupflow.impl._core._store import Fields  # noqa: E402
from groupflow.model.errors import (  # noqa: E402
    ArgumentError,
    CallOrderError,
    ConfigError,
    DuplicateDataError,
    MissingDataError,
    StoreError,
    StoreTimeout,
    Unavailable,
)

try:
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack
except ImportError as _missing:
    raise Unavailable(
        f"the TransferQueue store needs the tq extra ({_missing.name} is missing): "
        f"pip install 'groupflow[tq]'"
    ) from _missing

log = logging.getLogger("groupflow.store.tq")

_T = TypeVar("_T")

KEY_FIELD = "__groupflow_id__"
"""A field every row carries: its own id. Every read fetches it and compares it with the ids
asked for, in order, so a row TransferQueue dropped or reordered is an error, not a shift."""
TAG = "groupflow"
"""The key of a row's TransferQueue tag under which the store records the row's fields and
the codec of each."""
CONTROLLER = ("TransferQueueController", "transfer_queue")
"""The name and namespace of TransferQueue's controller actor (one per Ray cluster)."""

_INT64 = (-(2**63), 2**63 - 1)


# -- codecs: what a value was, so a read gives it back ------------------------------------------


def _is_int(value: object) -> bool:
    return (
        isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]
    )


def _codec(value: object) -> str:
    """How a field value is stored: "ints" or "floats" (a list of numbers: a 1-D int64 or
    float64 tensor, jagged across rows), "int" or "float" (a number), "tensor", or "object"
    (anything else, pickled by TransferQueue)."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if _is_int(value):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, list | tuple):
        if all(_is_int(v) for v in value):
            return "ints"
        if all(_is_int(v) or isinstance(v, float) for v in value):
            return "floats"
    return "object"


def _column(codec: str, values: list[Any]) -> Any:
    """One TensorDict column for the values of one field over a batch of rows."""
    if codec in ("ints", "floats"):
        dtype = torch.int64 if codec == "ints" else torch.float64
        tensors = [torch.tensor(list(v), dtype=dtype) for v in values]
        return _stack(tensors)
    if codec == "int":
        return torch.tensor(values, dtype=torch.int64)
    if codec == "float":
        return torch.tensor(values, dtype=torch.float64)
    if codec == "tensor":
        shapes = {tuple(v.shape) for v in values}
        dtypes = {v.dtype for v in values}
        if len(shapes) == 1 and len(dtypes) == 1:
            return torch.stack(values)
        if len(dtypes) == 1 and all(v.dim() == 1 for v in values):
            return _stack(values)
    return NonTensorStack(*values)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len({t.shape[0] for t in tensors}) == 1:
        return torch.stack(tensors)
    return torch.nested.nested_tensor(tensors, layout=torch.jagged)


def _cells(column: Any, rows: int, field: str) -> list[Any]:
    """A column read back, one cell per row: a jagged (nested) tensor is densified, a dense
    one split along its first dimension, a stack of objects listed."""
    if isinstance(column, torch.Tensor):
        cells: list[Any] = list(column.unbind(0))
    elif hasattr(column, "tolist"):
        cells = list(column.tolist())
    else:
        cells = list(column)
    if len(cells) != rows:
        raise MissingDataError(
            f"TransferQueue returned {len(cells)} values of field {field!r} for {rows} rows",
            fields={},
        )
    return cells


def _decode(codec: str, cell: Any) -> Any:
    if codec == "ints":
        return [int(v) for v in cell.tolist()]
    if codec == "floats":
        return [float(v) for v in cell.tolist()]
    if codec == "int":
        return int(cell.item())
    if codec == "float":
        return float(cell.item())
    if codec == "tensor" and isinstance(cell, torch.Tensor):
        return cell.clone()
    return cell


def _missing_rows_error(missing: Sequence[str]) -> MissingDataError:
    return MissingDataError(f"the store has no rows {sorted(missing)}", rows=missing)


# -- the store ---------------------------------------------------------------------------------


class TransferQueueStore:
    """A `SampleStore` on TransferQueue (see the module). Make one with `open`; thread-safe;
    one writing process per partition (the buffer's)."""

    blocking = True
    """Remote: the buffer calls it from worker threads."""

    def __init__(self, partition: str, *, timeout_s: float, owner: bool) -> None:
        """Use `open`."""
        self.partition = partition
        self.timeout_s = timeout_s
        self.owner = owner
        """Whether this store started TransferQueue (and so shuts it down on `close`)."""
        self._lock = threading.RLock()
        self._closed = False

    @classmethod
    def open(
        cls,
        *,
        partition: str | None = None,
        storage_units: int = 1,
        timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> TransferQueueStore:
        """A store on the TransferQueue of this Ray cluster, started here (with
        `storage_units` storage units: Ray needs one CPU free for each, plus one for the
        controller) if it is not running yet; then this store owns it. `partition` keeps its
        rows apart from other users' (default: a fresh one). Every later call waits at most
        `timeout_s`. Blocking: from trio, call it in a worker thread."""
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if not value > 0:
                raise ConfigError(
                    f"TransferQueueStore.{name} must be > 0 seconds, got {value!r}",
                    field=name,
                    config="TransferQueueStore",
                )
        if (
            isinstance(storage_units, bool)
            or not isinstance(storage_units, int)
            or storage_units < 1
        ):
            raise ConfigError(
                f"TransferQueueStore.storage_units must be a positive int, got {storage_units!r}",
                field="storage_units",
                config="TransferQueueStore",
            )
        ray = import_ray()
        if not ray.is_initialized():
            raise CallOrderError("TransferQueueStore.open needs a running Ray: open a ray_session")
        owner = not _controller_running(ray)
        if owner:
            free = float(ray.available_resources().get("CPU", 0.0))
            if free < 1 + storage_units:
                raise ConfigError(
                    f"TransferQueue with storage_units={storage_units} needs "
                    f"{1 + storage_units} free Ray CPUs (one for its controller, one per storage "
                    f"unit), and Ray has {free:g}: start Ray with more num_cpus or use fewer "
                    f"storage units (it would wait for them forever)",
                    field="storage_units",
                    config="TransferQueueStore",
                )
            conf = OmegaConf.create(
                {"backend": {"SimpleStorage": {"num_data_storage_units": storage_units}}}
            )
            _bounded(lambda: tq.init(conf), start_timeout_s, "starting TransferQueue")
        else:
            _bounded(tq.init, start_timeout_s, "connecting to the running TransferQueue")
        if not hasattr(tq.get_client(), "_loop"):
            raise Unavailable(
                f"transferqueue {getattr(tq, '__version__', '?')} has no client event loop; "
                f"groupflow's store needs transferqueue 0.1.x (pip install 'groupflow[tq]')"
            )
        store = cls(
            partition or f"groupflow-{uuid.uuid4().hex[:12]}", timeout_s=timeout_s, owner=owner
        )
        log.info(
            "TransferQueue store on partition %r (%s)",
            store.partition,
            "started here" if owner else "joined",
        )
        return store

    # -- the SampleStore protocol ----------------------------------------------------------------

    def put(self, rows: Mapping[str, Fields]) -> None:
        if not rows:
            return
        for sid, fields in rows.items():
            if KEY_FIELD in fields:
                raise ArgumentError(f"row {sid!r}: the field name {KEY_FIELD!r} is the store's own")
        with self._lock:
            existing = self._existing(rows)
            if existing:
                raise DuplicateDataError(
                    f"rows {existing} are already in the store; nothing written"
                )
            written: list[str] = []
            try:
                for ids, codecs in _by_codecs({s: dict(f) for s, f in rows.items()}):
                    columns = {KEY_FIELD: NonTensorStack(*ids)}
                    columns.update(
                        {f: _column(c, [rows[s][f] for s in ids]) for f, c in codecs.items()}
                    )
                    tags = [{TAG: dict(codecs)} for _ in ids]
                    self._batch_put(ids, columns, tags)
                    written += ids
            except BaseException:
                if written:
                    self._clear_quietly(written)
                raise

    def add_fields(self, values: Mapping[str, Fields]) -> None:
        if not values:
            return
        for sid, fields in values.items():
            if KEY_FIELD in fields:
                raise ArgumentError(f"row {sid!r}: the field name {KEY_FIELD!r} is the store's own")
        with self._lock:
            catalogue = self._catalogue()
            missing = [sid for sid in values if sid not in catalogue]
            if missing:
                raise _missing_rows_error(missing)
            clashes = {
                sid: sorted(set(fields) & catalogue[sid].keys())
                for sid, fields in values.items()
                if set(fields) & catalogue[sid].keys()
            }
            if clashes:
                raise DuplicateDataError(
                    f"fields already present, nothing written: {dict(sorted(clashes.items()))}"
                )
            adding = {sid: dict(fields) for sid, fields in values.items() if fields}
            for ids, codecs in _by_codecs(adding):
                columns = {f: _column(c, [values[s][f] for s in ids]) for f, c in codecs.items()}
                tags = [{TAG: {**catalogue[s], **codecs}} for s in ids]
                self._batch_put(ids, columns, tags)

    def get(self, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, dict[str, Any]]:
        ids = list(dict.fromkeys(sample_ids))
        if not ids:
            return {}
        with self._lock:
            catalogue = self._catalogue()
            missing = [sid for sid in ids if sid not in catalogue]
            if missing:
                raise _missing_rows_error(missing)
            lacking = {
                sid: sorted(set(fields) - catalogue[sid].keys())
                for sid in ids
                if set(fields) - catalogue[sid].keys()
            }
            if lacking:
                raise MissingDataError(
                    f"rows lack fields: {dict(sorted(lacking.items()))}", fields=lacking
                )
            out: dict[str, dict[str, Any]] = {sid: {} for sid in ids}
            if not fields:
                return out
            wanted = list(dict.fromkeys(fields))
            by_codecs: dict[tuple[str, ...], list[str]] = {}
            for sid in ids:
                by_codecs.setdefault(tuple(catalogue[sid][f] for f in wanted), []).append(sid)
            for codecs, group in by_codecs.items():
                read = functools.partial(
                    tq.async_kv_batch_get,
                    keys=group,
                    partition_id=self.partition,
                    select_fields=[KEY_FIELD, *wanted],
                )
                data = self._call(read, f"reading {len(group)} rows")
                self._check_read(group, wanted, data)
                for field, codec in zip(wanted, codecs, strict=True):
                    cells = _cells(data[field], len(group), field)
                    for sid, cell in zip(group, cells, strict=True):
                        out[sid][field] = _decode(codec, cell)
        return {sid: out[sid] for sid in sample_ids}

    def clear(self, sample_ids: Iterable[str], *, missing_ok: bool = False) -> None:
        ids = list(dict.fromkeys(sample_ids))
        if not ids:
            return
        with self._lock:
            catalogue = self._catalogue()
            missing = [sid for sid in ids if sid not in catalogue]
            if missing and not missing_ok:
                raise _missing_rows_error(missing)
            present = [sid for sid in ids if sid in catalogue]
            if present:
                self._call(
                    lambda: tq.async_kv_clear(keys=present, partition_id=self.partition),
                    f"clearing {len(present)} rows",
                )

    def list_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._catalogue())

    def missing_fields(
        self, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[str]]:
        wanted = set(fields)
        with self._lock:
            catalogue = self._catalogue()
        out: dict[str, list[str]] = {}
        for sid in sample_ids:
            have = catalogue.get(sid)
            lacking = wanted if have is None else wanted - have.keys()
            if lacking:
                out[sid] = sorted(lacking)
        return out

    def fields_of(self, sample_id: str) -> frozenset[str]:
        """The names of the fields one row has."""
        with self._lock:
            fields = self._catalogue().get(sample_id)
        if fields is None:
            raise _missing_rows_error([sample_id])
        return frozenset(fields)

    def __len__(self) -> int:
        return len(self.list_ids())

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Done with the store. The owner shuts TransferQueue down (every partition's rows go
        with it: close the owner last); any other store only stops using it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.owner:
                _bounded(tq.close, self.timeout_s, "shutting TransferQueue down")

    def __enter__(self) -> TransferQueueStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside ------------------------------------------------------------------------------

    def _call(self, make: Callable[[], Awaitable[_T]], what: str) -> _T:
        """Run one of TransferQueue's coroutines on its client's event loop and wait for it,
        at most `timeout_s`; past that it is cancelled and `StoreTimeout` raised."""
        if self._closed:
            raise CallOrderError(f"the TransferQueue store on {self.partition!r} is closed")
        loop: asyncio.AbstractEventLoop = tq.get_client()._loop

        async def run() -> _T:
            return await make()

        return self._wait(asyncio.run_coroutine_threadsafe(run(), loop), what)

    def _wait(self, future: concurrent.futures.Future[_T], what: str) -> _T:
        """The call's result within `timeout_s`; what TransferQueue or Ray raise instead (a
        storage unit or the controller gone, say) comes out as a `StoreError` naming the
        call and the partition."""
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StoreTimeout(
                f"TransferQueue did not finish {what} on partition {self.partition!r} within "
                f"timeout_s={self.timeout_s:g}"
            ) from None
        except Exception as exc:
            raise StoreError(
                f"TransferQueue failed {what} on partition {self.partition!r}: "
                f"{type(exc).__name__}: {str(exc)[:300]}"
            ) from exc

    def _existing(self, ids: Iterable[str]) -> list[str]:
        """Which of `ids` the partition holds already (TransferQueue would overwrite them)."""
        catalogue = self._catalogue()
        return sorted(sid for sid in ids if sid in catalogue)

    def _catalogue(self) -> dict[str, dict[str, str]]:
        """Every row of the partition, with the codec of each of its fields (the tags)."""
        listed = self._call(
            lambda: tq.async_kv_list(partition_id=self.partition), "listing the rows"
        )
        rows = listed.get(self.partition, {}) if isinstance(listed, dict) else {}
        out: dict[str, dict[str, str]] = {}
        for key, tag in rows.items():
            codecs = tag.get(TAG, {}) if isinstance(tag, dict) else {}
            out[str(key)] = {str(f): str(c) for f, c in codecs.items()}
        return out

    def _batch_put(
        self, ids: list[str], columns: dict[str, Any], tags: list[dict[str, Any]]
    ) -> None:
        data = TensorDict(columns, batch_size=[len(ids)])
        self._call(
            lambda: tq.async_kv_batch_put(
                keys=ids, partition_id=self.partition, fields=data, tags=tags
            ),
            f"writing {len(ids)} rows",
        )

    def _check_read(self, ids: list[str], fields: list[str], data: Any) -> None:
        """TransferQueue returns what it found, silently short: the rows and fields that
        came back must be exactly those asked for, in order."""
        got_fields = set(data.keys()) if hasattr(data, "keys") else set()
        absent = sorted({KEY_FIELD, *fields} - got_fields)
        if absent:
            raise MissingDataError(
                f"TransferQueue returned no {absent} for rows {ids}",
                fields={sid: [f for f in absent if f != KEY_FIELD] for sid in ids},
            )
        keys = [str(k) for k in _cells(data[KEY_FIELD], _rows(data), KEY_FIELD)]
        if keys != ids:
            dropped = [sid for sid in ids if sid not in keys]
            raise MissingDataError(
                f"TransferQueue returned rows {keys} when asked for {ids}"
                + (f": rows {dropped} are missing" if dropped else ""),
                rows=dropped,
            )

    def _clear_quietly(self, ids: list[str]) -> None:
        try:
            self._call(
                lambda: tq.async_kv_clear(keys=ids, partition_id=self.partition),
                f"clearing {len(ids)} rows after a failed write",
            )
        except Exception as error:
            log.warning("could not clear rows %s after a failed write: %r", ids[:8], error)


def _rows(data: Any) -> int:
    size = getattr(data, "batch_size", None)
    return int(size[0]) if size is not None and len(size) else 0


def _by_codecs(rows: Mapping[str, Mapping[str, Any]]) -> list[tuple[list[str], dict[str, str]]]:
    """The rows grouped by their fields and the codec of each: one TransferQueue write per
    group (a TensorDict holds the same fields for every row)."""
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for sid, fields in rows.items():
        signature = tuple(sorted((f, _codec(v)) for f, v in fields.items()))
        groups.setdefault(signature, []).append(sid)
    return [(ids, dict(signature)) for signature, ids in groups.items()]


def _controller_running(ray: Any) -> bool:
    name, namespace = CONTROLLER
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def _bounded(fn: Callable[[], object], timeout_s: float, what: str) -> None:
    """Run a TransferQueue call that has no time limit of its own in a helper thread, and
    wait for it at most `timeout_s` (a call past that keeps its thread, which is a daemon)."""
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:
            done.append(error)
        else:
            done.append(None)

    thread = threading.Thread(target=run, name=f"groupflow-tq: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not done:
        raise StoreTimeout(f"{what} did not finish within {timeout_s:g} s")
    if done[0] is not None:
        raise done[0]


__all__ = ["KEY_FIELD", "StoreTimeout", "TransferQueueStore"]
