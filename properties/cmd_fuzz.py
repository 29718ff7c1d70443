"""`groupflow fuzz`: the property machines with a budget far beyond CI's, and a progress line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from groupflow.impl.cli import Command, positive

MACHINES = ("buffer", "scheduler", "pipeline")


def run(args: argparse.Namespace) -> int:
    try:
        from groupflow.properties.buffer_machine import run_buffer_machine
        from groupflow.properties.pipeline_machine import run_pipeline_machine
        from groupflow.properties.scheduler_machine import run_scheduler_walks
    except ImportError:
        print("groupflow fuzz needs Hypothesis: pip install 'groupflow[fuzz]'", file=sys.stderr)
        return 2
    machines: dict[str, Callable[[int, int], object]] = {
        "buffer": lambda examples, steps: run_buffer_machine(max_examples=examples, steps=steps),
        "scheduler": lambda examples, steps: run_scheduler_walks(
            max_examples=examples, steps=steps
        ),
        "pipeline": lambda examples, steps: run_pipeline_machine(
            max_examples=examples, steps=steps
        ),
    }
    names = list(machines) if args.machine == "all" else [args.machine]
    failed = False
    began = time.perf_counter()
    deadline = None if args.minutes is None else began + 60 * args.minutes
    rounds = "until time is up" if deadline is not None else str(args.rounds)
    round_ = 0
    while True:
        round_ += 1
        if deadline is None and round_ > args.rounds:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            break
        for name in names:
            start = time.perf_counter()
            print(
                f"[{round_}/{rounds}] {name}: {args.examples} examples of up to {args.steps} steps...",
                file=sys.stderr,
                flush=True,
            )
            try:
                machines[name](args.examples, args.steps)
            except Exception as exc:  # Hypothesis has printed the shrunk failing example
                print(f"{name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
                print(
                    f"replay it (saved in .hypothesis/, tried first): groupflow fuzz "
                    f"--machine {name} --examples {args.examples} --steps {args.steps}",
                    file=sys.stderr,
                )
                failed = True
                if not args.keep_going:
                    return 1
            else:
                print(f"{name}: ok in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if deadline is not None:
        print(
            f"{round_ - 1} rounds in {(time.perf_counter() - began) / 60:.1f} min",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--machine", choices=[*MACHINES, "all"], default="all")
    p.add_argument("--examples", type=positive, default=2000)
    p.add_argument("--steps", type=positive, default=100)
    p.add_argument("--rounds", type=positive, default=1, help="repeat, with fresh random examples")
    p.add_argument(
        "--minutes",
        type=positive,
        default=None,
        metavar="M",
        help="instead of --rounds: repeat rounds until M minutes have passed (a round started "
        "before then finishes)",
    )
    p.add_argument("--keep-going", action="store_true", help="finish every round after a failure")


COMMAND = Command(
    name="fuzz",
    help="run the Hypothesis state machines with a large budget",
    description="Drive the buffer state machine, random walks through the scheduler model and "
    "the live-pipeline machine (Hypothesis orders rollouts, teacher calls, timers and crashes) "
    "with far more examples than CI does. Failing examples are shrunk, printed, and saved in "
    "Hypothesis's example database (.hypothesis/) so the next run replays them first.",
    arguments=_arguments,
    run=run,
)
