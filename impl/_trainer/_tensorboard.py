"""TensorBoard events for `groupflow train`: every numeric field of each step's `metrics.jsonl`
record, as a scalar under the same name, at the step's own number, in `RUN_DIR/tensorboard/`.

The `tensorboard` package is optional (`pip install 'groupflow[tensorboard]'`): this module
imports it only when a writer is opened, and `TrainConfig.tensorboard` says what to do without
it (`auto`: one info line and no events; `on`: refused when the config is built; `off`: never
written). A resumed run appends to the same folder and tells TensorBoard to hide what the
earlier process logged from the resumed step on (steps trained again after a crash), so each
step shows once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from groupflow.model.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"
"""The event folder's name in the run folder."""

INSTALL = "pip install 'groupflow[tensorboard]'"

TensorBoardMode = Literal["auto", "on", "off"]
MODES: tuple[TensorBoardMode, ...] = ("auto", "on", "off")

log = logging.getLogger("groupflow.trainer")


def tensorboard_missing() -> str | None:
    """None when the `tensorboard` package imports, else why it does not."""
    try:
        import tensorboard  # noqa: F401
    except ImportError as exc:
        return str(exc) or "the import failed"
    return None


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one `metrics.jsonl` record: every numeric field but `step` (a bool as 0
    or 1), under its own name."""
    return {
        name: float(value)
        for name, value in record.items()
        if name != "step" and isinstance(value, int | float)
    }


def refuse_on(why: str) -> ConfigError:
    """`tensorboard = "on"` without the package: one line naming the field and the fix."""
    return ConfigError(
        f"TrainConfig.tensorboard='on' but the tensorboard package cannot be imported ({why}): "
        f"{INSTALL}, or set tensorboard = 'auto' or 'off'",
        field="tensorboard",
        config="TrainConfig",
    )


class ScalarLog:
    """One run's TensorBoard writer (a `torch.utils.tensorboard.SummaryWriter`)."""

    def __init__(self, writer: Any, folder: Path) -> None:
        self._writer = writer
        self.folder = folder

    def write(self, step: int, record: Mapping[str, Any]) -> None:
        """Write the record's scalars at `step`, and flush (as `metrics.jsonl` is, each step)."""
        for name, value in scalars_of(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_scalar_log(
    mode: TensorBoardMode,
    folder: Path,
    *,
    resume_step: int | None,
    say: Callable[[str], None] = log.info,
) -> ScalarLog | None:
    """The writer for a run whose events go to `folder`, or None (`off`, or `auto` without the
    package: then `say` hears one line).

    A fresh run (`resume_step` None) removes the event files an earlier, never checkpointed run
    left there, as `metrics.jsonl` is emptied. A resumed run appends a new event file that
    purges the steps from `resume_step` on: those the crashed process logged after its last
    checkpoint, which this one trains again."""
    if mode == "off":
        return None
    why = tensorboard_missing()
    if why is None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            why = str(exc) or "the import failed"
    if why is not None:
        if mode == "on":
            raise refuse_on(why)
        say(f"tensorboard is not installed: no TensorBoard events ({INSTALL})")
        return None
    if resume_step is None and folder.is_dir():
        for stale in folder.glob("events.out.tfevents.*"):
            stale.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(folder), purge_step=resume_step)
    return ScalarLog(writer, folder)
