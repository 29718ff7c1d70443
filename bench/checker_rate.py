"""States per second of `groupflow check` on the README's bounds, one run at a time.

Run: `python bench/checker_rate.py` (a minute or two on two cores). Prints, per bounds, the
states, transitions and seconds of a full exploration and the rate, so a change to the model
or the explorer can be judged by running it before and after.
"""

from __future__ import annotations

import argparse
import time

from groupflow.model.bounds import Bounds
from groupflow.model.explorer import explore

BOUNDS = {
    "defaults (--prompts 4, one teacher)": {},
    "--demand (the shipped dispatch)": dict(demand=True),
    "--prompts 6 --teachers 2 --crashes 1": dict(prompts=6, teachers=2, crashes=1),
    "--prompts 8 --teachers 2 --crashes 1": dict(prompts=8, teachers=2, crashes=1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two bounds only")
    args = parser.parse_args()
    rows = list(BOUNDS.items())[: 2 if args.quick else None]
    print(f"{'bounds':<40} {'states':>10} {'transitions':>12} {'seconds':>8} {'states/s':>9}")
    for label, extra in rows:
        start = time.perf_counter()
        report = explore(Bounds(**extra))  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        print(
            f"{label:<40} {report.states:>10,} {report.transitions:>12,} {seconds:>8.2f} "
            f"{report.states / seconds:>9,.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
