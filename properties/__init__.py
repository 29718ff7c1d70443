"""Hypothesis state machines and properties, importable with any budget (CI, soak, `groupflow fuzz`)."""

from groupflow.properties.buffer_machine import BufferMachine, run_buffer_machine
from groupflow.properties.scheduler_machine import SchedulerWalk, run_scheduler_walks

__all__ = ["BufferMachine", "SchedulerWalk", "run_buffer_machine", "run_scheduler_walks"]
