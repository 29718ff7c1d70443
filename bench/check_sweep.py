"""Sweep `groupflow check` over a grid of small bounds and tally which settle without violation.

This is the evidence behind the README's statements on flush timers and demand dispatch: for
each design and dispatch setting it counts the configurations with a violation, and how many of
those the stated conditions explain (capacity below a step; for `coalesce` without a timer,
permits all held by waiting groups: inflight <= teachers * (max_batch - 1)).
Run: `python bench/check_sweep.py` (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import itertools
import time

from groupflow.model.explorer import explore
from groupflow.model.scheduler import Bounds, Design

SETTINGS = {
    "timer": dict(flush_timer=True, demand=False),
    "no timer": dict(flush_timer=False, demand=False),
    "demand, no timer": dict(flush_timer=False, demand=True),
}


def _grid(quick: bool) -> list[dict[str, int]]:
    out = []
    for t, b, p, g, c, extra in itertools.product(
        [1, 2, 3], [2, 3], [1, 2, 3], [0, 1, 2], [1, 2, 3, 4, 6], [1, 2]
    ):
        if quick and (t == 3 or b == 3):
            continue
        out.append(
            dict(
                teachers=t,
                max_batch=b,
                per_step=p,
                gate_window=g,
                capacity=c,
                inflight=b + extra,
                prompts=min(p * (g + 3), 9),
            )
        )
    return out


def _explained(cfg: dict[str, int], design: Design, setting: str) -> bool:
    if cfg["capacity"] < cfg["per_step"]:
        return True
    if setting == "no timer" and design is Design.COALESCE:
        return cfg["inflight"] <= cfg["teachers"] * (cfg["max_batch"] - 1)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one or two teachers, batches of two")
    args = parser.parse_args()
    grid = _grid(args.quick)
    print(f"{len(grid)} configurations per row; no checkpoints, crashes or interrupts")
    print(
        f"{'design':<9} {'dispatch':<17} {'violating':>9} {'capacity<step':>13} "
        f"{'permits held':>12} {'other':>6} {'states':>10} {'seconds':>8}"
    )
    for design, (setting, flags) in itertools.product(Design, SETTINGS.items()):
        counts = {"violating": 0, "capacity": 0, "permits": 0, "other": 0}
        states = 0
        start = time.perf_counter()
        for cfg in grid:
            bounds = Bounds(**cfg, design=design, checkpoints=0, interrupts=False, **flags)
            report = explore(bounds)
            states += report.states
            if report.ok:
                continue
            counts["violating"] += 1
            if cfg["capacity"] < cfg["per_step"]:
                counts["capacity"] += 1
            elif _explained(cfg, design, setting):
                counts["permits"] += 1
            else:
                counts["other"] += 1
        print(
            f"{design.value:<9} {setting:<17} {counts['violating']:>9} {counts['capacity']:>13} "
            f"{counts['permits']:>12} {counts['other']:>6} {states:>10,} "
            f"{time.perf_counter() - start:>8.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
