"""What the supervisor needs to know of a pump: its name, its kind, how to run it, and for a
stage how to hear that its upstream has ended."""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable


class PumpKind(enum.Enum):
    """The role of a pump, which fixes what its ending means (see `supervise`)."""

    MONITOR = "monitor"
    """Loops until cancelled (stall watchdog, probes); returning at all is a failure."""
    PRODUCER = "producer"
    """May end normally when its data runs out; then the stages downstream drain."""
    STAGE = "stage"
    """Ends once its upstream has ended and its backlog is empty."""
    TERMINAL = "terminal"
    """Its return ends the run (the train pump)."""

    def __str__(self) -> str:
        return self.value


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
