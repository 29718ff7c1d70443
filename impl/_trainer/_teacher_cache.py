"""The on-disk cache of trained domain teachers: keyed on everything that makes one, written
atomically, verified before it is trusted.

`DIR/teacher-count-<key>.pt` holds the weights (`TorchTeacher.save`) and
`DIR/teacher-count-<key>.json` beside it a manifest: the key's contents in full, the weights'
sha256 and size, and a checksum of the manifest itself (the idea of the pipeline's checkpoint
folders, for one file). Both are written to temporary names, synced, and renamed into place,
weights first and manifest last: a crash at any moment leaves either the old pair, or weights
the manifest does not vouch for, never a pair that verifies and is wrong. The key is hashed
into the name, so teachers of different recipes live side by side; the manifest's contents are
still compared in full on load, which catches a file copied or renamed under another key.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from groupflow.impl._pipeline import fsync_path
from groupflow.impl._teachers._served_lm import LlamaLMConfig
from groupflow.impl._teachers._torch import LMConfig, TorchTeacher
from groupflow.model.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound

FORMAT = 1
"""The manifest's layout; a manifest of another format is rebuilt."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(contents: Mapping[str, Any]) -> bytes:
    """One spelling per value: the key hashes these bytes and the manifest compares them."""
    return json.dumps(contents, sort_keys=True, separators=(",", ":")).encode()


@attrs.frozen
class CacheEntry:
    """Where the teacher for one key lives."""

    weights: Path
    manifest: Path
    key: Mapping[str, Any]

    @classmethod
    def of(cls, directory: Path, name: str, key: Mapping[str, Any]) -> CacheEntry:
        stem = f"teacher-{name}-{digest(canonical(key))[:20]}"
        return cls(directory / f"{stem}.pt", directory / f"{stem}.json", key)


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    return digest(canonical({k: v for k, v in manifest.items() if k != "checksum"}))


def save(entry: CacheEntry, teacher: TorchTeacher, **facts: Any) -> None:
    """Write `teacher` and its manifest (with `facts`: accuracy, steps, ...) atomically."""
    directory = entry.weights.parent
    directory.mkdir(parents=True, exist_ok=True)
    temporaries: list[Path] = []
    try:
        weights_tmp = _temporary(entry.weights, temporaries)
        teacher.save(weights_tmp)
        fsync_path(weights_tmp)
        data = weights_tmp.read_bytes()
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "key": dict(entry.key),
            "weights": entry.weights.name,
            "sha256": digest(data),
            "bytes": len(data),
            **facts,
        }
        manifest["checksum"] = _manifest_checksum(manifest)
        manifest_tmp = _temporary(entry.manifest, temporaries)
        manifest_tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        fsync_path(manifest_tmp)
        os.replace(weights_tmp, entry.weights)
        temporaries.remove(weights_tmp)
        os.replace(manifest_tmp, entry.manifest)
        temporaries.remove(manifest_tmp)
        fsync_path(directory)
    finally:
        for path in temporaries:
            path.unlink(missing_ok=True)


def load(
    entry: CacheEntry, *, config: LMConfig | LlamaLMConfig, device: str
) -> tuple[TorchTeacher, dict[str, Any]]:
    """The cached teacher and its manifest, or `CheckpointNotFound` (nothing cached),
    `CheckpointCorrupt` (unreadable, or fails a checksum) or `CheckpointMismatch` (made under
    another key, or not of shape `config`), each naming the file."""
    manifest = _read_manifest(entry)
    _verify_key(entry, manifest)
    _verify_weights(entry, manifest)
    try:
        teacher = TorchTeacher.load(entry.weights, device=device)
    except Exception as exc:  # an unpickling error, a missing key, a wrong shape
        raise CheckpointCorrupt(f"{entry.weights} does not load as a teacher: {exc}") from exc
    _verify_config(entry, teacher, config)
    return teacher, manifest


def _read_manifest(entry: CacheEntry) -> dict[str, Any]:
    if not entry.manifest.is_file():
        if entry.weights.exists():
            raise CheckpointCorrupt(f"{entry.weights} has no manifest {entry.manifest.name}")
        raise CheckpointNotFound(f"no cached teacher at {entry.manifest}")
    try:
        manifest = json.loads(entry.manifest.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"{entry.manifest} is not readable JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("checksum") != _manifest_checksum(manifest):
        raise CheckpointCorrupt(f"{entry.manifest} fails its checksum: changed or damaged")
    return manifest


def _verify_key(entry: CacheEntry, manifest: Mapping[str, Any]) -> None:
    """The manifest was written for this key (the name holds only a prefix of its hash)."""
    if manifest.get("format") != FORMAT or manifest.get("key") != json.loads(canonical(entry.key)):
        raise CheckpointMismatch(
            f"{entry.manifest} was made for another teacher (format {manifest.get('format')}, "
            f"key {manifest.get('key')}), not for {dict(entry.key)}"
        )


def _verify_weights(entry: CacheEntry, manifest: Mapping[str, Any]) -> None:
    """The weights are the bytes the manifest vouches for: torch.load would take a flipped bit
    in a tensor without a word."""
    if not entry.weights.is_file():
        raise CheckpointCorrupt(f"{entry.weights} is missing (its manifest is there)")
    data = entry.weights.read_bytes()
    if len(data) != manifest.get("bytes") or digest(data) != manifest.get("sha256"):
        raise CheckpointCorrupt(
            f"{entry.weights} fails its checksum ({len(data)} bytes, {manifest.get('bytes')} "
            f"written): changed, truncated or damaged"
        )


def _verify_config(
    entry: CacheEntry, teacher: TorchTeacher, config: LMConfig | LlamaLMConfig
) -> None:
    if teacher.model.cfg != config:
        raise CheckpointMismatch(
            f"{entry.weights} holds a model of {teacher.model.cfg}, not the recipe's {config}"
        )


def _temporary(final: Path, temporaries: list[Path]) -> Path:
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    temporaries.append(Path(name))
    return Path(name)
