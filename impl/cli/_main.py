"""The `groupflow` command line: one subcommand per job, each in a module of its own that
declares a `Command`.

Subcommands that live above `impl` in the layers (the simulator, the fuzzer) register through
the `groupflow.commands` entry-point group, so this module never imports them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from groupflow.impl.cli import _bench_teacher, _check, _model, _train
from groupflow.impl.cli._args import OneLineParser
from groupflow.impl.cli._command import Command
from groupflow.impl.pipeline import leaves
from groupflow.model.errors import UsageError

BUILT_IN: tuple[Command, ...] = (
    _train.COMMAND,
    _model.COMMAND,
    _check.COMMAND,
    _bench_teacher.COMMAND,
)


def _plugins() -> list[Command]:
    """The commands of the `groupflow.commands` entry points: each names a module whose
    `COMMAND` is the subcommand. A broken one is reported and left out."""
    found = []
    for entry in sorted(entry_points(group="groupflow.commands"), key=lambda e: e.name):
        try:
            command = entry.load().COMMAND
        except (ImportError, AttributeError) as exc:  # a broken plugin must not take the
            print(f"groupflow: command {entry.name!r} unavailable: {exc}", file=sys.stderr)
            continue  # other commands down
        if not isinstance(command, Command):
            print(
                f"groupflow: command {entry.name!r} unavailable: its COMMAND is not a Command",
                file=sys.stderr,
            )
            continue
        found.append(command)
    return found


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = OneLineParser(
        prog="groupflow",
        description="A verified core for asynchronous RL post-training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (*BUILT_IN, *_plugins()):
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `groupflow` console script; returns the process exit status: 0 done,
    1 what was checked failed, 2 a mistake in the command line or its inputs (one line, no
    traceback), 130 interrupted (Ctrl-C)."""
    args = _parser().parse_args(argv)
    name = f"groupflow {args.command}"
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        return _interrupted(name)
    except BaseExceptionGroup as group:
        if any(isinstance(e, KeyboardInterrupt) for e in leaves(group)):
            return _interrupted(name)
        raise
    except UsageError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    return status


def _interrupted(name: str) -> int:
    print(f"\n{name}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
