"""`Command`: the one way a subcommand of `groupflow` is declared."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import attrs


@attrs.frozen
class Command:
    """One subcommand: its name, help line and description, the arguments it takes, and the
    function that runs it and returns the exit status.

    Each subcommand module declares one as `COMMAND`, and the dispatcher lists them all. A command
    imports what is heavy (torch, Hypothesis) inside `run`, so `groupflow --help` stays light
    and a missing extra breaks only the commands that need it.
    """

    name: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def register(
        self, sub: argparse._SubParsersAction[argparse.ArgumentParser]
    ) -> argparse.ArgumentParser:
        """Add this command to the subcommands of a parser; returns its own parser."""
        parser = sub.add_parser(self.name, help=self.help, description=self.description)
        self.arguments(parser)
        parser.set_defaults(run=self.run)
        return parser
