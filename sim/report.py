"""Simulation results as a table a person reads, ratios against the inline baseline, or JSON."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from groupflow.sim.run import SimResult

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("s/step", "s_per_step", "{:.2f}"),
    ("calls/step", "calls_per_step", "{:.2f}"),
    ("rows/call", "rows_per_call", "{:.1f}"),
    ("teacher s/step", "teacher_s_per_step", "{:.2f}"),
    ("wait s/group", "wait_per_group_s", "{:.2f}"),
    ("permit-s/step", "permit_s_per_step", "{:.2f}"),
    ("generating", "generation_concurrency", "{:.1f}"),
    ("sync s/step", "sync_s_per_step", "{:.2f}"),
    ("discarded", "discarded", "{}"),
    ("given up", "shortfall", "{}"),
)
"""What the table shows: the simulation's own figures, the same for the same input byte for
byte; how fast the simulator ran is `speed`'s, apart."""
_RATIOS = ("s_per_step", "calls_per_step", "teacher_s_per_step", "permit_s_per_step")


def table(results: Sequence[SimResult]) -> str:
    """One row per variant, plus the ratios of each pump variant to inline when both ran."""
    if not results:
        return ""
    first = results[0]
    lines = [
        f"scenario {first.scenario}, seed {first.seed}, {first.steps} train steps, "
        f"max_inflight_prompts {first.max_inflight} (virtual time)"
    ]
    header = [f"{'design':<14}"] + [f"{name:>14}" for name, _, _ in _COLUMNS] + ["  trace"]
    lines.append(" ".join(header))
    for r in results:
        cells = [f"{r.variant:<14}"]
        cells += [f"{fmt.format(getattr(r, attr)):>14}" for _, attr, fmt in _COLUMNS]
        cells.append(f"  {r.trace_hash}")
        lines.append(" ".join(cells))
        lines += [f"{'':<14} ! {problem}" for problem in _problems(r)]
        if r.crashed:
            how = _RESUMED_FROM[r.resumed_from_checkpoint]
            lines.append(f"{'':<14} crashed at the scenario's crash time; resumed from {how}")
        c = r.conformance
        if c is not None:
            if c.ok:
                lines.append(f"{'':<14} conforms to the model: {c.actions:,} actions checked")
            else:
                lines.append(f"{'':<14} ! does not conform to the model:")
                lines.extend(f"{'':<16}{line}" for line in (c.failure or "").splitlines())
    lines += _ratios([(r.variant, _figures(r)) for r in results])
    return "\n".join(lines) + "\n"


def seeds_table(runs: Sequence[Sequence[SimResult]]) -> str:
    """As `table`, for each variant simulated on several seeds (`runs`: one sequence of
    results per variant, the seeds in order): each figure's mean over the seeds, and beneath
    it their range (over the seeds where it is a number). One seed's draws of the scenario's
    spreads move a figure by several percent, so one seed does not establish a difference
    between designs smaller than that range. The ratios are of the means."""
    if not runs or not runs[0]:
        return ""
    first = runs[0][0]
    seeds = [r.seed for r in runs[0]]
    steps = max(r.steps for results in runs for r in results)
    lines = [
        f"scenario {first.scenario}, seeds {seeds[0]} to {seeds[-1]}, {steps} train "
        f"steps, max_inflight_prompts {first.max_inflight} (virtual time): the mean over the "
        f"seeds, and beneath it their range"
    ]
    lines.append(" ".join([f"{'design':<14}"] + [f"{name:>14}" for name, _, _ in _COLUMNS]))
    means = []
    for results in runs:
        figures = [_figures(r) for r in results]
        mean = {attr: statistics.fmean(f[attr] for f in figures) for attr in figures[0]}
        means.append((results[0].variant, mean))
        cells, spans = [f"{results[0].variant:<14}"], [f"{'  range':<14}"]
        for _, attr, fmt in _COLUMNS:
            numbers = [f[attr] for f in figures if math.isfinite(f[attr])]
            ends = "{:.0f}" if fmt == "{}" else fmt  # a count's range in whole numbers
            span = f"{ends.format(min(numbers))}-{ends.format(max(numbers))}" if numbers else "-"
            cells.append(f"{_MEAN_FORMATS.get(fmt, fmt).format(mean[attr]):>14}")
            spans.append(f"{span:>14}")
        lines += [" ".join(cells), " ".join(spans)]
        most = max(r.steps for r in results)
        for r in results:
            problems = _problems(r)
            if r.steps != most:
                problems.append(f"trained {r.steps} steps")
            if r.conformance is not None and not r.conformance.ok:
                problems.append(
                    f"does not conform to the model (`--seed {r.seed} --conform` alone shows where)"
                )
            lines += [f"{'':<14} ! seed {r.seed}: {problem}" for problem in problems]
        for resumed, how in _RESUMED_FROM.items():
            crashed = [
                str(r.seed) for r in results if r.crashed and r.resumed_from_checkpoint is resumed
            ]
            if crashed:
                lines.append(
                    f"{'':<14} crashed at the scenario's crash time; resumed from {how} "
                    f"(seeds {', '.join(crashed)})"
                )
        checked = [r.conformance for r in results if r.conformance is not None]
        if checked and all(c.ok for c in checked):
            actions = sum(c.actions for c in checked)
            lines.append(
                f"{'':<14} conforms to the model on every seed: {actions:,} actions checked"
            )
    lines += _ratios(means)
    return "\n".join(lines) + "\n"


_RESUMED_FROM = {True: "its last checkpoint", False: "scratch (no checkpoint yet)"}
"""Where a simulation that crashed resumed, by `SimResult.resumed_from_checkpoint`."""
_MEAN_FORMATS = {"{}": "{:.1f}"}
"""A count's format in `table` -> its mean's in `seeds_table`."""


def _figures(r: SimResult) -> dict[str, float]:
    return {attr: float(getattr(r, attr)) for _, attr, _ in _COLUMNS}


def _problems(r: SimResult) -> list[str]:
    """What went wrong in a simulation, one line each (empty: nothing)."""
    out = [] if r.outcome == "ok" else [r.outcome]
    if r.stalls:
        out.append(f"stalled {r.stalls} time(s): no progress for stall_timeout_s")
    if r.skipped_steps:
        out.append(
            f"{r.skipped_steps} of {r.steps} steps skipped, every prompt of each given up (the "
            f"learner was not called); the figures per step count them"
        )
    return out


def _ratios(figures: Sequence[tuple[str, dict[str, float]]]) -> list[str]:
    """Each pump variant's figures against the inline baseline's, and each variant's seconds
    per step over the bound's, where those ran."""
    lines = []
    by_variant = dict(figures)
    inline = by_variant.get("inline")
    if inline is not None:
        for variant, values in figures:
            if variant == "inline":
                continue
            parts = []
            for attr in _RATIOS:
                base, value = inline[attr], values[attr]
                parts.append(f"{attr} x{value / base:.2f}" if base else f"{attr} {value:.2f} vs 0")
            lines.append(f"{variant} / inline: " + ", ".join(parts))
    bound = by_variant.get("bound")
    if bound is not None and bound["s_per_step"]:
        for variant, values in figures:
            if variant != "bound":
                excess = values["s_per_step"] / bound["s_per_step"] - 1
                lines.append(f"{variant}: {excess:+.0%} seconds per step over the bound")
    return lines


def speed(results: Sequence[SimResult]) -> str:
    """How fast the simulator ran each variant (and checked it, under `--conform`): real time,
    which varies from run to run, so it stays out of `table`."""
    lines = []
    by_variant: dict[str, list[SimResult]] = {}
    for r in results:
        by_variant.setdefault(r.variant, []).append(r)
    for variant, runs in by_variant.items():
        if len(runs) > 1:  # seeds (`seeds_table`)
            wall = sum(r.wall_s for r in runs)
            steps = sum(r.steps for r in runs)
            line = (
                f"{variant}: {len(runs)} seeds, {steps} steps simulated in {wall:.2f} s "
                f"({steps / wall if wall > 0 else float('inf'):.0f} steps/s)"
            )
            checked = [r.conformance for r in runs if r.conformance is not None]
            if checked:
                actions = sum(c.actions for c in checked)
                seconds = sum(c.seconds for c in checked)
                line += f"; {actions:,} actions checked in {seconds:.2f} s"
            lines.append(line)
            continue
        r = runs[0]
        line = (
            f"{r.variant}: {r.steps} steps simulated in {r.wall_s:.2f} s "
            f"({r.steps_per_wall_s:.0f} steps/s)"
        )
        if r.conformance is not None:
            c = r.conformance
            line += f"; {c.actions:,} actions checked in {c.seconds:.2f} s"
            line += f" ({c.actions_per_s:,.0f} actions/s)"
        lines.append(line)
    return "\n".join(lines) + "\n"


def json_number(value: float) -> float | None:
    """`value` to six places, or None where it is not finite (JSON has no NaN nor
    infinity): a figure per step of a run that reached no step, say."""
    return round(value, 6) if math.isfinite(value) else None


def as_json(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """Each result as a JSON object: every figure of the table, a figure that cannot be
    computed as null."""
    out = []
    for r in results:
        out.append(
            {
                "scenario": r.scenario,
                "design": r.variant,
                "seed": r.seed,
                "steps": r.steps,
                "skipped_steps": r.skipped_steps,
                "outcome": r.outcome,
                "stalls": r.stalls,
                "virtual_s": json_number(r.virtual_s),
                **{attr: json_number(float(getattr(r, attr))) for _, attr, _ in _COLUMNS},
                "wall_s": json_number(r.wall_s),
                "steps_per_wall_s": json_number(r.steps_per_wall_s),
                "max_inflight": r.max_inflight,
                "crashed": r.crashed,
                "resumed_from_checkpoint": r.resumed_from_checkpoint,
                "trace_hash": r.trace_hash,
                **(
                    {}
                    if r.conformance is None
                    else {
                        "conformance": {
                            "actions": r.conformance.actions,
                            "seconds": json_number(r.conformance.seconds),
                            "failure": r.conformance.failure,
                        }
                    }
                ),
            }
        )
    return out
