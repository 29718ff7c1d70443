"""States per second of `groupflow check` on the README's bounds, with and without its
reductions, side by side in one run.

Run: `python bench/checker_rate.py` (a few minutes on two cores). For each bounds it explores
the full state space (`reduce=False`) and the reduced one (canonical states and persistent
sets, the default), and prints the states each visits, the seconds, and two rates: states
visited per second, and states of the full space covered per second (full states divided by
the reduced search's seconds: the rate at which the reduced search settles the same
question). `--against REV` also runs the explorer of an older commit (its `model/` from git)
on the same bounds, so "before" and "after" are measured in one run on one machine. Every
search runs in a fresh process, as `groupflow check` runs it, and the first two bounds take
the best of `--repeat` such processes. `--compiled` also runs this tree's model compiled by
mypyc, as `groupflow check --compiled` runs it (built first, about a minute). `--sweep` runs the whole soundness sweep (`groupflow.properties.reduction_sweep`)
and prints how the two searches' verdicts and first traces compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

BOUNDS: dict[str, dict[str, int | bool]] = {
    "defaults (--prompts 4, one teacher)": {},
    "--demand (the shipped dispatch)": dict(demand=True),
    "--prompts 6 --crashes 1 --batch-failures 1": dict(prompts=6, crashes=1, batch_failures=1),
    "--prompts 6 --teachers 2 --crashes 1": dict(prompts=6, teachers=2, crashes=1),
    "--prompts 8 --teachers 2 --crashes 1": dict(prompts=8, teachers=2, crashes=1),
}

_RUN = """
import json, sys, time
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.explorer import explore
bounds = Bounds(**json.loads(sys.argv[2]))
start = time.perf_counter()
report = explore(bounds, reduce=sys.argv[3] == "reduced")
print(json.dumps([report.states, time.perf_counter() - start]))
"""


def _old_model(rev: str, into: Path) -> Path:
    """`model/` of commit `rev`, unpacked as `groupflow.model` under `into`."""
    data = subprocess.run(
        ["git", "archive", rev, "model"],
        check=True,
        capture_output=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout
    target = into / "groupflow"
    target.mkdir()
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(target, filter="data")
    return into


def _timed(
    root: Path | None, extra: dict[str, int | bool], *, reduce: bool, repeat: int
) -> tuple[int, float]:
    """States visited and the best of `repeat` wall times (the others are the machine's
    noise: two cores, shared). Each search runs in a process of its own, as `groupflow check`
    runs it, so that no cache one search fills speeds up the next; `root` holds the
    `groupflow` to import (None: this one)."""
    best = float("inf")
    states = 0
    for _ in range(repeat):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                _RUN,
                "" if root is None else str(root),
                json.dumps(extra),
                "reduced" if reduce else "full",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        states, seconds = json.loads(out)
        best = min(best, float(seconds))
    return int(states), best


def _repeated(label: str) -> bool:
    """The first two bounds take a second: repeat those; the others take minutes."""
    return label in list(BOUNDS)[:2]


def _rates(args: argparse.Namespace) -> None:
    rows = list(BOUNDS.items())[: 2 if args.quick else None]
    with tempfile.TemporaryDirectory() as tmp:
        old = _old_model(args.against, Path(tmp)) if args.against else None
        built = _compiled_model(Path(tmp) / "cache") if args.compiled else None
        head = f"{'bounds':<38} {'full: states':>12} {'s':>6} {'states/s':>8} | "
        head += f"{'reduced: states':>15} {'s':>6} {'visited/s':>9} {'covered/s':>9} {'x':>5}"
        if old is not None:
            head += f" | {args.against[:10]}: {'states':>8} {'s':>6} {'states/s':>8}"
        if built is not None:
            head += f" | {'compiled: states':>16} {'s':>6} {'visited/s':>9}"
        print(head)
        for label, extra in rows:
            repeat = args.repeat if _repeated(label) else 1
            full, full_s = _timed(None, extra, reduce=False, repeat=repeat)
            visited, reduced_s = _timed(None, extra, reduce=True, repeat=repeat)
            line = (
                f"{label:<38} {full:>12,} {full_s:>6.2f} {full / full_s:>8,.0f} | "
                f"{visited:>15,} {reduced_s:>6.2f} {visited / reduced_s:>9,.0f} "
                f"{full / reduced_s:>9,.0f} {full_s / reduced_s:>5.1f}"
            )
            if old is not None:
                old_states, old_s = _timed(old, extra, reduce=True, repeat=repeat)
                line += f" | {'':>10}  {old_states:>8,} {old_s:>6.2f} {old_states / old_s:>8,.0f}"
            if built is not None:
                fast_states, fast_s = _timed(built, extra, reduce=True, repeat=repeat)
                line += f" | {fast_states:>16,} {fast_s:>6.2f} {fast_states / fast_s:>9,.0f}"
            print(line, flush=True)


def _compiled_model(cache: Path) -> Path:
    """This tree's model compiled by mypyc, as `groupflow check --compiled` builds it."""
    from groupflow.cli._compiled import compiled_model

    return compiled_model(cache, say=lambda text: print(text, file=sys.stderr, flush=True))


def _sweep() -> None:
    from groupflow.model.scheduler.explorer import compare_reduction
    from groupflow.properties.reduction_sweep import sweep_bounds

    results = []
    for bounds in sweep_bounds(quick=False):
        r = compare_reduction(bounds)
        results.append(r)
        kinds = ",".join(sorted({f.kind for f in r.full.findings})) or "ok"
        verdict = "agree" if not r.problems else "DISAGREE " + "; ".join(r.problems)
        print(
            f"{len(results):>4} {r.full.states:>9,} -> {r.reduced.states:>8,} {kinds:<24} "
            f"{verdict}",
            flush=True,
        )
    with_findings = [r for r in results if r.full.findings]
    longer = sum(
        len(f.trace) > len(g.trace)
        for r in with_findings
        for f in r.reduced.findings
        for g in r.full.findings
        if f.kind == g.kind
    )
    full = sum(r.full.states for r in results)
    reduced = sum(r.reduced.states for r in results)
    print(
        f"sweep: {len(results)} bounds, {sum(not r.problems for r in results)} agree; "
        f"{len(with_findings)} with violations, in which {longer} first traces are longer "
        f"reduced than full; states visited {full:,} full, {reduced:,} reduced "
        f"({full / reduced:.1f}x fewer)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two bounds only")
    parser.add_argument("--against", metavar="REV", help="also run model/ of this git commit")
    parser.add_argument("--sweep", action="store_true", help="run the whole soundness sweep")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also run this tree's model compiled by mypyc (`groupflow check --compiled`)",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="best of N runs for the small bounds (default 3)"
    )
    args = parser.parse_args()
    if args.sweep:
        _sweep()
    else:
        _rates(args)


if __name__ == "__main__":
    main()
