"""`groupflow model`, and the README diagram it generates."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from groupflow.cli import _model as cmd_model
from groupflow.cli import main
from groupflow.model import TRANSITIONS, GroupState, to_dot, to_mermaid
from tests.helpers import README, ROOT, user_pages


def test_model_prints_table_and_writes_diagrams(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "out" / "lc"
    assert main(["model", "--out", str(prefix)]) == 0
    out = capsys.readouterr().out
    for row in TRANSITIONS:
        assert re.search(rf"\b{row.event.value}\b.*\b{row.target.value}\b", out), row
    assert (tmp_path / "out" / "lc.dot").read_text() == to_dot()
    assert (tmp_path / "out" / "lc.mmd").read_text() == to_mermaid()
    assert f"wrote {prefix}.dot" in out and f"wrote {prefix}.mmd" in out


def test_model_json_lists_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "--json", "--out", str(tmp_path / "lc")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(TRANSITIONS)
    assert {r["to"] for r in rows} <= {s.value for s in GroupState}


def test_console_script_runs(tmp_path: Path) -> None:
    """The installed entry point, as a user calls it."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from groupflow.cli import main; raise SystemExit(main())",
            "model",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "lifecycle.dot").exists() and (tmp_path / "lifecycle.mmd").exists()


def test_readme_diagram_is_generated_from_the_table() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert cmd_model.readme_block() in readme, (
        "README's lifecycle diagram drifted from the table: run "
        "`groupflow model --readme README.md`"
    )


def test_update_readme_rewrites_only_the_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{cmd_model.README_START}\nold\n{cmd_model.README_END}\nafter\n")
    assert cmd_model.update_readme(readme)
    text = readme.read_text()
    assert text == f"before\n{cmd_model.readme_block()}\nafter\n"
    assert not cmd_model.update_readme(readme)


def test_update_readme_without_markers_says_what_to_add(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="marker"):
        cmd_model.update_readme(readme)


def test_readme_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    commands = [line for line in lines[:6] if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert "groupflow train" in commands[0] and "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci, ".ci/run must run the README's test command"


def test_the_docs_blocks_run_or_parse() -> None:
    """Every python block a user reads is real code: the README's examples (the buffer's, the
    pipeline's) run; a docs page's quotes are of examples/custom_client.py (which
    tests/meta/test_examples.py runs); a sketch (it needs a cluster, a server, a checkpoint) must
    still parse; any other block runs."""
    sketches = 0
    for page in user_pages():
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"<!-- example: \w+ -->\n```python\n.*?```", "", text, flags=re.DOTALL)
        sketch = r"<!-- sketch: [^>]*-->\n```python\n(.*?)```"
        for code in re.findall(sketch, text, flags=re.DOTALL):
            compile(code, f"{page.name} (sketch)", "exec")
            sketches += 1
        text = re.sub(sketch, "", text, flags=re.DOTALL)
        for code in re.findall(r"```python\n(.*?)```", text, re.DOTALL):
            exec(compile(code, page.name, "exec"), {"__name__": "docs_example"})
    assert sketches, "the docs' sketches went missing from this test's view"
    readme = README.read_text(encoding="utf-8")
    assert "ReplayBuffer(" in readme and "build_pipeline(" in readme


def test_fuzz_runs_the_machines_with_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--examples", "5", "--steps", "10"]) == 0
    err = capsys.readouterr().err
    assert "buffer: ok" in err and "scheduler: ok" in err and "pipeline: ok" in err
    assert "served: ok" in err and "rows checked" in err


def test_fuzz_runs_the_pipeline_machine_hosted_on_asyncio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["fuzz", "--machine", "pipeline", "--host", "asyncio", "--examples", "4"]
    assert main([*argv, "--steps", "12", "--seed", "5"]) == 0
    err = capsys.readouterr().err
    assert "pipeline over fake teachers on the asyncio host" in err and "pipeline: ok" in err


def test_commands_work_without_the_test_extras() -> None:
    """A plain `pip install .` has no Hypothesis, matplotlib or torch: every command still loads,
    and the ones that need an extra say which."""
    code = (
        "import sys\n"
        "for name in ('hypothesis', 'matplotlib', 'torch', 'httpx'):\n"
        "    sys.modules[name] = None\n"
        "from groupflow.cli import main\n"
        "assert main(['sim', '--steps', '2', '--design', 'pump']) == 0\n"
        "assert main(['fuzz']) == 2\n"
        "assert main(['bench-teacher']) == 2\n"
        "assert main(['bench-teacher', '--engine', 'vllm', '--url', 'http://127.0.0.1:9']) == 2\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "pip install 'groupflow[fuzz]'" in done.stderr
    assert "pip install 'groupflow[torch]'" in done.stderr
    assert "pip install 'groupflow[served]'" in done.stderr


def test_fuzz_for_minutes_repeats_rounds_until_the_time_is_up(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import itertools
    import types

    import groupflow.cli._fuzz as cmd_fuzz

    ticks = itertools.count(step=10.0)  # every reading of the clock is 10 s later
    fake_time = types.SimpleNamespace(perf_counter=lambda: next(ticks))
    monkeypatch.setattr(cmd_fuzz, "time", fake_time)
    assert (
        main(["fuzz", "--machine", "buffer", "--examples", "3", "--steps", "5", "--minutes", "1"])
        == 0
    )
    err = capsys.readouterr().err
    assert "[1/until time is up] buffer" in err and "[2/until time is up] buffer" in err
    assert "[3/until time is up]" not in err
    assert "2 rounds in" in err


def test_fuzz_prints_the_seed_that_replays_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    from groupflow.properties.pipeline_bugs import applied

    args = ["fuzz", "--machine", "pipeline", "--examples", "50", "--steps", "30", "--seed", "11"]
    with applied("rollout frees its permit before the commit writes rows"):
        assert main(args) == 1
        first = capsys.readouterr().err
        assert "state.start(" in first, "the shrunk example is not printed"
        replay = re.search(r"replay it: groupflow (.*)", first)
        assert replay is not None, first
        assert "--seed 11" in replay.group(1)
        assert main(replay.group(1).split()) == 1
        again = capsys.readouterr().err
    failure = [line for line in first.splitlines() if "FAILED" in line]
    assert failure and failure == [line for line in again.splitlines() if "FAILED" in line]


def test_fuzz_with_a_seed_generates_the_same_examples(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The setups drawn are the same (what the run then does may differ a little: trio breaks
    ties between equal deadlines by object identity)."""
    from groupflow.properties import pipeline_machine

    drawn: list[object] = []
    start = pipeline_machine.PipelineMachine._start

    def record(
        self: pipeline_machine.PipelineMachine, setup: pipeline_machine.Setup, seed: int
    ) -> None:
        drawn.append(setup)
        start(self, setup, seed)

    monkeypatch.setattr(pipeline_machine.PipelineMachine, "_start", record)
    runs = []
    for seed in ("3", "3", "4"):
        drawn.clear()
        assert main(["fuzz", "--machine", "pipeline", "--examples", "8", "--seed", seed]) == 0
        runs.append(list(drawn))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert "seed 3" in capsys.readouterr().err
