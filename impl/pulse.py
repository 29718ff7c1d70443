"""`Pulse`: "something changed", for tasks that wait on a condition over shared state."""

from __future__ import annotations

import trio


class Pulse:
    """Waiters re-check their condition after every `notify`.

    The pattern is `while not condition(): await pulse.wait()`: no notification is lost, since
    a waiter checks the condition before it waits and every change notifies.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        """Wake every current waiter. Synchronous, cheap, safe outside a trio run."""
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()
