"""Hypothesis state machines and properties, importable with any budget (CI, soak, `groupflow fuzz`)."""

from groupflow.properties.buffer_machine import BufferMachine, run_buffer_machine

__all__ = ["BufferMachine", "run_buffer_machine"]
