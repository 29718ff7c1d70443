"""Where rows live: the `SampleStore` protocol and `MemoryStore`, the embedded default.

The buffer keeps metadata only; rows and their fields stay in a store. A store never drops
anything silently: reading a row or field that is not there raises an error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from groupflow.model.errors import DuplicateDataError, MissingDataError

Fields = Mapping[str, Any]
"""The fields of one row, by name."""

PAD_PREFIX = "\x00groupflow-pad/"
"""Ids of the temporary rows a teacher call pads its batch with start with a NUL byte; the
buffer refuses real rows whose ids start so, so the two can never be confused."""


@runtime_checkable
class SampleStore(Protocol):
    """Rows keyed by sample id, each a set of named fields.

    Implementations are called from the trio thread when `blocking` is false and from a worker
    thread when it is true (a remote store), so a blocking store must be thread-safe.
    """

    blocking: bool

    def put(self, rows: Mapping[str, Fields]) -> None:
        """Add new rows; raise `DuplicateDataError` (writing nothing) if any id exists."""
        ...

    def add_fields(self, values: Mapping[str, Fields]) -> None:
        """Add fields to existing rows; missing rows or already-present fields write nothing."""
        ...

    def get(self, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The named fields of the named rows; anything missing raises `MissingDataError`."""
        ...

    def clear(self, sample_ids: Iterable[str], *, missing_ok: bool = False) -> None:
        """Remove rows; an unknown id raises unless `missing_ok` (cleanup after a failed write)."""
        ...

    def list_ids(self) -> frozenset[str]:
        """Every row id the store holds."""
        ...

    def missing_fields(
        self, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[str]]:
        """For each named row that lacks any of `fields`, the fields it lacks (all of them for
        a row the store does not hold); empty when every row has every field. One batched
        call: the buffer asks it before it lets a stage mark groups scored."""
        ...


def _missing_rows_error(missing: Sequence[str]) -> MissingDataError:
    return MissingDataError(f"the store has no rows {sorted(missing)}", rows=missing)


@attrs.define
class MemoryStore:
    """An in-process store: a dict of rows. The embedded default, and the reference for others."""

    _rows: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    blocking: bool = attrs.field(default=False, kw_only=True)
    """Set true to have the buffer call this store from a worker thread, as it would a remote one."""

    def put(self, rows: Mapping[str, Fields]) -> None:
        existing = sorted(sid for sid in rows if sid in self._rows)
        if existing:
            raise DuplicateDataError(f"rows {existing} are already in the store; nothing written")
        for sid, fields in rows.items():
            self._rows[sid] = dict(fields)

    def add_fields(self, values: Mapping[str, Fields]) -> None:
        missing = [sid for sid in values if sid not in self._rows]
        if missing:
            raise _missing_rows_error(missing)
        clashes = {
            sid: sorted(set(fields) & self._rows[sid].keys())
            for sid, fields in values.items()
            if set(fields) & self._rows[sid].keys()
        }
        if clashes:
            raise DuplicateDataError(
                f"fields already present, nothing written: {dict(sorted(clashes.items()))}"
            )
        for sid, fields in values.items():
            self._rows[sid].update(fields)

    def get(self, sample_ids: Sequence[str], fields: Sequence[str]) -> dict[str, dict[str, Any]]:
        missing = [sid for sid in sample_ids if sid not in self._rows]
        if missing:
            raise _missing_rows_error(missing)
        lacking = {
            sid: sorted(set(fields) - self._rows[sid].keys())
            for sid in sample_ids
            if set(fields) - self._rows[sid].keys()
        }
        if lacking:
            raise MissingDataError(
                f"rows lack fields: {dict(sorted(lacking.items()))}", fields=lacking
            )
        return {sid: {f: self._rows[sid][f] for f in fields} for sid in sample_ids}

    def clear(self, sample_ids: Iterable[str], *, missing_ok: bool = False) -> None:
        ids = list(sample_ids)
        if not missing_ok:
            missing = [sid for sid in ids if sid not in self._rows]
            if missing:
                raise _missing_rows_error(missing)
        for sid in ids:
            self._rows.pop(sid, None)

    def list_ids(self) -> frozenset[str]:
        return frozenset(self._rows)

    def missing_fields(
        self, sample_ids: Sequence[str], fields: Sequence[str]
    ) -> dict[str, list[str]]:
        wanted = set(fields)
        out: dict[str, list[str]] = {}
        for sid in sample_ids:
            row = self._rows.get(sid)
            lacking = wanted if row is None else wanted - row.keys()
            if lacking:
                out[sid] = sorted(lacking)
        return out

    def fields_of(self, sample_id: str) -> frozenset[str]:
        """The names of the fields one row has."""
        if sample_id not in self._rows:
            raise _missing_rows_error([sample_id])
        return frozenset(self._rows[sample_id])

    def __len__(self) -> int:
        return len(self._rows)


def _as_dict(fields: Mapping[str, Any]) -> dict[str, Any]:
    return dict(fields)


@attrs.frozen
class Row:
    """One generated sample: its id and its fields, as a rollout commits it."""

    sample_id: str
    fields: Mapping[str, Any] = attrs.field(converter=_as_dict)
