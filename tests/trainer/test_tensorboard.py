"""`groupflow train`'s TensorBoard events: the scalars read back from the event files equal
`metrics.jsonl`'s, a resume continues them with each step shown once, `off` writes none, and
`on` without the package is refused when the config is built, naming the field."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the trainer needs torch (pip install '.[train]')")
pytest.importorskip("tensorboard", reason="pip install 'groupflow[tensorboard]'")

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

import groupflow.impl._trainer._run as run_module  # noqa: E402
import groupflow.impl._trainer._tensorboard as tb_module  # noqa: E402
from groupflow.impl._trainer import TrainConfig  # noqa: E402
from groupflow.model.errors import ConfigError  # noqa: E402
from tests.trainer.test_run import TINY, _crash_at, _random_teachers, _run  # noqa: E402


def _events(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the run's event folder, as TensorBoard shows it (a tag whose
    every point was purged on resume is left out: it shows no curve)."""
    accumulator = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    series = {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
    return {tag: points for tag, points in series.items() if points}


def _expected(out: Path) -> dict[str, dict[int, float]]:
    """`metrics.jsonl`'s numeric fields by name and step; a step logged twice (trained again
    after a crash) counts as its last record."""
    last: dict[int, dict[str, Any]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        last[record["step"]] = record  # the whole record: its fields may differ from the first
    want: dict[str, dict[int, float]] = {}
    for step, record in last.items():
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float):
                want.setdefault(name, {})[step] = float(value)
    return want


def _check_events_match_metrics(out: Path, steps: int) -> None:
    got = _events(out)
    want = _expected(out)
    assert {"loss", "kl", "sync_s", "steps_per_s", "teacher_calls"} <= set(want)
    assert any(name.startswith("accuracy/") for name in want)
    assert set(got) == set(want)
    for name, series in got.items():
        numbers = [step for step, _ in series]
        assert numbers == sorted(set(numbers)), f"{name}: steps {numbers} repeat or go back"
        assert set(numbers) == set(want[name]), f"{name}: steps {numbers}"
        for step, value in series:
            assert value == pytest.approx(want[name][step], rel=1e-6), (name, step)
    assert set(want["kl"]) == set(range(steps))


def test_a_run_writes_its_metrics_as_tensorboard_scalars(tmp_path: Path) -> None:
    config = TrainConfig.from_mapping(TINY)
    _run(config, tmp_path / "run", _random_teachers(config), plot=False)
    _check_events_match_metrics(tmp_path / "run", config.steps)


def test_a_fresh_run_into_a_folder_without_checkpoints_starts_the_events_afresh(
    tmp_path: Path,
) -> None:
    config = TrainConfig.from_mapping({**TINY, "steps": 2})
    stale = tmp_path / "run" / "tensorboard"
    stale.mkdir(parents=True)
    (stale / "events.out.tfevents.1.stale").write_bytes(b"")
    (stale / "notes.txt").write_text("kept")
    _run(config, tmp_path / "run", _random_teachers(config), plot=False)
    assert not (stale / "events.out.tfevents.1.stale").exists()
    assert (stale / "notes.txt").read_text() == "kept"
    _check_events_match_metrics(tmp_path / "run", config.steps)


def test_off_writes_no_events(tmp_path: Path) -> None:
    config = TrainConfig.from_mapping({**TINY, "steps": 2, "tensorboard": "off"})
    _run(config, tmp_path / "run", _random_teachers(config), plot=False)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_a_bad_mode_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="TrainConfig.tensorboard must be one of") as caught:
        TrainConfig(tensorboard="yes")  # type: ignore[arg-type]
    assert caught.value.field == "tensorboard"


def test_on_without_the_package_is_refused_when_the_config_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    with pytest.raises(ConfigError) as caught:
        TrainConfig(tensorboard="on")
    assert caught.value.field == "tensorboard"
    message = str(caught.value)
    assert "\n" not in message
    assert "TrainConfig.tensorboard" in message
    assert "pip install 'groupflow[tensorboard]'" in message
    toml = tmp_path / "on.toml"
    toml.write_text('[train]\ntensorboard = "on"\n')
    with pytest.raises(ConfigError, match="TrainConfig.tensorboard='on'"):
        TrainConfig.from_toml(toml)
    TrainConfig(tensorboard="auto")
    TrainConfig(tensorboard="off")


def test_auto_without_the_package_runs_and_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notice goes where the run's other notices go (`say`: the terminal under the CLI), not
    to a logger nobody configured."""
    config = TrainConfig.from_mapping({**TINY, "steps": 3})
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    heard: list[str] = []
    _run(config, tmp_path / "run", _random_teachers(config), plot=False, say=heard.append)
    assert not (tmp_path / "run" / "tensorboard").exists()
    said = [line for line in heard if "tensorboard" in line.lower()]
    assert len(said) == 1 and "pip install" in said[0], heard
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def _stop_and_resume(out: Path) -> None:
    config = TrainConfig.from_mapping({**TINY, "steps": 6})
    teachers = _random_teachers(config)
    _run(config, out, teachers, plot=False, stop_after=3)
    _run(config, out, teachers, plot=False, resume=True)


def _crash_and_resume(out: Path) -> None:
    """Crash after the third step: the checkpoint is from the second, so the resumed run trains
    the third step again, and `metrics.jsonl` holds it twice."""
    config = TrainConfig.from_mapping({**TINY, "steps": 6})
    teachers = _random_teachers(config)
    _crash_at(config, out, teachers, 3)
    _run(config, out, teachers, plot=False, resume=True)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) > len(set(steps)), f"no step was trained twice: {steps}"


@pytest.mark.parametrize("how", [_stop_and_resume, _crash_and_resume], ids=["stop", "crash"])
def test_a_resumed_run_continues_the_events_with_each_step_once(
    tmp_path: Path, how: Callable[[Path], None]
) -> None:
    how(tmp_path / "run")
    assert len(list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))) == 2
    _check_events_match_metrics(tmp_path / "run", 6)


# -- seeded bugs: each must make the resume check above fail --------------------------------


def _purges_a_step_late(monkeypatch: pytest.MonkeyPatch) -> None:
    original = tb_module.open_scalar_log

    def opened(mode: Any, folder: Path, *, resume_step: int | None, **kw: Any) -> Any:
        late = None if resume_step is None else resume_step + 1
        return original(mode, folder, resume_step=late, **kw)

    monkeypatch.setattr(run_module, "open_scalar_log", opened)


def _never_purges(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils.tensorboard as torch_tensorboard

    original = torch_tensorboard.SummaryWriter

    def writer(folder: str, purge_step: int | None = None, **kw: Any) -> Any:
        return original(folder, **kw)

    monkeypatch.setattr(torch_tensorboard, "SummaryWriter", writer)


def _counts_steps_from_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    original = tb_module.ScalarLog.write

    def write(self: Any, step: int, record: Any) -> None:
        counted = getattr(self, "_counted", 0)
        self._counted = counted + 1
        original(self, counted, record)

    monkeypatch.setattr(tb_module.ScalarLog, "write", write)


def _writes_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    original = tb_module.ScalarLog.write
    monkeypatch.setattr(
        tb_module.ScalarLog, "write", lambda self, step, record: original(self, step + 1, record)
    )


TENSORBOARD_BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "a resume purges from one step too late": _purges_a_step_late,
    "a resume does not purge the crashed process's later steps": _never_purges,
    "a resumed run numbers its steps from 0": _counts_steps_from_zero,
    "every step is written one step on": _writes_the_next_step,
}


@pytest.mark.parametrize("bug", sorted(TENSORBOARD_BUGS))
def test_seeded_tensorboard_bugs_are_caught(
    bug: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    TENSORBOARD_BUGS[bug](monkeypatch)
    with pytest.raises(AssertionError):
        _crash_and_resume(tmp_path / "run")
        _check_events_match_metrics(tmp_path / "run", 6)
