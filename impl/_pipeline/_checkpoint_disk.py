"""Checkpoint folders on disk: written atomically, verified before they are trusted, one writer
per folder.

`DIR/step-000004/` holds `manifest.json` (readable: the step, the ledger, the cut, and a
sha256 and size for every other file, with a checksum of the manifest itself) and one file per
state. It is written into a temporary folder, synced, and renamed into place; `DIR/latest`
then names it, replaced atomically too. `latest` is a hint: the newest complete folder wins,
so a crash between the rename and the pointer loses nothing. A flipped bit or a truncated file
anywhere fails verification, naming the file. `DIR/.lock` keeps a second writer out while a
run holds the folder, and the holder's pid and host are written in it for the error message.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from groupflow.model.errors import (
    CheckpointCorrupt,
    CheckpointExists,
    CheckpointLocked,
    CheckpointNotFound,
    ConfigError,
)

MANIFEST = "manifest.json"
_STEP_FOLDER = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"\.step-\d+\..+")
log = logging.getLogger("groupflow.checkpoint")


def folder_name(step: int) -> str:
    return f"step-{step:06d}"


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


def step_of_folder(folder: Path) -> int | None:
    """The step a checkpoint folder's name says (`step-000004`: 4), or None for another name."""
    match = _STEP_FOLDER.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def check_directory(directory: Path) -> None:
    """A checkpoint folder is a folder, or does not exist yet (it is made at the first save)."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(
            f"CheckpointConfig: the checkpoints folder {str(directory)!r} is a file, not a folder",
            field="folder",
            config="CheckpointConfig",
        )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return _digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_folder(
    directory: Path, name: str, manifest: Mapping[str, Any], files: Mapping[str, bytes]
) -> Path:
    """Write `files` and a manifest recording their checksums into `directory/name`,
    atomically; point `latest` at it. Refuses to replace an existing folder."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    if final.exists():
        raise CheckpointExists(f"checkpoint {final} already exists; refusing to overwrite it")
    full = dict(manifest)
    full["files"] = {f: {"sha256": _digest(data), "bytes": len(data)} for f, data in files.items()}
    full["checksum"] = _manifest_checksum(full)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=directory))
    try:
        for filename, data in files.items():
            _write_synced(tmp / filename, data)
        _write_synced(tmp / MANIFEST, (json.dumps(full, indent=2) + "\n").encode())
        fsync_path(tmp)
        if final.exists():
            raise CheckpointExists(f"checkpoint {final} already exists; refusing to overwrite it")
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(directory)
    point_latest(directory, name)
    return final


def read_folder(folder: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and files of a checkpoint folder, every checksum verified."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointNotFound(f"no checkpoint at {folder} (expected {path})")
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("checksum") != _manifest_checksum(manifest):
        raise CheckpointCorrupt(f"{path} fails its checksum: it was changed or damaged")
    files: dict[str, bytes] = {}
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        raise CheckpointCorrupt(f"{path} lists no files")
    for filename, expected in listed.items():
        file = folder / filename
        if not file.is_file():
            raise CheckpointCorrupt(f"{file} is missing")
        data = file.read_bytes()
        if len(data) != expected.get("bytes") or _digest(data) != expected.get("sha256"):
            raise CheckpointCorrupt(
                f"{file} fails its checksum ({len(data)} bytes, {expected.get('bytes')} "
                f"written): it was changed, truncated or damaged"
            )
        files[filename] = data
    return manifest, files


def newest(directory: Path) -> Path:
    """The newest complete checkpoint folder in a run folder. A folder is complete once it
    has its manifest (it is renamed into place whole); `latest` is not trusted over it."""
    complete = [path for _, path in step_folders(directory) if (path / MANIFEST).is_file()]
    pointer = directory / "latest"
    named = _read_pointer(pointer)
    if not complete:
        if not directory.is_dir():
            raise CheckpointNotFound(f"no checkpoint at {directory}: it does not exist")
        gone = f"; its `latest` names {named}, which is not there" if named else ""
        raise CheckpointNotFound(
            f"no checkpoint in {directory}: no step-* folder with a {MANIFEST}{gone}"
        )
    if named is not None:
        if named != complete[-1].name:
            log.warning(
                "%s names %s, but %s is newer and complete: resuming from the newer one",
                pointer,
                named,
                complete[-1].name,
            )
    return complete[-1]


def _read_pointer(pointer: Path) -> str | None:
    """The folder `latest` names, or None (no pointer, or one that cannot be read as text:
    it is a hint, never trusted over the folders themselves)."""
    try:
        return pointer.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def point_latest(directory: Path, name: str) -> None:
    """`directory/latest` names `name`, replaced atomically."""
    pointer = directory / ".latest.tmp"
    _write_synced(pointer, (name + "\n").encode())
    os.replace(pointer, directory / "latest")
    fsync_path(directory)


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
        point_latest(directory, keep.name)
    else:
        (directory / "latest").unlink(missing_ok=True)
    fsync_path(directory)
    log.warning(
        "resuming from step %d, older than the newest checkpoint in %s: moved %s aside to %s",
        step,
        directory,
        ", ".join(p.name for p in newer),
        aside,
    )
    return aside


def remove_temporaries(directory: Path) -> list[Path]:
    """Remove what crashed writes left (`.step-N.*` folders); only the lock holder calls this."""
    removed = []
    if directory.is_dir():
        for entry in directory.iterdir():
            if _TEMPORARY.fullmatch(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def prune(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoint folders; the removed, oldest first."""
    folders = [path for _, path in step_folders(directory)]
    doomed = folders[:-keep] if keep else folders
    for path in doomed:
        shutil.rmtree(path)
    return doomed


@attrs.define
class FolderLock:
    """An exclusive `flock` on `DIR/.lock`, held while a run may write there. The kernel
    drops it when the process dies, so a crash never leaves the folder locked."""

    directory: Path
    _fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointLocked(
                f"the checkpoints folder {self.directory} is in use by {holder}: one run writes to a "
                f"folder at a time; wait for it to end or choose another folder"
            ) from None
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
