"""The stall watchdog (a MONITOR): no progress for `stall_timeout_s` means warn or abort.

Progress is whatever the controller counts (commits, scored groups, train steps); the watchdog
only sees that the count stopped changing, for how long, and since when. What is stuck, in
words (which teacher's call has been in flight how long, what training waits for), comes from
the controller's `waiting`. A stall is warned about once: the next warning needs progress first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import trio

from groupflow.impl._pipeline._config import StallAction
from groupflow.impl._pipeline._pump import PumpKind
from groupflow.model.errors import Stalled

log = logging.getLogger("groupflow.watchdog")


class StallWatchdog:
    kind = PumpKind.MONITOR

    def __init__(
        self,
        progress: Callable[[], Hashable],
        *,
        timeout_s: float,
        action: StallAction,
        tick_s: float | None = None,
        name: str = "stall watchdog",
        waiting: Callable[[float], str] | None = None,
    ) -> None:
        self.name = name
        self.progress = progress
        self.timeout_s = timeout_s
        self.action = action
        self.tick_s = tick_s if tick_s is not None else min(30.0, timeout_s / 4)
        self.waiting = waiting
        """What is stuck at a time (`trio.current_time()`), in words."""
        self.warnings = 0
        """Stalls warned about: one per stall, however long it lasts."""

    async def run(self) -> None:
        began = trio.current_time()
        last = self.progress()
        since = began
        warned = False
        while True:
            await trio.sleep(self.tick_s)
            now = trio.current_time()
            seen = self.progress()
            if seen != last:
                last, since, warned = seen, now, False
                continue
            if warned or now - since < self.timeout_s:
                continue
            message = self.describe(now, since=since, began=began)
            if self.action is StallAction.ABORT:
                raise Stalled(message)
            self.warnings += 1
            warned = True
            log.warning("%s; not warned again until the run moves", message)

    def describe(self, now: float, *, since: float, began: float) -> str:
        where = f"{since - began:.0f} s into the run" if since > began else "the start"
        message = (
            f"no progress for {now - since:.0f} s, since {where} "
            f"(stall_timeout_s={self.timeout_s:g})"
        )
        stuck = self.waiting(now) if self.waiting is not None else ""
        return f"{message}: {stuck}" if stuck else message
