"""Sweep `groupflow check` over a grid of small bounds and tally which settle without violation.

This is the evidence behind the README's statements on flush timers and demand dispatch: for
each design and dispatch setting it counts the configurations with a violation, how many of
those the config's own conditions (`decisions.config_problems`, the function `PipelineConfig`
calls) predict, and how many configurations the conditions refuse that the checker finds safe
(both must be zero where the conditions are exact). For `coalesce` without a timer it also
counts those where waiting groups can hold every permit: inflight <= teachers * (max_batch - 1).
Run: `python bench/check_sweep.py` (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

from groupflow.model.policy import Design
from groupflow.model.scheduler.bounds import Bounds
from groupflow.model.scheduler.explorer import explore
from groupflow.model.shape import Shape, split_shape

SETTINGS: dict[str, dict[str, Any]] = {
    "timer": dict(flush_timer=True, demand=False),
    "demand + timer": dict(flush_timer=True, demand=True),
    "no timer": dict(flush_timer=False, demand=False),
    "demand, no timer": dict(flush_timer=False, demand=True),
}
"""The first two are what `PipelineConfig` offers (demand + timer is its default); the last
two exist only in the checker, to show what the timer is for."""


def _grid(quick: bool) -> list[dict[str, Any]]:
    out = []
    for t, b, p, g, c, extra in itertools.product(
        [1, 2, 3], [2, 3], [1, 2, 3], [0, 1, 2], [1, 2, 3, 4, 6], [-1, 0, 1, 2]
    ):
        if quick and (t == 3 or b == 3):
            continue
        out.append(
            dict(
                teachers=t,
                max_batch_groups=b,
                prompts_per_step=p,
                gate_window=g,
                max_buffered_groups=c,
                max_inflight_prompts=b + extra,
                prompts=min(p * (g + 3), 9),
            )
        )
    return out


def _explained(cfg: dict[str, int], design: Design, setting: str) -> bool:
    if cfg["max_buffered_groups"] < cfg["prompts_per_step"]:
        return True
    if setting == "no timer" and design is Design.COALESCE:
        return cfg["max_inflight_prompts"] <= cfg["teachers"] * (cfg["max_batch_groups"] - 1)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one or two teachers, batches of two")
    args = parser.parse_args()
    grid = _grid(args.quick)
    print(f"{len(grid)} configurations per row; no checkpoints, crashes or interrupts")
    print(
        f"{'design':<9} {'dispatch':<17} {'violating':>9} {'predicted':>9} "
        f"{'capacity<step':>13} {'permits held':>12} {'unpredicted':>11} {'over-refused':>12} "
        f"{'states':>10} {'seconds':>8}"
    )
    for design, (setting, flags) in itertools.product(Design, SETTINGS.items()):
        counts = {
            "violating": 0,
            "predicted": 0,
            "capacity": 0,
            "permits": 0,
            "over": 0,
        }
        states = 0
        start = time.perf_counter()
        for cfg in grid:
            shape, rest = split_shape(cfg, Shape())
            bounds = Bounds(
                shape=shape, **rest, design=design, checkpoints=0, interrupts=False, **flags
            )
            report = explore(bounds)
            states += report.states
            predicted = bool(bounds.problems())
            if report.ok:
                counts["over"] += predicted
                continue
            counts["violating"] += 1
            counts["predicted"] += predicted
            if cfg["max_buffered_groups"] < cfg["prompts_per_step"]:
                counts["capacity"] += 1
            elif _explained(cfg, design, setting):
                counts["permits"] += 1
        print(
            f"{design.value:<9} {setting:<17} {counts['violating']:>9} "
            f"{counts['predicted']:>9} {counts['capacity']:>13} {counts['permits']:>12} "
            f"{counts['violating'] - counts['predicted']:>11} {counts['over']:>12} "
            f"{states:>10,} {time.perf_counter() - start:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
