"""Argument types every subcommand shares: numbers in range and paths that can be written,
checked when the command line is parsed, so a mistake is one line naming the value (exit
status 2) before any work starts."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def at_least(lowest: int) -> Callable[[str], int]:
    """An int >= `lowest`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value

    parse.__name__ = f"int >= {lowest}"
    return parse


positive = at_least(1)


def writable_file(text: str) -> Path:
    """A file path whose folder exists (or can be made) and can be written, and that is not
    a folder itself."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is read-only")
    return path


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad command line in one line (and where to read more), status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
