"""One JSON request to a served engine, its failure told by cause: the HTTP side that served
teachers and the served generator share.

A server that cannot be reached, resets the connection, breaks its answer, does not answer in
time, or answers 5xx or 429 may be fine on the next call (`TransientError`); one that answers
4xx refuses this request and would refuse it again (the `Caller`'s `refused` error); an answer
that is not JSON is its `malformed` one. Every error names `where` (the engine and its URL).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from groupflow.model.errors import TransientError

__all__ = ["Caller", "is_url", "request_json", "served_model"]

MODELS = "/v1/models"


def is_url(value: object) -> bool:
    """Whether `value` is a URL an engine can be reached at (http:// or https://)."""
    return isinstance(value, str) and value.startswith(("http://", "https://"))


@attrs.frozen
class Caller:
    """Who calls (`where`: the engine and its URL, for every message) and the errors a refusal
    and a malformed answer are for it."""

    where: str
    refused: type[Exception]
    malformed: type[Exception]


async def request_json(
    client: Any,
    method: str,
    url: str,
    caller: Caller,
    *,
    json_body: Mapping[str, Any] | None = None,
) -> object:
    """The decoded JSON answer to `method url`; an error by cause otherwise."""
    import httpx  # the `served` extra

    where, refused, malformed = caller.where, caller.refused, caller.malformed
    try:
        response = await client.request(method, url, json=json_body)
    except httpx.TransportError as exc:  # refused, reset, timed out, a broken answer
        raise TransientError(f"{where}: {type(exc).__name__}: {exc or 'no detail'}") from exc
    if response.status_code == 429 or response.status_code >= 500:
        raise TransientError(
            f"{where}: HTTP {response.status_code}: {response.text[:200]!r} (busy or failing)"
        )
    if response.status_code >= 400:
        raise refused(
            f"{where} refused the request: HTTP {response.status_code}: {response.text[:300]!r}"
        )
    try:
        return json.loads(response.content)
    except ValueError as exc:
        raise malformed(
            f"{where} answered HTTP {response.status_code} with no JSON: {response.content[:120]!r}"
        ) from exc


async def served_model(client: Any, url: str, cache: dict[str, str], caller: Caller) -> str:
    """The model the server at `url` serves: the first its `/v1/models` lists, asked once
    (`cache` keeps the answer per URL)."""
    if url not in cache:
        listed = await request_json(client, "GET", url + MODELS, caller)
        data = listed.get("data") if isinstance(listed, Mapping) else None
        first = data[0].get("id") if isinstance(data, list) and data else None
        if not isinstance(first, str):
            raise caller.malformed(f"{caller.where}: {MODELS} lists no model: {listed!r:.200}")
        cache[url] = first
    return cache[url]
