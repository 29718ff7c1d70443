"""The `groupflow` command line: one subcommand per job, each in a module of its own.

Subcommands that live above `impl` in the layers (the simulator, the fuzzer) register through
the `groupflow.commands` entry-point group, so this module never imports them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from groupflow.impl import cmd_bench_teacher, cmd_check, cmd_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="groupflow",
        description="A verified core for asynchronous RL post-training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (cmd_model, cmd_check, cmd_bench_teacher):
        module.add_parser(sub)
    for entry in sorted(entry_points(group="groupflow.commands"), key=lambda e: e.name):
        try:
            module = entry.load()
        except ImportError as exc:  # a broken plugin must not take the other commands down
            print(f"groupflow: command {entry.name!r} unavailable: {exc}", file=sys.stderr)
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `groupflow` console script; returns the process exit status."""
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
