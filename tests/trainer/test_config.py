"""`groupflow train`'s config: checkpoints as a `[train.checkpoints]` table with the names
`CheckpointConfig` has, and the older names read with a warning that says what to write."""

from __future__ import annotations

from pathlib import Path

import pytest

from groupflow.impl import CheckpointConfig, CheckpointPolicy
from groupflow.impl._trainer import RunFolder, TrainConfig
from groupflow.impl.errors import ConfigError


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_the_checkpoints_table_round_trips_and_lands_in_the_run_folder(tmp_path: Path) -> None:
    config = TrainConfig(checkpoints={"every_steps": 7, "keep": 2, "policy": "uncommitted"})
    again = TrainConfig.from_toml(_toml(tmp_path, config.to_toml()))
    assert again == config
    pipeline = again.pipeline_config(RunFolder.new(tmp_path / "run", again).checkpoints)
    assert pipeline.checkpoints == CheckpointConfig(
        tmp_path / "run" / "checkpoints", every_steps=7, keep=2, policy="uncommitted"
    )


def test_a_checkpoints_key_left_out_takes_its_default() -> None:
    checkpoints = TrainConfig(checkpoints={"keep": 5}).checkpoints
    assert (checkpoints.every_steps, checkpoints.keep) == (100, 5)
    assert checkpoints.policy is CheckpointPolicy.FLUSH


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('folder = "elsewhere"', r"unknown keys \['folder'\].*RUN_DIR/checkpoints"),
        ("every = 3", r"unknown keys \['every'\]; known: \['every_steps', 'keep'"),
        ("every_steps = 0", r"every_steps must be"),
        ('policy = "naive"', r"'naive' exists only in `groupflow check`"),
    ],
)
def test_a_bad_checkpoints_table_is_refused_naming_the_key(
    tmp_path: Path, table: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_toml(
            _toml(tmp_path, f"[train]\nsteps = 10\n\n[train.checkpoints]\n{table}\n")
        )
