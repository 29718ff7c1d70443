"""Hypothesis state machines and properties, importable with any budget (CI, soak, `groupflow fuzz`).

Names load on first use, so that `groupflow` commands that do not fuzz work without Hypothesis.
"""

from __future__ import annotations

from groupflow.impl._core import lazy_names

_EXPORTS = {
    "BufferMachine": "buffer_machine",
    "run_buffer_machine": "buffer_machine",
    "PipelineMachine": "pipeline_machine",
    "run_pipeline_machine": "pipeline_machine",
    "SchedulerWalk": "scheduler_machine",
    "run_scheduler_walks": "scheduler_machine",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_names(__name__, _EXPORTS, globals())
