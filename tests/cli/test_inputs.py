"""Every subcommand refuses a bad number or path in one line naming the value, with status 2
and no traceback, before doing any work; Ctrl-C ends any of them with one line and status 130."""

from __future__ import annotations

from pathlib import Path

import pytest

from groupflow.cli import main


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        status = main(argv)
    except SystemExit as exit:
        status = int(exit.code or 0)
    captured = capsys.readouterr()
    assert status == 2, (argv, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, (argv, captured.err)
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["sim", "--steps", "0"], "--steps: must be >= 1, got 0"),
        (["sim", "--steps", "many"], "'many' is not a whole number"),
        (["sim", "--scenario", "no-such-scenario"], "no-such-scenario"),
        (["fuzz", "--examples", "0"], "--examples: must be >= 1, got 0"),
        (["fuzz", "--rounds", "0"], "--rounds: must be >= 1, got 0"),
        (["fuzz", "--steps", "-3"], "--steps: must be >= 1, got -3"),
        (["bench-teacher", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
        (["bench-teacher", "--seq-len", "0"], "--seq-len: must be >= 2, got 0"),
        (["bench-teacher", "--groups", "0"], "--groups: must be >= 1, got 0"),
        (["bench-teacher", "--dp", "0"], "--dp: must be >= 1, got 0"),
        (["check", "--max-states", "-5"], "--max-states: must be >= 1, got -5"),
        (["check", "--prompts", "0"], "prompts"),
        (["no-such-command"], "invalid choice: 'no-such-command'"),
    ],
)
def test_bad_numbers_and_names_are_refused_in_one_line(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert named in _refused(argv, capsys)


def test_bad_paths_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert "is not a folder" in _refused(["sim", "--plot", str(a_file / "t.png")], capsys)
    assert "is a folder" in _refused(["sim", "--plot", str(tmp_path)], capsys)
    assert "is not a folder" in _refused(["model", "--out", str(a_file / "x")], capsys)
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    out = tmp_path / "diagram"
    line = _refused(["model", "--out", str(out), "--readme", str(readme)], capsys)
    assert "has no lifecycle diagram section" in line and "marker" in line
    assert not list(tmp_path.glob("diagram*")), "nothing is written when the README is refused"
    assert "cannot read" in _refused(["model", "--readme", str(tmp_path / "none.md")], capsys)
    assert "cannot read scenario" in _refused(
        ["sim", "--scenario", str(tmp_path / "no.toml")], capsys
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("name = [unclosed\n", "bad.toml"),
        ('name = "x"\nsteps = 0\n', "bad.toml"),
        (
            'name = "x"\nsteps = 4\n[pipeline]\nprompts_per_step = -1\n'
            "num_generations_per_prompt = 2\nmax_inflight_prompts = 2\nmax_buffered_groups = 4\n",
            "prompts_per_step",
        ),
    ],
)
def test_a_malformed_scenario_is_refused_naming_the_file(
    text: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "bad.toml"
    scenario.write_text(text)
    assert named in _refused(["sim", "--scenario", str(scenario)], capsys)


def test_ctrl_c_ends_a_command_in_one_line_with_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import groupflow.cli._sim as cmd_sim

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cmd_sim, "simulate", interrupted)
    assert main(["sim", "--design", "pump"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "groupflow sim: interrupted"


def test_ctrl_c_during_check_says_what_was_explored(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import groupflow.cli._check as check

    def explore(bounds: object, **kwargs: object) -> None:
        progress = kwargs["progress"]
        assert callable(progress)
        progress(4_000, 9_000, 120, 1.5)
        raise KeyboardInterrupt

    monkeypatch.setattr(check, "explore", explore)
    assert main(["check"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "groupflow check: interrupted checking pump after about 4,000 states and 9,000 "
        "transitions in 2 s, no verdict for it"
    ]
