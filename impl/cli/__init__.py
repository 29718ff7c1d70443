"""The `groupflow` command line: `main` (the console script) and `Command`, the one way a
subcommand is declared (`groupflow model`, `check` and `bench-teacher` here; `sim` and `fuzz`
from above `impl`, through the `groupflow.commands` entry points)."""

from groupflow.impl.cli._args import (
    at_least,
    image_file,
    positive,
    prepare_output,
    readable_file,
    writable_file,
    writable_folder,
)
from groupflow.impl.cli._command import Command
from groupflow.impl.cli._main import command_parsers, exit_status, main

__all__ = [
    "Command",
    "at_least",
    "command_parsers",
    "exit_status",
    "image_file",
    "main",
    "positive",
    "prepare_output",
    "readable_file",
    "writable_file",
    "writable_folder",
]
