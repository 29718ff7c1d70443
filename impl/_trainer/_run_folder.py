"""`RunFolder`: a `groupflow train` run's folder and what lives in it (its config, checkpoints,
trace, metrics, summary), resolved once where the command starts and passed whole. A new run's
folder holds no run; a resumed one holds its own config and a checkpoint that verifies: every
check is made before any work, and a refusal leaves the folder as it was."""

from __future__ import annotations

from pathlib import Path

import attrs

from groupflow.impl._pipeline import TRACE_FILE, Checkpoint, load_checkpoint, step_folders
from groupflow.impl._teachers import PROBE_FILE
from groupflow.impl._trainer._config import CHECKPOINT_FOLDER, TrainConfig
from groupflow.impl._trainer._tensorboard import TENSORBOARD_DIR
from groupflow.model.errors import ConfigError

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.txt"
CURVES_FILE = "curves.png"


@attrs.frozen
class RunFolder:
    """One run's folder: `new` for a run that starts there, `resume` for one that goes on."""

    path: Path = attrs.field(converter=Path)
    config: TrainConfig
    checkpoint: Checkpoint | None
    """What a resumed run continues from (verified); None: a new run."""

    @classmethod
    def new(cls, path: Path | str, config: TrainConfig) -> RunFolder:
        """A run of `config` that starts in `path`: refused (naming `--resume`) when the
        folder already holds a run's checkpoints (`step-*` folders: the lock file a run that
        never saved leaves is none). Nothing is written yet (`start` does)."""
        folder = cls(path, config, None)
        if step_folders(folder.checkpoints):
            raise ConfigError(
                f"--out {folder.path} already holds a run's checkpoints: continue it with "
                f"--resume {folder.path}, or give another folder",
                field="out",
            )
        return folder

    @classmethod
    def resume(cls, path: Path | str, config: TrainConfig | None = None) -> RunFolder:
        """The run saved in `path`, to go on: its `config.toml` read (once), its newest
        checkpoint loaded and verified. With `config`, the saved one must be the same: a run
        goes on with the settings its checkpoints were taken under."""
        path = Path(path)
        where = f"--resume {path}"
        if not (path / CONFIG_FILE).is_file():
            raise ConfigError(
                f"{where}: not a groupflow train run folder (no {CONFIG_FILE} in it); give "
                f"the --out folder of an earlier run",
                field="resume",
            )
        if not (path / CHECKPOINT_FOLDER).is_dir():
            raise ConfigError(f"{where}: no {CHECKPOINT_FOLDER}/ folder there", field="resume")
        saved = TrainConfig.from_toml(path / CONFIG_FILE, where=where)
        if config is not None and saved != config:
            changed = [
                a.name
                for a in attrs.fields(TrainConfig)
                if a.eq and getattr(saved, a.name) != getattr(config, a.name)
            ]
            raise ConfigError(
                f"{where}: the run was started with other settings ({changed}); resume with "
                f"its {CONFIG_FILE}",
                field=changed[0],
            )
        return cls(path, saved, load_checkpoint(path / CHECKPOINT_FOLDER))

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINT_FOLDER

    @property
    def trace(self) -> Path:
        return self.path / TRACE_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def teacher_probe(self) -> Path:
        return self.path / PROBE_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def curves(self) -> Path:
        return self.path / CURVES_FILE

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD_DIR

    def start(self) -> None:
        """Make the folder ready for the run: a new run writes its config and starts its
        metrics and trace afresh (a trace or a teacher probe left by a run that never saved
        is dropped); a resumed one appends to what is there."""
        if self.checkpoint is None:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / CONFIG_FILE).write_text(self.config.to_toml())
            self.metrics.write_text("")
            self.trace.unlink(missing_ok=True)
            self.teacher_probe.unlink(missing_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
