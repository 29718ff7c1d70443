"""One JSON request to a served engine, bounded and told by cause: the HTTP side that served
teachers, the served generator and its weight syncs share.

Every request has a total time bound and a size bound (`Bounds`): httpx's own read timeout
bounds only the gap between two reads, so a server that answers a byte at a time would hold
the call forever, and an answer is read whole before it is parsed. The answer is streamed and
counted (decoded, so a compressed one is counted as it expands), and refused as soon as it
passes its bound.

A server that cannot be reached, resets or cuts the connection, or answers 5xx or 429 may be
fine on the next call (`EngineBusy`); one that does not answer in full in time,
`EngineTimeout` (also busy); one that answers 4xx refuses this request and would refuse it
again (`EngineRefused`); an answer that is not JSON or is too large is `EngineOutputError`.
Every error names `where` (the engine, its URL and the call) and, for a bound, its setting.
"""

from __future__ import annotations

import functools
import json
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from groupflow.model.errors import EngineBusy, EngineOutputError, EngineRefused, EngineTimeout

__all__ = [
    "Bounds",
    "is_url",
    "new_client",
    "request_json",
    "served_model",
    "served_root",
]

MODELS = "/v1/models"
ENVELOPE_BYTES = 64 * 1024
"""What an answer may take besides its per-token part: ids, usage, the JSON around them."""
SMALL_ANSWER_BYTES = 1024 * 1024
"""The bound of an answer that is about no tokens: the model list, a sync's steps."""


def new_client(connect_timeout_s: float) -> Any:
    """An httpx client for engine calls: its connect timeout set, every other bound left to
    `request_json`, and the TLS settings built once per process (building them costs about
    45 ms of the event loop's time, which a client per call would spend on every rollout)."""
    import httpx  # the `served` extra

    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout_s), verify=_tls())


@functools.cache
def _tls() -> ssl.SSLContext:
    import certifi  # what httpx verifies against by default, and one of its requirements

    return ssl.create_default_context(cafile=certifi.where())


def is_url(value: object) -> bool:
    """Whether `value` is a URL an engine can be reached at (http:// or https://)."""
    return isinstance(value, str) and value.startswith(("http://", "https://"))


@attrs.frozen
class Bounds:
    """How long one request may take in all, its answer read whole, and how many bytes that
    answer may have; each with the setting that says so, for the error's message."""

    seconds: float
    seconds_setting: str
    max_bytes: int
    bytes_setting: str

    @classmethod
    def small(cls, seconds: float, seconds_setting: str) -> Bounds:
        """An answer about no tokens (a model list, a sync's step): 1 MiB at most."""
        return cls(seconds, seconds_setting, SMALL_ANSWER_BYTES, "answers about no tokens")

    @classmethod
    def per_token(
        cls, seconds: float, seconds_setting: str, tokens: int, per_token: int, setting: str
    ) -> Bounds:
        """An answer about `tokens` tokens: `per_token` bytes each, and the envelope."""
        return cls(seconds, seconds_setting, ENVELOPE_BYTES + per_token * tokens, setting)


async def request_json(
    client: Any,
    method: str,
    url: str,
    *,
    where: str,
    bounds: Bounds,
    json_body: Mapping[str, Any] | None = None,
) -> object:
    """The decoded JSON answer to `method url`, within `bounds`; an error by cause otherwise.
    A cancel from outside stays a cancel."""
    import httpx  # the `served` extra

    status = 0
    content = b""
    with trio.move_on_after(bounds.seconds) as scope:
        try:
            async with client.stream(method, url, json=json_body) as response:
                status = response.status_code
                content = await _read(response, where, bounds)
        except httpx.TransportError as exc:  # refused, reset, cut, a broken answer
            raise EngineBusy(f"{where}: {type(exc).__name__}: {exc or 'no detail'}") from exc
    if scope.cancelled_caught:
        raise EngineTimeout(
            f"{where} did not answer in full within {bounds.seconds:g} s ({bounds.seconds_setting})"
        )
    return _decode(status, content, where)


def request_json_blocking(method: str, url: str, *, where: str, bounds: Bounds) -> object:
    """`request_json` for code that runs before any trio run (a check of a server the user
    names): the same bounds, each chunk read within what is left of `bounds.seconds`, the same
    errors by cause."""
    import httpx  # the `served` extra

    deadline = time.monotonic() + bounds.seconds
    late = EngineTimeout(
        f"{where} did not answer in full within {bounds.seconds:g} s ({bounds.seconds_setting})"
    )
    try:
        with httpx.stream(method, url, timeout=bounds.seconds) as response:
            status = response.status_code
            _check_announced(response, where, bounds)
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                _check_size(body, where, bounds)
                if time.monotonic() > deadline:
                    raise late
    except httpx.TimeoutException:
        raise late from None
    except httpx.TransportError as exc:  # refused, reset, cut, a broken answer
        raise EngineBusy(f"{where}: {type(exc).__name__}: {exc or 'no detail'}") from exc
    return _decode(status, bytes(body), where)


def _decode(status: int, content: bytes, where: str) -> object:
    """An answer's JSON, or its status's error by cause."""
    if status == 429 or status >= 500:
        raise EngineBusy(f"{where}: HTTP {status}: {content[:200]!r} (busy or failing)")
    if status >= 400:
        raise EngineRefused(f"{where} refused the request: HTTP {status}: {content[:300]!r}")
    try:
        return json.loads(content)
    except ValueError as exc:
        raise EngineOutputError(
            f"{where} answered HTTP {status} with no JSON: {content[:120]!r}"
        ) from exc


async def _read(response: Any, where: str, bounds: Bounds) -> bytes:
    """The answer's body, refused once it passes `bounds.max_bytes` (before reading, when its
    length is announced)."""
    _check_announced(response, where, bounds)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        _check_size(body, where, bounds)
    return bytes(body)


def _check_announced(response: Any, where: str, bounds: Bounds) -> None:
    announced = response.headers.get("content-length", "")
    if announced.isdigit() and int(announced) > bounds.max_bytes:
        raise _too_large(where, bounds, f"announced {int(announced):,} bytes")


def _check_size(body: bytearray, where: str, bounds: Bounds) -> None:
    if len(body) > bounds.max_bytes:
        raise _too_large(where, bounds, f"sent more than {bounds.max_bytes:,} bytes")


def _too_large(where: str, bounds: Bounds, what: str) -> EngineOutputError:
    return EngineOutputError(
        f"{where} {what}: its answer may have {bounds.max_bytes:,} at most ({bounds.bytes_setting})"
    )


async def served_model(
    client: Any, url: str, cache: dict[str, str], *, where: str, bounds: Bounds
) -> str:
    """The model the server at `url` serves: the first its `/v1/models` lists, asked once
    (`cache` keeps the answer per URL)."""
    if url not in cache:
        listed = await request_json(client, "GET", url + MODELS, where=where, bounds=bounds)
        data = listed.get("data") if isinstance(listed, Mapping) else None
        first = data[0].get("id") if isinstance(data, list) and data else None
        if not isinstance(first, str):
            raise EngineOutputError(f"{where}: {MODELS} lists no model: {listed!r:.200}")
        cache[url] = first
    return cache[url]


def served_root(url: str, *, where: str, seconds: float = 10.0) -> Path:
    """The folder the server at `url` serves its model from (the `root` its `/v1/models` lists
    first), asked before any run starts: within `seconds` and `Bounds.small`'s size, or an
    `EngineError` by cause (`EngineOutputError` for a list that names no folder)."""
    bounds = Bounds.small(seconds, "a server's check before the run")
    listed = request_json_blocking("GET", url.rstrip("/") + MODELS, where=where, bounds=bounds)
    data = listed.get("data") if isinstance(listed, Mapping) else None
    root = data[0].get("root") if isinstance(data, list) and data else None
    if not isinstance(root, str) or not root:
        raise EngineOutputError(f"{where}: {MODELS} names no served folder: {listed!r:.200}")
    return Path(root)
