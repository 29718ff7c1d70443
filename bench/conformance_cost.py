"""What the conformance check costs: every shipped scenario run with and without it, side by
side, under virtual time (`groupflow.sim.verify.conformance`).

Run: `python bench/conformance_cost.py` (about a minute). For each scenario and the pump with
demand dispatch (`--design` to choose another) it prints the wall seconds of the simulated run
without and with the check, the overhead, the actions checked, and the checking rate.
"""

from __future__ import annotations

import argparse
import statistics

from groupflow.sim.run import INLINE, PUMP_DEMAND, PUMP_TIMER, conform_steps, runs, simulate
from groupflow.sim.scenario import load_scenario, shipped_scenarios

VARIANTS = {"inline": INLINE, "timer": PUMP_TIMER, "demand": PUMP_DEMAND}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--design", choices=sorted(VARIANTS), default="demand")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; medians shown")
    args = parser.parse_args()
    variant = VARIANTS[args.design]
    print(
        f"{'scenario':<24} {'plain s':>8} {'checked s':>10} {'overhead':>9} {'actions':>8} "
        f"{'actions/s':>10}"
    )
    total_actions = 0
    total_check_s = 0.0
    for name in shipped_scenarios():
        scenario = load_scenario(name)
        if not runs(scenario, variant):
            continue  # the inline baseline has no second stage
        steps = conform_steps(scenario)  # the model's check grows with the prompts
        plain = [simulate(scenario, variant, steps=steps).wall_s for _ in range(args.repeats)]
        checked = [
            simulate(scenario, variant, steps=steps, conform=True) for _ in range(args.repeats)
        ]
        summary = checked[0].conformance
        assert summary is not None and summary.ok, summary
        plain_s = statistics.median(plain)
        checked_s = statistics.median(r.wall_s for r in checked)
        check_s = statistics.median(r.conformance.seconds for r in checked if r.conformance)
        total_actions += summary.actions
        total_check_s += check_s
        print(
            f"{name:<24} {plain_s:>8.3f} {checked_s:>10.3f} {checked_s / plain_s:>8.2f}x "
            f"{summary.actions:>8,} {summary.actions / check_s:>10,.0f}",
            flush=True,
        )
    print(f"all: {total_actions:,} actions checked at {total_actions / total_check_s:,.0f}/s")


if __name__ == "__main__":
    main()
