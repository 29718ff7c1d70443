"""The edges of the commands, tried as a user would: every error a user can cause ends in one
line naming the value, with exit status 2 and no traceback, before any work starts, and leaves
every file as it was; the hangs end in bounded time.

Each row of the table runs the CLI in a subprocess (it is the CLI that is judged). A property
then runs every command in-process with generated bad values for each of its flags, with the
commands' work replaced by a tripwire: a value accepted where it should be refused starts work
and fails the property. Seeded bugs show both can fail."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch", reason="the train and bench-teacher rows need torch")

from groupflow.cli import _args as args_module  # noqa: E402
from groupflow.cli import _main as main_module  # noqa: E402
from groupflow.cli import _train as train_module  # noqa: E402
from groupflow.cli import command_parsers, main  # noqa: E402
from groupflow.impl._trainer import TrainConfig  # noqa: E402
from groupflow.impl._trainer import _config as config_module  # noqa: E402
from groupflow.model.errors import UsageError  # noqa: E402
from groupflow.sim import calibrate  # noqa: E402
from tests.helpers import SLOW_TEACHER_SCENARIO  # noqa: E402
from tests.trainer.test_run import TINY, _random_teachers, _run  # noqa: E402

# -- the sandbox: one of each kind of bad input --------------------------------------------


def _sandbox(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "sub").mkdir()
    (root / "afile").write_text("")
    (root / "garbage.pt").write_bytes(bytes(range(256)) * 2)
    (root / "text.txt").write_text("hello\n")
    (root / "binary.bin").write_bytes(bytes(range(255, -1, -1)))
    (root / "list.json").write_text("[1, 2]\n")
    (root / "empty.jsonl").write_text("")
    (root / "latin1.toml").write_bytes(b"steps = 3\n# caf\xe9\n")
    (root / "slow.toml").write_text(SLOW_TEACHER_SCENARIO)
    return root


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a folder)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step `groupflow train` run folder, with checkpoints."""
    out = tmp_path_factory.mktemp("edges") / "run"
    config = TrainConfig.from_mapping({**TINY, "steps": 2})
    _run(config, out, _random_teachers(config), plot=False)
    return out


@pytest.fixture
def sandbox(tmp_path: Path, run_folder: Path) -> Path:
    root = _sandbox(tmp_path / "box")
    shutil.copytree(run_folder, root / "run")
    broken = root / "broken"
    shutil.copytree(run_folder, broken)
    newest = sorted((broken / "checkpoints").glob("step-*"))[-1]
    learner = newest / "learner.bin"
    data = bytearray(learner.read_bytes())
    data[len(data) // 2] ^= 0xFF
    learner.write_bytes(bytes(data))
    return root


# -- each row, in a subprocess ---------------------------------------------------------------


def _cli(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "groupflow.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


ROWS: list[tuple[list[str], str]] = [
    (["train", "--out", "afile/run"], "afile is not a folder"),
    (["train", "--out", "/proc/groupflow-run"], "/proc is not writable"),
    (["train", "--out", "afile"], "'afile' is a file, not a folder"),
    (["train", "--config", "latin1.toml"], "not UTF-8 text (byte 0xe9 at offset 15)"),
    (["train", "--steps", str(10**14)], "--steps: must be <= 1,000,000"),
    (["train", "--teacher", "count=garbage.pt"], "teacher garbage.pt is not a file of torch"),
    (
        ["train", "--teacher", "count=afile", "--teacher", "count=sub"],
        "domain 'count' has a --teacher already (afile)",
    ),
    (
        [
            "train",
            "--engine",
            "vllm",
            "--teacher-url",
            "count=http://a",
            "--teacher-url",
            "count=http://b",
        ],
        "domain 'count' has a --teacher-url already (http://a)",
    ),
    (["train", "--resume", "broken"], "learner.bin fails its checksum"),
    (["train", "--resume", "sub"], "--resume sub: not a groupflow train run folder"),
    (["train", "--resume", "run", "--steps", "3"], "drop --steps"),
    (["train", "--stepz", "3"], "(see groupflow train --help)"),
    (["sim", "--steps", str(10**12)], "--steps: must be <= 1,000,000"),
    (["sim", "--plot", "/proc/groupflow/t.png"], "/proc is not writable"),
    (["sim", "--plot", "t.bmpx"], "the extension must say the image format"),
    (["sim", "--from-run", "empty.jsonl"], "empty.jsonl: line 1 is not a groupflow trace"),
    (["sim", "--from-run", "text.txt"], "text.txt: line 1 is not a groupflow trace"),
    (["sim", "--from-run", "binary.bin"], "binary.bin: line 1 is not a groupflow trace"),
    (["sim", "--from-run", "list.json"], "list.json: line 1 is not a groupflow trace"),
    (["sim", "--scenario", "afile"], "afile: [pipeline] needs prompts_per_step"),
    (["sim", "--from-run", "run", "--plot", "t.png"], "--plot t.png draws simulated runs"),
    (["sim", "--from-run", "run", "--trace", "t.jsonl"], "--trace t.jsonl writes a simulated"),
    (["sim", "--from-run", "run", "--conform"], "--conform checks a simulated run"),
    (["sim", "--from-run", "run", "--scenario", "cluster"], "--scenario cluster: the fit makes"),
    (["sim", "--from-run", "run", "--steps", "5"], "--steps 5 sets how long the what-if runs"),
    (["sim", "--write", "fit.toml"], "--write fit.toml is where --from-run writes its fit"),
    (["sim", "--design", "pump", "--trace", "run/trace.jsonl"], "already holds a trace"),
    (["sim", "--design", "inline", "--dispatch", "timer"], "--design inline runs no pump"),
    (["sim", "--design", "all", "--dispatch", "demand"], "runs the pump with each dispatch"),
    (["sim", "--from-run", "run", "--dispatch", "timer"], "the what-if pump's dispatch"),
    (["check", "--teachers", "1000000"], "--teachers 1,000,000 > --prompts 4"),
    (["check", "--checkpoint-policy", "bogus"], "'bogus' is not a checkpoint policy"),
    (["check", "--capacity", "4"], "unrecognized arguments: --capacity 4"),
    (["check", "--prompts", "-3"], "argument --prompts: must be >= 1, got -3"),
    (["check", "--stages", "3"], "argument --stages: must be <= 2, got 3"),
    (["check", "--depth", "5"], "--depth 5 sets the random walks: add --simulate N"),
    (["check", "--seed", "3"], "--seed 3 sets the random walks: add --simulate N"),
    (["check", "--simulate", "3", "--max-states", "9"], "--max-states 9 sets the exhaustive"),
    (["check", "--simulate", "3", "--no-reduction"], "--no-reduction sets the exhaustive"),
    (["model", "--out", "/proc/groupflow/lifecycle"], "/proc is not writable"),
    (["bench-teacher", "--model", "garbage.pt"], "teacher garbage.pt is not a file of torch"),
    (["fuzz", "--device", "tpu"], "--device tpu"),
    (["fuzz", "--seed", "abc"], "argument --seed: 'abc' is not a whole number"),
    (["sim", "--from-run", "empty.jsonl"], 'header", ...}): the file is empty'),
    (["fuzz", "--rounds", "2", "--minutes", "1"], "--rounds 2 and --minutes 1 each say how"),
    (["fuzz", "--machine", "buffer", "--scorer", "torch"], "--scorer torch sets the pipeline"),
    (["fuzz", "--machine", "served", "--steps", "5"], "--steps 5: the served machine's examples"),
    (["replay", "binary.bin"], "binary.bin: line 1 is not a JSON object"),
    (["sim", "--steps=--"], "--steps: expected a value, got '--'"),
    (["train", "--teacher-url", "count=http://127.0.0.1:9"], "add --engine vllm"),
    (["train", "--engine", "vllm", "--teacher-url", "count=ftp://x"], "'ftp://x' is not an http"),
    (["train", "--engine", "vllm", "--teacher-url", "chemistry=http://x"], "unknown domain"),
    (["train", "--engine", "vllm", "--teachers-on", "ray"], "drop one of them"),
    (["train", "--teacher-dp", "3"], "--teacher-dp 3 sizes the teachers' Ray worker groups"),
    (["train", "--ray-address", "auto"], "--ray-address auto: nothing runs on Ray"),
    (["train", "--vllm-python", "afile"], "'afile' is not executable"),
    (["train", "--vllm-python", sys.executable], "add --engine vllm"),
    (["train", "--student-url", "http://127.0.0.1:9"], "add --engine vllm"),
    (["train", "--engine", "vllm", "--student-url", "x"], "--student-url 'x': not an http"),
    (["bench-teacher", "--url", "http://127.0.0.1:9"], "--url times a served teacher"),
    (["bench-teacher", "--engine", "vllm", "--url", "ftp://x"], "--url 'ftp://x': not an http"),
    (["bench-teacher", "--vocab", "100"], "--vocab 100 sets a served teacher's token ids"),
    (["bench-teacher", "--engine", "vllm", "--dp", "2"], "--dp 2 places a teacher in this"),
    (
        ["bench-teacher", "--engine", "vllm", "--url", "http://127.0.0.1:9", "--model", "small"],
        "--model small is for a server started here",
    ),
    (["train", "--resume", "run", "--engine", "vllm"], "drop --engine"),
    (
        ["train", "--engine", "vllm", "--vllm-python", "/bin/false"],
        "/bin/false has no vLLM to start servers with",
    ),
]


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.args, done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.parametrize(("argv", "named"), ROWS, ids=[" ".join(a) for a, _ in ROWS])
def test_each_row_is_refused_in_one_line_and_changes_nothing(
    argv: list[str], named: str, sandbox: Path
) -> None:
    before = _tree(sandbox)
    line = _one_line(_cli(argv, sandbox))
    assert named in line, line
    assert line.startswith(f"groupflow {argv[0]}"), line
    assert _tree(sandbox) == before


def test_a_plot_into_a_folder_not_made_yet_is_made(sandbox: Path) -> None:
    """Checked up front, written at the end: the folders on the way are made then."""
    done = _cli(["sim", "--steps", "2", "--design", "pump", "--plot", "new/deep/t.png"], sandbox)
    assert done.returncode == 0, done.stderr
    assert (sandbox / "new" / "deep" / "t.png").stat().st_size > 0


def test_a_teacher_that_never_answers_ends_in_bounded_time_warning_once(sandbox: Path) -> None:
    """A call of 10^12 virtual seconds: the simulation is bounded in virtual time, fails with
    exit 1 saying so, and the stall watchdog warns once, in words, not once a minute."""
    done = _cli(["sim", "--scenario", "slow.toml", "--design", "pump"], sandbox, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "still running after" in done.stdout + done.stderr
    stalls = [line for line in done.stderr.splitlines() if "no progress for" in line]
    assert len(stalls) == 1, stalls[:5]
    assert "teacher 'teacher': a call of" in stalls[0], stalls[0]


# -- every flag with generated bad values, in-process ----------------------------------------


class WorkStarted(Exception):
    """A command got past its checks with a value it should have refused."""


def _tripwire(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace each command's work with `WorkStarted`: what the property feeds must never
    reach it."""
    import groupflow.cli._check as check
    import groupflow.cli._sim as cmd_sim
    import groupflow.impl._teachers as teachers
    import groupflow.impl._trainer as trainer
    import groupflow.impl._trainer._provision as trainer_provision
    import groupflow.properties.buffer_machine as buffer_machine
    import groupflow.properties.pipeline_machine as pipeline_machine
    import groupflow.properties.scheduler_machine as scheduler_machine

    def boom(*args: object, **kwargs: object) -> Any:
        raise WorkStarted("work started")

    for module, name in [
        (trainer_provision, "domain_teacher"),  # training a teacher
        (trainer, "train"),
        (cmd_sim, "simulate"),
        (check, "explore"),
        (check, "random_walks"),
        (buffer_machine, "run_buffer_machine"),
        (scheduler_machine, "run_scheduler_walks"),
        (pipeline_machine, "run_pipeline_machine"),
        (teachers, "score_teacher_batch"),
    ]:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, boom)


def _in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    err = io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = main(argv)
            except SystemExit as exit:
                status = int(exit.code or 0)
            except WorkStarted:
                raise
            except Exception:  # what the interpreter does with an error main lets out
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(here)
    return status, err.getvalue()


def check_refused(argv: list[str], box: Path, named: str | None = None) -> str:
    """`argv` run in `box` ends in status 2, one line, no traceback, nothing written."""
    before = _tree(box)
    try:
        status, err = _in_process(argv, box)
    except WorkStarted:
        raise AssertionError(f"{argv}: accepted, and the command's work started") from None
    lines = err.strip().splitlines()
    assert status == 2, (argv, status, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, (argv, err[-2000:])
    if named is not None:
        assert named in lines[0], (argv, lines[0])
    assert _tree(box) == before, (argv, "changed files")
    return lines[0]


_NOT_NUMBERS = st.sampled_from(["", "x", "1.5.2", "1e", "--", "0x1g", "½"])
_BAD_PATHS = {
    "writable_file": ["afile/x", "/proc/groupflow/x", "sub"],
    "writable_folder": ["afile/x", "/proc/groupflow/x", "afile"],
    "image_file": ["afile/x.png", "/proc/groupflow/x.png", "sub", "x.bmpx", "x"],
    "readable_file": ["nothere.toml", "sub", "latin1.toml"],
}
_BAD_STRINGS = {
    ("sim", "--scenario"): ["no-such-scenario", "afile", "text.txt", "sub"],
    ("sim", "--from-run"): ["empty.jsonl", "text.txt", "binary.bin", "list.json", "nothere"],
    ("bench-teacher", "--model"): ["garbage.pt", "nothere", "sub"],
    ("train", "--teacher"): ["count=garbage.pt", "count", "chemistry=afile", "count=nothere"],
    ("train", "--device"): ["tpu", "gpu", "cuda:x"],
    ("bench-teacher", "--device"): ["tpu", "gpu"],
    ("fuzz", "--device"): ["tpu", "cpu"],
    ("model", "--readme"): ["nothere.md", "afile", "sub"],
    ("train", "--resume"): ["sub", "nothere", "afile", "broken"],
    ("train", "--reward-weight"): ["x", "nan", "-1", "inf"],
    ("train", "--teacher-url"): ["count", "count=", "count=ftp://x", "chemistry=http://x"],
    ("train", "--vllm-python"): ["afile", "nothere", "sub"],
    ("train", "--student-url"): ["ftp://x", "x"],
    ("bench-teacher", "--url"): ["ftp://x", "x"],
    ("bench-teacher", "--vllm-python"): ["afile", "nothere", "sub"],
    ("replay", "path"): ["nothere", "empty.jsonl", "binary.bin", "list.json"],
}
_SKIP = {("train", "--ray-address"), ("check", "--seed"), ("sim", "--seed")}
"""Flags with no bad value to generate (any int is a seed; a Ray address needs Ray)."""


def _bad_values(command: str, action: argparse.Action) -> st.SearchStrategy[str] | None:
    flag = action.option_strings[0] if action.option_strings else action.dest
    if (command, flag) in _SKIP or action.nargs == 0:
        return None
    if (command, flag) in _BAD_STRINGS:
        return st.sampled_from(_BAD_STRINGS[command, flag])
    if action.help == argparse.SUPPRESS:  # an earlier name of a flag: refused whatever follows
        return st.sampled_from(["2", "x"])
    if action.choices is not None:
        known = {str(c) for c in action.choices}

        def outside(text: str) -> bool:
            return text not in known and not text.startswith("-")

        return st.text(min_size=1, max_size=6).filter(outside)
    name = getattr(action.type, "__name__", "")
    bound = re.fullmatch(r"int >= (-?\d+)", name)
    if bound:
        lowest = int(bound.group(1))
        return st.integers(max_value=lowest - 1).map(str) | _NOT_NUMBERS
    if name in _BAD_PATHS:
        return st.sampled_from(_BAD_PATHS[name])
    if action.type is int:  # checked by the command itself (`check`'s bounds)
        return st.integers(max_value=-1).map(str) | _NOT_NUMBERS
    if name == "_seed":
        return _NOT_NUMBERS
    if command == "check" and flag == "--checkpoint-policy":
        return st.sampled_from(["bogus", "flush,", "FLUSH", ","])
    raise AssertionError(f"no bad values known for {command} {flag}: add them to the table")


def _cases() -> list[tuple[str, argparse.Action]]:
    out = []
    for command, parser in sorted(command_parsers().items()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            out.append((command, action))
    return out


CASES = _cases()


def test_every_flag_has_bad_values_or_a_reason() -> None:
    """A new flag must join the property: it has generated bad values, or a reason in _SKIP."""
    for command, action in CASES:
        _bad_values(command, action)


@pytest.fixture
def tripwired(monkeypatch: pytest.MonkeyPatch) -> None:
    _tripwire(monkeypatch)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_every_command_refuses_generated_bad_values(
    data: st.DataObject, sandbox: Path, tripwired: None
) -> None:
    command, action = data.draw(
        st.sampled_from([(c, a) for c, a in CASES if _bad_values(c, a) is not None]),
        label="flag",
    )
    strategy = _bad_values(command, action)
    assert strategy is not None
    value = data.draw(strategy, label="value")
    if action.option_strings:
        argv = [command, f"{action.option_strings[0]}={value}"]
    else:
        argv = [command, value]
    check_refused(argv, sandbox)


# -- seeded bugs -----------------------------------------------------------------------------


def _seeded(box: Path, argv: list[str], named: str | None = None) -> None:
    with pytest.raises(AssertionError):
        check_refused(argv, box, named)


def test_seeded_bug_checkpoint_errors_caught_by_type_at_the_top(
    sandbox: Path, tripwired: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the top catches `UsageError` only (as before), so a `CheckpointCorrupt` from
    `--teacher` is a traceback with status 1."""
    check_refused(["train", "--teacher", "count=garbage.pt"], sandbox)
    monkeypatch.setattr(main_module, "INPUT_ERRORS", (UsageError,))
    _seeded(sandbox, ["train", "--teacher", "count=garbage.pt"])


def test_seeded_bug_writes_checked_with_os_access(
    sandbox: Path, tripwired: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: the write check asks `os.access` (always yes for root) instead of trying:
    `--plot` under /proc is accepted and the simulation starts."""
    check_refused(["sim", "--plot", "/proc/groupflow/t.png"], sandbox)

    def by_permission_bits(text: str, path: Path) -> None:
        if not os.access(args_module._nearest_existing(path), os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text!r}")

    monkeypatch.setattr(args_module, "_refuse_unwritable", by_permission_bits)
    if os.access("/proc", os.W_OK):  # root: the permission bits say yes
        _seeded(sandbox, ["sim", "--plot", "/proc/groupflow/t.png"])


def test_seeded_bug_no_bound_on_the_run_size(
    sandbox: Path, tripwired: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: `--steps` takes any positive number and the config any run size (as
    before): 10^14 steps are accepted and the run starts (then hangs building prompts)."""
    check_refused(["train", "--steps", str(10**14)], sandbox)
    monkeypatch.setattr(
        train_module, "at_least", lambda lowest, at_most=None: args_module.at_least(lowest)
    )
    monkeypatch.setattr(config_module, "check_run_size", lambda *args, **kwargs: None)
    _seeded(sandbox, ["train", "--steps", str(10**14)])


def test_seeded_bug_overrides_on_resume_not_named(
    sandbox: Path, tripwired: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: no check of the flags given with `--resume`: `--steps` reaches the config
    comparison, which refuses without saying which flag to drop."""
    check_refused(["train", "--resume", "run", "--steps", "3"], sandbox, "drop --steps")
    monkeypatch.setattr(train_module, "_refuse_overrides_on_resume", lambda args: None)
    _seeded(sandbox, ["train", "--resume", "run", "--steps", "3"], "drop --steps")


def test_seeded_bug_a_trace_header_read_unguarded(
    sandbox: Path, tripwired: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug: `sim --from-run` parses the first line without a guard: text is a
    traceback."""
    check_refused(["sim", "--from-run", "text.txt"], sandbox)

    def unguarded(trace: Path) -> dict[str, Any]:
        header: dict[str, Any] = json.loads(trace.read_text().splitlines()[0])
        return header

    monkeypatch.setattr(calibrate, "_read_header", unguarded)
    _seeded(sandbox, ["sim", "--from-run", "text.txt"])


IGNORED: list[tuple[str, str, list[str], str]] = [
    # (the module of the command, its check, an option it would ignore, what the refusal names)
    ("_sim", "_not_for_a_fit", ["sim", "--from-run", "run", "--plot", "t.png"], "--plot t.png"),
    ("_check", "_mixed", ["check", "--depth", "5"], "--depth 5"),
    ("_train", "_refuse_unused_placement", ["train", "--teacher-dp", "3"], "--teacher-dp 3"),
    ("_bench_teacher", "_unused", ["bench-teacher", "--vocab", "100"], "--vocab 100"),
    (
        "_fuzz",
        "_unused",
        ["fuzz", "--machine", "buffer", "--rounds", "2", "--minutes", "1"],
        "--rounds 2",
    ),
]


@pytest.mark.parametrize(
    ("module", "check", "argv", "named"), IGNORED, ids=[" ".join(a) for _, _, a, _ in IGNORED]
)
def test_seeded_bug_an_option_the_command_ignores_is_caught(
    sandbox: Path,
    tripwired: None,
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    check: str,
    argv: list[str],
    named: str,
) -> None:
    """Seeded bug: the command's check of the options that mean nothing with the others
    given answers "none" (as it did before there was one), and the command does its work
    with the option ignored: `--from-run` fits without the plot, `check` searches without
    the walks' depth, `train` runs its teachers in process, `bench-teacher` times a teacher
    whose vocabulary is its model's, `fuzz` runs by the clock."""
    check_refused(argv, sandbox, named)
    monkeypatch.setattr(importlib.import_module(f"groupflow.cli.{module}"), check, _answers_none)
    _seeded(sandbox, argv, named)


def _answers_none(*args: object) -> None:
    return None


def test_seeded_bug_the_tripwire_sees_accepted_values(
    sandbox: Path, tripwired: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The property's own harness: a value the command accepts reaches the tripwire, and the
    check fails (a `--scenario` that exists is accepted)."""
    _seeded(sandbox, ["sim", "--scenario", "slow.toml"])
