"""The shipped recipe's shape through the real pipeline, pump against the inline baseline.

8 prompts per step x 4 generations, a fake teacher that takes 1 s per call whatever its size
(latency-bound, as the seed measured at 0.9-1.23 s per 4-row call), generation 3-5 s per group,
2 s per train step, all under trio's virtual clock. Prints, side by side, teacher calls per
step, rows per call, generation permit-seconds held while scoring, and seconds per step.
Run: `python bench/pipeline_recipe.py [--steps N]`.
"""

from __future__ import annotations

import argparse
import time

import trio
import trio.testing

from groupflow.impl import PipelineConfig, ScoringConfig, build_pipeline
from groupflow.impl.testing import FakeGenerator, FakeLearner, FakeScorer
from groupflow.model.shape import Shape

SETTINGS = [
    ("inflight 8, batch <= 7", 8, 7),
    ("inflight 16, batch <= 8", 16, 8),
]
DESIGNS = [("inline", "demand"), ("pump", "timer"), ("pump", "demand")]


async def _run(
    inflight: int, batch: int, design: str, dispatch: str, steps: int
) -> dict[str, float]:
    config = PipelineConfig(
        shape=Shape(
            prompts_per_step=8,
            num_generations_per_prompt=4,
            max_inflight_prompts=inflight,
            max_buffered_groups=16,
            gate_window=1,
            max_batch_groups=batch,
        ),
        scoring=ScoringConfig(flush_after_s=2.0, design=design, dispatch=dispatch),
    )
    scorer = FakeScorer(fixed=1.0)
    generator = FakeGenerator(latency=lambda o: 3.0 + (o * 7 % 5) * 0.5)
    pipeline = build_pipeline(
        config,
        prompts=list(range(8 * steps)),
        generator=generator,
        learner=FakeLearner(latency=2.0),
        scorer=scorer,
        train_fields=["input_ids"],
    )
    start = trio.current_time()
    await pipeline.run()
    elapsed = trio.current_time() - start
    return {
        "calls/step": len(scorer.calls) / steps,
        "rows/call": sum(c.rows for c in scorer.calls) / len(scorer.calls),
        "permit-s scoring/step": pipeline.rollout.permit_seconds_scoring / steps,
        "s/step": elapsed / steps,
        "most generating": generator.most_running,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    clock = trio.testing.MockClock(autojump_threshold=0)
    wall = time.perf_counter()
    for label, inflight, batch in SETTINGS:
        print(f"{label} (virtual time, {args.steps} steps)")
        print(
            f"  {'design':<16} {'calls/step':>10} {'rows/call':>9} {'permit-s/step':>13} {'s/step':>7} {'most generating':>15}"
        )
        rows = {}
        for design, dispatch in DESIGNS:
            name = design if design == "inline" else f"pump ({dispatch})"
            rows[name] = trio.run(_run, inflight, batch, design, dispatch, args.steps, clock=clock)
            r = rows[name]
            print(
                f"  {name:<16} {r['calls/step']:>10.2f} {r['rows/call']:>9.1f} {r['permit-s scoring/step']:>13.2f} {r['s/step']:>7.2f} {r['most generating']:>15}"
            )
        base = rows["inline"]
        for name in ("pump (timer)", "pump (demand)"):
            r = rows[name]
            print(
                f"  {name} / inline: calls x{r['calls/step'] / base['calls/step']:.2f}, s/step x{r['s/step'] / base['s/step']:.2f}"
            )
        print()
    print(f"wall-clock {time.perf_counter() - wall:.2f} s")


if __name__ == "__main__":
    main()
