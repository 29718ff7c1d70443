"""What a user sees of a run: the progress bar, and at the end the summary (`summary.txt`) and
the learning curves (`curves.png`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger("groupflow.trainer")


@attrs.frozen
class TrainSummary:
    out: Path
    steps: int
    """Steps trained, in total, across resumes."""
    stopped_early: bool
    wall_s: float
    steps_per_s: float
    accuracy_before: Mapping[str, float]
    """Greedy accuracy on held-out prompts, per domain, before this run's first step."""
    accuracy_after: Mapping[str, float] | None
    """The same after the run; None when Ctrl-C cut the evaluation short (the run's steps are
    trained and saved: `groupflow train` exits 130 saying so)."""
    kl_first: float
    """Mean teacher-student KL over the first steps logged (of the whole run, resumes
    included), and over the last."""
    kl_last: float
    refit_ms: float
    """Mean time of a weight sync (generator refit), ms."""
    curves: Path | None
    metrics: Path


ProgressFactory = Callable[[int, int], Any]
"""(total steps, steps done) -> a tqdm-like bar with `update`, `set_postfix_str`, `close`."""


def progress_bar(total: int, done: int) -> Any:
    """The terminal's progress bar (tqdm): steps, the step rate, KL and accuracy."""
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="train", unit="step", dynamic_ncols=True)


def kl_series(path: Path) -> list[float]:
    """The KL of each trained step in `metrics.jsonl`, in order."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "kl" in record:
            out.append(float(record["kl"]))
    return out


def plot_curves(metrics: Path, target: Path) -> Path | None:
    """The learning curves (KL, loss, each domain's accuracy on the rollouts) as a PNG; None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no matplotlib: no curves.png (pip install 'groupflow[train]')")
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "kl" in r]
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r["kl"] for r in records])
    axes[0].set_title("teacher-student KL (sampled tokens)")
    axes[1].plot(steps, [r["loss"] for r in records])
    axes[1].set_title("loss")
    names = sorted({k for r in records for k in r if k.startswith("accuracy/")})
    for name in names:
        axes[2].plot(steps, [r.get(name, float("nan")) for r in records], label=name.split("/")[1])
    axes[2].set_title("rollouts correct, per domain")
    axes[2].set_ylim(-0.02, 1.02)
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def format_summary(summary: TrainSummary) -> str:
    lines = [
        f"run: {summary.out}",
        f"steps: {summary.steps}{' (stopped early)' if summary.stopped_early else ''}, "
        f"{summary.wall_s:.1f} s, {summary.steps_per_s:.2f} steps/s, refit {summary.refit_ms:.2f} ms",
        f"teacher-student KL: {summary.kl_first:.3f} (first steps) -> {summary.kl_last:.3f} (last)",
        "",
        f"{'domain':<10} {'greedy accuracy before':>23} {'after':>7}",
    ]
    after = summary.accuracy_after
    for name in summary.accuracy_before if after is None else after:
        lines.append(
            f"{name:<10} {summary.accuracy_before.get(name, float('nan')):>23.2f} "
            + ("      -" if after is None else f"{after[name]:>7.2f}")
        )
    if after is None:
        lines.append("(interrupted: no evaluation after the run, no curves)")
    lines.append("")
    lines.append(f"metrics: {summary.metrics}")
    if summary.curves is not None:
        lines.append(f"curves:  {summary.curves}")
    return "\n".join(lines) + "\n"
