"""`groupflow train` from the command line: bad input refused in one line, a run with saved
teachers, and Ctrl-C: the run stops after its step, saves, says how to continue, and the
resumed run's trace replays valid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="groupflow train needs torch (pip install '.[train]')")

from groupflow.cli import main  # noqa: E402
from groupflow.impl import TorchTeacher
from groupflow.impl._trainer import TrainConfig
from groupflow.impl._trainer._student import new_student, student_config
from groupflow.impl.errors import ConfigError
from groupflow.sim.verify.replay import replay  # noqa: E402
from tests.helpers import tiny_train_toml  # noqa: E402


@pytest.fixture
def saved_teachers(tmp_path: Path) -> list[str]:
    """`--teacher` arguments for both domains: small random teachers saved to files (no
    training, so the test does not wait for it)."""
    args = []
    for i, domain in enumerate(("count", "reverse")):
        path = tmp_path / f"{domain}.pt"
        TorchTeacher(
            new_student(student_config(d_model=32, n_layers=1), seed=i), device="cpu"
        ).save(path)
        args += ["--teacher", f"{domain}={path}"]
    return args


def _status(argv: list[str]) -> int:
    """`main`'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return int(exit.code or 0)


def _config(tmp_path: Path, steps: int) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_train_toml(steps=steps))
    return path


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--steps", "0"], "--steps: must be >= 1, got 0"),
        (["--teacher", "chemistry=/x.pt"], "chemistry"),
        (["--teacher", "count"], "count"),
        (["--device", "gpu"], "device='gpu' is not a torch device"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert _status(["train", "--out", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_config_with_an_unknown_key_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstepz = 3\n")
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "unknown [train] keys ['stepz']" in err and len(err.strip().splitlines()) == 1


def test_a_run_with_saved_teachers(
    saved_teachers: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ["train", "--config", str(_config(tmp_path, 4)), "--out", str(out), "--no-progress"]
    assert main([*args, *saved_teachers, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "greedy accuracy before" in printed and "steps: 4" in printed
    assert main(["replay", str(out)]) == 0


def test_the_inline_baseline_runs_through_the_same_pipeline_and_replays(
    saved_teachers: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--design inline`: each group scored inside its rollout, holding its permit (the upstream
    way): the run trains, says one teacher call per group, and its trace replays VALID against
    the model of the inline design."""
    out = tmp_path / "inline"
    args = ["train", "--config", str(_config(tmp_path, 4)), "--out", str(out), "--no-progress"]
    assert main([*args, "--design", "inline", *saved_teachers, "--device", "cpu"]) == 0
    assert 'design = "inline"' in (out / "config.toml").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["teacher_calls"] == r["teacher_groups"] for r in records), records[0]
    capsys.readouterr()
    assert main(["replay", str(out)]) == 0
    assert capsys.readouterr().out.startswith("VALID")
    with pytest.raises(
        ConfigError, match="TrainConfig.design is 'inline', which scores inside the rollout"
    ):
        TrainConfig(design="inline", reward_weight=0.5)


@pytest.mark.timeout(600)  # the two subprocesses' own limits come first
def test_ctrl_c_stops_after_the_step_saves_and_the_run_resumes(
    saved_teachers: list[str], tmp_path: Path
) -> None:
    """Enough steps that the run cannot finish before the signal lands, however late this
    process gets to send it on a loaded machine."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "groupflow.cli", "train", "--config",
        str(_config(tmp_path, 200)), "--out", str(out), "--no-progress", "--device", "cpu",
        *saved_teachers,
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run did not get going"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr  # interrupted: not done, though saved cleanly
    assert "stopping: finishing step" in stderr
    assert f"continue with: groupflow train --resume {out}" in stderr
    assert "(stopped early)" in stdout
    assert replay(out).verdict == "incomplete"
    env = {**os.environ}
    resumed = subprocess.run(
        [sys.executable, "-m", "groupflow.cli", "train", "--resume", str(out),
         "--no-progress", "--device", "cpu", *saved_teachers],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    verdict = replay(out)
    assert verdict.verdict == "valid", verdict.problem
    assert len(verdict.trained) == 200 * 2


def test_a_cuda_device_without_cuda_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded bug it catches: a CLI that skips the device check (the run would fail later,
    with a traceback). torch is told there is no CUDA, so this runs on GPU machines too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _status(["train", "--device", "cuda", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch sees no CUDA device" in err[0], err


def _interrupt_the_evaluation_after_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (a real SIGINT, through trio's handler) in the greedy evaluation after the last
    step, the second evaluation of a run."""
    from groupflow.impl._trainer import _run
    from groupflow.impl._trainer._greedy import greedy_accuracy_by_domain as real

    calls: list[None] = []

    def evaluation(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(_run, "greedy_accuracy_by_domain", evaluation)


@pytest.mark.parametrize("host", ["trio", "asyncio"])
def test_ctrl_c_after_the_last_step_keeps_the_run_and_says_so(
    saved_teachers: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    host: str,
) -> None:
    """The steps are trained and saved: the summary is printed without the evaluation after,
    and one line says the run is complete; status 130, as the user interrupted. On an asyncio
    host too, whose own Ctrl-C handler cancels the hosting task."""
    _interrupt_the_evaluation_after_the_run(monkeypatch)
    out = tmp_path / "run"
    args = ["train", "--config", str(_config(tmp_path, 3)), "--out", str(out), "--no-progress"]
    args += ["--host", host]
    assert main([*args, *saved_teachers, "--device", "cpu"]) == 130
    printed = capsys.readouterr()
    assert "steps: 3," in printed.out and "(interrupted: no evaluation" in printed.out
    assert printed.err.strip().splitlines()[-1] == (
        f"interrupted after the last step: all 3 steps are trained and saved in "
        f"{out / 'checkpoints'}; the evaluation after the run was left out"
    )
    assert (out / "checkpoints" / "step-000003").is_dir()
    assert (out / "summary.txt").read_text() == printed.out


@pytest.mark.parametrize("host", ["trio", "asyncio"])
def test_seeded_bug_ctrl_c_after_the_last_step_losing_the_summary_is_caught(
    saved_teachers: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    host: str,
) -> None:
    """Seeded bugs: under trio, the evaluation after the run lets Ctrl-C through; under
    asyncio, it leaves the host's handler in place, which cancels the hosting task. Either
    way the run ends with "interrupted" alone, no summary."""
    import contextlib

    from groupflow.impl._trainer import _run

    def unguarded(learner: Any, run: Any, plot: bool) -> Any:
        evaluation = vars(_run)["greedy_accuracy_by_domain"]  # the one that presses Ctrl-C
        return evaluation(learner.model, run.config), None

    if host == "trio":
        monkeypatch.setattr(_run, "_evaluated", unguarded)
    else:
        monkeypatch.setattr(_run, "_ctrl_c_raises", contextlib.nullcontext)
    with pytest.raises(AssertionError):
        test_ctrl_c_after_the_last_step_keeps_the_run_and_says_so(
            saved_teachers, capsys, tmp_path, monkeypatch, host
        )
