"""The `groupflow` command line: one subcommand per job, each in a module of its own that
declares a `Command`. The command line sits above every layer it drives (the implementation,
the simulator, the run verifier, the fuzzer), so it imports each command directly."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from groupflow.cli import _bench_teacher, _check, _fuzz, _model, _replay, _sim, _train
from groupflow.cli._args import OneLineParser
from groupflow.cli._command import Command
from groupflow.impl._pipeline import leaves
from groupflow.model.errors import (
    CheckpointError,
    ExternalError,
    PumpFailed,
    TraceError,
    Unavailable,
    UsageError,
)

COMMANDS: tuple[Command, ...] = (
    _train.COMMAND,
    _model.COMMAND,
    _check.COMMAND,
    _bench_teacher.COMMAND,
    _fuzz.COMMAND,
    _replay.COMMAND,
    _sim.COMMAND,
)
"""Every subcommand, in the order `groupflow --help` lists them."""


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="groupflow",
        description="A verified core for asynchronous RL post-training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {c.name: c.register(sub) for c in COMMANDS}
    return parser, commands


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's own parser, by name (what `groupflow NAME --help` describes): for
    tools and tests that go through every command's arguments."""
    return _parser()[1]


INPUT_ERRORS: tuple[type[BaseException], ...] = (
    UsageError,
    CheckpointError,
    TraceError,
    Unavailable,
)
"""What the user handed over is wrong or not there: a mistake in the command line, a
configuration, a checkpoint or trace named on it, a package or device it asks for."""


def exit_status(error: BaseException) -> int | None:
    """The exit status an error ends a command with, by where it sits in the hierarchy of
    `groupflow.model.errors`: 2 for the user's input (`INPUT_ERRORS`), 1 for a run that failed
    for another reason outside groupflow (a pump's failure is judged by its cause), None for
    anything else (a bug: its traceback is what a report needs)."""
    if isinstance(error, PumpFailed) and error.__cause__ is not None:
        return exit_status(error.__cause__) or 1
    if isinstance(error, INPUT_ERRORS):
        return 2
    if isinstance(error, ExternalError | PumpFailed | OSError):
        return 1
    return None


def one_line(error: BaseException) -> str:
    """An error's message on one line (a message that lists several problems keeps them all)."""
    text = str(error) or type(error).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `groupflow` console script; returns the process exit status: 0 done,
    1 what was checked failed (or the run failed for a reason outside groupflow), 2 a mistake
    in the command line or its inputs, 130 interrupted (Ctrl-C). Every status but 0 comes with
    one line on stderr naming the command and the value, never a traceback, except for a bug
    in groupflow itself."""
    parser, commands = _parser()
    args, unknown = parser.parse_known_args(argv)
    name = f"groupflow {args.command}"
    if unknown:  # said by the subcommand's parser, so the pointer is to its --help
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        return _interrupted(name)
    except BaseExceptionGroup as group:
        if any(isinstance(e, KeyboardInterrupt) for e in leaves(group)):
            return _interrupted(name)
        raise
    except Exception as exc:
        code = exit_status(exc)
        if code is None:
            raise
        print(f"{name}: {one_line(exc)}", file=sys.stderr)
        return code
    return status


def _interrupted(name: str) -> int:
    print(f"\n{name}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
