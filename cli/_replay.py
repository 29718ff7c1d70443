"""`groupflow replay`: judge a run's trace against the model, after the fact."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from groupflow.cli._command import Command
from groupflow.model.errors import TraceError
from groupflow.sim.verify.replay import replay


def run(args: argparse.Namespace) -> int:
    try:
        result = replay(Path(args.path))
    except (TraceError, OSError) as exc:
        print(f"groupflow replay: {exc}", file=sys.stderr)
        return 2
    print(result.verdict_line())
    print(f"  {result.summary()}")
    for note in result.notes:
        print(f"  note: {note}")
    if not result.ok and result.model:
        print(f"  model: {result.model}")
    return 0 if result.ok else 1


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        metavar="RUN_DIR_OR_FILE",
        help="a trace (build_pipeline(trace=...), groupflow sim --trace), or the run folder "
        "that holds trace.jsonl",
    )


COMMAND = Command(
    name="replay",
    help="validate a run's trace against the model: every action, every prompt",
    description="Walk a trace written by build_pipeline(trace=...) through the model "
    "`groupflow check` explores: every action must be allowed from the model state reached, "
    "the invariants must hold, each crash must resume from the model's last checkpoint, and "
    "at the end every prompt must be trained exactly once (across restarts) or given up. "
    "Prints a verdict and a summary; exit status 0 for a valid trace, 1 for one that is "
    "rejected (naming the line), did not end, or failed, 2 for a file that is not a trace.",
    arguments=_arguments,
    run=run,
)
