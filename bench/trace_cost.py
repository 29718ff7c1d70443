"""What the trace costs: every shipped scenario run with the trace off and on, side by side,
under virtual time (`build_pipeline(trace=...)`), and how fast `groupflow replay` reads it.

Run: `python bench/trace_cost.py` (under a minute). For each scenario and the pump with demand
dispatch (`--design` to choose another) it prints the wall seconds of the simulated run with
the trace off and on (medians of `--repeats`, interleaved), the overhead, the lines and bytes
written, the time spent inside `TraceWriter.record` per line and the longest one (how long one
line holds trio's thread), and the rate at which the replay judges the trace.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from groupflow.impl import TraceWriter
from groupflow.sim.run import INLINE, PUMP_DEMAND, PUMP_TIMER, conform_steps, runs, simulate
from groupflow.sim.scenario import load_scenario, shipped_scenarios
from groupflow.sim.verify.replay import replay

VARIANTS = {"inline": INLINE, "timer": PUMP_TIMER, "demand": PUMP_DEMAND}


def _time_records(run: Callable[[], object]) -> tuple[float, float, int]:
    """Seconds inside `TraceWriter.record` (building and writing an action's line), summed and
    the longest, and the lines recorded, for one traced run (timed in a run of its own, so the
    timing does not weigh on the side-by-side figures)."""
    original = TraceWriter.record
    spent: list[float] = []

    def timed(self: TraceWriter, action: Any, **kw: Any) -> None:
        started = time.perf_counter()
        original(self, action, **kw)
        spent.append(time.perf_counter() - started)

    TraceWriter.record = timed  # type: ignore[method-assign]
    try:
        run()
    finally:
        TraceWriter.record = original  # type: ignore[method-assign]
    return sum(spent), max(spent), len(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--design", choices=sorted(VARIANTS), default="demand")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each; medians shown")
    args = parser.parse_args()
    variant = VARIANTS[args.design]
    print(
        f"{'scenario':<24} {'off s':>7} {'on s':>7} {'overhead':>9} {'lines':>6} "
        f"{'KiB':>6} {'us/line':>8} {'max us':>7} {'replay lines/s':>15}"
    )
    total_lines = total_recorded = 0
    total_inside = 0.0
    total_extra = 0.0
    total_off = 0.0
    with tempfile.TemporaryDirectory(prefix="groupflow-trace-cost-") as tmp:
        for name in shipped_scenarios():
            scenario = load_scenario(name)
            if not runs(scenario, variant):
                continue  # the inline baseline has no second stage
            steps = conform_steps(scenario)  # the model's check grows with the prompts
            off, on = [], []
            path = Path(tmp) / f"{name}.jsonl"
            for _ in range(args.repeats):  # interleaved, so drift in the machine hits both
                off.append(simulate(scenario, variant, steps=steps).wall_s)
                path.unlink(missing_ok=True)
                on.append(simulate(scenario, variant, steps=steps, trace=path).wall_s)
            off_s, on_s = statistics.median(off), statistics.median(on)
            lines = len(path.read_text().splitlines())
            size = path.stat().st_size
            started = time.perf_counter()
            result = replay(path)
            replay_s = time.perf_counter() - started
            assert result.ok, result.verdict_line()
            probe = Path(tmp) / f"{name}-probe.jsonl"
            inside, longest, recorded = _time_records(
                functools.partial(simulate, scenario, variant, trace=probe)
            )
            total_inside += inside
            total_recorded += recorded
            total_lines += lines
            total_extra += on_s - off_s
            total_off += off_s
            print(
                f"{name:<24} {off_s:>7.3f} {on_s:>7.3f} {on_s / off_s:>8.2f}x {lines:>6,} "
                f"{size / 1024:>6.0f} {inside / recorded * 1e6:>8.1f} "
                f"{longest * 1e6:>7.0f} {lines / replay_s:>15,.0f}",
                flush=True,
            )
    print(
        f"all: {total_lines:,} lines, {total_inside / total_recorded * 1e6:.1f} us inside "
        f"record() a line; traced runs took {(total_off + total_extra) / total_off:.2f}x the "
        f"untraced wall time (medians)"
    )


if __name__ == "__main__":
    main()
