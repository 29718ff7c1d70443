"""The stall watchdog (a MONITOR): no progress for `stall_timeout_s` means warn or abort.

Progress is whatever the controller counts (commits, scored groups, train steps); the watchdog
only sees that the count stopped changing, and says for how long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import trio

from groupflow.impl.pipeline._config import StallAction
from groupflow.impl.pipeline._pump import PumpKind
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
    ) -> None:
        self.name = name
        self.progress = progress
        self.timeout_s = timeout_s
        self.action = action
        self.tick_s = tick_s if tick_s is not None else min(30.0, timeout_s / 4)
        self.warnings = 0

    async def run(self) -> None:
        last = self.progress()
        since = trio.current_time()
        while True:
            await trio.sleep(self.tick_s)
            now = trio.current_time()
            seen = self.progress()
            if seen != last:
                last, since = seen, now
                continue
            if now - since < self.timeout_s:
                continue
            message = f"no progress for {now - since:.0f} s (stall_timeout_s={self.timeout_s}); last seen {seen}"
            if self.action is StallAction.ABORT:
                raise Stalled(message)
            self.warnings += 1
            log.warning(message)
            since = now
