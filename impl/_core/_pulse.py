"""`Pulse`: "something changed", for tasks that wait on a condition over shared state."""

from __future__ import annotations

from trio.lowlevel import ParkingLot


class Pulse:
    """Waiters re-check their condition after every `notify`.

    The pattern is `while not condition(): await pulse.wait()`: no notification is lost, since
    a waiter checks the condition before it parks and every change notifies. With no waiter,
    `notify` costs next to nothing (it is called on every buffer transition).
    """

    def __init__(self) -> None:
        self._lot = ParkingLot()

    def notify(self) -> None:
        """Wake every current waiter. Synchronous; safe outside a trio run."""
        if self._lot:
            self._lot.unpark_all()

    async def wait(self) -> None:
        await self._lot.park()
