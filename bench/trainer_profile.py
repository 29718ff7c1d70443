"""Where a `groupflow train` run spends its time: groupflow's core (buffer, ledger, pumps,
supervisor, stage, observer and trace, the lifecycle model) against everything else (model
compute, torch, trio), from a profile of the trio thread.

Run: `python bench/trainer_profile.py [--steps N]` (a minute or two on two cores). It trains
the embedded default for N steps (teachers from the cache, trained first if absent) under
cProfile, sums the time spent in functions of `groupflow.impl.core`, `groupflow.impl.pipeline`
and `groupflow.model` (their own time, not what they call), and prints it beside the run's
wall time. Sampling and scoring run in worker threads, which the profile does not see; they
are model compute, so the share printed is an upper bound on the core's share of the whole.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import trio

from groupflow.impl.trainer import TrainConfig, provide_teachers, train

CORE = ("/impl/core/", "/impl/pipeline/", "/model/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=12, help="list this many core functions")
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps)
    teachers = provide_teachers(config, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        trio.run(
            lambda: train(config, Path(tmp) / "run", teachers=teachers, device="cpu", progress=None)
        )
        profile.disable()
        wall = time.perf_counter() - began
    stats = pstats.Stats(profile)
    core = total = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        if any(part in filename.replace("\\", "/") for part in CORE):
            core += tottime
    rows = sorted(
        (
            (tottime, f"{Path(filename).parent.name}/{Path(filename).name}:{line}({function})")
            for (filename, line, function), (_, _, tottime, _, _) in stats.stats.items()  # type: ignore[attr-defined]
            if any(part in filename.replace("\\", "/") for part in CORE)
        ),
        reverse=True,
    )
    print("the core's costliest functions (own time):")
    for tottime, where in rows[: args.top]:
        print(f"  {tottime:7.3f} s  {where}")
    print(f"steps: {args.steps}, wall {wall:.1f} s, {args.steps / wall:.2f} steps/s")
    print(f"trio thread, profiled: {total:.2f} s; of it in groupflow's core: {core:.3f} s")
    print(
        f"core share: {100 * core / total:.2f}% of the profiled thread, "
        f"{100 * core / wall:.2f}% of wall time"
    )


if __name__ == "__main__":
    main()
