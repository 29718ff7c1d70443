"""The policy vocabulary: the choices a configuration makes, named once for the model, the
checker, the pipeline's config and the command line alike.

These are plain enums with no behaviour; what each choice means is decided in
`groupflow.model.decisions` and explored in `groupflow.model.scheduler`.
"""

from __future__ import annotations

import enum


class Design(enum.StrEnum):
    """Where scoring sits relative to the generation permit."""

    PUMP = "pump"
    """The permit is released at commit; a stage batches groups across rollouts (groupflow's)."""
    INLINE = "inline"
    """Commit awaits scoring of its own group under one lock per teacher, holding its permit."""
    COALESCE = "coalesce"
    """Each rollout commits, joins a per-teacher batch and awaits its result, holding its permit."""


class Dispatch(enum.StrEnum):
    """When a stage sends a batch that is not full."""

    TIMER = "timer"
    """After `flush_after_s` since its oldest group arrived (or at once on drain)."""
    DEMAND = "demand"
    """Also at once when training waits on a step none of whose groups can still join the
    queue: waiting longer cannot grow that step's batch, only delay training."""


class DispatchReason(enum.StrEnum):
    """Why a stage sent a batch. The order of the members is the order they are tried in."""

    INLINE = "inline"
    """The inline baseline: one group per call, as soon as the teacher's lock is free."""
    RETRY = "retry"
    """The head of the queue is a group whose call failed: it goes again, alone, at once."""
    FULL = "full"
    DRAIN = "drain"
    """Upstream has ended (data ran out, or the run is shutting down): nothing more will come."""
    CHECKPOINT_FLUSH = "checkpoint flush"
    """A `flush` checkpoint waits on a group in the queue."""
    DEMAND = "demand"
    TIMER = "timer"


class FailurePolicy(enum.StrEnum):
    """What a stage does with the groups of a failed teacher call."""

    RETRY = "retry"
    """Retry each group alone once, then discard it."""
    DISCARD = "discard"
    FAIL = "fail"
    """Fail the run (which then shuts down)."""


class CheckpointPolicy(enum.StrEnum):
    """What a checkpoint does with groups still WRITTEN or SCORING."""

    FLUSH = "flush"
    """Wait (bounded) for the stages to finish the groups pending at the cut, then save them
    READY. Admission goes on meanwhile: the wait is for the cut's groups only."""
    UNCOMMITTED = "uncommitted"
    """Save only READY groups; the prompts of the others are issued again on resume."""
    NAIVE = "naive"
    """The upstream baseline: save READY groups and the data cursor only, with no ledger of
    prompts in flight. Not offered by the implementation; here so the checker can show why."""


class Sampler(enum.StrEnum):
    """How the train pump picks READY groups."""

    IN_ORDER = "in_order"
    """Groups admitted for the current train step, oldest reservation first."""
    WINDOWED = "windowed"
    """Any READY group generated at most `max_staleness_versions` weight versions ago."""


class SyncMode(enum.StrEnum):
    """How new weights reach the engines after a train step, relative to the rollouts
    generating then (the simulator's `[weight_sync] mode`, a served generator's `sync_mode`).
    No rollout starts during a sync either way."""

    WAIT = "wait"
    """The sync begins once the rollouts in flight have finished."""
    INTERRUPT = "interrupt"
    """The rollouts in flight pause for the sync, then go on with the new weights."""
