"""`groupflow check`: explore every reachable state of the abstract scheduler for small bounds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import attrs

from groupflow.cli._args import at_least, positive, with_defaults
from groupflow.cli._command import Command
from groupflow.model.errors import ArgumentError
from groupflow.model.policy import CheckpointPolicy, Design, FailurePolicy
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.explorer import Report, WalkReport, explore, random_walks
from groupflow.model.shape import SHAPE_FIELDS, Shape, shape_dict


class _ProgressLine:
    """A status line on stderr, rewritten in place on a terminal, for runs longer than 2 s."""

    def __init__(self, stream: TextIO, label: str, *, walks: bool = False) -> None:
        self.stream = stream
        self.label = label
        self.walks = walks
        self.shown = False
        self.tty = stream.isatty()
        self.last_line: float | None = None
        self.seen: tuple[int, int, float] = (0, 0, 0.0)
        """The latest (states, transitions, seconds) heard: what an interrupt reports."""

    def __call__(self, states: int, transitions: int, frontier: int, seconds: float) -> None:
        self.seen = (states, transitions, seconds)
        if seconds < 2.0:
            return
        if not self.tty and self.last_line is not None and seconds - self.last_line < 10.0:
            return
        self.last_line = seconds
        if self.walks:
            text = (
                f"{self.label}: {states:,} walks done, {frontier:,} to go, {transitions:,} "
                f"transitions, {seconds:.0f} s ({transitions / seconds:,.0f} transitions/s)"
            )
        else:
            text = (
                f"{self.label}: {states:,} states, {transitions:,} transitions, frontier "
                f"{frontier:,}, {seconds:.0f} s ({states / seconds:,.0f} states/s)"
            )
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _bounds(args: argparse.Namespace, design: Design) -> Bounds:
    return Bounds(
        prompts=args.prompts,
        shape=Shape(**{name: getattr(args, name) for name in SHAPE_FIELDS}),
        teachers=args.teachers,
        crashes=args.crashes,
        checkpoints=args.checkpoints,
        rollout_failures=args.rollout_failures,
        batch_failures=args.batch_failures,
        design=design,
        flush_timer=not args.no_flush_timer,
        demand=args.demand,
        failure_policy=FailurePolicy(args.failure_policy),
        permanent_failures=args.permanent_failures,
        checkpoint_policies=args.checkpoint_policy,
        drain_on_shutdown=args.shutdown == "drain",
        interrupts=not args.no_interrupts,
        stages=args.stages,
        aborts=args.aborts,
        train_failures=args.train_failures,
    )


def _policies(text: str) -> frozenset[CheckpointPolicy]:
    """`--checkpoint-policy`: one policy or several, comma-separated."""
    names = [p.strip() for p in text.split(",")]
    known = [p.value for p in CheckpointPolicy]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, unknown)) or repr(text)} is not a checkpoint policy: use "
            f"{', '.join(known)}, or several comma-separated"
        )
    return frozenset(CheckpointPolicy(n) for n in names)


def _bounds_json(b: Bounds) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in attrs.fields(Bounds):
        if not field.init:
            continue  # a table derived from the others, not a bound
        value = getattr(b, field.name)
        if isinstance(value, Shape):
            out.update(shape_dict(value))
            continue
        if isinstance(value, frozenset):
            value = sorted(v.value for v in value)
        elif hasattr(value, "value"):
            value = value.value
        out[field.name] = value
    return out


def _report_json(r: Report) -> dict[str, Any]:
    return {
        "bounds": _bounds_json(r.bounds),
        "states": r.states,
        "transitions": r.transitions,
        "final_states": r.final_states,
        "seconds": round(r.seconds, 3),
        "states_per_second": round(r.states_per_second),
        "complete": r.complete,
        "reduced": r.reduced,
        "violations": [f.to_json(r.bounds) for f in r.findings],
    }


def _print_report(r: Report) -> None:
    b = r.bounds
    timer = "flush timer on" if b.flush_timer else "no flush timer"
    demand = ", demand dispatch" if b.demand else ""
    print(f"design {b.design} ({timer}{demand})")
    print(
        f"  explored {r.states:,} states and {r.transitions:,} transitions "
        f"({r.final_states:,} final) in {r.seconds:.2f} s, {r.states_per_second:,.0f} states/s"
        + ("" if r.complete else "; STOPPED at --max-states: the result is partial")
        + (f"; {r.reduced:,} states expanded through a persistent subset" if r.reduced else "")
    )
    if not r.findings:
        print("  no violations" + ("" if r.complete else " among the states visited"))
        return
    for finding in r.findings:
        print()
        print("  " + finding.explain(b).replace("\n", "\n  "))


def _print_walks(r: WalkReport) -> None:
    b = r.bounds
    print(f"design {b.design}: random walks (a sample of runs, not a proof)")
    print(
        f"  {r.walks:,} walks, {r.transitions:,} transitions ({r.finished:,} walks reached the "
        f"end of the run) in {r.seconds:.2f} s, {r.transitions_per_second:,.0f} transitions/s"
    )
    if not r.findings:
        print("  no violations seen")
        return
    for finding in r.findings:
        print()
        print("  " + finding.explain(b).replace("\n", "\n  "))


_DEPTH = 10_000
"""Actions per random walk at the most, by default."""


def _simulate(args: argparse.Namespace, bounds: list[Bounds]) -> int:
    args = with_defaults(args, {"depth": _DEPTH, "seed": 0})
    reports = []
    for b in bounds:
        progress = _ProgressLine(sys.stderr, f"walking {b.design}", walks=True)
        try:
            reports.append(
                random_walks(
                    b,
                    walks=args.simulate,
                    depth=args.depth,
                    seed=args.seed,
                    progress=progress,
                )
            )
        finally:
            progress.close()
        if not args.json:
            _print_walks(reports[-1])
            print()
    if args.json:
        out = [
            {
                "bounds": _bounds_json(r.bounds),
                "walks": r.walks,
                "transitions": r.transitions,
                "finished": r.finished,
                "seconds": round(r.seconds, 3),
                "violations": [f.to_json(r.bounds) for f in r.findings],
            }
            for r in reports
        ]
        print(json.dumps(out, indent=2))
    return 0 if all(r.ok for r in reports) else 1


def _mixed(args: argparse.Namespace) -> str | None:
    """An option of the exhaustive search given with `--simulate`, or one of the walks'
    without it, named; None where there is none."""
    if args.simulate is None:
        walks = [
            f"--{name} {value}"
            for name in ("depth", "seed")
            if (value := getattr(args, name)) is not None
        ]
        if walks:
            return f"{walks[0]} sets the random walks: add --simulate N, or drop it"
    else:
        search = ([f"--max-states {args.max_states}"] if args.max_states is not None else []) + (
            ["--no-reduction"] if args.no_reduction else []
        )
        if search:
            return (
                f"{search[0]} sets the exhaustive search, which --simulate {args.simulate} "
                f"replaces: drop one of them"
            )
    return None


def run(args: argparse.Namespace) -> int:
    mixed = _mixed(args)
    if mixed is not None:
        raise ArgumentError(mixed)
    if args.teachers > args.prompts:  # before the search: its every state holds each lane
        raise ArgumentError(
            f"--teachers {args.teachers:,} > --prompts {args.prompts}: prompt o goes to teacher "
            f"o % teachers, so a teacher past the prompts has none; give at most {args.prompts}"
        )
    if args.compiled:
        return _run_compiled(args)
    designs = list(Design) if args.design == "all" else [Design(args.design)]
    try:
        bounds = [_bounds(args, d) for d in designs]
    except ValueError as exc:
        print(f"groupflow check: {exc}", file=sys.stderr)
        return 2
    for b in bounds:
        problems = b.problems()
        if problems:
            print(
                f"groupflow check: note: PipelineConfig would refuse these bounds with design "
                f"{b.design}: " + "; ".join(problems),
                file=sys.stderr,
            )
    if args.simulate is not None:
        return _simulate(args, bounds)
    reports = []
    for b in bounds:
        progress = _ProgressLine(sys.stderr, f"checking {b.design}")
        try:
            reports.append(
                explore(
                    b,
                    max_states=args.max_states,
                    progress=progress,
                    reduce=not args.no_reduction,
                    progress_every=2_000,
                )
            )
        except KeyboardInterrupt:
            progress.close()
            states, transitions, seconds = progress.seen
            done = ", ".join(f"{r.bounds.design}: {r.states:,} states" for r in reports)
            print(
                f"groupflow check: interrupted checking {b.design} after about {states:,} "
                f"states and {transitions:,} transitions in {seconds:.0f} s, no verdict for it"
                + (f" (finished before it: {done})" if done else ""),
                file=sys.stderr,
            )
            return 130
        finally:
            progress.close()
        if not args.json:
            _print_report(reports[-1])
            print()
    if args.json:
        print(json.dumps([_report_json(r) for r in reports], indent=2))
    elif len(reports) > 1:
        print(f"{'design':<10} {'states':>10} {'seconds':>8}  violations")
        for r in reports:
            found = ", ".join(f.kind for f in r.findings) or "none"
            print(f"{r.bounds.design.value:<10} {r.states:>10,} {r.seconds:>8.2f}  {found}")
    return 0 if all(r.ok for r in reports) else 1


def _run_compiled(args: argparse.Namespace) -> int:
    """The command again in a child process on the model compiled by mypyc (built first if the
    cache holds none for this source): see `groupflow.cli._compiled`."""
    from groupflow.cli import _compiled
    from groupflow.impl._core import default_cache_dir

    folder = _compiled.compiled_model(
        default_cache_dir(), say=lambda text: print(f"groupflow check: {text}", file=sys.stderr)
    )
    return _compiled.rerun(argparse.Namespace(**{**vars(args), "compiled": False}), folder)


def _arguments(p: argparse.ArgumentParser) -> None:
    size = p.add_argument_group("bounds")
    for flag, default, lowest, text in (
        ("--prompts", 4, 1, "prompts in the data source"),
        ("--prompts-per-step", 2, 1, "prompts per train step"),
        ("--max-inflight-prompts", 3, 1, "generation permits"),
        ("--max-batch-groups", 2, 1, "groups per teacher call"),
        ("--teachers", 1, 1, "physical teachers (prompt o goes to teacher o %% teachers)"),
        ("--num-generations-per-prompt", 2, 1, "rows per group"),
        ("--max-buffered-groups", 4, 1, "groups the buffer holds, unready ones included"),
        ("--gate-window", 1, 0, "steps ahead of training a prompt may be admitted"),
        ("--crashes", 0, 0, "crashes (restart from the last checkpoint) to allow"),
        ("--checkpoints", 1, 0, "checkpoints to allow"),
        ("--rollout-failures", 0, 0, "failed rollouts to allow"),
        ("--batch-failures", 0, 0, "failed teacher calls to allow"),
        ("--train-failures", 0, 0, "train steps that raise (the run fails) to allow"),
        ("--aborts", 0, 0, "failures from outside the scheduler (a pump raised) to allow"),
        (
            "--stages",
            1,
            0,
            "scoring stages: 0 (READY at commit), 1 (teacher), 2 (teacher, verifier)",
        ),
    ):
        size.add_argument(
            flag,
            type=at_least(lowest, at_most=2 if flag == "--stages" else None),
            default=default,
            metavar="N",
            help=f"{text} (default {default})",
        )
    design = p.add_argument_group("design")
    design.add_argument("--design", choices=[d.value for d in Design] + ["all"], default="pump")
    design.add_argument(
        "--no-flush-timer", action="store_true", help="batches wait until full (or drain)"
    )
    design.add_argument(
        "--demand",
        action="store_true",
        help="dispatch at once when training waits on queued groups",
    )
    design.add_argument(
        "--failure-policy", choices=[f.value for f in FailurePolicy], default="retry"
    )
    design.add_argument(
        "--permanent-failures",
        action="store_true",
        help="a failed teacher call may also be permanent: under the retry policy its groups "
        "are given up at once, not retried (the model live runs are checked against)",
    )
    design.add_argument(
        "--checkpoint-policy",
        type=_policies,
        default=frozenset({CheckpointPolicy.FLUSH, CheckpointPolicy.UNCOMMITTED}),
        metavar="P[,P]",
        help="policies a checkpoint may use: flush, uncommitted, naive (the upstream baseline)",
    )
    design.add_argument("--shutdown", choices=["drain", "discard"], default="drain")
    design.add_argument("--no-interrupts", action="store_true", help="the user never stops the run")
    p.add_argument(
        "--max-states", type=positive, default=None, metavar="N", help="stop after N states"
    )
    p.add_argument(
        "--no-reduction",
        action="store_true",
        help="visit every state: no canonical states, no persistent sets (slower; the same "
        "verdicts, and traces that are shortest among all runs)",
    )
    walk = p.add_argument_group("random walks, for bounds beyond exhaustive reach")
    walk.add_argument(
        "--simulate",
        type=positive,
        default=None,
        metavar="N",
        help="instead of visiting every state, run N seeded random walks of the model and "
        "check every state on the way (finds violations, proves nothing)",
    )
    walk.add_argument(
        "--depth",
        type=positive,
        default=None,
        metavar="N",
        help=f"actions per walk at the most (default {_DEPTH:,})",
    )
    walk.add_argument("--seed", type=int, default=None, help="the walks' seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="run the search on the model compiled by mypyc (about twice as fast; built once "
        "per source into the cache folder, about a minute; needs pip install 'groupflow[compile]' "
        "and a C compiler)",
    )


COMMAND = Command(
    name="check",
    help="exhaustively check the scheduler model for small bounds",
    description="Visit every reachable state of the abstract scheduler (groups, permits, "
    "teacher batches, timers, checkpoints, crashes, shutdown) and check the invariants, "
    "deadlock freedom, drain on exit, the prompt ledger, and that the run can always finish. "
    "Exit status 1 when a violation is found; each comes with a trace (the shortest of all "
    "with --no-reduction).",
    arguments=_arguments,
    run=run,
)
