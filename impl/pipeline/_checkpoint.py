"""Checkpoints: atomic on disk, with the prompt ledger, so no prompt is lost or trained twice.

A checkpoint holds the train position, the learner's state, the READY groups with their rows,
and the ledger of prompt ordinals. Groups still WRITTEN or SCORING at the cut are handled by the
policy: `flush` first waits (at most `flush_timeout_s`) for the stage to score them, then saves
them READY; `uncommitted` saves without them. Either way, every issued prompt that is neither
trained, saved nor given up is recorded to be issued again on resume.

On disk: `DIR/step-000004/state.pkl` (and a readable `meta.json`), written to a temporary
folder first and renamed into place; `DIR/latest` names the newest, replaced atomically too.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from groupflow.impl.core import PromptLedger, ReplayBuffer
from groupflow.impl.pipeline._config import PipelineConfig
from groupflow.impl.pipeline._observe import RunStatus
from groupflow.impl.pipeline._rollout import TrainPosition
from groupflow.impl.pipeline._teacher_stage import TeacherStage
from groupflow.model import GroupState, decisions
from groupflow.model.actions import ActionKind
from groupflow.model.errors import (
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointNotFound,
)
from groupflow.model.policy import CheckpointPolicy

if TYPE_CHECKING:
    from groupflow.impl.pipeline._train import Learner  # _train imports this module

CHECKPOINT_FORMAT = "groupflow.checkpoint/1"
_STEP_FOLDER = re.compile(r"step-(\d+)")
log = logging.getLogger("groupflow.checkpoint")


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    """The checkpoint folders directly in `directory`, oldest step first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_FOLDER.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def set_aside_newer(directory: Path, step: int, *, keep: Path) -> Path | None:
    """A resume from `step` when `directory` holds newer checkpoints is a rollback: they move
    into one `rolled-back-from-step-N-TIME` folder beside them (nothing is deleted), `latest`
    names the resumed checkpoint if it lives here (else goes), and a warning says so. Returns
    the folder they went to, or None when nothing was newer."""
    newer = [path for s, path in step_folders(directory) if s > step]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    aside = directory / f"rolled-back-from-step-{step:06d}-{stamp}"
    suffix = 0
    while aside.exists():
        suffix += 1
        aside = directory / f"rolled-back-from-step-{step:06d}-{stamp}-{suffix}"
    aside.mkdir()
    for path in newer:
        os.replace(path, aside / path.name)
    keep = Path(keep).resolve()
    if keep.parent == directory.resolve():
        _point_latest(directory, keep.name)
    else:
        (directory / "latest").unlink(missing_ok=True)
    _fsync(directory)
    log.warning(
        "resuming from step %d, older than the newest checkpoint in %s: moved %s aside to %s",
        step,
        directory,
        ", ".join(p.name for p in newer),
        aside,
    )
    return aside


@attrs.frozen
class Checkpoint:
    """A loaded checkpoint."""

    path: Path
    step: int
    weight_version: int
    fingerprint: dict[str, Any]
    buffer: dict[str, Any]
    ledger: dict[str, Any]
    learner: object
    """The learner's `state_dict()` (None: the run said its learner keeps no state)."""
    cut: dict[str, list[int]]
    """What was pending at the cut (ordinals WRITTEN, SCORING, RESERVED), for the record."""


def _write_atomically(
    directory: Path, name: str, state: dict[str, Any], meta: dict[str, Any]
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=directory))
    try:
        with open(tmp / "state.pkl", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        _write_synced(tmp / "meta.json", json.dumps(meta, indent=2) + "\n")
        _fsync(tmp)
        if final.exists():
            raise CheckpointExists(f"checkpoint {final} already exists; refusing to overwrite it")
        os.replace(tmp, final)
    except BaseException:
        for leftover in tmp.glob("*"):
            leftover.unlink()
        tmp.rmdir()
        raise
    _fsync(directory)
    _point_latest(directory, name)
    return final


def _point_latest(directory: Path, name: str) -> None:
    """`directory/latest` names `name`, replaced atomically."""
    pointer = directory / ".latest.tmp"
    _write_synced(pointer, name + "\n")
    os.replace(pointer, directory / "latest")
    _fsync(directory)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> Checkpoint:
    """Load `path`: a checkpoint folder, or a run folder whose `latest` names one."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    state_file = path / "state.pkl"
    if not state_file.is_file():
        raise CheckpointNotFound(f"no checkpoint at {path} (expected {state_file})")
    try:
        with open(state_file, "rb") as f:
            state = pickle.load(f)
    except (pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointCorrupt(f"{state_file} cannot be read: {exc!r}") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointCorrupt(f"{state_file} is not a {CHECKPOINT_FORMAT} checkpoint")
    try:
        return Checkpoint(
            path=path,
            step=state["step"],
            weight_version=state["weight_version"],
            fingerprint=state["fingerprint"],
            buffer=state["buffer"],
            ledger=state["ledger"],
            learner=state["learner"],
            cut=state["cut"],
        )
    except KeyError as exc:
        raise CheckpointCorrupt(f"{state_file} lacks {exc}") from exc


@attrs.define
class Checkpointer:
    """Saves after every `every_steps` train steps, under the config's pending policy."""

    directory: Path
    every_steps: int
    config: PipelineConfig
    buffer: ReplayBuffer
    ledger: PromptLedger
    position: TrainPosition
    learner: Learner | None
    """None: the learner keeps no state (`stateless_learner=True`), so none is saved."""
    fingerprint: dict[str, Any]
    stage: TeacherStage | None = None
    status: RunStatus = attrs.field(factory=RunStatus)
    write_in_thread: bool = True
    """Write from a worker thread so the run goes on meanwhile. Under a virtual clock (tests,
    the simulator) write inline instead: a thread's real time would let the clock jump."""
    saved: list[Path] = attrs.field(factory=list)
    flush_timeouts: int = 0
    cut: tuple[CheckpointPolicy, tuple[int, ...]] | None = None
    """While a save is in progress: its policy and the ordinals it waits for."""
    last: dict[str, Any] | None = None
    """The train step and the ledger of the newest checkpoint saved (or resumed from)."""

    async def after_step(self) -> None:
        if self.position.step % self.every_steps == 0:
            await self.save()

    async def save(self) -> Path | None:
        """Save a checkpoint; None when the run failed while it waited (nothing is written:
        the model abandons a checkpoint in progress when the run fails)."""
        policy = self.config.checkpoint_policy
        cut = self._pending()
        waits = decisions.flush_cut(policy, [*cut["WRITTEN"], *cut["SCORING"]])
        self.cut = (policy, waits)
        self.status.report(ActionKind.CHECKPOINT, detail=policy)
        try:
            timed_out = await self._flush(set(waits)) if waits else False
            buffer_state = await self.buffer.state_dict()
            # from the snapshot written, not the buffer now: groups may turn READY meanwhile
            ready = {g["ordinal"] for g in buffer_state["groups"]}
            learner_state = self.learner.state_dict() if self.learner is not None else None
            if self.status.failed:
                return None
            ledger = self.ledger.state_dict(saved=ready)
            self.cut = None
            self.last = {"step": self.position.step, "ledger": ledger}
            self.status.report(
                ActionKind.FLUSH_TIMEOUT if timed_out else ActionKind.CHECKPOINT_SAVED
            )
        finally:
            self.cut = None
            if self.stage is not None:
                self.stage.end_flush()
        state: dict[str, Any] = {
            "format": CHECKPOINT_FORMAT,
            "step": self.position.step,
            "weight_version": self.position.weight_version,
            "fingerprint": self.fingerprint,
            "buffer": buffer_state,
            "ledger": ledger,
            "learner": learner_state,
            "cut": cut,
        }
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": self.position.step,
            "policy": self.config.checkpoint_policy.value,
            "ready_groups_saved": len(ready),
            "pending_at_cut": cut,
            "reissue_on_resume": ledger["reissue"],
        }
        name = f"step-{self.position.step:06d}"
        if self.write_in_thread:
            path = await trio.to_thread.run_sync(
                _write_atomically, self.directory, name, state, meta
            )
        else:
            path = _write_atomically(self.directory, name, state, meta)
        self.saved.append(path)
        return path

    def existing(self) -> list[Path]:
        """Checkpoints already in the folder, oldest first."""
        return [path for _, path in step_folders(self.directory)]

    def _pending(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {"RESERVED": [], "WRITTEN": [], "SCORING": []}
        for g in self.buffer.groups():
            if g.state.value in out and g.ordinal is not None:
                out[g.state.value].append(g.ordinal)
        return out

    async def _flush(self, ordinals: set[int]) -> bool:
        """Have the stage score the groups pending at the cut now, and wait (bounded) for
        them. True when the wait timed out. Admission goes on meanwhile: the wait is for these
        groups only, so it does not grow with new rollouts."""
        ids = {g.group_id for g in self.buffer.groups() if g.ordinal in ordinals}
        if self.stage is not None:
            self.stage.flush(ids)

        def pending() -> bool:
            return any(
                g.group_id in ids and g.state in (GroupState.WRITTEN, GroupState.SCORING)
                for g in self.buffer.groups()
            )

        with trio.move_on_after(self.config.flush_timeout_s) as scope:
            while pending():
                await self.buffer.changed.wait()
        if scope.cancelled_caught:
            self.flush_timeouts += 1
            return True
        return False
