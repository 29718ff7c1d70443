"""Hypothesis state machines and properties, importable with any budget (CI, soak, `groupflow fuzz`).

Names load on first use, so that `groupflow` commands that do not fuzz work without Hypothesis.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BufferMachine": "groupflow.properties.buffer_machine",
    "run_buffer_machine": "groupflow.properties.buffer_machine",
    "PipelineMachine": "groupflow.properties.pipeline_machine",
    "run_pipeline_machine": "groupflow.properties.pipeline_machine",
    "SchedulerWalk": "groupflow.properties.scheduler_machine",
    "run_scheduler_walks": "groupflow.properties.scheduler_machine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'groupflow.properties' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
