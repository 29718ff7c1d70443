"""Readiness from field sets: a group is trainable once it has every field training needs.

A stage (teacher scoring, a reward model, a verifier) exists to add fields. `defer_ready` is the
one-stage case: the group waits for a stage to mark it even if no field is declared missing.
"""

from __future__ import annotations

from collections.abc import Iterable

from groupflow.model.lifecycle import Guard


def missing_fields(fields: Iterable[str], required: Iterable[str]) -> frozenset[str]:
    """The required fields a group does not have yet."""
    return frozenset(required) - frozenset(fields)


def readiness(fields: Iterable[str], required: Iterable[str], *, awaiting_stage: bool) -> Guard:
    """COMPLETE when the group may become READY now, PENDING when a stage still owes it something."""
    if awaiting_stage or missing_fields(fields, required):
        return Guard.PENDING
    return Guard.COMPLETE
