"""`groupflow check --compiled`: the search on the model compiled by mypyc gives the reports of
the search on the pure model, byte for byte but for its timings; the child really runs the
compiled modules; a build is reused only for the source it was built from; and without mypyc
the option is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from groupflow.cli import _compiled, main

compiled = pytest.mark.skipif(
    not _compiled.has_mypyc(),
    reason="--compiled needs mypyc, which comes with mypy: pip install -e '.[compile]'",
)

F = TypeVar("F", bound=Callable[..., Any])


def builds(test: F) -> F:
    """A test of the compiled search: it needs mypyc, runs in CI's extras step (marker
    `compiled`), and may build the model first (about a minute on two cores)."""
    return compiled(pytest.mark.compiled(pytest.mark.timeout(1200)(test)))  # type: ignore[no-any-return]


CASES = {
    "defaults": [],
    "every-design": ["--design", "all"],
    "a-deadlock": ["--no-flush-timer", "--max-batch-groups", "2", "--max-buffered-groups", "2"],
    "a-crash-and-a-batch-failure": ["--prompts", "5", "--crashes", "1", "--batch-failures", "1"],
}
"""Bounds whose reports are compared: no violation, every design, a violation with its trace,
and faults."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the model is compiled once, by the first test."""
    return tmp_path_factory.mktemp("cache")


def _reports(
    args: list[str], capfd: pytest.CaptureFixture[str]
) -> tuple[int, list[dict[str, Any]]]:
    """The exit status and the JSON reports, without the timings (`capfd`: the compiled search
    prints from a child process)."""
    status = main(["check", *args, "--json"])
    reports = json.loads(capfd.readouterr().out)
    for report in reports:
        del report["seconds"], report["states_per_second"]
    return status, reports


@builds
@pytest.mark.parametrize("args", CASES.values(), ids=CASES.keys())
def test_the_compiled_search_gives_the_pure_searchs_reports(
    args: list[str],
    cache: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GROUPFLOW_CACHE", str(cache))
    pure = _reports(args, capfd)
    assert pure == _reports(["--compiled", *args], capfd)


@builds
def test_seeded_bug_a_child_on_the_pure_model_is_caught(
    cache: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded bug: the child does not put the compiled model first on its path, so it runs
    the pure one under the compiled name. It stops before searching, naming the module."""
    monkeypatch.setattr(
        _compiled, "_CHILD", _compiled._CHILD.replace("sys.path.insert(0, sys.argv[1])", "")
    )
    with pytest.raises(json.JSONDecodeError):  # the child printed no report
        test_the_compiled_search_gives_the_pure_searchs_reports([], cache, capfd, monkeypatch)
    assert main(["check", "--compiled"]) == 1
    assert "--compiled imported groupflow.model.decisions from" in capfd.readouterr().err


@compiled
@pytest.mark.compiled
def test_a_build_is_keyed_by_every_byte_of_the_model(tmp_path: Path) -> None:
    """A change to any source file of the model (here one byte of a guard) is another build,
    so an edited model is never checked by a build of the one before."""
    copy = tmp_path / "model"
    shutil.copytree(_compiled.model_source(), copy)
    before = _compiled.source_key(copy)
    guards = copy / "scheduler" / "guards.py"
    guards.write_text(guards.read_text() + "\n")
    assert _compiled.source_key(copy) != before


def test_without_mypyc_the_option_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_compiled, "has_mypyc", lambda: False)
    assert main(["check", "--compiled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "groupflow check: --compiled needs mypyc, which comes with mypy: pip install "
        "'groupflow[compile]' (and a C compiler with the Python headers)"
    ]


_PARENT = """
import signal, sys
from groupflow.cli import _compiled, main
if sys.argv[1] == "seeded":  # the command does not leave Ctrl-C to its child
    _compiled.signal = type("Signals", (), {"signal": staticmethod(lambda *a: None),
                                            "SIGINT": signal.SIGINT, "SIG_IGN": signal.SIG_IGN})
sys.exit(main(["check", "--compiled", *sys.argv[2:]]))
"""
_LONG = ["--prompts", "8", "--teachers", "2", "--crashes", "2", "--batch-failures", "2"]
"""Bounds the compiled search takes about 20 s over (3.8 million states)."""


def _interrupted(how: str) -> tuple[int, list[str]]:
    """`groupflow check --compiled` on `_LONG`, sent Ctrl-C (SIGINT to its process group, as a
    terminal does to its foreground job) at its first progress line: its exit status and the
    lines it wrote to stderr after that one."""
    process = subprocess.Popen(
        [sys.executable, "-c", _PARENT, how, *_LONG],
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        first = process.stderr.readline()  # two seconds in
        assert first.startswith("checking pump:"), first
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, [line for line in err.splitlines() if line.strip()]


@builds
@pytest.mark.parametrize("how", ["as-shipped"])
def test_ctrl_c_stops_the_compiled_search_as_it_stops_the_search(
    how: str, cache: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child reports Ctrl-C as the command does, in one line, status 130; the command says
    nothing of its own (it leaves Ctrl-C to the child). The compiled search hears it at its next
    progress call, every 2,000 states."""
    monkeypatch.setenv("GROUPFLOW_CACHE", str(cache))
    assert main(["check", "--compiled", "--max-states", "10"]) in (0, 1)  # the build is there
    capfd.readouterr()
    status, lines = _interrupted(how)
    assert status == 130, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("groupflow check: interrupted checking pump after about"), lines


@builds
def test_seeded_bug_a_command_that_hears_ctrl_c_beside_its_child_is_caught(
    cache: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded bug: the command does not ignore Ctrl-C while its child searches, so both say
    they were interrupted (and the command may return while its child still runs)."""
    with pytest.raises(AssertionError):
        test_ctrl_c_stops_the_compiled_search_as_it_stops_the_search(
            "seeded", cache, capfd, monkeypatch
        )
