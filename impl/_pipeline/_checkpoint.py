"""Checkpoints: atomic on disk, verified on load, with the prompt ledger, so no prompt is lost
or trained twice.

A checkpoint holds the train position, the learner's state, the READY groups with their rows,
and the ledger of prompt ordinals. Groups still WRITTEN or SCORING at the cut are handled by the
policy: `flush` first waits (at most `flush_timeout_s`) for the stage to score them, then saves
them READY; `uncommitted` saves without them. Either way, every issued prompt that is neither
trained, saved nor given up is recorded to be issued again on resume.

On disk (`_checkpoint_disk`): `DIR/step-000004/` with a JSON manifest (checksums of every file,
and of itself) and the buffer's and the learner's states (`_codec`: loading runs no code).
Loading verifies the checksums, then that ledger, restored groups and train position agree.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import attrs
import trio

from groupflow.impl._core import PromptLedger, ReplayBuffer
from groupflow.impl._pipeline._checkpoint_disk import (
    MANIFEST,
    FolderLock,
    check_directory,
    folder_name,
    newest,
    prune,
    read_folder,
    remove_temporaries,
    step_folders,
    step_of_folder,
    write_folder,
)
from groupflow.impl._pipeline._codec import decode, encode
from groupflow.impl._pipeline._config import CheckpointConfig
from groupflow.impl._pipeline._observe import RunStatus
from groupflow.impl._pipeline._rollout import TrainPosition
from groupflow.impl._pipeline._scoring_stage import ScoringStage
from groupflow.impl.contract import Learner
from groupflow.model import GroupState, decisions
from groupflow.model.errors import (
    CheckpointCorrupt,
)
from groupflow.model.policy import CheckpointPolicy
from groupflow.model.scheduler.actions import WRITE_FAILED, ActionKind

CHECKPOINT_FORMAT = "groupflow.checkpoint/2"
_BUFFER = "buffer.bin"
_LEARNER = "learner.bin"
_PARTS = ("trained", "shortfall", "saved", "reissue")
"""The ledger's lists: each prompt below the cursor is in exactly one."""
log = logging.getLogger("groupflow.checkpoint")


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


def load_checkpoint(path: Path) -> Checkpoint:
    """Load `path`: a checkpoint folder, or a run folder (its newest complete checkpoint).
    Nothing is trusted unverified: a changed, truncated or damaged file raises
    `CheckpointCorrupt` naming it, and so does a ledger that disagrees with the restored groups
    or the train position."""
    path = Path(path)
    is_folder = (path / MANIFEST).is_file() or step_of_folder(path) is not None
    folder = path if is_folder else newest(path)
    manifest, files = read_folder(folder)
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointCorrupt(
            f"{folder / MANIFEST} is not a {CHECKPOINT_FORMAT} checkpoint "
            f"(format {manifest.get('format')!r})"
        )
    try:
        codecs = manifest["codecs"]
        checkpoint = Checkpoint(
            path=folder,
            step=manifest["step"],
            weight_version=manifest["weight_version"],
            fingerprint=manifest["fingerprint"],
            buffer=decode(files[_BUFFER], codecs[_BUFFER], where=str(folder / _BUFFER)),
            ledger=manifest["ledger"],
            learner=decode(files[_LEARNER], codecs[_LEARNER], where=str(folder / _LEARNER)),
            cut=manifest["cut"],
        )
    except KeyError as exc:
        raise CheckpointCorrupt(f"{folder / MANIFEST} lacks {exc}") from exc
    check_meaning(checkpoint)
    named = step_of_folder(folder)
    if named is not None and named != checkpoint.step:
        raise CheckpointCorrupt(
            f"{folder / MANIFEST} is the checkpoint of step {checkpoint.step}, but its folder "
            f"is {folder.name}: folders renamed or swapped; put it back in "
            f"{folder_name(checkpoint.step)} or give that folder"
        )
    return checkpoint


def check_meaning(checkpoint: Checkpoint) -> None:
    """The parts of a checkpoint agree: each prompt below the cursor accounted exactly once
    (trained, given up, saved or to be issued again), the saved prompts exactly the restored
    groups, the trained prompts exactly the steps before the position. A count or list these
    checks read that is missing or not of its kind is refused first, naming it."""
    where = checkpoint.path / MANIFEST
    unreadable = _unreadable(checkpoint)
    if unreadable:
        raise CheckpointCorrupt(f"{where} does not hold together: " + "; ".join(unreadable))
    ledger = checkpoint.ledger
    problems = []
    parts: dict[str, list[int]] = {k: ledger[k] for k in _PARTS}
    for name, ordinals in parts.items():
        if len(set(ordinals)) != len(ordinals):
            problems.append(f"{name} lists a prompt twice")
    seen: dict[int, str] = {}
    for name, ordinals in parts.items():
        for o in ordinals:
            if o in seen and seen[o] != name:
                problems.append(f"prompt {o} is both {seen[o]} and {name}")
            seen[o] = name
    cursor = ledger["cursor"]
    beyond = sorted(o for o in seen if not 0 <= o < cursor)
    if beyond:
        problems.append(f"prompts {beyond[:5]} are beyond the cursor {cursor}")
    lost = [o for o in range(cursor) if o not in seen]
    if lost:
        problems.append(
            f"prompts {lost[:5]} are below the cursor {cursor} but neither trained, given up, "
            f"saved nor to be issued again: a resume would lose them"
        )
    num_prompts = ledger["num_prompts"]
    if cursor > num_prompts:
        problems.append(f"the cursor {cursor} is past the source's {num_prompts} prompts")
    restored = sorted(g["ordinal"] for g in checkpoint.buffer["groups"])
    if restored != sorted(parts["saved"]):
        problems.append(f"saved prompts {sorted(parts['saved'])} but groups of {restored}")
    done = range(min(checkpoint.step * checkpoint.fingerprint["prompts_per_step"], num_prompts))
    if set(parts["trained"]) - set(done) or set(done) - set(parts["trained"]) - set(
        parts["shortfall"]
    ):
        problems.append(
            f"step {checkpoint.step} means prompts 0..{len(done) - 1} are trained or given up; "
            f"the ledger says trained {_span(parts['trained'])}"
        )
    if checkpoint.weight_version != checkpoint.step:
        problems.append(f"weight_version {checkpoint.weight_version} is not step {checkpoint.step}")
    if problems:
        raise CheckpointCorrupt(f"{where} does not hold together: " + "; ".join(problems))


def _unreadable(checkpoint: Checkpoint) -> list[str]:
    """What keeps the checks above from reading a checkpoint at all: a count they read missing
    or not a count, a part of the ledger not a list of prompts (a manifest edited and signed
    again by hand, or written by a bug)."""
    ledger = checkpoint.ledger if isinstance(checkpoint.ledger, dict) else {}
    fingerprint = checkpoint.fingerprint if isinstance(checkpoint.fingerprint, dict) else {}
    counts = {
        "the step": checkpoint.step,
        "the ledger's num_prompts": ledger.get("num_prompts"),
        "the ledger's cursor": ledger.get("cursor"),
        "the fingerprint's prompts_per_step": fingerprint.get("prompts_per_step"),
    }
    problems = [
        f"{name} is {value!r}, not a count"
        for name, value in counts.items()
        if not (isinstance(value, int) and value >= 0)
    ]
    for name in _PARTS:
        ordinals = ledger.get(name)
        if not (isinstance(ordinals, list) and all(isinstance(o, int) for o in ordinals)):
            problems.append(f"the ledger's {name} is {ordinals!r}, not a list of prompts")
    groups = checkpoint.buffer.get("groups") if isinstance(checkpoint.buffer, dict) else None
    if not (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("ordinal"), int) for g in groups)
    ):
        problems.append("the buffer's groups are not a list of groups, each with its prompt")
    return problems


def _span(ordinals: list[int]) -> str:
    return f"{len(ordinals)} prompts" + (f" ({min(ordinals)}..{max(ordinals)})" if ordinals else "")


@attrs.define
class Checkpointer:
    """Saves after every `settings.every_steps` train steps, under `settings.policy`."""

    settings: CheckpointConfig
    buffer: ReplayBuffer
    ledger: PromptLedger
    position: TrainPosition
    learner: Learner | None
    """None: the learner keeps no state (`stateless_learner=True`), so none is saved."""
    fingerprint: dict[str, Any]
    stages: tuple[ScoringStage, ...] = ()
    """The scoring stages a `flush` save has score the groups pending at the cut."""
    status: RunStatus = attrs.field(factory=RunStatus)
    saved: list[Path] = attrs.field(factory=list)
    flush_timeouts: int = 0
    cut: tuple[CheckpointPolicy, tuple[int, ...]] | None = None
    """While a save is in progress: its policy and the ordinals it waits for."""
    last: dict[str, Any] | None = None
    """The train step and the ledger of the newest checkpoint on disk (or resumed from)."""
    writing: dict[str, Any] | None = None
    """The step and ledger of a snapshot being written (`last` once it is on disk)."""
    _lock: FolderLock = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        check_directory(self.directory)
        self._lock = FolderLock(self.directory)

    @property
    def directory(self) -> Path:
        return self.settings.folder

    async def after_step(self) -> None:
        if self.position.step % self.settings.every_steps == 0:
            await self.save()

    async def save(self) -> Path | None:
        """Save a checkpoint; None when the run failed while it waited (nothing is written:
        the model abandons a checkpoint in progress when the run fails)."""
        policy = self.settings.policy
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
            if inspect.isawaitable(learner_state):  # an asyncio learner's (`aio.part`)
                learner_state = await learner_state
            if self.status.failed:
                return None
            ledger = self.ledger.state_dict(saved=ready)
            self.cut = None
            self.writing = {"step": self.position.step, "ledger": ledger}
            self.status.report(
                ActionKind.FLUSH_TIMEOUT if timed_out else ActionKind.CHECKPOINT_SAVED
            )
        finally:
            self.cut = None
            for stage in self.stages:
                stage.end_flush()
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "step": self.position.step,
            "weight_version": self.position.weight_version,
            "policy": self.settings.policy.value,
            "fingerprint": self.fingerprint,
            "ledger": ledger,
            "cut": cut,
            "ready_groups_saved": len(ready),
        }
        states = {_BUFFER: buffer_state, _LEARNER: learner_state}
        name = folder_name(self.position.step)
        written = self.writing
        try:
            if self.settings.write_in_thread:  # not cancellable: a write, once begun, ends
                path = await trio.to_thread.run_sync(self._write, name, manifest, states)
            else:
                path = self._write(name, manifest, states)
        except Exception:
            self.status.mark_failed()  # the run fails; the checkpoint before this one stands
            self.status.report(ActionKind.CHECKPOINT_WRITTEN, detail=WRITE_FAILED)
            raise
        finally:
            self.writing = None
        self.last = written
        self.saved.append(path)
        self.status.report(ActionKind.CHECKPOINT_WRITTEN)
        return path

    def _write(self, name: str, manifest: dict[str, Any], states: dict[str, Any]) -> Path:
        """Encode the states, write the folder, drop the oldest beyond `settings.keep`."""
        files, codecs = {}, {}
        for filename, state in states.items():
            files[filename], codecs[filename] = encode(state, what=f"checkpoint {filename}")
        path = write_folder(self.directory, name, {**manifest, "codecs": codecs}, files)
        keep = self.settings.keep
        if keep is not None:
            for old in prune(self.directory, keep):
                log.info("removed checkpoint %s (keep=%d)", old, keep)
        return path

    def lock(self) -> None:
        """Hold the folder for this run (`CheckpointLocked` if another run does), and remove
        what crashed writes left there. Holding it already is fine."""
        if self._lock.held:
            return
        self._lock.acquire()
        for leftover in remove_temporaries(self.directory):
            log.warning("removed %s, left by a checkpoint write that did not finish", leftover)

    def unlock(self) -> None:
        self._lock.release()

    @property
    def locked(self) -> bool:
        """This run holds the folder (from its start until it has drained)."""
        return self._lock.held

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
        """Have the stages score the groups pending at the cut now, and wait (bounded) for
        them. True when the wait timed out. Admission goes on meanwhile: the wait is for these
        groups only, so it does not grow with new rollouts."""
        ids = {g.group_id for g in self.buffer.groups() if g.ordinal in ordinals}
        for stage in self.stages:
            stage.flush(ids)

        def pending() -> bool:
            return any(
                g.group_id in ids and g.state in (GroupState.WRITTEN, GroupState.SCORING)
                for g in self.buffer.groups()
            )

        with trio.move_on_after(self.settings.flush_timeout_s) as scope:
            while pending():
                await self.buffer.changed.wait()
        if scope.cancelled_caught:
            self.flush_timeouts += 1
            return True
        return False
