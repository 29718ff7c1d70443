"""Bytes for a checkpoint's states, which loading turns back into values without running code.

A state of plain values (dicts, lists, tuples, sets, strings, bytes, numbers, None) is pickled
and read back by an unpickler that refuses every global: pickle can only call what a global
names, so nothing can run. A state holding torch tensors (a learner's weights and optimizer)
goes through `torch.save` and comes back through `torch.load(weights_only=True)`, torch's own
loader that refuses code. Anything else is refused when the checkpoint is written, naming its
type, rather than trusted on load.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

from groupflow.model.errors import ArgumentError, CheckpointCorrupt

PLAIN = "plain"
TORCH = "torch"
_PLAIN_TYPES = (dict, list, tuple, set, frozenset, str, bytes, int, float, bool, type(None))


class _PlainPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _PLAIN_TYPES:
            return NotImplemented
        raise pickle.PicklingError(f"{type(obj).__module__}.{type(obj).__qualname__}")


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a checkpoint holds values")


def _plain(value: object) -> bytes | None:
    buffer = io.BytesIO()
    try:
        _PlainPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except pickle.PicklingError:
        return None
    return buffer.getvalue()


def encode(value: object, *, what: str) -> tuple[bytes, str]:
    """`value` as bytes, and the codec that reads them back."""
    data = _plain(value)
    if data is not None:
        return data, PLAIN
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        torch = None
    if torch is not None:
        buffer = io.BytesIO()
        try:  # what torch's safe loader refuses, refuse now rather than at resume
            torch.save(value, buffer)
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True, map_location="cpu")
        except Exception as exc:
            raise ArgumentError(
                f"{what} holds a value a checkpoint cannot store safely: {exc}"
            ) from exc
        return buffer.getvalue(), TORCH
    raise ArgumentError(
        f"{what} holds a value other than plain Python values (dict, list, str, numbers, ...) "
        f"and torch is not installed to store tensors; convert it (e.g. .tolist())"
    )


def decode(data: bytes, codec: str, *, where: str) -> Any:
    """The value `encode` wrote; `CheckpointCorrupt` naming `where` if it cannot be read."""
    try:
        if codec == PLAIN:
            return _NoGlobals(io.BytesIO(data)).load()
        if codec == TORCH:
            torch = importlib.import_module("torch")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except ImportError as exc:
        raise CheckpointCorrupt(f"{where} holds torch tensors; install torch to load it") from exc
    except Exception as exc:
        raise CheckpointCorrupt(f"{where} cannot be read: {exc!r}") from exc
    raise CheckpointCorrupt(f"{where}: unknown codec {codec!r}")
