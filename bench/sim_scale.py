"""How fast the simulator runs: simulated train steps per second of wall time, for the shipped
recipe (500 steps) and the cluster-size scenario (100 steps), side by side.

Run: `python bench/sim_scale.py [--repeats N]`. Goals (issue #15): the shipped recipe at 200
steps per wall second or more, the cluster scenario's 100 steps in under a minute. Each figure
is the median of the repeats; the machine's load average is printed with them, since a shared
machine slows every figure alike.
"""

from __future__ import annotations

import argparse
import os
import statistics

from groupflow.sim.run import PUMP_DEMAND, simulate
from groupflow.sim.scenario import load_scenario

RUNS = (("shipped-recipe", 500), ("cluster", 100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(
        f"{'scenario':<16} {'steps':>6} {'wall s':>8} {'steps/wall s':>13} {'s/step (virtual)':>17}"
    )
    for name, steps in RUNS:
        scenario = load_scenario(name)
        results = [simulate(scenario, PUMP_DEMAND, steps=steps) for _ in range(args.repeats)]
        wall = statistics.median(r.wall_s for r in results)
        print(
            f"{name:<16} {steps:>6} {wall:>8.2f} {steps / wall:>13.0f} "
            f"{results[0].s_per_step:>17.2f}"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
