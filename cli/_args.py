"""Argument types every subcommand shares: numbers in range and paths that can be read or
written, checked when the command line is parsed, so a mistake is one line naming the value
(exit status 2) before any work starts.

A path to write is checked by trying: a file is created and removed in the nearest folder that
exists. `os.access` answers for the permission bits only, and for root they always allow, while
a read-only mount, `/proc` or a path under a file still refuse the write an hour later.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def with_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> argparse.Namespace:
    """`args` with each flag of `defaults` the user left unset (None) set to its default. A
    flag that means something only beside others defaults to None, so that the command can
    tell it was given and refuse it where it means nothing; its default is filled in after."""
    unset = {name: value for name, value in defaults.items() if getattr(args, name) is None}
    return argparse.Namespace(**{**vars(args), **unset})


def at_least(lowest: int, *, at_most: int | None = None) -> Callable[[str], int]:
    """An int >= `lowest` (and <= `at_most`, when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        if at_most is not None and value > at_most:
            raise argparse.ArgumentTypeError(f"must be <= {at_most:,}, got {value:,}")
        return value

    parse.__name__ = f"int >= {lowest}"
    return parse


positive = at_least(1)


def _nearest_existing(path: Path) -> Path:
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _refuse_unwritable(text: str, path: Path) -> None:
    """Refuse `path` (a file or folder to create or replace) unless its nearest existing folder
    really takes a new file."""
    folder = _nearest_existing(path if path.is_dir() else path.parent)
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".groupflow-probe-", dir=folder)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: {folder} is not writable ({exc.strerror})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def writable_file(text: str) -> Path:
    """A file path whose folder exists (or can be made) and can be written, and that is not
    a folder itself. The command makes missing folders when it writes (`prepare_output`)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    _refuse_unwritable(text, path)
    if path.exists():
        try:
            with path.open("ab"):
                pass
        except OSError as exc:
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: {exc.strerror.lower() if exc.strerror else exc}"
            ) from None
    return path


def writable_folder(text: str) -> Path:
    """A folder that exists, or can be made where it is named, and takes new files."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    _refuse_unwritable(text, path)
    return path


def image_file(text: str) -> Path:
    """A writable file whose extension matplotlib draws (PNG, SVG, PDF, ...)."""
    path = writable_file(text)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise argparse.ArgumentTypeError(
            f"drawing {text!r} needs matplotlib: pip install 'groupflow[plot]'"
        ) from None
    formats = Figure().canvas.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the extension must say the image format, one of {', '.join(sorted(formats))}"
        )
    return path


def readable_file(text: str) -> Path:
    """A file that exists and can be read."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} ({exc.strerror})") from None
    return path


def executable_file(text: str) -> str:
    """A program that exists and may be run (an interpreter, say)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(path, os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not executable")
    return text


def prepare_output(path: Path) -> Path:
    """Make the folders above an output file the command line named (checked when parsed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad command line in one line (and where to read more), status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # argparse drops a lone '--' given as a flag's value (`--steps=--`) and hands the
        # command an empty list in place of the value: refuse it here, for every flag
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            raise argparse.ArgumentError(action, "expected a value, got '--'")
        return super()._get_values(action, arg_strings)
