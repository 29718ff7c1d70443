"""`groupflow train --engine vllm`: the embedded models as Hugging Face Llama checkpoints a
server loads (`LlamaLM`), the run's servers started side by side and always stopped
(`served_engines`), the configuration and its refusals; and, with vLLM (marker `vllm`), a real
run on three servers whose trace replays VALID and whose KL falls."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.helpers import NEEDS_VLLM, vllm_python

torch = pytest.importorskip("torch", reason="the trainer needs torch")
transformers = pytest.importorskip("transformers", reason="LlamaLM needs transformers")


import trio  # noqa: E402

from groupflow.impl._teachers import (  # noqa: E402
    PROBE_FILE,
    PROBE_REPEATS,
    ProbeCall,
    read_probe,
    write_probe,
)
from groupflow.impl._teachers._served_lm import (  # noqa: E402
    GPT2LM,
    GPT2LMConfig,
    LlamaLM,
    LlamaLMConfig,
    ServedLM,
)
from groupflow.impl._teachers._torch import TorchTeacher, new_lm  # noqa: E402
from groupflow.impl._trainer import VOCAB, Engine, RunFolder, TrainConfig  # noqa: E402
from groupflow.impl._trainer._domain_teachers import ENGINE_RECIPE  # noqa: E402
from groupflow.impl._trainer._engines import RunEngines, served_engines  # noqa: E402
from groupflow.impl._trainer._run import train  # noqa: E402
from groupflow.impl._trainer._student import ENGINE_CONTEXT, run_student  # noqa: E402
from groupflow.impl._trainer._tasks import ANSWER_LENGTH, make_prompts, token_words  # noqa: E402
from groupflow.impl.engines import ServedGenerator, VLLMServer  # noqa: E402
from groupflow.impl.engines._completions import read_samples, sample_body  # noqa: E402
from groupflow.impl.errors import ConfigError, Unavailable  # noqa: E402
from groupflow.impl.testing import Fault, VLLMImitation  # noqa: E402
from groupflow.model.errors import EngineOutputError, ScoringTimeout  # noqa: E402

SHAPE = LlamaLMConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=1, max_len=ENGINE_CONTEXT)
GPT2_SHAPE = GPT2LMConfig(
    vocab_size=VOCAB, d_model=64, n_heads=2, n_layers=1, max_len=ENGINE_CONTEXT
)
SHAPES: dict[str, LlamaLMConfig | GPT2LMConfig] = {"llama": SHAPE, "gpt2": GPT2_SHAPE}
"""The served architectures: the teachers' (Llama) and the student's (GPT-2)."""


def _model(seed: int = 0, architecture: str = "llama") -> ServedLM:
    model = new_lm(SHAPES[architecture], seed=seed)
    assert isinstance(model, ServedLM)
    return model


# -- the models, as a server loads them ---------------------------------------------------


@pytest.mark.parametrize("architecture", sorted(SHAPES))
def test_the_exported_folder_is_the_same_model_for_transformers(
    tmp_path: Path, architecture: str
) -> None:
    """What a server loads from the folder (config, weights, tokenizer) is the model trained:
    the same logits, and the tokenizer's word `i` is token `i`."""
    model = _model(architecture=architecture).eval()
    words = token_words()
    folder = model.save_folder(tmp_path / "m", words)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    ids = torch.tensor([[0, 1, 5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        assert torch.allclose(model(ids), loaded(input_ids=ids).logits, atol=1e-6)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_tokens_to_ids(list(words)) == list(range(VOCAB))
    assert words[:3] == ("<s>", "count", "reverse")
    assert loaded.config.eos_token_id is None
    assert loaded.config.architectures == [type(model.hf).__name__]  # what an engine runs
    head = loaded.config.head_dim if architecture == "llama" else 64 // loaded.config.n_head
    assert head in (32, 64), "a head width vLLM's CPU attention takes"


@pytest.mark.parametrize("architecture", sorted(SHAPES))
def test_new_weights_replace_the_old_in_place_leaving_no_temporary(
    tmp_path: Path, architecture: str
) -> None:
    folder = _model(0, architecture).save_folder(tmp_path / "m", token_words())
    other = _model(1, architecture)
    other.write_weights(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    for name, value in other.hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_a_folder_needs_one_distinct_word_per_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="3 words .* for a vocabulary of 32"):
        _model().save_folder(tmp_path / "m", ["a", "b", "c"])
    with pytest.raises(ConfigError, match="distinct: 1"):
        _model().save_folder(tmp_path / "m", ["a"] * VOCAB)


def test_a_llama_teacher_saves_and_loads_as_a_torch_teacher(tmp_path: Path) -> None:
    teacher = TorchTeacher.from_config(SHAPE, seed=3, device="cpu")
    teacher.save(tmp_path / "t.pt")
    again = TorchTeacher.load(tmp_path / "t.pt", device="cpu")
    assert isinstance(again.model, LlamaLM) and again.model.cfg == SHAPE
    ids = torch.tensor([[0, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        assert torch.equal(teacher.model(ids), again.model(ids))


def test_a_run_on_an_engine_starts_from_a_gpt2_student_with_room_to_score() -> None:
    """Learned absolute positions (GPT-2), heads of 32; the teachers are Llamas."""
    student = run_student(TrainConfig(engine="vllm"))
    assert isinstance(student, GPT2LM)
    assert student.cfg == attrs.evolve(GPT2_SHAPE, n_layers=2)
    # a scoring call asks for one token after a whole row: the context holds it
    assert student.cfg.max_len == ENGINE_CONTEXT == 11
    assert isinstance(ENGINE_RECIPE.config, LlamaLMConfig)
    assert ENGINE_RECIPE.config.max_len == ENGINE_CONTEXT
    assert not isinstance(run_student(TrainConfig()), ServedLM)


def test_a_served_student_starts_spread_as_torch_starts_a_layer() -> None:
    """GPT-2's own initial spread (0.02) would leave the student's policy near uniform."""
    student = run_student(TrainConfig(engine="vllm"))
    assert isinstance(student, GPT2LM)
    embedding = student.hf.transformer.wte.weight.detach()
    assert 0.8 < float(embedding.std()) < 1.2
    ids = torch.tensor([[0, 1, 5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        spread = torch.log_softmax(student(ids)[0, -1], -1).max().item()
    assert float(spread) > math.log(1 / VOCAB) + 0.5, "a near-uniform first policy"


def test_a_served_run_refuses_a_width_its_heads_do_not_divide() -> None:
    with pytest.raises(ConfigError, match="d_model =48 must be a multiple of 32 with engine"):
        TrainConfig(engine="vllm", d_model=48, n_heads=4)


def test_the_engine_is_part_of_the_config() -> None:
    config = TrainConfig(engine="vllm")
    assert config.engine is Engine.VLLM
    assert 'engine = "vllm"' in config.to_toml()
    with pytest.raises(ConfigError, match=r"TrainConfig.engine must be one of 'torch', 'vllm'"):
        TrainConfig(engine="sglang")


async def test_train_refuses_engines_that_do_not_match_its_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="engine='vllm' needs the servers"):
        await train(
            RunFolder.new(tmp_path, TrainConfig(engine="vllm", steps=1)), teachers={}, progress=None
        )
    assert not any(tmp_path.iterdir())


# -- the sampling request of a run on an engine -------------------------------------------


def test_a_run_on_vllm_without_its_client_is_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from groupflow.impl._trainer._engines import check_engine_needs

    real = importlib.util.find_spec

    def hidden(name: str, *rest: Any) -> Any:
        return None if name == "httpx" else real(name, *rest)

    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    with pytest.raises(Unavailable, match=r"needs httpx here: pip install 'groupflow\[engines\]'"):
        check_engine_needs(_small(), student_url=None, served=(), python=sys.executable)


def test_a_run_whose_servers_are_all_the_users_needs_no_vllm() -> None:
    from groupflow.impl._trainer._engines import check_engine_needs

    config = _small()
    everyone = set(config.domains)
    check_engine_needs(config, student_url="http://x", served=everyone, python="/bin/false")
    with pytest.raises(Unavailable, match="/bin/false has no vLLM"):
        check_engine_needs(config, student_url=None, served=everyone, python="/bin/false")


def test_a_run_asks_for_responses_of_exactly_the_answer_length() -> None:
    body = sample_body("m", [0, 1], n=2, max_tokens=4, temperature=1.0, seed=0, exact_length=True)
    assert body["ignore_eos"] is True and body["min_tokens"] == 4
    assert "ignore_eos" not in sample_body("m", [0], n=1, max_tokens=4, temperature=1, seed=0)
    short = {
        "model": "m",
        "choices": [
            {"index": 0, "token_ids": [5, 6, 7], "logprobs": {"token_logprobs": [-1.0] * 3}}
        ],
    }
    with pytest.raises(EngineOutputError, match="3 tokens for sample 0, 4 asked for"):
        read_samples(short, [0, 1], 1, model="m", max_tokens=4, where="g", exact_length=True)
    assert read_samples(short, [0, 1], 1, model="m", max_tokens=4, where="g") == [
        ([5, 6, 7], [-1.0] * 3)
    ]
    with pytest.raises(EngineOutputError, match="3 tokens for sample 0, at most 2 asked"):
        read_samples(short, [0, 1], 1, model="m", max_tokens=2, where="g")


def test_a_served_row_carries_the_weight_version_it_was_asked_under() -> None:
    assert "weight_version" in ServedGenerator.fields


# -- the run's servers: started side by side, always stopped ------------------------------

_FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    model = sys.argv[sys.argv.index("--model") + 1]
    if os.path.basename(model) in os.environ.get("FAKE_FAIL", "").split(","):
        print("cannot load", model, file=sys.stderr)
        sys.exit(3)
    time.sleep(float(os.environ.get("FAKE_WARMUP_S", "0.5")))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


@pytest.fixture
def fake_vllm(tmp_path: Path) -> str:
    """An interpreter that runs, for `-m vllm...`, a server answering `/health` only."""
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return str(python)


def _teachers() -> dict[str, Any]:
    return {
        "count-teacher": TorchTeacher(_model(1), device="cpu"),
        "http://elsewhere:8000": None,  # a teacher the user serves: started by nobody here
    }


def _alive(urls: list[str]) -> list[bool]:
    import httpx

    out = []
    for url in urls:
        try:
            out.append(httpx.get(url + "/health", timeout=2).status_code == 200)
        except httpx.HTTPError:
            out.append(False)
    return out


def _small() -> TrainConfig:
    return TrainConfig(engine="vllm", d_model=32, n_heads=2, n_layers=1)


@pytest.mark.parametrize("count", [None, 3], ids=["every prompt", "fewer prompts than groups"])
async def test_a_served_run_times_its_teachers_calls_of_each_size_over_http(
    tmp_path: Path, count: int | None
) -> None:
    """`RunEngines.probe` on two imitation teachers: calls of 1, 2, 4 and 8 groups of the run's
    rows (a prompt and an answer of the run's length; a run of fewer prompts uses them again),
    each teacher in turn, each call taking at least what the server spends on it."""
    pytest.importorskip("httpx", reason="the engines need httpx")
    config = _small()
    prompts = make_prompts(config.num_prompts, domains=config.domains, seed=config.seed)[:count]
    with VLLMImitation(vocab=VOCAB, score_s=0.01) as one, VLLMImitation(vocab=VOCAB) as two:
        engines = RunEngines(
            student_url=one.url,
            student_folder=tmp_path,
            teachers={"count-teacher": one.url, "reverse-teacher": two.url},
        )
        with trio.fail_after(60):
            calls = await engines.probe(prompts, config)
    group = config.shape.num_generations_per_prompt
    for name in ("count-teacher", "reverse-teacher"):
        mine = [c for c in calls if c.teacher == name]
        assert [c.rows for c in mine] == [group, 2 * group, 4 * group, 8 * group] * PROBE_REPEATS
        for c in mine:
            firsts = [prompts[i % len(prompts)] for i in range(c.rows // group)]
            assert c.tokens == group * sum(len(p.tokens) + ANSWER_LENGTH for p in firsts)
    assert min(c.seconds for c in calls if c.teacher == "count-teacher") >= 0.01


async def test_a_probe_past_its_limit_is_a_timeout_naming_the_probe(tmp_path: Path) -> None:
    pytest.importorskip("httpx", reason="the engines need httpx")
    config = _small()
    prompts = make_prompts(config.num_prompts, domains=config.domains, seed=config.seed)
    with VLLMImitation(vocab=VOCAB, score_s=0.3) as server:
        engines = RunEngines(server.url, tmp_path, {"count-teacher": server.url})
        with trio.fail_after(60), pytest.raises(ScoringTimeout) as caught:
            await engines.probe(prompts, config, limit_s=0.5)
    assert "the teacher probe before the first step took longer than 0.5 s" in str(caught.value)


def test_a_new_run_in_a_used_folder_drops_the_old_probe(tmp_path: Path) -> None:
    """A run that never saved leaves its probe; the next new run there probes again (a probe
    of other servers or another batch would mislead the fit)."""
    RunFolder.new(tmp_path / "run", _small()).start()
    write_probe(tmp_path / "run" / PROBE_FILE, [ProbeCall("count-teacher", 4, 40, 0.1)])
    RunFolder.new(tmp_path / "run", _small()).start()
    assert not (tmp_path / "run" / PROBE_FILE).exists()


def test_seeded_bug_an_old_probe_kept_by_a_new_run_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RunFolder, "teacher_probe", property(lambda self: self.path / "x.json"))
    with pytest.raises(AssertionError):
        test_a_new_run_in_a_used_folder_drops_the_old_probe(tmp_path)


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        (Fault.huge(20_000_000), r"announced 20,000,000 bytes.*EngineOutputError"),
        (Fault.with_status(503), r"HTTP 503.*EngineBusy"),
        (Fault.edit(lambda a: a.update(data=[])), r"names no served folder.*EngineOutputError"),
    ],
    ids=["huge", "503", "no-folder"],
)
def test_a_users_student_server_is_checked_before_anything_starts(
    tmp_path: Path, fault: Fault, says: str
) -> None:
    pytest.importorskip("httpx", reason="the engines need httpx")
    student = run_student(_small())
    assert isinstance(student, ServedLM)
    with VLLMImitation() as server:
        server.script("/v1/models", fault)
        with pytest.raises(Unavailable, match=f"--student-url {server.url}.*{says}") as caught:
            served_engines(_small(), tmp_path, {}, student_url=server.url).__enter__()
    assert "\n" not in str(caught.value)


def test_the_servers_start_together_and_are_stopped_on_leaving(
    tmp_path: Path, fake_vllm: str
) -> None:
    pytest.importorskip("httpx", reason="the engines need httpx")
    with served_engines(_small(), tmp_path, _teachers(), python=fake_vllm) as engines:
        time.sleep(0.5)  # the threads that waited for the servers have ended
        urls = [engines.student_url, engines.teachers["count-teacher"]]
        assert _alive(urls) == [True, True]
        assert engines.teachers["http://elsewhere:8000"] == "http://elsewhere:8000"
        assert (engines.student_folder / "model.safetensors").is_file()
        assert (tmp_path / "engines" / "count-teacher" / "tokenizer.json").is_file()
    assert _alive(urls) == [False, False]


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_seeded_bug_servers_launched_from_the_threads_that_wait_for_them(
    tmp_path: Path, fake_vllm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's parent-death signal follows the thread that started a child: launched from
    the worker threads that wait for their warm-up, the servers die with those threads."""
    pytest.importorskip("httpx", reason="the engines need httpx")
    launch, wait = VLLMServer.launch, VLLMServer.wait_ready

    def launch_in_the_waiting_thread(self: VLLMServer) -> None:
        launch(self)
        wait(self)

    monkeypatch.setattr(VLLMServer, "launch", lambda self: None)
    monkeypatch.setattr(VLLMServer, "wait_ready", launch_in_the_waiting_thread)
    with served_engines(_small(), tmp_path, _teachers(), python=fake_vllm) as engines:
        time.sleep(0.5)
        assert _alive([engines.student_url, engines.teachers["count-teacher"]]) == [False, False]


def test_a_server_that_cannot_start_stops_the_others_and_names_its_log(
    tmp_path: Path, fake_vllm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("httpx", reason="the engines need httpx")
    monkeypatch.setenv("FAKE_FAIL", "count-teacher")
    monkeypatch.setenv("FAKE_WARMUP_S", "0")
    started: list[VLLMServer] = []
    launch = VLLMServer.launch

    def record(self: VLLMServer) -> None:
        started.append(self)
        launch(self)

    monkeypatch.setattr(VLLMServer, "launch", record)
    with (
        pytest.raises(Unavailable, match=r"count-teacher.log: cannot load"),
        served_engines(_small(), tmp_path, _teachers(), python=fake_vllm),
    ):
        raise AssertionError("not reached: a server failed")
    assert len(started) == 2 and all(s.process is None for s in started)
    assert _alive([f"http://127.0.0.1:{s.port}" for s in started]) == [False, False]


def test_only_a_llama_teacher_can_be_served(tmp_path: Path, fake_vllm: str) -> None:
    from groupflow.impl._teachers._torch import LMConfig

    plain = TorchTeacher.from_config(LMConfig(vocab_size=VOCAB, max_len=16), device="cpu")
    with (
        pytest.raises(ConfigError, match="'mine' is a CausalLM, which vLLM does not serve"),
        served_engines(_small(), tmp_path, {"mine": plain}, python=fake_vllm),
    ):
        pass
    assert not (tmp_path / "engines").exists()


# -- the real engine ----------------------------------------------------------------------


@pytest.mark.vllm
@NEEDS_VLLM
@pytest.mark.timeout(1500)
def test_groupflow_train_on_vllm_replays_valid_and_the_kl_falls(tmp_path: Path) -> None:
    """The embedded run on three vLLM servers (the student, a teacher per domain): rollouts
    sampled by the served student, scored by the served teachers, the student's weights
    reloaded by its server after every step. The trace replays VALID, the KL falls, the
    first step's importance weights are one (the served log-probs are the learner's), and no
    server outlives the run."""
    out = tmp_path / "run"
    env = {**os.environ, "GROUPFLOW_CACHE": str(tmp_path / "cache")}
    argv = [sys.executable, "-m", "groupflow.cli", "train", "--engine", "vllm"]
    argv += ["--steps", "120", "--out", str(out), "--no-progress"]
    argv += ["--vllm-python", str(vllm_python())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    replay = subprocess.run(
        [sys.executable, "-m", "groupflow.cli", "replay", str(out / "trace.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replay.stdout.startswith("VALID"), replay.stdout + replay.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(120))
    kl = [r["kl"] for r in records]
    first, last = sum(kl[:10]) / 10, sum(kl[-10:]) / 10
    # the task's slow start: a student's KL falls little over its first hundred steps (about
    # 0.4 by step 120, for the embedded student as for the served one), then fast
    assert last < first - 0.2, (first, last)
    # step 0 trains on rows the served student sampled with the learner's own weights: each
    # importance weight is about one (none truncated) when the served log-probs are the learner's
    assert records[0]["clipped"] == 0.0, records[0]
    assert 'engine = "vllm"' in (out / "config.toml").read_text()
    # each teacher's calls of 1 to 8 groups of 4 rows, timed before the run
    probe = read_probe(out / "teacher-probe.json")
    assert {c.teacher for c in probe} == {"count-teacher", "reverse-teacher"}
    assert sorted({c.rows for c in probe}) == [4, 8, 16, 32]
    leftover = subprocess.run(["pgrep", "-f", str(out / "engines")], capture_output=True, text=True)
    assert leftover.stdout == "", "a server outlived the run"


@pytest.mark.vllm
@NEEDS_VLLM
@pytest.mark.timeout(1500)
async def test_a_run_on_vllm_stopped_and_resumed_serves_the_checkpoints_weights(
    tmp_path: Path,
) -> None:
    """Stopped after 12 of 24 steps; resumed on fresh servers, whose student folder holds the
    starting weights again. The resume has the student's server reload the checkpoint's
    weights before the first rollout: the steps after it train on rows about as fresh as any
    (few importance weights truncated; rows sampled with the starting weights, twelve steps
    behind, would truncate far more), the served student is the learner at the end, and the
    two incarnations replay VALID with every prompt trained once."""
    from groupflow.impl._pipeline import load_checkpoint
    from groupflow.impl._trainer._provision import provide_teachers
    from groupflow.impl._trainer._student import response_logprobs
    from groupflow.impl.engines import ServedTeachers
    from groupflow.sim.verify.replay import replay

    config = TrainConfig(engine="vllm", steps=24, checkpoints={"every_steps": 6})
    out = tmp_path / "run"
    teachers = provide_teachers(config, cache_dir=tmp_path / "cache", device="cpu")
    physical = {t.name: t.teacher for t in teachers.values()}
    common: dict[str, Any] = {"teachers": teachers, "progress": None, "plot": False}
    with served_engines(config, tmp_path / "a", physical, python=vllm_python()) as engines:
        with trio.fail_after(600):
            first = await train(
                RunFolder.new(out, config), stop_after=12, engines=engines, **common
            )
    assert first.steps == 12 and first.stopped_early
    with served_engines(config, tmp_path / "b", physical, python=vllm_python()) as engines:
        with trio.fail_after(600):
            second = await train(RunFolder.resume(out, config), engines=engines, **common)
            row = [0, 1, 5, 6, 7, 8, 9, 10, 11, 12]
            request = _score_request(row)
            await ServedTeachers({"student": [engines.student_url]}).score(request)
        served = request.store.get(["s0"], [request.field])["s0"][request.field]
    assert second.steps == 24
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(24))
    assert max(r["clipped"] for r in records[12:15]) < 0.15, records[12:15]
    last = load_checkpoint(out / "checkpoints")  # the run's end (24 is a multiple of 6)
    assert last.step == 24
    student = run_student(config)
    assert isinstance(last.learner, dict)
    student.load_state_dict(last.learner["model"])
    with torch.inference_mode():
        mine = response_logprobs(student, torch.tensor([row]))[0].tolist()
    assert max(abs(a - b) for a, b in zip(served, mine, strict=True)) < 2e-3
    verdict = replay(out / "trace.jsonl")
    assert verdict.verdict == "valid", verdict.problem
    assert len(verdict.incarnations) == 2 and verdict.trained == frozenset(range(192))


def _score_request(row: list[int]) -> Any:
    from groupflow.impl import MemoryStore
    from groupflow.impl._trainer import PROMPT_LENGTH
    from groupflow.impl.contract import ScoreRequest
    from groupflow.model import GroupState, GroupView

    store = MemoryStore()
    store.put({"s0": {"input_ids": row, "prompt_length": PROMPT_LENGTH}})
    view = GroupView(
        group_id="g",
        state=GroupState.SCORING,
        target_step=0,
        sample_ids=("s0",),
        fields=frozenset(),
        awaiting_stage=True,
        start_weight_version=0,
        end_weight_version=0,
        ordinal=0,
        agent=None,
    )
    return ScoreRequest("student", (view,), store, "served_logprobs")
