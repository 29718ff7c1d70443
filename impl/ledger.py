"""The prompt ledger: every prompt carries a monotonic ordinal from the data source, and the
ledger knows what became of each, so that no prompt is lost or trained twice across a crash.

An issued ordinal ends trained, given up (a failed rollout or scoring: shortfall), or dropped
(cancelled at shutdown or lost to a crash: issued again). The ledger hands out re-issued ordinals
before fresh ones.
"""

from __future__ import annotations

from collections import deque

import attrs


@attrs.define
class PromptLedger:
    """Ordinals 0..`num_prompts`-1 (None: an endless source)."""

    num_prompts: int | None
    cursor: int = 0
    """The next fresh ordinal."""
    trained: set[int] = attrs.field(factory=set)
    shortfall: set[int] = attrs.field(factory=set)
    reissue: deque[int] = attrs.field(factory=deque)
    in_flight: set[int] = attrs.field(factory=set)
    """Issued and not yet trained, given up or dropped."""

    def peek(self) -> int | None:
        """The ordinal `issue` would hand out, if any."""
        if self.reissue:
            return self.reissue[0]
        if self.num_prompts is None or self.cursor < self.num_prompts:
            return self.cursor
        return None

    def issue(self) -> int:
        ordinal = self.peek()
        if ordinal is None:
            raise LookupError(f"the data source is exhausted ({self.num_prompts} prompts issued)")
        if self.reissue:
            self.reissue.popleft()
        else:
            self.cursor += 1
        self.in_flight.add(ordinal)
        return ordinal

    @property
    def exhausted(self) -> bool:
        return self.peek() is None

    def mark_trained(self, ordinals: set[int] | list[int] | tuple[int, ...]) -> None:
        twice = sorted(set(ordinals) & self.trained)
        if twice:
            raise RuntimeError(f"prompts {twice} were already trained: the ledger is inconsistent")
        self._settle(ordinals)
        self.trained.update(ordinals)

    def mark_shortfall(self, ordinal: int) -> None:
        """Given up on (failed for good): accounted, not issued again."""
        self._settle([ordinal])
        self.shortfall.add(ordinal)

    def mark_dropped(self, ordinal: int) -> None:
        """Dropped without fault (shutdown, crash): issued again, first."""
        self._settle([ordinal])
        self.reissue.append(ordinal)

    def _settle(self, ordinals: set[int] | list[int] | tuple[int, ...]) -> None:
        unknown = sorted(set(ordinals) - self.in_flight)
        if unknown:
            raise RuntimeError(f"prompts {unknown} are not in flight: the ledger is inconsistent")
        self.in_flight.difference_update(ordinals)
