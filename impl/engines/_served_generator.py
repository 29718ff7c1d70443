"""`ServedGenerator`: the rollout pump's generator for a student served by an OpenAI-compatible
completions server (vLLM), native trio.

A rollout is one request: the prompt's token ids, `n = num_generations`, a seed made of the
generator's seed, the prompt's ordinal and the weight version (so a run replays, and a prompt
issued again after new weights samples anew). Each row is the prompt and its sampled response
(`input_ids`, `prompt_length`), the sampled tokens' log-probs (`generation_logprobs`) and the
weight version the request was sent under (`weight_version`), all checked before the rollout
commits.

New weights reach the server in `sync_weights`: the server pauses (draining the rollouts in
flight under `sync_mode="wait"`, freezing them under `"interrupt"`), `publish(version)` writes
the weights where the server loads its model from (the learner's job: a Hugging Face folder),
the server reloads them (vLLM's `/collective_rpc` `reload_weights`), drops its prefix cache
(computed with the old weights) and resumes; a server
started with `VLLM_SERVER_DEV_MODE=1` offers these routes. The weight version a row was sampled with is the one of its
request: a rollout started before the sync carries the old version, as the simulator models.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from groupflow.impl.core import choice, positive_int, positive_number, positive_seconds
from groupflow.impl.engines._completions import COMPLETIONS, read_samples, sample_body
from groupflow.impl.engines._http import Caller, is_url, request_json, served_model
from groupflow.impl.pipeline import GenerateRequest
from groupflow.model.errors import ConfigError, GeneratorOutputError, Unavailable
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


def _url(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not is_url(value):
        raise ConfigError(
            f"ServedGenerator.url={value!r} must be an http:// or https:// URL",
            field="url",
            config="ServedGenerator",
        )


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
    """`wait`: the server drains the rollouts in flight, then reloads; `interrupt`: it freezes
    them, reloads, and they go on with the new weights (vLLM's `/pause` modes `wait` and
    `keep`). No rollout is sent while a sync runs."""
    connect_timeout_s: float = attrs.field(default=10.0, validator=positive_seconds)
    read_timeout_s: float = attrs.field(default=300.0, validator=positive_seconds)
    fields = FIELDS
    synced: list[int] = attrs.field(factory=list)
    """The weight versions the server reloaded, in order."""
    _served: dict[str, str] = attrs.field(factory=dict, init=False, repr=False)
    _sync_done: trio.Event | None = attrs.field(default=None, init=False, repr=False)
    """While a sync runs: set when it has ended (rollouts wait on it before they are sent)."""
    _sending: set[trio.Event] = attrs.field(factory=set, init=False, repr=False)
    """Rollouts past the sync check whose request is not on the wire yet: each is set once
    its request is sent (or has failed), and a sync pauses the server only after them."""

    def _client(self) -> Any:
        import httpx  # the `served` extra

        return httpx.AsyncClient(
            timeout=httpx.Timeout(self.read_timeout_s, connect=self.connect_timeout_s)
        )

    async def generate(self, request: GenerateRequest) -> list[Mapping[str, Any]]:
        where = f"generator at {self.url} (prompt {request.ordinal})"
        caller = Caller(where, refused=GeneratorOutputError, malformed=GeneratorOutputError)
        prompt = [int(t) for t in self.prompt_ids(request.prompt)]
        seed = (self.seed * 1_000_003 + request.ordinal * 7_919 + request.weight_version) % 2**31
        async with self._client() as client:
            model = self.model or await served_model(client, self.url, self._served, caller)
            body = sample_body(
                model,
                prompt,
                n=request.num_generations,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=seed,
                exact_length=self.exact_length,
            )
            # checked last, after every other wait: a sync that begins from here on waits
            # until this request is on the wire
            await self._no_sync_running()
            on_the_wire = trio.Event()
            self._sending.add(on_the_wire)

            async def sent(http_request: Any) -> None:
                on_the_wire.set()

            client.event_hooks["request"].append(sent)
            try:
                answer = await request_json(
                    client, "POST", self.url + COMPLETIONS, caller, json_body=body
                )
            finally:
                on_the_wire.set()
                self._sending.discard(on_the_wire)
        samples = read_samples(
            answer,
            prompt,
            request.num_generations,
            where=where,
            length=self.max_tokens if self.exact_length else None,
        )
        return [
            {
                "input_ids": prompt + ids,
                "prompt_length": len(prompt),
                "generation_logprobs": logprobs,
                "weight_version": request.weight_version,
            }
            for ids, logprobs in samples
        ]

    async def _no_sync_running(self) -> None:
        """Return once no sync runs: no rollout is sent while the weights change."""
        while self._sync_done is not None:
            await self._sync_done.wait()

    async def sync_weights(self, version: int) -> None:
        """Pause the server (its way of `sync_mode`), have `publish` write the version's
        weights, reload them, resume; no new rollout is sent meanwhile."""
        where = f"generator at {self.url} (weights of version {version})"
        refused = Caller(where, refused=Unavailable, malformed=GeneratorOutputError)
        pause = "wait" if self.sync_mode is SyncMode.WAIT else "keep"
        self._sync_done = trio.Event()
        try:
            for sending in list(self._sending):  # requests already past the check go first
                await sending.wait()
            async with self._client() as client:
                try:
                    # the cache is dropped after the reload (below), not by the pause (vLLM's
                    # deprecated default, which it skips under "keep")
                    await request_json(
                        client,
                        "POST",
                        f"{self.url}{PAUSE}?mode={pause}&clear_cache=false",
                        refused,
                    )
                    try:
                        if self.publish is not None:
                            await self.publish(version)
                        answer = await request_json(
                            client,
                            "POST",
                            self.url + RELOAD,
                            refused,
                            json_body={"method": "reload_weights"},
                        )
                        dropped = await request_json(
                            client, "POST", self.url + RESET_CACHE, refused
                        )
                    finally:
                        with trio.CancelScope(shield=True):
                            await request_json(client, "POST", self.url + RESUME, refused)
                except Unavailable as exc:
                    exc.add_note(
                        "a vLLM server pauses and reloads weights when started with "
                        "VLLM_SERVER_DEV_MODE=1"
                    )
                    raise
        finally:
            done, self._sync_done = self._sync_done, None
            done.set()
        results = answer.get("results") if isinstance(answer, Mapping) else None
        if not isinstance(results, list):
            raise GeneratorOutputError(f"{where}: reload_weights answered {answer!r:.200}")
        if not (isinstance(dropped, Mapping) and dropped.get("success") is True):
            raise GeneratorOutputError(
                f"{where}: the server kept its prefix cache ({dropped!r:.200}): rollouts would "
                f"reuse keys and values computed with the old weights"
            )
        self.synced.append(version)
