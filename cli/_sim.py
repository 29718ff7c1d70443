"""`groupflow sim`: run a scenario through the real pipeline under virtual time and compare the
pump design with the inline baseline (and, with `--design all`, the pipeline bound)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from groupflow.cli._args import (
    at_least,
    image_file,
    prepare_output,
    with_defaults,
    writable_file,
)
from groupflow.cli._command import Command
from groupflow.impl._core import MAX_RUN_PROMPTS
from groupflow.model.errors import ArgumentError, TraceError
from groupflow.sim.report import as_json, json_number, seeds_table, speed, table
from groupflow.sim.run import SimResult, runs, simulate, variants
from groupflow.sim.scenario import load_scenario, scenario_toml, shipped_scenarios

if TYPE_CHECKING:
    from groupflow.sim.calibrate import Calibration, Terms

_T = TypeVar("_T")

_SCENARIO = "shipped-recipe"
_DISPATCH = "demand"

MAX_SEEDS = 100
"""The most seeds one invocation simulates (each is a whole simulation per design)."""


def run(args: argparse.Namespace) -> int:
    if args.from_run is not None:
        return _from_run(args)
    if args.write is not None:
        raise ArgumentError(
            f"--write {args.write} is where --from-run writes its fit: add --from-run RUN_DIR, "
            f"or drop --write"
        )
    unused = _unused_dispatch(args.design or "both", args.dispatch)
    if unused is not None:
        raise ArgumentError(unused)
    args = with_defaults(args, {"scenario": _SCENARIO, "dispatch": _DISPATCH})
    try:
        scenario = load_scenario(args.scenario)
        chosen = variants(args.design or "both", args.dispatch)
    except ValueError as exc:
        print(f"groupflow sim: {exc}", file=sys.stderr)
        return 2
    if not all(runs(scenario, v) for v in chosen):
        pump = [v for v in chosen if runs(scenario, v)]
        if not pump:
            print(
                f"groupflow sim: scenario {scenario.name!r} has a [verifier] stage, which the "
                f"inline baseline does not run; pick --design pump or all",
                file=sys.stderr,
            )
            return 2
        print(
            f"note: scenario {scenario.name!r} has a [verifier] stage; the inline baseline "
            f"does not run one, so it is left out",
            file=sys.stderr,
        )
        chosen = pump
    if args.trace is not None and len(chosen) > 1:
        print(
            f"groupflow sim: --trace {args.trace} writes one run's trace; pick one --design "
            f"(pump or inline), not {args.design!r}",
            file=sys.stderr,
        )
        return 2
    if args.trace is not None and Path(args.trace).is_file() and Path(args.trace).stat().st_size:
        raise ArgumentError(
            f"--trace {args.trace} already holds a trace: this run's would follow it as one "
            f"run that never resumed; remove it or give another file"
        )
    if args.seeds > 1 and (args.trace is not None or args.plot is not None):
        what = "--trace" if args.trace is not None else "--plot"
        print(
            f"groupflow sim: {what} shows one run; pick --seeds 1, not --seeds {args.seeds}",
            file=sys.stderr,
        )
        return 2
    runs_by_variant = [
        _over_seeds(
            args,
            variant.label,
            functools.partial(
                simulate,
                scenario,
                variant,
                steps=args.steps,
                conform=args.conform,
                trace=None if args.trace is None else prepare_output(args.trace),
            ),
        )
        for variant in chosen
    ]
    results = [r for runs_of_one in runs_by_variant for r in runs_of_one]
    if args.json:
        print(json.dumps(as_json(results), indent=2))
    else:
        print(_what_if(runs_by_variant), end="")
        print(speed(results), end="", file=sys.stderr)
    if args.plot is not None:
        from groupflow.sim.plot import plot_timelines

        written = plot_timelines(results, prepare_output(Path(args.plot)))
        if not args.json:
            print(f"wrote {written}")
    conforms = all(r.conformance is None or r.conformance.ok for r in results)
    return 0 if conforms and all(r.outcome == "ok" for r in results) else 1


def _seeds(args: argparse.Namespace) -> range:
    return range(args.seed, args.seed + args.seeds)


def _over_seeds(args: argparse.Namespace, label: str, simulate_one: Callable[..., _T]) -> list[_T]:
    """`simulate_one(seed=...)` of each seed of `--seeds`, saying which runs on a terminal."""
    out = []
    for i, seed in enumerate(_seeds(args), 1):
        if not args.json and sys.stderr.isatty():
            which = "" if args.seeds == 1 else f", seed {seed} ({i} of {args.seeds})"
            print(f"{'simulating ' + label + which + '...':<72}", end="\r", file=sys.stderr)
        out.append(simulate_one(seed=seed))
    return out


def _what_if(runs_by_variant: list[list[SimResult]]) -> str:
    """The table of one seed's runs, or of several seeds' (`seeds_table`)."""
    if len(runs_by_variant[0]) == 1:
        return table([runs_of_one[0] for runs_of_one in runs_by_variant])
    return seeds_table(runs_by_variant)


def _unused_dispatch(design: str | None, dispatch: str | None) -> str | None:
    """`--dispatch` given where no design it picks for runs, named; None otherwise."""
    if dispatch is None or design in ("pump", "both"):
        return None
    if design is None:
        return f"--dispatch {dispatch} picks the what-if pump's dispatch: add --design"
    runs = "no pump" if design == "inline" else "the pump with each dispatch"
    return (
        f"--dispatch {dispatch} picks the pump's dispatch; --design {design} runs {runs}: drop it"
    )


def _not_for_a_fit(args: argparse.Namespace, target: Path) -> str | None:
    """The options of a scenario's simulation that `--from-run` does not take, named with
    what to run instead; None where there are none."""
    if args.scenario is not None:
        return f"--scenario {args.scenario}: the fit makes its scenario from the run; drop it"
    later = f"fit first, then `groupflow sim --scenario {target}"
    if args.trace is not None:
        return (
            f"--trace {args.trace} writes a simulated run's trace: {later} --design pump "
            f"--trace {args.trace}`"
        )
    if args.plot is not None:
        return f"--plot {args.plot} draws simulated runs: {later} --plot {args.plot}`"
    if args.conform:
        return f"--conform checks a simulated run against the model: {later} --conform`"
    unused = _unused_dispatch(args.design, args.dispatch)
    if unused is not None:
        return unused
    if args.steps is not None and args.design is None:
        return (
            f"--steps {args.steps} sets how long the what-if runs (the run is compared at its "
            f"own length): add --design, or drop --steps"
        )
    return None


def _from_run(args: argparse.Namespace) -> int:
    """Fit a scenario to a run's trace, write it, and show how well its simulation
    reproduces the run; with --design, also simulate those designs of it (what if)."""
    from groupflow.sim.calibrate import (
        attribution_table,
        calibrate,
        compare,
        comparison_table,
        mean_terms,
        simulated_terms,
        variant_of,
    )

    run_dir = Path(args.from_run)
    target = (
        Path(args.write)
        if args.write is not None
        else ((run_dir if run_dir.is_dir() else run_dir.parent) / "fitted-scenario.toml")
    )
    refused = _not_for_a_fit(args, target)
    if refused is not None:
        print(f"groupflow sim --from-run: {refused}", file=sys.stderr)
        return 2
    try:
        if sys.stderr.isatty():
            print("fitting (the trace is replayed through the model first)...", file=sys.stderr)
        fit = calibrate(run_dir)
    except (TraceError, OSError) as exc:
        print(f"groupflow sim --from-run: {exc}", file=sys.stderr)
        return 2
    prepare_output(target).write_text(scenario_toml(fit.scenario), encoding="utf-8")
    text = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the JSON alone
    print(f"wrote {target} (simulate it: groupflow sim --scenario {target})", file=text)
    if not args.json:
        for note in fit.notes:
            print(f"note: {note}")
    own = variant_of(fit.scenario.pipeline)
    own_runs = _over_seeds(args, own.label, functools.partial(simulated_terms, fit.scenario, own))
    for result, _ in own_runs:
        if result.outcome != "ok" or result.stalls:
            what = (
                result.outcome
                if result.outcome != "ok"
                else f"it stalled {result.stalls} time(s), no progress for "
                f"{fit.scenario.pipeline.stall_timeout_s:g} s of virtual time"
            )
            print(
                f"groupflow sim --from-run: the fitted simulation (seed {result.seed}) does not "
                f"run as the run did ({what}): it predicts nothing. The fitted scenario is in "
                f"{target}: `groupflow sim --scenario {target} --seed {result.seed} --plot "
                f"FILE.png` shows where it stops",
                file=sys.stderr,
            )
            return 1
    per_seed = [compare(fit.observed, result) for result, _ in own_runs]
    terms = mean_terms([t for _, t in own_runs])
    if not args.json:
        over = "" if args.seeds == 1 else f", the mean of seeds {args.seed} to {_seeds(args)[-1]}"
        print(
            f"\nthe run ({fit.observed.steps} steps) against its simulation ({own.label}, "
            f"{own_runs[0][0].steps} steps{over}):"
        )
        print(comparison_table(per_seed), end="")
        print()
        print(attribution_table(fit.observed.terms, terms), end="")
    fitted = _fit_json(target, fit, own.label, own_runs, per_seed, terms) if args.json else {}
    if args.design is not None:
        args = with_defaults(args, {"dispatch": _DISPATCH})
        chosen = [v for v in variants(args.design, args.dispatch) if runs(fit.scenario, v)]
        if not chosen:
            print(
                f"groupflow sim --from-run: the fitted scenario has a [verifier] stage, which "
                f"the inline baseline does not run; pick --design pump, both or all, not "
                f"{args.design!r}",
                file=sys.stderr,
            )
            return 2
        runs_by_variant = [
            _over_seeds(
                args, v.label, functools.partial(simulate, fit.scenario, v, steps=args.steps)
            )
            for v in chosen
        ]
        results = [r for runs_of_one in runs_by_variant for r in runs_of_one]
        if args.json:
            print(json.dumps({**fitted, "what_if": as_json(results)}, indent=2))
        else:
            print("\nwhat if (the fitted scenario):")
            print(_what_if(runs_by_variant), end="")
            print(speed(results), end="", file=sys.stderr)
        return 0 if all(r.outcome == "ok" and not r.stalls for r in results) else 1
    if args.json:
        print(json.dumps(fitted, indent=2))
    return 0


def _fit_json(
    target: Path,
    fit: Calibration,
    design: str,
    own_runs: list[tuple[SimResult, Terms]],
    per_seed: list[list[tuple[str, float, float, float]]],
    terms: Terms,
) -> dict[str, Any]:
    """What `--from-run` prints, as JSON: the fitted file and its notes, each figure of the
    run against the mean of its simulations (each seed's error beside it), and where a
    step's seconds go in both. A figure that cannot be compared is null."""
    from groupflow.sim.calibrate import COMPARED, summarize

    rows = summarize(per_seed)
    return {
        "fitted_scenario": str(target),
        "notes": list(fit.notes),
        "design": design,
        "run_steps": fit.observed.steps,
        "simulated_steps": own_runs[0][0].steps,
        "seeds": [result.seed for result, _ in own_runs],
        "compared": [
            {
                "figure": key,
                "label": row.label,
                "run": json_number(row.run),
                "simulated": json_number(row.simulated),
                "error": json_number(row.error),
                "errors": [json_number(e) for e in row.errors],
            }
            for row, (_, key) in zip(rows, COMPARED, strict=True)
        ],
        "terms": {
            "run": {k: json_number(v) for k, v in attrs.asdict(fit.observed.terms).items()},
            "simulated": {k: json_number(v) for k, v in attrs.asdict(terms).items()},
        },
    }


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        default=None,
        metavar="NAME|FILE",
        help=f"a shipped scenario or a TOML file (default {_SCENARIO})",
    )
    p.add_argument(
        "--design",
        choices=["pump", "inline", "both", "all"],
        default=None,
        help="both: inline and pump; all: inline, pump with each dispatch, and the bound "
        "(scoring that costs nothing)",
    )
    p.add_argument(
        "--dispatch",
        choices=["timer", "demand"],
        default=None,
        help=f"the pump's: on a timer, or at once when training waits (default {_DISPATCH})",
    )
    p.add_argument(
        "--steps",
        type=at_least(1, at_most=MAX_RUN_PROMPTS),
        default=None,
        help="train steps (default: the scenario's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds",
        type=at_least(1, at_most=MAX_SEEDS),
        default=1,
        metavar="N",
        help="simulate seeds SEED to SEED+N-1 and show each figure's mean and range over them "
        "(one seed's draws move a figure by several percent)",
    )
    p.add_argument(
        "--conform",
        action="store_true",
        help="check every action the pipeline takes against the model `groupflow check` "
        "explores, and the live state against the model's after each (exit status 1 on the "
        "first disagreement, printed with both states)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        type=writable_file,
        default=None,
        help="write the run's actions here, for `groupflow replay FILE.jsonl` (one --design; "
        "a file that holds a trace already is refused)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        default=None,
        help="fit a scenario to the trace a run wrote (groupflow train's run folder, or any "
        "trace.jsonl), write it as TOML (--write), and report how well its simulation "
        "reproduces the run; with --design, also simulate those designs of it",
    )
    p.add_argument(
        "--write",
        metavar="FILE.toml",
        type=writable_file,
        default=None,
        help="where --from-run writes the fitted scenario (default RUN_DIR/fitted-scenario.toml)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        type=image_file,
        default=None,
        help="write the timelines here",
    )


COMMAND = Command(
    name="sim",
    help="simulate a scenario: pump vs the inline baseline, under virtual time",
    description="Run a scenario through the real pipeline (controller, supervisor, buffer, "
    "pumps) under virtual time with simulated generation, teacher and training, and report "
    "per design: seconds per step, teacher calls, rows per call, teacher time, waiting, "
    "permit-seconds held by scoring, generation concurrency, discards, and the trace hash. "
    f"Shipped scenarios: {', '.join(shipped_scenarios())}.",
    arguments=_arguments,
    run=run,
)
