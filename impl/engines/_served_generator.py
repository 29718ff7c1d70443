"""`ServedGenerator`: the rollout pump's generator for a student served by an OpenAI-compatible
completions server (vLLM), native trio.

A rollout is one request: the prompt's token ids, `n = num_generations`, a seed made of the
generator's seed, the prompt's ordinal and the weight version (so a run replays, and a prompt
issued again after new weights samples anew). Each row is the prompt and its sampled response
(`input_ids`, `prompt_length`), the sampled tokens' log-probs (`generation_logprobs`) and the
weight version the server held when the request was sent (`weight_version`: the last one a
sync loaded, or the request's before any sync), all checked before the rollout commits. A rollout has a total time bound (`rollout_timeout_s`, by default fitted to
`max_tokens`) and its answer a size bound (`bytes_per_token` of what was asked).

New weights reach the server in `sync_weights`: the server pauses, `publish(version)` writes
the weights where the server loads its model from (the learner's job: a Hugging Face folder),
the server reloads them (vLLM's `/collective_rpc` `reload_weights`), drops its prefix cache
(computed with the old weights) and resumes; a server started with `VLLM_SERVER_DEV_MODE=1`
offers these routes. No rollout request is sent from the moment a sync begins until it ends.

Which weights sampled a rollout is decided on the wire, not guessed. Under `sync_mode="wait"`
the sync pauses the server only once every rollout request already started has its answer, so
each rollout is sampled wholly by the weights its request was sent under, which its rows
carry. Under `"interrupt"` the sync does not wait: a rollout in flight is frozen, and goes on
with the new weights after the reload; the pipeline labels its group with both versions (the
start and end weight versions of the buffer), since its tokens may come from either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl._core import Pulse, choice, positive_int, positive_number, positive_seconds
from groupflow.impl.contract import GenerateRequest
from groupflow.impl.engines._completions import COMPLETIONS, read_samples, sample_body
from groupflow.impl.engines._http import (
    Bounds,
    is_url,
    new_client,
    request_json,
    served_model,
)
from groupflow.model.errors import (
    CallOrderError,
    ConfigError,
    EngineOutputError,
    EngineRefused,
    EngineTimeout,
)
from groupflow.model.policy import SyncMode

__all__ = ["ServedGenerator"]

RELOAD = "/collective_rpc"
PAUSE = "/pause"
RESUME = "/resume"
RESET_CACHE = "/reset_prefix_cache?reset_running_requests=true"
"""After a reload: the keys and values cached for prompt prefixes were computed with the old
weights, and a rollout that reused them would sample from neither version. Rollouts frozen
under `interrupt` are recomputed with the new weights (vLLM preempts them)."""
FIELDS = frozenset({"input_ids", "prompt_length", "generation_logprobs", "weight_version"})
ROLLOUT_BASE_S = 60.0
ROLLOUT_PER_TOKEN_S = 0.5
"""The default rollout bound: a minute (a first call warms a server up: ~40 s on a CPU) and
half a second per token asked for. A server that samples one rollout slower than two tokens a
second, its queue included, is failing, not busy."""


def _url(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not is_url(value):
        raise ConfigError(
            f"ServedGenerator.url={value!r} must be an http:// or https:// URL",
            field="url",
            config="ServedGenerator",
        )


def _optional_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        positive_seconds(instance, attribute, value)


def _sync_mode(value: SyncMode | str) -> SyncMode:
    return choice(SyncMode, value, config="ServedGenerator", field="sync_mode")


@attrs.define
class ServedGenerator:
    """A `Generator` over the server at `url`: `prompt_ids(prompt)` gives a prompt's token ids,
    `max_tokens` bounds each response. `publish(version)`, when given, writes a weight
    version where the server loads it from before `sync_weights` has the server reload."""

    url: str = attrs.field(validator=_url)
    prompt_ids: Callable[[Any], Sequence[int]]
    max_tokens: int = attrs.field(validator=positive_int)
    temperature: float = attrs.field(default=1.0, validator=positive_number)
    seed: int = 0
    exact_length: bool = False
    """Every response `max_tokens` long (the server ignores end-of-sequence tokens), checked:
    for a learner that takes responses of one length."""
    model: str | None = None
    publish: Callable[[int], Awaitable[None]] | None = None
    sync_mode: SyncMode = attrs.field(default=SyncMode.WAIT, converter=_sync_mode)
    """`wait`: a sync waits for the rollouts in flight to be answered, then pauses the server
    and reloads; `interrupt`: it pauses at once, freezing them, and they go on with the new
    weights (vLLM's `/pause` modes `wait` and `keep`)."""
    connect_timeout_s: float = attrs.field(default=10.0, validator=positive_seconds)
    rollout_timeout_s: float | None = attrs.field(default=None, validator=_optional_seconds)
    """The total time one rollout's request may take, its answer read whole; by default
    `ROLLOUT_BASE_S` plus `ROLLOUT_PER_TOKEN_S` per token of `max_tokens`."""
    sync_timeout_s: float = attrs.field(default=600.0, validator=positive_seconds)
    """The total time each step of a sync may take (pause, publish, reload, dropping the
    cache, resume): a large model's reload from disk takes minutes."""
    cancel_grace_s: float = attrs.field(default=5.0, validator=positive_seconds)
    """How long a sync that is cancelled or failed may spend asking the server to resume, so
    a server is not left paused. `build_pipeline` refuses a grace that is not below the run's
    `shutdown_timeout_s`: a cancel ends within it."""
    bytes_per_token: int = attrs.field(default=1024, validator=positive_int)
    """An answer may have this many bytes per token asked for or sent (vLLM writes about 80),
    besides 64 KiB: a larger one is refused before it is read whole."""
    fields = FIELDS
    synced: list[int] = attrs.field(factory=list)
    """The weight versions the server reloaded, in order."""
    _served: dict[str, str] = attrs.field(factory=dict, init=False, repr=False)
    _sync_done: trio.Event | None = attrs.field(default=None, init=False, repr=False)
    """While a sync runs: set when it has ended (rollouts wait on it before they are sent)."""
    _in_flight: int = attrs.field(default=0, init=False, repr=False)
    """Rollout requests started (past the sync check) and not answered yet."""
    _loaded: int | None = attrs.field(default=None, init=False, repr=False)
    """The weight version the server holds: the last a sync reloaded (None before any)."""
    _changed: Pulse = attrs.field(factory=Pulse, init=False, repr=False)

    @property
    def rollout_bound_s(self) -> float:
        """The total time one rollout may take (`rollout_timeout_s` or its default)."""
        if self.rollout_timeout_s is not None:
            return self.rollout_timeout_s
        return ROLLOUT_BASE_S + ROLLOUT_PER_TOKEN_S * self.max_tokens

    def _client(self) -> Any:
        return new_client(self.connect_timeout_s)

    async def generate(self, request: GenerateRequest) -> list[Mapping[str, Any]]:
        where = f"generator at {self.url} (prompt {request.ordinal})"
        prompt = [int(t) for t in self.prompt_ids(request.prompt)]
        seed = (self.seed * 1_000_003 + request.ordinal * 7_919 + request.weight_version) % 2**31
        n = request.num_generations
        setting = "ServedGenerator.rollout_timeout_s"
        async with self._client() as client:
            model = self.model or await served_model(
                client,
                self.url,
                self._served,
                where=where,
                bounds=Bounds.small(self.rollout_bound_s, setting),
            )
            body = sample_body(
                model,
                prompt,
                n=n,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=seed,
                exact_length=self.exact_length,
            )
            bounds = Bounds.per_token(
                self.rollout_bound_s,
                setting,
                n * (len(prompt) + self.max_tokens),
                self.bytes_per_token,
                "ServedGenerator.bytes_per_token",
            )
            # checked last, after every other wait, and counted in the same step: a sync that
            # begins from here on waits for this request's answer (under `wait`)
            await self._no_sync_running()
            self._in_flight += 1
            version = self._label(request)
            try:
                answer = await request_json(
                    client,
                    "POST",
                    self.url + COMPLETIONS,
                    where=where,
                    bounds=bounds,
                    json_body=body,
                )
            finally:
                self._in_flight -= 1
                self._changed.notify()
        samples = read_samples(
            answer,
            prompt,
            n,
            model=model,
            max_tokens=self.max_tokens,
            where=where,
            exact_length=self.exact_length,
        )
        return [
            {
                "input_ids": prompt + ids,
                "prompt_length": len(prompt),
                "generation_logprobs": logprobs,
                "weight_version": version,
            }
            for ids, logprobs in samples
        ]

    def _label(self, request: GenerateRequest) -> int:
        """The weight version the server holds as a request is sent: the last a sync loaded,
        or the request's before any sync."""
        return request.weight_version if self._loaded is None else self._loaded

    async def _no_sync_running(self) -> None:
        """Return once no sync runs: no rollout is sent while the weights change."""
        while self._sync_done is not None:
            await self._sync_done.wait()

    async def sync_weights(self, version: int) -> None:
        """Load the weights of `version` into the server: under `wait`, once the rollouts in
        flight are answered; then pause, `publish`, reload, drop the prefix cache, resume. No
        rollout request is sent meanwhile. A step that fails names itself; the server is
        asked to resume after a failure or a cancel (within `cancel_grace_s`)."""
        if self._sync_done is not None:
            raise CallOrderError(
                f"ServedGenerator.sync_weights({version}) while another sync runs: one at a time"
            )
        where = f"generator at {self.url}, weight sync to version {version}"
        self._sync_done = trio.Event()
        try:
            if self.sync_mode is SyncMode.WAIT:
                await self._answered()
            async with self._client() as client:
                await self._sync(client, version, where)
        finally:
            done, self._sync_done = self._sync_done, None
            done.set()
        self.synced.append(version)

    async def _answered(self) -> None:
        """Return once every rollout request already started has its answer (or failed):
        until then the server may still be reading one, and a pause sent now could reach it
        first, so that the rollout is sampled after the reload, with weights it is not
        labelled with."""
        while self._in_flight:
            await self._changed.wait()

    async def _sync(self, client: Any, version: int, where: str) -> None:
        pause = "wait" if self.sync_mode is SyncMode.WAIT else "keep"
        try:
            # the cache is dropped after the reload (below), not by the pause (vLLM's
            # deprecated default, which it skips under "keep")
            await self._step(client, where, "pause", f"{PAUSE}?mode={pause}&clear_cache=false")
            if self.publish is not None:
                with trio.move_on_after(self.sync_timeout_s) as publishing:
                    await self.publish(version)
                if publishing.cancelled_caught:
                    raise EngineTimeout(
                        f"{where}: step 'publish': publish({version}) did not return within "
                        f"{self.sync_timeout_s:g} s (ServedGenerator.sync_timeout_s)"
                    )
            answer = await self._step(
                client, where, "reload", RELOAD, body={"method": "reload_weights"}
            )
            results = answer.get("results") if isinstance(answer, Mapping) else None
            if not isinstance(results, list) or not results:
                raise EngineOutputError(
                    f"{where}: step 'reload': reload_weights reached no worker: {answer!r:.200}"
                )
            self._loaded = version
            dropped = await self._step(client, where, "drop the prefix cache", RESET_CACHE)
            if not (isinstance(dropped, Mapping) and dropped.get("success") is True):
                raise EngineOutputError(
                    f"{where}: step 'drop the prefix cache': the server kept it "
                    f"({dropped!r:.200}): rollouts would reuse keys and values computed with "
                    f"the old weights"
                )
        except BaseException as exc:
            if isinstance(exc, EngineRefused):
                exc.add_note(
                    "a vLLM server pauses and reloads weights when started with "
                    "VLLM_SERVER_DEV_MODE=1"
                )
            await self._resume_after(client, where, exc)
            raise
        await self._step(client, where, "resume", RESUME)

    async def _step(
        self, client: Any, where: str, step: str, path: str, body: Any = None
    ) -> object:
        return await request_json(
            client,
            "POST",
            self.url + path,
            where=f"{where}: step {step!r} (POST {path.split('?')[0]})",
            bounds=Bounds.small(self.sync_timeout_s, "ServedGenerator.sync_timeout_s"),
            json_body=body,
        )

    async def _resume_after(self, client: Any, where: str, exc: BaseException) -> None:
        """Ask the server to resume after a failed or cancelled step, within
        `cancel_grace_s`; what goes wrong is a note on `exc`, which stays the error."""
        with trio.CancelScope(shield=True), trio.move_on_after(self.cancel_grace_s) as scope:
            try:
                await self._step(client, where, "resume", RESUME)
            except Exception as failed:
                exc.add_note(f"the server may still be paused: resuming it failed: {failed}")
        if scope.cancelled_caught:
            exc.add_note(
                f"the server may still be paused: it did not answer the resume within "
                f"{self.cancel_grace_s:g} s (ServedGenerator.cancel_grace_s)"
            )
