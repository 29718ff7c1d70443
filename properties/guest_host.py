"""A trio run in guest mode, driven by hand: the pipeline machine's host loop.

`GuestHost.call` hands each of the machine's decisions to the trio side
(`TrioToken.run_sync_soon`) and then runs trio's callbacks until a helper task sees every other
task blocked (`trio.testing.wait_all_tasks_blocked`): after each call the guest run has done
everything it can without a new event from outside.
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Callable
from typing import Any

import trio
import trio.lowlevel
import trio.testing

PUMP_LIMIT = 5_000
"""Trio callbacks one rule may run before the machine calls the pipeline busy-looping (a rule
needs a few dozen)."""


class _Host:
    """What both hosts share: trio's callbacks queued for the host to run by hand, virtual
    time, and a helper task that says when every other task is blocked (`quiet`)."""

    def __init__(self, main: Callable[[], Any]) -> None:
        self.clock = trio.testing.MockClock(autojump_threshold=math.inf)
        self.queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.quiet = False
        self.done: Any = None
        """The guest run's `outcome.Outcome`, once it ended."""
        self.token: trio.lowlevel.TrioToken | None = None
        self._poke = trio.Event()
        self._main = main

    async def _guest(self) -> Any:
        """The guest run's main: `main`, beside the task that watches for quiet."""
        self.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_quiet)
            result = await self._main()
            nursery.cancel_scope.cancel()
        return result

    async def _watch_quiet(self) -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked()
            self.quiet = True
            await self._poke.wait()
            self._poke = trio.Event()

    def pump(self) -> None:
        """Run trio's callbacks until the run has settled (or is over)."""
        raise NotImplementedError

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` inside trio (synchronously, between its tasks), then let the run settle
        (`pump`)."""
        assert self.token is not None and self.done is None

        def inside() -> None:
            self.quiet = False
            try:
                fn()
            finally:
                self._poke.set()

        self.quiet = False
        self.token.run_sync_soon(inside)
        self.pump()

    def advance(self, seconds: float) -> None:
        self.call(lambda: self.clock.jump(seconds))


class GuestHost(_Host):
    """A trio run in guest mode, driven by hand: `call(fn)` runs `fn` inside trio, then trio
    runs until every task is blocked."""

    def __init__(self, main: Callable[[], Any]) -> None:
        super().__init__(main)
        trio.lowlevel.start_guest_run(
            self._guest,
            run_sync_soon_threadsafe=self.queue.put,
            run_sync_soon_not_threadsafe=self.queue.put,
            done_callback=self._finished,
            clock=self.clock,
            host_uses_signal_set_wakeup_fd=True,
        )
        self.pump()

    def _finished(self, result: Any) -> None:
        self.done = result

    def pump(self) -> None:
        """Run trio's callbacks until every task is blocked (or the run is over)."""
        for _ in range(PUMP_LIMIT):
            if self.quiet or self.done is not None:
                return
            self.queue.get(timeout=30)()
        raise AssertionError(
            f"the pipeline did not settle within {PUMP_LIMIT} trio callbacks: a task never "
            f"blocks (a busy loop)"
        )

    def settle_until(self, done: Callable[[], bool], *, timeout_s: float = 120.0) -> None:
        """Run trio's callbacks, in real time, until `done()` (real I/O has ended: a served
        teacher's answer came), then let trio settle."""
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self.done is not None:
                raise AssertionError(f"the real I/O did not end within {timeout_s:g} s")
            try:
                self.queue.get(timeout=left)()
            except queue.Empty:
                continue
        self.call(lambda: None)

    def close(self) -> None:
        """End the guest run (its main returns when told), and wait for it."""
        for _ in range(PUMP_LIMIT):
            if self.done is not None:
                return
            self.queue.get(timeout=30)()
        raise AssertionError("the trio guest run did not end")


ASYNCIO_STEPS = 16
"""Passes of the asyncio loop between two trio callbacks: enough for every asyncio call a
trio callback released to run to its end and hand its result back (a handful)."""


ASYNCIO_SETTLE_S = 30.0
"""Real seconds the asyncio host waits for trio's next callback as the run closes."""


class AsyncioGuestHost(_Host):
    """The machine's host for its asyncio variant: trio in guest mode on a real asyncio loop,
    started as `groupflow.impl.aio` starts it (`start_guest`, with the machine's clock), the
    parts asyncio tasks on that loop. The same interface as `GuestHost`.

    Trio's callbacks are queued, as `GuestHost` queues them, and run one at a time inside the
    loop; before each, the loop makes `ASYNCIO_STEPS` passes, so every asyncio call a callback
    released has ended and handed its result to trio by the next trio tick. What trio sees is
    then a function of the example, not of when trio's I/O thread woke up, and an example
    replays exactly. A call settles when trio is blocked and every asyncio call trio started
    is either held by the machine (`held()`) or handed back."""

    def __init__(
        self, main: Callable[[], Any], *, held: Callable[[], int], uvloop: bool = False
    ) -> None:
        import asyncio

        from groupflow.impl.aio import start_guest

        super().__init__(main)
        self.loop: asyncio.AbstractEventLoop
        if uvloop:
            import uvloop as _uvloop

            self.loop = _uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self._held = held
        self.run = start_guest(
            self._guest, loop=self.loop, clock=self.clock, schedule=self.queue.put
        )
        self.pump()

    def pump(self) -> None:
        """Run trio's callbacks, and the loop between them, until both sides have settled."""
        import asyncio

        async def settle() -> None:
            for _ in range(PUMP_LIMIT):
                for _ in range(ASYNCIO_STEPS):
                    await asyncio.sleep(0)
                if self.run.done.done():
                    self.done = self.run.done.result()
                    return
                if self.quiet:
                    if self.run.calls <= self._held():
                        return
                    # trio waits on asyncio calls that ended: let it look again
                    assert self.token is not None
                    self.quiet = False
                    self.token.run_sync_soon(self._poke.set)
                self.queue.get(timeout=30)()
            calls, held = self.run.calls, self._held()
            why = (
                f"{calls} asyncio calls in flight, {held} held"
                if calls > held
                else "a task never blocks (a busy loop)"
            )
            raise AssertionError(
                f"the pipeline did not settle within {PUMP_LIMIT} trio callbacks: {why}"
            )

        self.loop.run_until_complete(settle())

    def close(self) -> None:
        """End the guest run, wait for it, and close the loop. Virtual time runs by itself
        from here (a call a seeded bug left uncancelled is abandoned after its bound), and the
        asyncio tasks left over are cancelled: a failed example leaves no trio run behind on
        this thread for the next to meet."""
        import asyncio

        self.clock.autojump_threshold = 0

        async def ended() -> None:
            while not self.run.done.done():
                for _ in range(ASYNCIO_STEPS):
                    await asyncio.sleep(0)
                try:
                    self.queue.get(timeout=ASYNCIO_SETTLE_S)()
                except queue.Empty:
                    return
            self.done = self.run.done.result()

        try:
            if self.done is None:
                self.loop.run_until_complete(ended())
        finally:
            left = asyncio.all_tasks(self.loop)
            for task in left:
                task.cancel()
            if left:
                self.loop.run_until_complete(asyncio.wait(left, timeout=ASYNCIO_SETTLE_S))
            self.loop.close()
