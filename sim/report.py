"""Simulation results as a table a person reads, ratios against the inline baseline, or JSON."""

from __future__ import annotations

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
        if r.outcome != "ok":
            lines.append(f"{'':<14} ! {r.outcome}")
        if r.stalls:
            lines.append(f"{'':<14} ! stalled {r.stalls} time(s): no progress for stall_timeout_s")
        if r.crashed:
            how = (
                "its last checkpoint"
                if r.resumed_from_checkpoint
                else "scratch (no checkpoint yet)"
            )
            lines.append(f"{'':<14} crashed at the scenario's crash time; resumed from {how}")
        c = r.conformance
        if c is not None:
            if c.ok:
                lines.append(f"{'':<14} conforms to the model: {c.actions:,} actions checked")
            else:
                lines.append(f"{'':<14} ! does not conform to the model:")
                lines.extend(f"{'':<16}{line}" for line in (c.failure or "").splitlines())
    inline = next((r for r in results if r.variant == "inline"), None)
    if inline is not None:
        for r in results:
            if r is inline:
                continue
            parts = []
            for attr in _RATIOS:
                base = getattr(inline, attr)
                value = getattr(r, attr)
                parts.append(f"{attr} x{value / base:.2f}" if base else f"{attr} {value:.2f} vs 0")
            lines.append(f"{r.variant} / inline: " + ", ".join(parts))
    bound = next((r for r in results if r.variant == "bound"), None)
    if bound is not None and bound.s_per_step:
        for r in results:
            if r is not bound:
                excess = r.s_per_step / bound.s_per_step - 1
                lines.append(f"{r.variant}: {excess:+.0%} seconds per step over the bound")
    return "\n".join(lines) + "\n"


def speed(results: Sequence[SimResult]) -> str:
    """How fast the simulator ran each variant (and checked it, under `--conform`): real time,
    which varies from run to run, so it stays out of `table`."""
    lines = []
    for r in results:
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


def as_json(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        out.append(
            {
                "scenario": r.scenario,
                "design": r.variant,
                "seed": r.seed,
                "steps": r.steps,
                "outcome": r.outcome,
                "stalls": r.stalls,
                "virtual_s": round(r.virtual_s, 6),
                **{attr: round(float(getattr(r, attr)), 6) for _, attr, _ in _COLUMNS},
                "wall_s": round(r.wall_s, 6),
                "steps_per_wall_s": round(r.steps_per_wall_s, 6),
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
                            "seconds": round(r.conformance.seconds, 6),
                            "failure": r.conformance.failure,
                        }
                    }
                ),
            }
        )
    return out
