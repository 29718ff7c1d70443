"""The states a prompt group moves through, and the named subsets the rest of the code uses."""

from __future__ import annotations

from groupflow.model.enums import ValueEnum


class GroupState(ValueEnum):
    """Where one prompt group is in its lifecycle.

    The value is the name users see in messages, tables and diagrams.
    """

    RESERVED = "RESERVED"
    """A slot is taken and a rollout is in flight; no rows exist yet."""
    WRITTEN = "WRITTEN"
    """Rows are in the store but the group is not trainable: a stage still has to add fields."""
    SCORING = "SCORING"
    """The group is part of a stage's in-flight batch."""
    READY = "READY"
    """Trainable: every field training needs is present; visible to the sampler."""
    CONSUMED = "CONSUMED"
    """Selected by the train pump; its rows are cleared once the step is done."""
    DISCARDED = "DISCARDED"
    """Dropped; its rows are cleared."""


TERMINAL_STATES: frozenset[GroupState] = frozenset({GroupState.CONSUMED, GroupState.DISCARDED})
"""No event leads out of these."""

UNREADY_STATES: frozenset[GroupState] = frozenset(
    {GroupState.RESERVED, GroupState.WRITTEN, GroupState.SCORING}
)
"""Groups that hold capacity and count for their target step but can be neither selected nor evicted."""

LIVE_STATES: frozenset[GroupState] = UNREADY_STATES | {GroupState.READY}
"""Groups that may still be trained."""
