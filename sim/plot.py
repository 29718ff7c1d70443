"""The timeline picture: one lane per generation slot, per teacher (and the verifier), for the
weight sync and for the trainer, one panel per design, with each engine's load (sequences
generating on it) drawn under it, so the pipelining shows rather than being read off a table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from groupflow.impl.testing import Span
from groupflow.model.errors import Unavailable
from groupflow.sim.run import SimResult

_COLORS = {"generate": "#7aa6c2", "score": "#e3a33b", "train": "#6bb36b", "sync": "#9467bd"}


def _slots(spans: Sequence[Span]) -> list[int]:
    """Greedy lanes for the rollouts: each goes to the first slot free at its start."""
    free_at: list[float] = []
    lanes = []
    for span in spans:
        for i, t in enumerate(free_at):
            if t <= span.start:
                free_at[i] = span.end
                lanes.append(i)
                break
        else:
            free_at.append(span.end)
            lanes.append(len(free_at) - 1)
    return lanes


def plot_timelines(
    results: Sequence[SimResult], path: Path, *, until_s: float | None = None
) -> Path:
    """Write the timelines of `results`, one above the other, to `path` (PNG, SVG, PDF)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise Unavailable("--plot needs matplotlib: pip install 'groupflow[plot]'") from exc
    horizon = until_s or min(r.virtual_s for r in results)
    fig, grid = plt.subplots(
        2 * len(results),
        1,
        figsize=(14, 2.2 + 0.28 * 20 * len(results) / 2 + 1.0 * len(results)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [4, 1] * len(results)},
    )
    for index, result in enumerate(results):
        ax, load_ax = grid[2 * index, 0], grid[2 * index + 1, 0]
        _plot_load(load_ax, result, horizon)
        spans = sorted(
            (s for s in result.spans if s.start < horizon), key=lambda s: (s.start, s.end)
        )
        rollouts = [s for s in spans if s.kind == "generate"]
        lanes: list[tuple[str, list[tuple[Span, str]]]] = []
        for index, slot in enumerate(_slots(rollouts)):
            while len(lanes) <= slot:
                lanes.append((f"gen {len(lanes)}", []))
            lanes[slot][1].append((rollouts[index], _COLORS["generate"]))
        for teacher in sorted({s.lane for s in spans if s.kind == "score"}):
            lanes.append(
                (
                    teacher,
                    [
                        (s, _COLORS["score"])
                        for s in spans
                        if s.kind == "score" and s.lane == teacher
                    ],
                )
            )
        syncs = [(s, _COLORS["sync"]) for s in spans if s.kind == "sync"]
        if syncs:
            lanes.append(("weight sync", syncs))
        lanes.append(("trainer", [(s, _COLORS["train"]) for s in spans if s.kind == "train"]))
        for y, (_, items) in enumerate(lanes):
            for span, color in items:
                ax.broken_barh(
                    [(span.start, max(span.end - span.start, 0.02))],
                    (y - 0.4, 0.8),
                    facecolors=color if span.ok else "#c44e52",
                    edgecolors="white",
                    linewidth=0.5,
                )
        ax.set_yticks(range(len(lanes)), [name for name, _ in lanes], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, horizon)
        ax.set_title(
            f"{result.variant}: {result.s_per_step:.2f} s/step, {result.calls_per_step:.2f} "
            f"teacher calls/step, {result.permit_s_per_step:.1f} permit-s/step held by scoring",
            fontsize=9,
            loc="left",
        )
    grid[-1, 0].set_xlabel(
        "virtual seconds (blue: generation, orange: teacher and verifier calls, purple: weight "
        "sync, green: train steps, red: failed; under each panel: sequences on each engine)"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_load(ax: object, result: SimResult, horizon: float) -> None:
    """Each engine's sequences over time, as steps."""
    per_engine: dict[int, tuple[list[float], list[int]]] = {}
    for time, engine, sequences in result.engine_load:
        if time > horizon:
            break
        times, values = per_engine.setdefault(engine, ([0.0], [0]))
        times.append(time)
        values.append(sequences)
    for engine, (times, values) in sorted(per_engine.items()):
        times.append(horizon)
        values.append(values[-1])
        ax.step(times, values, where="post", linewidth=0.8, label=f"engine {engine}")  # type: ignore[attr-defined]
    ax.set_ylabel("sequences", fontsize=7)  # type: ignore[attr-defined]
    if len(per_engine) > 1:
        ax.legend(fontsize=6, loc="upper right", ncol=min(len(per_engine), 8))  # type: ignore[attr-defined]
