"""`ServedTeachers`: the teacher stage's scorer for teachers served over HTTP by an
OpenAI-compatible completions server (vLLM), native trio: a call is an HTTP request the run can
cancel for real, with no worker thread to wait for or abandon.

Each teacher has one server or several (data-parallel replicas). A call sends the batch's real
rows (no padding: the server batches them itself) in one request per replica, the rows split
evenly, the requests side by side; with the stage's one call per teacher at a time, that is one
request per server in flight. What comes back is checked (`_completions`) before any field is
written, and all of the call's rows are written at once, so a failed call leaves no field.

Each request has a total time bound (`request_timeout_s`, besides the stage's `call_timeout_s`
over the whole call) and its answer a size bound (`bytes_per_token` of the tokens sent).

Errors by cause, as for every served engine: a server that cannot be reached, resets or cuts
the connection, or answers 5xx or 429 is busy (`EngineBusy`), one that does not answer in full
in time has timed out (`EngineTimeout`); both may be fine on the next call (transient: retried
under `failure_policy="retry"`). One that answers 4xx refuses this request and would refuse it
again (`EngineRefused`), and an answer that is not what was asked is `EngineOutputError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl._core import positive_int, positive_seconds
from groupflow.impl._pipeline import leaves
from groupflow.impl._teachers import TEACHER_INPUTS
from groupflow.impl.contract import ScoreRequest, TokenRow
from groupflow.impl.engines._completions import COMPLETIONS, read_prompt_logprobs, score_body
from groupflow.impl.engines._http import (
    Bounds,
    is_url,
    new_client,
    request_json,
    served_model,
)
from groupflow.model.errors import ConfigError, RoutingError

__all__ = ["ServedTeachers"]


def _check_servers(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"ServedTeachers.servers={value!r} must map each teacher to its server URLs",
            field="servers",
            config="ServedTeachers",
        )
    for teacher, urls in value.items():
        if (
            isinstance(urls, str)
            or not isinstance(urls, Sequence)
            or not urls
            or not all(is_url(u) for u in urls)
        ):
            raise ConfigError(
                f"ServedTeachers.servers[{teacher!r}]={urls!r} must be a non-empty list of "
                f"http:// or https:// URLs",
                field="servers",
                config="ServedTeachers",
            )


@attrs.define
class ServedTeachers:
    """A `Scorer` over served teachers: `servers` maps each physical teacher to the base URLs
    of its replicas (`http://127.0.0.1:8000`); `models` names the model each serves (by
    default the first one its `/v1/models` lists, asked once per server)."""

    servers: Mapping[str, Sequence[str]] = attrs.field(validator=_check_servers)
    models: Mapping[str, str] = attrs.field(factory=dict)
    connect_timeout_s: float = attrs.field(default=10.0, validator=positive_seconds)
    request_timeout_s: float = attrs.field(default=300.0, validator=positive_seconds)
    """The total time one request may take, its answer read whole (the stage's
    `call_timeout_s` bounds the whole call besides)."""
    bytes_per_token: int = attrs.field(default=1024, validator=positive_int)
    """An answer may have this many bytes per token sent (vLLM writes about 80), besides
    64 KiB: a larger one is refused before it is read whole."""
    reads = TEACHER_INPUTS
    _served: dict[str, str] = attrs.field(factory=dict, init=False, repr=False)
    """Base URL -> the model name it serves, once asked."""

    @property
    def teachers(self) -> frozenset[str]:
        return frozenset(self.servers)

    async def score(self, request: ScoreRequest) -> None:
        urls = self.servers.get(request.teacher)
        if urls is None:
            raise RoutingError(
                f"no served teacher {request.teacher!r}; have {sorted(self.servers)}"
            )
        ids = list(request.sample_ids)
        fields = request.store.get(ids, sorted(TEACHER_INPUTS))
        rows = [
            TokenRow(tuple(fields[sid]["input_ids"]), int(fields[sid]["prompt_length"]))
            for sid in ids
        ]
        shards = _split(rows, len(urls))
        results: list[list[list[float]] | None] = [None] * len(shards)
        try:
            async with new_client(self.connect_timeout_s) as client:
                async with trio.open_nursery() as nursery:
                    for i, (url, shard) in enumerate(zip(urls, shards, strict=True)):
                        if shard:
                            nursery.start_soon(
                                self._one, client, request.teacher, url, shard, results, i
                            )
        except BaseExceptionGroup as group:
            raise _first(group, request.teacher) from None
        scored = [values for part in results if part for values in part]
        request.store.add_fields(
            {sid: {request.field: values} for sid, values in zip(ids, scored, strict=True)}
        )

    async def _one(
        self,
        client: Any,
        teacher: str,
        url: str,
        rows: list[TokenRow],
        results: list[list[list[float]] | None],
        index: int,
    ) -> None:
        where = f"teacher {teacher!r} at {url}"
        setting = "ServedTeachers.request_timeout_s"
        model = self.models.get(teacher) or await served_model(
            client,
            url,
            self._served,
            where=where,
            bounds=Bounds.small(self.request_timeout_s, setting),
        )
        bounds = Bounds.per_token(
            self.request_timeout_s,
            setting,
            sum(len(row.input_ids) for row in rows),
            self.bytes_per_token,
            "ServedTeachers.bytes_per_token",
        )
        body = await request_json(
            client,
            "POST",
            url + COMPLETIONS,
            where=where,
            bounds=bounds,
            json_body=score_body(model, rows),
        )
        results[index] = read_prompt_logprobs(body, rows, model=model, where=where)


def _first(group: BaseExceptionGroup, teacher: str) -> BaseException:
    """The call's error: the first replica's to fail (one failure per call, as per run); the
    others that failed in the same instant are a note on it."""
    found = leaves(group)
    first = found[0]
    if len(found) > 1 and isinstance(first, Exception):
        others = "; ".join(f"{type(e).__name__}: {e}" for e in found[1:])
        first.add_note(f"other replicas of teacher {teacher!r} failed too: {others}")
    return first


def _split(rows: list[TokenRow], parts: int) -> list[list[TokenRow]]:
    """`rows` in `parts` contiguous runs as even as can be (the first ones one longer)."""
    size, extra = divmod(len(rows), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(rows[start:end])
        start = end
    return out
