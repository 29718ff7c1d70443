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


class GuestHost:
    """A trio run in guest mode, driven by hand: `call(fn)` runs `fn` inside trio, then trio
    runs until every task is blocked."""

    def __init__(self, main: Callable[[], Any]) -> None:
        self.clock = trio.testing.MockClock(autojump_threshold=math.inf)
        self.queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.quiet = False
        self.done: Any = None
        """The guest run's `outcome.Outcome`, once it ended."""
        self.token: trio.lowlevel.TrioToken | None = None
        self._poke = trio.Event()
        self._main = main

        async def guest() -> Any:
            self.token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_quiet)
                result = await self._main()
                nursery.cancel_scope.cancel()
            return result

        trio.lowlevel.start_guest_run(
            guest,
            run_sync_soon_threadsafe=self.queue.put,
            run_sync_soon_not_threadsafe=self.queue.put,
            done_callback=self._finished,
            clock=self.clock,
            host_uses_signal_set_wakeup_fd=True,
        )
        self.pump()

    def _finished(self, result: Any) -> None:
        self.done = result

    async def _watch_quiet(self) -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked()
            self.quiet = True
            await self._poke.wait()
            self._poke = trio.Event()

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

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` inside trio (synchronously, between its tasks), then let trio settle."""
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
