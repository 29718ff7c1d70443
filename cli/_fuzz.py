"""`groupflow fuzz`: the property machines with a budget far beyond CI's, and a progress line."""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from groupflow.cli._args import positive, with_defaults
from groupflow.cli._command import Command
from groupflow.model.errors import ArgumentError

MACHINES = ("buffer", "scheduler", "pipeline", "served")
SCORERS = ("fake", "torch")
"""The pipeline machine's teachers (`groupflow.properties.pipeline_machine.SCORERS`, which
needs Hypothesis to import: this module must load without it)."""


@contextmanager
def _progress(label: str, count: Callable[[], int], total: int) -> Iterator[None]:
    """Rewrite one line on the terminal every second: examples done of `total`, and time."""
    if not sys.stderr.isatty():
        yield
        return
    stop = threading.Event()
    began = time.perf_counter()

    def tick() -> None:
        while not stop.wait(1.0):
            done = count()
            print(
                f"\r{label}: {done}/{total} examples, {time.perf_counter() - began:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    ticker = threading.Thread(target=tick, name="fuzz progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        print("\r\033[K", end="", file=sys.stderr, flush=True)


def _shrunk_examples(exc: BaseException) -> str:
    """Each failure with the shrunk example Hypothesis attached to it (as exception notes):
    one for a single failure, one per failure for an `ExceptionGroup` of distinct ones."""
    leaves = list(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else [exc]
    parts = []
    for i, leaf in enumerate(leaves, 1):
        head = f"failure {i} of {len(leaves)}: " if len(leaves) > 1 else ""
        message = str(leaf).splitlines()[0] if str(leaf) else ""
        notes = "\n".join(getattr(leaf, "__notes__", []))
        parts.append(f"{head}{type(leaf).__name__}: {message}\n{notes}".rstrip())
    return "\n\n".join(parts)


def _replay(args: argparse.Namespace, name: str, seed: int) -> str:
    scorer = (
        f" --scorer {args.scorer} --device {args.device} --host {args.host}"
        if name == "pipeline"
        else ""
    )
    steps = "" if name == "served" else f" --steps {args.steps}"
    return (
        f"groupflow fuzz --machine {name}{scorer} --examples {args.examples}{steps} --seed {seed}"
    )


_ROUNDS = 1
_STEPS = 100
"""Rounds, and steps per example, by default."""


def _unused(args: argparse.Namespace) -> str | None:
    """A flag that means nothing with the others given, named with what to do; None where
    there is none."""
    if args.minutes is not None and args.rounds is not None:
        return (
            f"--rounds {args.rounds} and --minutes {args.minutes} each say how long to fuzz: "
            f"drop one of them"
        )
    if args.machine not in ("pipeline", "all"):
        for flag, value, default in (
            ("--scorer", args.scorer, "fake"),
            ("--host", args.host, "trio"),
        ):
            if value != default:
                return (
                    f"{flag} {value} sets the pipeline machine's parts; --machine "
                    f"{args.machine} runs none: drop it"
                )
    if args.machine == "served" and args.steps is not None:
        return f"--steps {args.steps}: the served machine's examples are whole runs; drop it"
    return None


def run(args: argparse.Namespace) -> int:
    unused = _unused(args)
    if unused is not None:
        raise ArgumentError(unused)
    args = with_defaults(args, {"rounds": _ROUNDS, "steps": _STEPS})
    try:
        from groupflow.properties import pipeline_machine
        from groupflow.properties.buffer_machine import run_buffer_machine
        from groupflow.properties.scheduler_machine import run_scheduler_walks
    except ImportError:
        print("groupflow fuzz needs Hypothesis: pip install 'groupflow[fuzz]'", file=sys.stderr)
        return 2
    if args.scorer == "torch" and importlib.util.find_spec("torch") is None:
        print("--scorer torch needs torch: pip install 'groupflow[torch]'", file=sys.stderr)
        return 2
    if args.scorer == "torch":
        from groupflow.impl._teachers._torch import resolve_device

        resolve_device(args.device)  # a device torch does not know is refused before a round
    elif args.device != "auto":
        raise ArgumentError(
            f"--device {args.device}: the fake scorer runs no model; --device applies to "
            f"--scorer torch"
        )
    names = list(MACHINES) if args.machine == "all" else [args.machine]
    if "served" in names and importlib.util.find_spec("httpx") is None:
        if args.machine == "served":
            print(
                "the served machine needs httpx: pip install 'groupflow[served]'",
                file=sys.stderr,
            )
            return 2
        print("served machine left out: pip install 'groupflow[served]'", file=sys.stderr)
        names.remove("served")
    machines: dict[str, Callable[[int, int, int], object]] = {
        "buffer": lambda examples, steps, seed: run_buffer_machine(
            max_examples=examples, steps=steps, seed=seed
        ),
        "scheduler": lambda examples, steps, seed: run_scheduler_walks(
            max_examples=examples, steps=steps, seed=seed
        ),
        "pipeline": lambda examples, steps, seed: pipeline_machine.run_pipeline_machine(
            max_examples=examples,
            steps=steps,
            seed=seed,
            scorer=args.scorer,
            device=args.device,
            host=args.host,
        ),
        "served": lambda examples, steps, seed: _served().run_served_machine(
            max_examples=examples, seed=seed
        ),
    }
    failed = False
    began = time.perf_counter()
    deadline = None if args.minutes is None else began + 60 * args.minutes
    rounds = "until time is up" if deadline is not None else str(args.rounds)
    first_seed = random.randrange(2**32) if args.seed is None else args.seed
    round_ = 0
    while True:
        round_ += 1
        if deadline is None and round_ > args.rounds:
            break
        if deadline is not None and time.perf_counter() >= deadline:
            break
        seed = (first_seed + round_ - 1) % 2**32
        for name in names:
            start = time.perf_counter()
            hosted = f" on the {args.host} host" if args.host != "trio" else ""
            over = f" over {args.scorer} teachers{hosted}" if name == "pipeline" else ""
            steps = "" if name == "served" else f" of up to {args.steps} steps"
            print(
                f"[{round_}/{rounds}] {name}{over}: {args.examples} examples{steps}, "
                f"seed {seed}...",
                file=sys.stderr,
                flush=True,
            )
            try:
                with _progress(name, _examples_of(name), args.examples):
                    machines[name](args.examples, args.steps, seed)
            except Exception as exc:
                print(f"{name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
                print(_shrunk_examples(exc), file=sys.stderr)
                print(f"replay it: {_replay(args, name, seed)}", file=sys.stderr)
                failed = True
                if not args.keep_going:
                    return 1
            else:
                took = time.perf_counter() - start
                rate = ""
                if name == "pipeline":
                    stats = pipeline_machine.stats
                    rate = (
                        f" ({stats['examples']} examples, {stats['checks']} steps: "
                        f"{stats['examples'] / took:.1f} examples/s, "
                        f"{stats['checks'] / took:.0f} steps/s)"
                    )
                elif name == "served":
                    stats = _served().stats
                    rate = (
                        f" ({stats['examples']} examples, {stats['checked']} rows checked, "
                        f"{stats['resumed']} runs resumed: {stats['examples'] / took:.2f} "
                        f"examples/s)"
                    )
                print(f"{name}: ok in {took:.1f} s{rate}", file=sys.stderr)
    if deadline is not None:
        print(
            f"{round_ - 1} rounds in {(time.perf_counter() - began) / 60:.1f} min",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _served() -> types.ModuleType:
    """The served machine, imported when it runs (it needs httpx besides Hypothesis)."""
    from groupflow.properties import served_machine

    return served_machine


def _examples_of(name: str) -> Callable[[], int]:
    """How many examples machine `name` has started, for the progress line (0 when it does
    not count them)."""
    if name == "pipeline":
        from groupflow.properties import pipeline_machine

        return lambda: pipeline_machine.stats["examples"]
    if name == "served":
        return lambda: _served().stats["examples"]
    return lambda: 0


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**32 - 1, got {value}")
    return value


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--machine", choices=[*MACHINES, "all"], default="all")
    p.add_argument("--examples", type=positive, default=2000)
    p.add_argument(
        "--steps",
        type=positive,
        default=None,
        help=f"steps per example at the most (default {_STEPS}; not the served machine's)",
    )
    p.add_argument(
        "--rounds",
        type=positive,
        default=None,
        help=f"repeat, with fresh random examples (default {_ROUNDS})",
    )
    p.add_argument(
        "--minutes",
        type=positive,
        default=None,
        metavar="M",
        help="instead of --rounds: repeat rounds until M minutes have passed (a round started "
        "before then finishes)",
    )
    p.add_argument(
        "--seed",
        type=_seed,
        default=None,
        metavar="S",
        help="the first round's random seed (round r uses S + r - 1): the same seed and budget "
        "replay the same examples (default: a fresh one, printed)",
    )
    p.add_argument(
        "--scorer",
        choices=list(SCORERS),
        default="fake",
        help="the pipeline machine's teachers: pure-Python fakes, or TorchTeacher (needs torch)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="where torch teachers run: auto (CUDA when torch sees one), cpu, cuda:0, ...",
    )
    p.add_argument(
        "--host",
        choices=["trio", "asyncio", "uvloop"],
        default="trio",
        help="the pipeline machine's host: trio, or asyncio (or uvloop) with trio as its guest "
        "and the parts written for asyncio (groupflow.impl.aio)",
    )
    p.add_argument("--keep-going", action="store_true", help="finish every round after a failure")


COMMAND = Command(
    name="fuzz",
    help="run the Hypothesis state machines with a large budget",
    description="Drive the buffer state machine, random walks through the scheduler model, "
    "the live-pipeline machine (Hypothesis orders rollouts, teacher calls, timers and crashes) "
    "and the served machine (the pipeline over vLLM imitations, with faults on the wire, on "
    "the real clock) with far more examples than CI does. A failing example is shrunk and "
    "printed, with the command (its seed) that replays it.",
    arguments=_arguments,
    run=run,
)
