"""Reading a trace (`build_pipeline(trace=...)`): finding its file, its lines and what each
parses to, the prompt ordinals a line names, and the model its header describes
(`bounds_of_header`). `groupflow.sim.verify.replay` judges what is read against the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from groupflow.impl._pipeline import TRACE_FORMAT, config_from_json, trace_path
from groupflow.model.errors import TraceCorrupt, TraceNotFound
from groupflow.model.scheduler.bounds import Bounds
from groupflow.sim.verify.conformance import bounds_for

__all__ = [
    "RUN_FIELDS",
    "LineRejected",
    "bounds_of_header",
    "line_ordinals",
    "parse_line",
    "trace_file",
    "trace_lines",
]

RUN_FIELDS = ("config", "prompts", "num_steps", "teachers", "routing")
"""Header fields every incarnation of one run must agree on (they make the model)."""


class LineRejected(Exception):
    """The line at hand breaks the model or the accounting (internal to the replay)."""


def trace_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, whether it ended with a newline)."""
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            yield number, text.rstrip("\n"), text.endswith("\n")


def parse_line(text: str) -> dict[str, Any] | None:
    """The JSON object a line holds, or None where it holds no object with a `type`."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("type"), str) else None


def line_ordinals(text: str, values: object, prompts: int) -> list[int]:
    """The prompt ordinals a line's field (named `text`) lists, each one of the run's
    `prompts`; raises `LineRejected` otherwise."""
    if not isinstance(values, list) or not all(
        isinstance(o, int) and not isinstance(o, bool) for o in values
    ):
        raise LineRejected(f"{text} must be a list of prompt ordinals, got {values!r}")
    bad = [o for o in values if not 0 <= o < prompts]
    if bad:
        raise LineRejected(f"{text} names prompts {bad} outside 0..{prompts - 1}")
    return list(values)


def bounds_of_header(header: Mapping[str, Any]) -> Bounds:
    """The model a trace's run is checked against, rebuilt from its header (as
    `bounds_for` builds it for a live check). Raises `TraceCorrupt` naming what is wrong."""
    fmt = header.get("format")
    if fmt != TRACE_FORMAT:
        raise TraceCorrupt(
            f"trace format {fmt!r} is not one this groupflow reads (format {TRACE_FORMAT}); "
            f"replay it with the groupflow version that wrote it"
        )
    missing = [f for f in RUN_FIELDS if f not in header]
    if missing:
        raise TraceCorrupt(f"the trace's header lacks {missing}: not a groupflow trace")
    config = config_from_json(header["config"])
    prompts = header["prompts"]
    steps = header["num_steps"]
    if not isinstance(prompts, int) or not isinstance(steps, int) or prompts < 1:
        raise TraceCorrupt(f"the header's prompts={prompts!r}, num_steps={steps!r} are not counts")
    most = math.ceil(prompts / config.shape.prompts_per_step)
    if steps != most:
        raise TraceCorrupt(
            f"the traced run trains {steps} of the {most} steps its {prompts} prompts make "
            f"(num_steps={steps}): the model covers runs over all their prompts, so replay "
            f"cannot judge this one; trace runs with num_steps={most} (or prompts cut to "
            f"{steps * config.shape.prompts_per_step})"
        )
    try:
        return bounds_for(
            config,
            prompts=prompts,
            routing=header["routing"],
            teachers=header["teachers"],
            stages=header.get("stages"),  # absent before extra stages existed: the default
        )
    except (TypeError, ValueError) as exc:
        raise TraceCorrupt(
            f"the header's routing, teachers or stages do not make a model: {exc}"
        ) from exc


def trace_file(path: Path) -> Path:
    """The trace at `path`: a run folder's, or the file itself. Raises `TraceNotFound`."""
    path = Path(path)
    if not path.exists():
        raise TraceNotFound(f"{str(path)!r} does not exist: give a run folder or a trace file")
    file = trace_path(path)
    if not file.is_file():
        raise TraceNotFound(
            f"{str(path)!r} is a folder without a trace ({file.name}): pass build_pipeline("
            f"trace=...) that folder, or give the trace file"
        )
    return file
