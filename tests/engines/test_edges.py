"""Served engines at their edges, over real HTTP, against the vLLM imitation: every call bounded
in time and size, every answer checked for identity and meaning, errors by cause the same for a
teacher call, a rollout and a weight sync, a sync's steps named, a cancel that stays a cancel,
and rollouts labelled with the weights that sampled them. Each capability has a seeded bug
that its test catches."""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from groupflow.impl import PipelineConfig, build_pipeline
from groupflow.impl.contract import GenerateRequest, TokenRow
from groupflow.impl.engines import ServedGenerator, ServedTeachers, served_root
from groupflow.impl.errors import (
    ConfigError,
    EngineBusy,
    EngineError,
    EngineOutputError,
    EngineRefused,
    EngineTimeout,
)
from groupflow.impl.testing import FakeLearner, Fault, VLLMImitation
from groupflow.model.shape import Shape
from tests.helpers import score_request, scored_field

pytest.importorskip("httpx", reason="the served engines need httpx: pip install -e '.[served]'")

ROWS = [TokenRow((5, 6, 7, 8), 2), TokenRow((9, 10, 11), 1)]
COMPLETIONS = "/v1/completions"


@pytest.fixture
def server() -> Iterator[VLLMImitation]:
    with VLLMImitation(token_s=0.001) as imitation:
        yield imitation


def _teacher(server: VLLMImitation, **settings: Any) -> ServedTeachers:
    return ServedTeachers({"t": [server.url]}, models={"t": server.model}, **settings)


def _generator(server: VLLMImitation, **settings: Any) -> ServedGenerator:
    settings.setdefault("max_tokens", 4)
    return ServedGenerator(server.url, list, model=server.model, **settings)


def _rollout(
    ordinal: int = 0, version: int = 0, prompt: list[int] | None = None
) -> GenerateRequest:
    return GenerateRequest(ordinal, prompt or [5, 6], None, 2, version)


async def _call(role: str, server: VLLMImitation, **settings: Any) -> None:
    """One call of `role` against `server`: a teacher call, a rollout or a weight sync."""
    if role == "teacher":
        request = score_request(ROWS)
        try:
            await _teacher(server, **settings).score(request)
        finally:  # a failed call writes nothing
            if scored_field(request) != [None, None]:
                assert all(scored_field(request))
    elif role == "rollout":
        await _generator(server, **settings).generate(_rollout())
    else:
        await _generator(server, **settings).sync_weights(1)


ROUTE = {"teacher": COMPLETIONS, "rollout": COMPLETIONS, "sync": "/pause"}
"""The first request each role sends (the model is named, so none asks for it)."""
TIME_SETTING = {
    "teacher": "request_timeout_s",
    "rollout": "rollout_timeout_s",
    "sync": "sync_timeout_s",
}
SIZE_SETTING = {
    "teacher": "ServedTeachers.bytes_per_token",
    "rollout": "ServedGenerator.bytes_per_token",
    "sync": "answers about no tokens",
}
ROLES = ["teacher", "rollout", "sync"]


# -- errors by cause, the same for every role -----------------------------------------------


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    ("fault", "error", "says"),
    [
        (Fault.with_status(503), EngineBusy, "HTTP 503"),
        (Fault.with_status(429), EngineBusy, "HTTP 429"),
        (Fault.with_status(400), EngineRefused, "refused the request: HTTP 400"),
        (Fault.with_status(404), EngineRefused, "refused the request: HTTP 404"),
        (Fault.raw(b"<html>"), EngineOutputError, "no JSON"),
        (Fault.close(), EngineBusy, "RemoteProtocolError"),
        (Fault.cut(40), EngineBusy, "RemoteProtocolError|ReadError"),
    ],
    ids=["503", "429", "400", "404", "garbage", "close", "cut"],
)
async def test_errors_are_told_by_cause_for_every_role(
    server: VLLMImitation, role: str, fault: Fault, error: type[Exception], says: str
) -> None:
    server.script(ROUTE[role], fault)
    with trio.fail_after(30), pytest.raises(error, match=says) as caught:
        await _call(role, server)
    assert type(caught.value) is error
    assert server.url in str(caught.value)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("fault", [Fault.hang(), Fault.drip(100)], ids=["hang", "drip"])
async def test_a_call_has_a_total_time_bound_named_in_its_error(
    server: VLLMImitation, role: str, fault: Fault
) -> None:
    """A server that drips its answer a few bytes at a time never lets httpx's read timeout
    fire; the total bound ends the call, as it ends one that never answers."""
    server.script(ROUTE[role], fault)
    with trio.fail_after(20), pytest.raises(EngineTimeout, match=TIME_SETTING[role]):
        await _call(role, server, **{TIME_SETTING[role]: 0.5})


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("chunked", [False, True], ids=["announced", "chunked"])
async def test_an_answer_past_its_size_bound_is_refused_before_it_is_read_whole(
    server: VLLMImitation, role: str, chunked: bool
) -> None:
    server.script(ROUTE[role], Fault.huge(20_000_000, chunked=chunked))
    with trio.fail_after(30), pytest.raises(EngineOutputError, match=SIZE_SETTING[role]):
        await _call(role, server)


def test_a_size_bound_follows_what_was_asked() -> None:
    from groupflow.impl.engines._http import ENVELOPE_BYTES, Bounds

    bounds = Bounds.per_token(1.0, "s", 100, 1024, "b")
    assert bounds.max_bytes == ENVELOPE_BYTES + 100 * 1024


async def test_seeded_bug_no_total_time_bound_is_caught(
    server: VLLMImitation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: a request bounded by httpx's read timeout alone (the gap between reads):
    the dripping server holds the call past the test's limit."""
    import groupflow.impl.engines._http as http

    unbounded = http.Bounds.small

    def forever(seconds: float, setting: str) -> Any:
        return unbounded(math.inf, setting)

    monkeypatch.setattr(http.Bounds, "small", staticmethod(forever))
    with pytest.raises((trio.TooSlowError, pytest.fail.Exception)):
        with trio.fail_after(3):
            await test_a_call_has_a_total_time_bound_named_in_its_error(
                server, "sync", Fault.drip(100)
            )


async def test_seeded_bug_an_answer_read_whole_whatever_its_size_is_caught(
    server: VLLMImitation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: no size bound (the answer read whole and parsed): nothing is refused."""
    import groupflow.impl.engines._http as http

    monkeypatch.setattr(http, "ENVELOPE_BYTES", 10**12)
    with pytest.raises(pytest.fail.Exception):
        await test_an_answer_past_its_size_bound_is_refused_before_it_is_read_whole(
            server, "teacher", False
        )


def test_a_servers_folder_is_read_from_its_model_list(server: VLLMImitation) -> None:
    assert served_root(server.url, where="the check") == Path(server.model)


@pytest.mark.parametrize(
    ("fault", "error", "says"),
    [
        (Fault.hang(), EngineTimeout, r"did not answer in full within 0\.5 s"),
        (Fault.drip(100), EngineTimeout, r"did not answer in full within 0\.5 s"),
        (Fault.huge(20_000_000), EngineOutputError, "announced 20,000,000 bytes"),
        (Fault.huge(20_000_000, chunked=True), EngineOutputError, "sent more than"),
        (Fault.with_status(404), EngineRefused, "HTTP 404"),
        (Fault.edit(lambda a: a.update(data=[])), EngineOutputError, "names no served folder"),
    ],
    ids=["hang", "drip", "huge", "huge-chunked", "404", "no-folder"],
)
def test_the_check_of_a_users_server_is_bounded_and_checked(
    server: VLLMImitation, fault: Fault, error: type[Exception], says: str
) -> None:
    """The trainer's check of a student server the user runs (before any trio run): every
    answer within its time and size, refused by cause in one line."""
    server.script("/v1/models", fault)
    began = time.monotonic()
    with pytest.raises(error, match=says) as caught:
        served_root(server.url, where="--student-url X", seconds=0.5)
    assert time.monotonic() - began < 5, "the check ran past its bound"
    assert "\n" not in str(caught.value)


def test_seeded_bug_a_check_bounded_by_the_read_timeout_alone_is_caught(
    server: VLLMImitation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the blocking check reads until the answer ends, each chunk within the
    read timeout alone (what `httpx.get(timeout=...)` does): a drip outlasts the bound."""
    import groupflow.impl.engines._http as http

    monkeypatch.setattr(http, "time", types.SimpleNamespace(monotonic=lambda: 0.0))
    with pytest.raises((pytest.fail.Exception, AssertionError), match="DID NOT RAISE|past its"):
        test_the_check_of_a_users_server_is_bounded_and_checked(
            server, Fault.drip(40), EngineTimeout, "within"
        )


# -- identity and meaning of what comes back ------------------------------------------------


def _set_model(answer: dict[str, Any]) -> None:
    answer["model"] = "another-model"


@pytest.mark.parametrize("role", ["teacher", "rollout"])
async def test_an_answer_for_another_model_is_refused(server: VLLMImitation, role: str) -> None:
    server.script(COMPLETIONS, Fault.edit(_set_model))
    with trio.fail_after(30), pytest.raises(EngineOutputError, match="another-model"):
        await _call(role, server)


def _teacher_logprob(value: object) -> Callable[[dict[str, Any]], None]:
    def change(answer: dict[str, Any]) -> None:
        entry = answer["choices"][0]["prompt_logprobs"][3]
        (token,) = entry
        entry[token]["logprob"] = value

    return change


def _sampled_logprob(value: object) -> Callable[[dict[str, Any]], None]:
    def change(answer: dict[str, Any]) -> None:
        answer["choices"][1]["logprobs"]["token_logprobs"][2] = value

    return change


IMPOSSIBLE = [
    (-9999.0, "clamp of minus infinity"),
    (-10000.0, "clamp of minus infinity"),
    (0.7, "above 0"),
    (-math.inf, "non-finite"),
    (math.nan, "non-finite"),
    (None, "no log-prob"),
    (True, "no log-prob"),
]


@pytest.mark.parametrize(("value", "says"), IMPOSSIBLE, ids=[s for _, s in IMPOSSIBLE])
@pytest.mark.parametrize("role", ["teacher", "rollout"])
async def test_an_impossible_logprob_is_refused_naming_where(
    server: VLLMImitation, role: str, value: object, says: str
) -> None:
    change = _teacher_logprob(value) if role == "teacher" else _sampled_logprob(value)
    server.script(COMPLETIONS, Fault.edit(change))
    where = "position 3 of row 0" if role == "teacher" else "token 2 of sample 1"
    with trio.fail_after(30), pytest.raises(EngineOutputError, match=says) as caught:
        await _call(role, server)
    assert where in str(caught.value)


async def test_a_logprob_of_zero_and_a_rounding_above_it_are_taken(
    server: VLLMImitation,
) -> None:
    for value in (0.0, 5e-5):
        server.script(COMPLETIONS, Fault.edit(_sampled_logprob(value)))
        rows = await _generator(server).generate(_rollout())
        assert rows[1]["generation_logprobs"][2] == value


def test_seeded_bug_a_finite_check_alone_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: a log-prob only has to be finite (vLLM's -9999.0 and a positive one pass)."""
    import groupflow.impl.engines._completions as completions

    def finite(value: object, *, where: str, what: str) -> float:
        assert isinstance(value, float) and math.isfinite(value), "refused"
        return value

    monkeypatch.setattr(completions, "check_logprob", finite)
    with VLLMImitation(token_s=0.001) as imitation:
        with pytest.raises(pytest.fail.Exception):
            trio.run(
                test_an_impossible_logprob_is_refused_naming_where,
                imitation,
                "teacher",
                -9999.0,
                "clamp of minus infinity",
            )


def test_seeded_bug_the_answers_model_unchecked_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import groupflow.impl.engines._completions as completions

    monkeypatch.setattr(completions, "check_model", lambda body, model, *, where: None)
    with VLLMImitation(token_s=0.001) as imitation:
        with pytest.raises(pytest.fail.Exception):
            trio.run(test_an_answer_for_another_model_is_refused, imitation, "rollout")


# -- a weight sync's steps ------------------------------------------------------------------

STEPS = [
    ("/pause", "pause"),
    ("/collective_rpc", "reload"),
    ("/reset_prefix_cache", "drop the prefix cache"),
    ("/resume", "resume"),
]


@pytest.mark.parametrize(("route", "step"), STEPS, ids=[s for _, s in STEPS])
async def test_a_failed_sync_step_names_itself(
    server: VLLMImitation, route: str, step: str
) -> None:
    server.script(route, Fault.with_status(500))
    with trio.fail_after(30), pytest.raises(EngineBusy, match=f"step '{step}'"):
        await _generator(server).sync_weights(1)
    if route != "/resume":  # the server is asked to resume after any failed step
        assert server.paths[-1] == "/resume"
        assert not await _is_paused(server)


async def _is_paused(server: VLLMImitation) -> bool:
    import httpx

    async with httpx.AsyncClient() as client:
        answer = await client.get(server.url + "/is_paused")
    return bool(answer.json()["is_paused"])


async def test_a_reload_that_reached_no_worker_fails_the_sync(server: VLLMImitation) -> None:
    server.script("/collective_rpc", Fault.edit(lambda answer: answer.update(results=[])))
    generator = _generator(server)
    with trio.fail_after(30), pytest.raises(EngineOutputError, match="reached no worker"):
        await generator.sync_weights(1)
    assert generator.synced == [] and not await _is_paused(server)


async def test_a_failing_resume_is_a_note_on_the_steps_own_error(server: VLLMImitation) -> None:
    server.script("/collective_rpc", Fault.with_status(500, b'{"error": "reload broke"}'))
    server.script("/resume", Fault.with_status(503, b'{"error": "resume broke"}'))
    with trio.fail_after(30), pytest.raises(EngineBusy, match="step 'reload'") as caught:
        await _generator(server).sync_weights(1)
    notes = " ".join(getattr(caught.value, "__notes__", ()))
    assert "resume broke" in notes and "may still be paused" in notes


@pytest.mark.parametrize("hung", ["/pause", "/collective_rpc"])
async def test_a_cancelled_sync_against_a_hung_server_ends_within_its_grace_as_a_cancel(
    server: VLLMImitation, hung: str
) -> None:
    """The cancel stays a cancel, and the sync's effort to resume the server (which hangs as
    well) is bounded by `cancel_grace_s`."""
    server.script(hung, Fault.hang())
    server.script("/resume", Fault.hang())
    generator = _generator(server, cancel_grace_s=0.5)
    started = trio.current_time()
    with trio.fail_after(20):
        with trio.move_on_after(0.3) as scope:
            await generator.sync_weights(1)
    assert scope.cancelled_caught, "the cancel did not come out as a cancel"
    assert trio.current_time() - started < 0.3 + 0.5 + 1.0


async def test_seeded_bug_a_resume_bounded_by_the_sync_timeout_is_caught(
    server: VLLMImitation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the resume after a cancel is bounded by `sync_timeout_s` (here 3 s), not
    the grace: the cancel takes seconds to come out."""
    real = ServedGenerator._resume_after

    async def slow(self: ServedGenerator, client: Any, where: str, exc: BaseException) -> None:
        self.cancel_grace_s = self.sync_timeout_s
        await real(self, client, where, exc)

    monkeypatch.setattr(ServedGenerator, "_resume_after", slow)
    monkeypatch.setattr(
        ServedGenerator, "__init__", _with_defaults(ServedGenerator.__init__, sync_timeout_s=3.0)
    )
    with pytest.raises(AssertionError):
        await test_a_cancelled_sync_against_a_hung_server_ends_within_its_grace_as_a_cancel(
            server, "/pause"
        )


def _with_defaults(init: Callable[..., None], **defaults: Any) -> Callable[..., None]:
    def changed(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**defaults, **kwargs})

    return changed


def test_a_cancel_grace_the_shutdown_bound_cannot_hold_is_refused_at_build() -> None:
    generator = ServedGenerator("http://127.0.0.1:1", list, max_tokens=4, cancel_grace_s=60)
    with pytest.raises(ConfigError, match=r"cancel_grace_s=60 is not below shutdown_timeout_s=60"):
        build_pipeline(
            PipelineConfig(
                shape=Shape(
                    prompts_per_step=2,
                    num_generations_per_prompt=2,
                    max_inflight_prompts=2,
                    max_buffered_groups=4,
                ),
            ),
            prompts=[[5], [6]],
            generator=generator,
            learner=FakeLearner(),
        )


def test_bounds_are_checked_when_built() -> None:
    bad: list[dict[str, Any]] = [
        {"rollout_timeout_s": 0},
        {"sync_timeout_s": -1},
        {"cancel_grace_s": 0},
    ]
    for settings in bad:
        with pytest.raises(ConfigError, match=next(iter(settings))):
            ServedGenerator("http://x", list, max_tokens=4, **settings)
    with pytest.raises(ConfigError, match="request_timeout_s"):
        ServedTeachers({"t": ["http://x"]}, request_timeout_s=0)
    assert ServedGenerator("http://x", list, max_tokens=100).rollout_bound_s == 60 + 50


# -- which weights sampled a rollout --------------------------------------------------------


async def _rollouts_across_a_sync(
    server: VLLMImitation, mode: str, *, late_s: float = 0.3
) -> list[tuple[Mapping[str, Any], frozenset[int]]]:
    """Three rollouts are in flight when a sync to version 1 begins; one of them reaches the
    server late (held `late_s` on its way in, as a slow network would); two more are asked
    for while the sync runs. Each row with the versions the server recorded for it."""

    async def publish(version: int) -> None:
        server.publish(version)

    generator = _generator(server, max_tokens=20, sync_mode=mode, publish=publish)
    rows: list[Mapping[str, Any]] = []

    async def rollout(ordinal: int) -> None:
        rows.extend(await generator.generate(_rollout(ordinal, prompt=[5, 6, ordinal])))

    server.script(COMPLETIONS, Fault.delay(0.0), Fault.delay(late_s))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for ordinal in range(3):
                nursery.start_soon(rollout, ordinal)
            await trio.sleep(0.01)
            nursery.start_soon(generator.sync_weights, 1)
            await trio.sleep(0.01)
            for ordinal in range(3, 5):
                nursery.start_soon(rollout, ordinal)
    assert generator.synced == [1]
    out = []
    for row in rows:
        versions = server.versions_of(row["input_ids"], row["generation_logprobs"])
        assert versions is not None, "the server sampled no such row"
        out.append((row, versions))
    return out


async def test_under_wait_each_rollout_carries_the_weights_that_sampled_it(
    server: VLLMImitation,
) -> None:
    """The sync pauses only once every request already started has its answer, the late one
    included; rollouts asked for meanwhile go after the reload, labelled with it."""
    rows = await _rollouts_across_a_sync(server, "wait")
    assert len(rows) == 10
    for row, versions in rows:
        assert versions == {row["weight_version"]}, (row["weight_version"], versions)
    assert sorted(row["weight_version"] for row, _ in rows) == [0] * 6 + [1] * 4


async def test_under_interrupt_a_rollout_spanning_the_sync_may_carry_both(
    server: VLLMImitation,
) -> None:
    rows = await _rollouts_across_a_sync(server, "interrupt")
    for row, versions in rows:
        assert versions <= {row["weight_version"], 1}, (row["weight_version"], versions)
    assert any(len(versions) == 2 for _, versions in rows), "no rollout spanned the sync"


async def test_seeded_bug_a_sync_that_does_not_wait_for_answers_is_caught(
    server: VLLMImitation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the sync pauses at once under `wait` (as when it waited only for the
    requests to be handed to httpx): the late request reaches the paused server, is held
    until the reload, and is sampled by version 1 while labelled 0."""

    async def at_once(self: ServedGenerator) -> None:
        return None

    monkeypatch.setattr(ServedGenerator, "_answered", at_once)
    with pytest.raises(AssertionError):
        await test_under_wait_each_rollout_carries_the_weights_that_sampled_it(server)


class _LabelLearner(FakeLearner):
    """Checks every trained row against what the server recorded: the versions that sampled
    it lie in its group's start..end weight versions, and (under `wait`) are exactly the
    row's own label."""

    def __init__(self, server: VLLMImitation, exact: bool) -> None:
        super().__init__(latency=0.0)
        self.server = server
        self.exact = exact
        self.checked = 0

    async def train_step(self, batch: Any) -> Any:
        for group in batch.groups:
            for sid in group.sample_ids:
                row = batch.rows[sid]
                versions = self.server.versions_of(row["input_ids"], row["generation_logprobs"])
                assert versions is not None
                span = set(range(group.start_weight_version, group.end_weight_version + 1))
                assert versions <= span, (versions, span)
                if self.exact:
                    assert versions == {row["weight_version"]}, (versions, row["weight_version"])
                self.checked += 1
        return await super().train_step(batch)


@pytest.mark.parametrize("mode", ["wait", "interrupt"])
async def test_a_pipeline_trains_every_row_under_the_weights_that_sampled_it(mode: str) -> None:
    with VLLMImitation(token_s=0.002) as server:

        async def publish(version: int) -> None:
            server.publish(version)

        generator = _generator(server, max_tokens=12, sync_mode=mode, publish=publish)
        learner = _LabelLearner(server, exact=mode == "wait")
        pipeline = build_pipeline(
            PipelineConfig(
                shape=Shape(
                    prompts_per_step=2,
                    num_generations_per_prompt=2,
                    max_inflight_prompts=4,
                    max_buffered_groups=6,
                    gate_window=1,
                ),
            ),
            prompts=[[5, 6, i % 50] for i in range(24)],
            generator=generator,
            learner=learner,
            train_fields=["input_ids", "generation_logprobs", "weight_version"],
        )
        with trio.fail_after(60):
            result = await pipeline.run()
    assert result.trained == frozenset(range(24))
    assert generator.synced == list(range(1, 13))
    assert learner.checked == 48
    assert not pipeline.buffer.store.list_ids()


async def test_a_run_that_fails_at_a_weight_sync_leaves_no_row_in_the_store(
    server: VLLMImitation,
) -> None:
    """The run fails at its third sync; the groups it had READY for later steps are dropped
    with their rows, as every group of a run that ends is."""
    server.script("/collective_rpc", Fault.delay(0), Fault.delay(0), Fault.with_status(400))
    pipeline = build_pipeline(
        PipelineConfig(
            shape=Shape(
                prompts_per_step=2,
                num_generations_per_prompt=2,
                max_inflight_prompts=4,
                max_buffered_groups=8,
            ),
        ),
        prompts=[[5, 6, i] for i in range(16)],
        generator=_generator(server, max_tokens=4),
        learner=FakeLearner(latency=0.05),
        train_fields=["input_ids", "generation_logprobs"],
    )
    with trio.fail_after(60), pytest.raises(EngineError) as caught:
        try:
            await pipeline.run()
        except Exception as exc:
            raise exc.__cause__ or exc from None
    assert "step 'reload'" in str(caught.value)
    assert not pipeline.buffer.store.list_ids(), "rows left in the store"
    assert len(pipeline.ledger.trained) == 4


async def test_seeded_bug_a_refusal_taken_for_a_busy_server_is_caught(
    server: VLLMImitation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: every HTTP error is transient (a 400 retried as if the server were busy):
    the errors-by-cause test for 400 sees `EngineBusy`."""
    import groupflow.impl.engines._http as http

    monkeypatch.setattr(http, "EngineRefused", EngineBusy)
    with pytest.raises(EngineBusy):
        await test_errors_are_told_by_cause_for_every_role(
            server, "teacher", Fault.with_status(400), EngineRefused, "refused the request"
        )
