"""What a checkpoint must have in common with the run that resumes it: sizes, fields, the data
and its routing, and whether the learner's state is saved.

Sizes alone would let a different prompt list of the same length, or another domain mapping,
resume silently and train the wrong prompts as if they were the saved ones; so the prompts and
each prompt's agent are digested (or the user supplies a digest for data we should not read
whole), and so is where each agent's groups are scored.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs

from groupflow.model.errors import ArgumentError, CheckpointMismatch

_SMALL_INTS = tuple(b"i%d:%d" % (len(str(i)), i) for i in range(1024))
"""The encodings of the ints a prompt's tokens mostly are, made once."""


def _encode(value: object, out: list[bytes], where: str) -> None:
    """Append a canonical, type-tagged encoding of `value`: equal data gives equal bytes in
    any process, which `hash()` and `repr()` of arbitrary objects do not promise.

    The exact builtin types a prompt is mostly made of (int, str, tuple, list) take a short
    path here; everything else, subclasses included, goes through `_encode_other`. The bytes
    are the same either way (and must stay so: checkpoints keep the digest)."""
    kind = type(value)
    if kind is int:
        number = cast(int, value)
        if 0 <= number < len(_SMALL_INTS):
            out.append(_SMALL_INTS[number])
        else:
            text = str(number).encode()
            out.append(b"i%d:" % len(text) + text)
    elif kind is str:
        data = cast(str, value).encode("utf-8", "surrogatepass")
        out.append(b"s%d:" % len(data) + data)
    elif kind is tuple or kind is list:
        items = cast(Sequence[object], value)
        out.append(b"l%d:" % len(items))
        for item in items:
            _encode(item, out, where)
    else:
        _encode_other(value, out, where)


_Layout = tuple[bytes, tuple[tuple[bytes, str], ...]]
_LAYOUTS: dict[type, _Layout] = {}


def _attrs_layout(cls: type) -> _Layout:
    """What an attrs class's instances encode as, but for the values: its tag with the
    mapping's head, and each field's encoded name in the order the mapping sorts them
    (made once per class)."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        encoded = [(a.name.encode("utf-8", "surrogatepass"), a.name) for a in attrs.fields(cls)]
        keys = sorted((b"s%d:" % len(data) + data, name) for data, name in encoded)
        head = b"a" + cls.__qualname__.encode() + b":" + b"d%d:" % len(keys)
        layout = _LAYOUTS[cls] = (head, tuple(keys))
    return layout


def _encode_other(value: object, out: list[bytes], where: str) -> None:
    if value is None or isinstance(value, bool):
        out.append(b"N" if value is None else b"T" if value else b"F")
    elif isinstance(value, int):
        text = str(value).encode()
        out.append(b"i%d:" % len(text) + text)
    elif isinstance(value, float):
        out.append(b"f" + struct.pack(">d", value) if not math.isnan(value) else b"fnan")
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s%d:" % len(data) + data)
    elif isinstance(value, (bytes, bytearray)):
        out.append(b"b%d:" % len(value) + bytes(value))
    elif isinstance(value, (list, tuple)):
        out.append(b"l%d:" % len(value))
        for item in value:
            _encode(item, out, where)
    elif isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            encoded: list[bytes] = []
            _encode(key, encoded, where)
            items.append((b"".join(encoded), item))
        out.append(b"d%d:" % len(items))
        for key_bytes, item in sorted(items, key=lambda pair: pair[0]):
            out.append(key_bytes)
            _encode(item, out, where)
    elif attrs.has(type(value)):
        # as `attrs.asdict(value, recurse=False)` encoded as a mapping, without making it
        head, keys = _attrs_layout(type(value))
        out.append(head)
        for key_bytes, name in keys:
            out.append(key_bytes)
            _encode(getattr(value, name), out, where)
    elif callable(getattr(value, "tolist", None)):  # numpy arrays, torch tensors
        out.append(b"t" + str(getattr(value, "dtype", "")).encode() + b":")
        _encode(value.tolist(), out, where)  # type: ignore[attr-defined]
    else:
        raise ArgumentError(
            f"{where} is a {type(value).__name__}, which groupflow cannot fingerprint; pass "
            f"data_digest= to build_pipeline (a string that changes whenever the data does)"
        )


def digest_data(prompts: Sequence[Any], agents: Sequence[str | None]) -> str:
    """A digest of every prompt and its agent, in order (sha256, hex)."""
    h = hashlib.sha256()
    for ordinal, (prompt, agent) in enumerate(zip(prompts, agents, strict=True)):
        chunks: list[bytes] = []
        _encode((prompt, agent), chunks, f"prompt {ordinal}")
        h.update(b"".join(chunks))
    return h.hexdigest()


def fingerprint(
    *,
    prompts_per_step: int,
    num_generations_per_prompt: int,
    num_prompts: int,
    fields: Sequence[str],
    data: str,
    routes: Mapping[str | None, str],
    learner_state: bool,
) -> dict[str, Any]:
    """What must not change between a save and a resume (plain JSON-able values)."""
    return {
        "prompts_per_step": prompts_per_step,
        "num_generations_per_prompt": num_generations_per_prompt,
        "num_prompts": num_prompts,
        "fields": sorted(fields),
        "data": data,
        "routes": {("" if a is None else a): t for a, t in sorted(routes.items(), key=str)},
        "learner_state": "saved" if learner_state else "none",
    }


_WHAT_TO_DO = {
    "data": "the prompts, or the agent of some prompt, differ from the run that saved it; "
    "resume with the same data (or pass the same data_digest=)",
    "routes": "some agent's groups now go to another teacher; resume with the same routing",
    "learner_state": "pass stateless_learner= as the run that saved it did: a checkpoint "
    "without learner state would continue from fresh weights while its ledger says the "
    "earlier steps were trained, and one with learner state would throw those weights away",
}


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], path: Path) -> None:
    """Refuse a resume whose run differs from the saved one, naming each difference."""
    differ = sorted(k for k in current if saved.get(k) != current.get(k))
    if not differ:
        return
    parts = []
    for key in differ:
        old, new = saved.get(key), current.get(key)
        if key == "data":
            text = "data: another digest"
        elif key == "routes" and isinstance(old, dict) and isinstance(new, dict):
            changed = sorted(a for a in set(old) | set(new) if old.get(a) != new.get(a))
            text = "routes: " + ", ".join(
                f"agent {a or None!r} saved {old.get(a)!r}, now {new.get(a)!r}" for a in changed
            )
        else:
            text = f"{key}: saved {old!r}, now {new!r}"
        hint = _WHAT_TO_DO.get(key)
        parts.append(text + (f" ({hint})" if hint else ""))
    raise CheckpointMismatch(f"checkpoint {path} was made by a different run: " + "; ".join(parts))
