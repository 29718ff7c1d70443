"""A run's record of each step: a line of `metrics.jsonl`, TensorBoard's scalars, and the
progress bar moved."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, TextIO

import attrs

from groupflow.impl._pipeline import StepRecord
from groupflow.impl._trainer._tensorboard import ScalarLog


def _numbers(prefix: str, value: object, *, sep: str = "/") -> dict[str, int | float]:
    """The numbers in `value` (an attrs instance, a mapping, a number) by name under
    `prefix` (joined by `sep`, deeper levels by a slash): how a stage's metrics become
    `metrics.jsonl` fields (`teacher_calls`, `teacher_reasons/demand`), whatever their
    shape."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int):
        return {prefix: value}
    if isinstance(value, float):
        return {prefix: round(value, 6)}
    if attrs.has(type(value)):
        value = attrs.asdict(value, recurse=False)  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        out: dict[str, int | float] = {}
        for key, item in value.items():
            out.update(_numbers(f"{prefix}{sep}{key}", item))
        return out
    return {}


@attrs.define
class MetricsLog:
    """Appends each step's record to `metrics.jsonl`, writes its scalars to TensorBoard (when
    `scalars` is set) and moves the progress bar."""

    file: TextIO
    bar: Any
    began: float
    done: int
    kls: list[float] = attrs.field(factory=list)
    syncs: list[float] = attrs.field(factory=list)
    scalars: ScalarLog | None = None
    last: float | None = None
    """When the previous step's record came (None before the first)."""

    def on_step(self, record: StepRecord) -> None:
        now = time.perf_counter()
        since = now - (self.began if self.last is None else self.last)
        self.last = now
        line: dict[str, Any] = {
            "step": record.step,
            "wall_s": round(now - self.began, 4),
            "steps_per_s": round(1 / since, 4) if since > 0 else 0.0,
            "groups": record.groups,
            "shortfall": record.shortfall,
            "waited_s": round(record.waited_s, 6),
            "train_s": round(record.train_s, 6),
            "sync_s": round(record.sync_s, 6),
            "skipped": record.skipped,
            **{k: round(v, 6) for k, v in record.stats.items()},
        }
        stages = {"teacher": record.scoring, **record.later_scoring}
        for name, scored in stages.items():
            if scored is not None:  # teacher_calls, teacher_queue_wait_s, verifier_groups, ...
                line.update(_numbers(name, scored, sep="_"))
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        if self.scalars is not None:
            self.scalars.write(record.step, line)
        self.done += 1
        if not record.skipped:
            self.kls.append(record.stats["kl"])
            self.syncs.append(record.sync_s)
        if self.bar is not None:
            accuracy = " ".join(
                f"{k.split('/', 1)[1]}={v:.2f}"
                for k, v in record.stats.items()
                if k.startswith("accuracy/")
            )
            self.bar.set_postfix_str(f"kl={record.stats.get('kl', float('nan')):.3f} {accuracy}")
            self.bar.update(1)
