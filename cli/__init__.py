"""The `groupflow` command line: `main` (the console script), one module per subcommand, each
declaring a `Command`. It sits above every other package (the implementation, the simulator
and run verifier, the fuzzer), so it imports each command directly."""

from groupflow.cli._main import command_parsers, main

__all__ = ["command_parsers", "main"]
