"""The formal model of groupflow: group states, the transition table, readiness and invariants.

Pure by design: the standard library and attrs only, no trio, no torch, no I/O, so the same
rules can be checked exhaustively, fuzzed, and enforced by the implementation at run time.
"""

from groupflow.model.diagram import to_dot, to_mermaid, to_text_table
from groupflow.model.invariants import (
    INVARIANTS,
    BufferSnapshot,
    GroupView,
    InvariantViolation,
    Violation,
    assert_invariants,
    check_invariants,
)
from groupflow.model.lifecycle import (
    TRANSITIONS,
    Actor,
    Event,
    Guard,
    IllegalTransition,
    Transition,
    fire,
    transitions_from,
)
from groupflow.model.readiness import missing_fields, readiness
from groupflow.model.states import LIVE_STATES, TERMINAL_STATES, UNREADY_STATES, GroupState

__all__ = [
    "INVARIANTS",
    "LIVE_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "UNREADY_STATES",
    "Actor",
    "BufferSnapshot",
    "Event",
    "GroupState",
    "GroupView",
    "Guard",
    "IllegalTransition",
    "InvariantViolation",
    "Transition",
    "Violation",
    "assert_invariants",
    "check_invariants",
    "fire",
    "missing_fields",
    "readiness",
    "to_dot",
    "to_mermaid",
    "to_text_table",
    "transitions_from",
]
