"""A run folder's checks before any work: a new run's folder holds no run, and a resumed one
holds this run's config and a checkpoint that verifies."""

from __future__ import annotations

from pathlib import Path

import attrs

from groupflow.impl.pipeline import Checkpoint, load_checkpoint
from groupflow.impl.trainer._config import CHECKPOINT_FOLDER, TrainConfig
from groupflow.model.errors import ConfigError


def resume_checkpoint(out: Path, config: TrainConfig) -> Checkpoint:
    """The checkpoint a `--resume` of the run folder `out` continues from, every check made
    before any work (the run's own config, a checkpoint that verifies): refused, nothing in
    the folder has changed."""
    checkpoints = Path(out) / CHECKPOINT_FOLDER
    if not checkpoints.is_dir():
        raise ConfigError(f"--resume {out}: no checkpoints/ folder there", field="resume")
    saved = TrainConfig.from_toml(Path(out) / "config.toml", where=f"--resume {out}")
    if saved != config:
        changed = [
            a.name
            for a in attrs.fields(TrainConfig)
            if getattr(saved, a.name) != getattr(config, a.name)
        ]
        raise ConfigError(
            f"--resume {out}: the run was started with other settings ({changed}); resume "
            f"with its config.toml",
            field=changed[0],
        )
    return load_checkpoint(checkpoints)


def check_fresh_out(out: Path) -> None:
    """A new run's folder holds no run's checkpoints (refused, naming `--resume`)."""
    checkpoints = Path(out) / CHECKPOINT_FOLDER
    if checkpoints.exists() and any(checkpoints.iterdir()):
        raise ConfigError(
            f"--out {out} already holds a run's checkpoints: continue it with --resume "
            f"{out}, or give another folder",
            field="out",
        )
