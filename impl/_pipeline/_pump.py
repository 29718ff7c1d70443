"""What the supervisor needs to know of a pump: its name, its kind, how to run it, and for a
stage how to hear that its upstream has ended; and the exception plumbing pumps share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import trio

from groupflow.model.enums import ValueEnum


class PumpKind(ValueEnum):
    """The role of a pump, which fixes what its ending means (see `supervise`)."""

    MONITOR = "monitor"
    """Loops until cancelled (stall watchdog, probes); returning at all is a failure."""
    PRODUCER = "producer"
    """May end normally when its data runs out; then the stages downstream drain."""
    STAGE = "stage"
    """Ends once its upstream has ended and its backlog is empty."""
    TERMINAL = "terminal"
    """Its return ends the run (the train pump)."""


@runtime_checkable
class Pump(Protocol):
    """A long-lived task of the pipeline."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> PumpKind: ...

    async def run(self) -> None:
        """Do the pump's work. Cancellation is how the supervisor stops producers and monitors;
        a pump cleans up in its own `finally` (shielded where it must finish)."""
        ...


@runtime_checkable
class StagePump(Pump, Protocol):
    """A stage also hears when everything upstream of it has ended, so it can drain."""

    def upstream_ended(self) -> None:
        """Called once, synchronously: send what is queued and return when the backlog is empty."""
        ...


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a nursery's ExceptionGroup of exactly one error as that error.

    A pump's internal nursery wraps the one failure that matters (a failed teacher call, say);
    unwrapped, callers and the supervisor can name it. A cancellation that met the error in
    the group is left out: the error replaces it on its way up, as it would without a nursery.
    The error keeps its own cause (a teacher call's `OSError`, say). Groups of several errors
    pass unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        found = leaves(group)
        found = [e for e in found if not isinstance(e, trio.Cancelled)] or found
        if len(found) == 1:
            raise found[0]  # noqa: B904 (its own cause stays; the group is its context)
        raise


def leaves(error: BaseException) -> list[BaseException]:
    """The errors inside `error`, however deeply grouped."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in leaves(sub)]
    return [error]
